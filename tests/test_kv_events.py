"""KV-cache events without a server: the radix tree's changes as blocks (hashes, parent links,
order, deduplication, flushes), and the ZeroMQ publisher's wire (vLLM's layout, sequence numbers,
replay, its bounded buffer, bind or connect, bad endpoints)."""
from __future__ import annotations

import random

import msgpack
import pytest
import torch
import zmq

from server_harness import free_port, replay_kv_events
from specserve.engine import EngineConfig
from specserve.engine.kv_events import KVEventPublisher, decode_batch, encode_batch
from specserve.engine.kvcache.block_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                                    chain_hashes)
from specserve.engine.kvcache.pools import TokenSlotAllocator
from specserve.engine.kvcache.radix_cache import RadixCache
from specserve.engine.process import kv_event_publisher

B = 4  # block size of the tree tests


def _cache(pair_keys: bool = False, num_slots: int = 4096):
    allocator = TokenSlotAllocator(num_slots, torch.device("cpu"))
    cache = RadixCache(allocator, pair_keys=pair_keys)
    return allocator, cache, cache.record_events(B)


def _insert(allocator, cache, tokens):
    keys = cache.keys(tokens, len(tokens))
    slots = allocator.alloc(len(keys))
    result = cache.insert(keys, slots)
    allocator.free(slots[:result.already_cached])  # as RequestSlots does with duplicates
    return keys


# --- the tree's blocks ----------------------------------------------------------------------
def test_a_new_path_stores_its_whole_blocks_chained():
    allocator, cache, events = _cache()
    tokens = list(range(100, 110))  # 10 tokens: blocks [0, 4) and [4, 8); 2 left over
    _insert(allocator, cache, tokens)
    hashes = chain_hashes(tokens, B)
    assert len(hashes) == 2
    assert events.take() == [BlockStored(tuple(hashes), None, tuple(tokens[:8]), B)]
    # Extending the path stores the block that now ends in it, its parent the last one.
    longer = tokens + [110, 111, 112]
    _insert(allocator, cache, longer)
    assert events.take() == [BlockStored((chain_hashes(longer, B)[2],), hashes[1],
                                         tuple(longer[8:12]), B)]
    assert events.take() == []


def test_a_branch_takes_its_first_block_tokens_from_above_and_a_split_says_nothing():
    allocator, cache, events = _cache()
    trunk = list(range(1, 13))  # 12 tokens, 3 blocks
    _insert(allocator, cache, trunk)
    events.take()
    branch = trunk[:6] + [50, 51, 52, 53]  # parts inside block 1: the trunk's node splits at 6
    _insert(allocator, cache, branch)
    hashes = chain_hashes(branch, B)
    assert hashes[0] == chain_hashes(trunk, B)[0]  # the same prefix, the same hash
    assert events.take() == [BlockStored((hashes[1],), hashes[0], tuple(branch[4:8]), B)]
    assert events.held_hashes() == set(chain_hashes(trunk, B)) | set(hashes)


def test_eviction_removes_a_leafs_blocks_deepest_first_and_a_flush_clears():
    allocator, cache, events = _cache()
    trunk = list(range(1, 13))
    branch = trunk[:6] + [50, 51, 52, 53]
    _insert(allocator, cache, trunk)
    _insert(allocator, cache, branch)  # most recent
    events.take()
    trunk_hashes, branch_hashes = chain_hashes(trunk, B), chain_hashes(branch, B)
    cache.evict(1)  # the least recently used leaf: the trunk's tail [6, 12)
    assert events.take() == [BlockRemoved(tuple(trunk_hashes[1:]))]
    assert cache.flush() == 10
    assert events.take() == [BlockRemoved((branch_hashes[1],)), BlockRemoved((branch_hashes[0],)),
                             AllBlocksCleared()]
    assert events.held_hashes() == set()
    assert cache.flush() == 0 and events.take() == [AllBlocksCleared()]  # idle: still says so


def test_a_flush_that_leaves_pinned_blocks_does_not_clear_all():
    allocator, cache, events = _cache()
    pinned, free = list(range(1, 9)), list(range(20, 28))
    _insert(allocator, cache, pinned)
    _insert(allocator, cache, free)
    events.take()
    match = cache.acquire(cache.keys(pinned, 8))
    cache.flush()
    assert events.take() == [BlockRemoved(tuple(chain_hashes(free, B)))]
    assert events.held_hashes() == set(chain_hashes(pinned, B))
    cache.release(match)


def test_pair_keys_hash_tokens_and_a_block_two_paths_hold_is_stored_and_removed_once():
    allocator, cache, events = _cache(pair_keys=True)
    first = [7, 8, 9, 10, 11]      # pair keys: 4 positions, one block of tokens 7..10
    second = [7, 8, 9, 10, 12]     # parts at position 3 (its next token differs)
    _insert(allocator, cache, first)
    h = chain_hashes(first, B)[0]
    assert events.take() == [BlockStored((h,), None, (7, 8, 9, 10), B)]
    _insert(allocator, cache, second)
    assert events.take() == []  # the same block (tokens 7..10) on a second path
    cache.evict(1)
    assert events.take() == []  # the other path still holds it
    cache.evict(1)
    assert events.take() == [BlockRemoved((h,))]


def test_recording_starts_with_what_the_tree_holds():
    allocator = TokenSlotAllocator(256, torch.device("cpu"))
    cache = RadixCache(allocator, pair_keys=False)
    trunk, branch = list(range(1, 13)), list(range(1, 7)) + [40, 41, 42]
    for tokens in (trunk, branch):
        slots = allocator.alloc(len(tokens))
        allocator.free(slots[:cache.insert(tokens, slots).already_cached])
    events = cache.record_events(B)
    stored = events.take()
    assert {h for e in stored for h in e.block_hashes} == set(chain_hashes(trunk, B)) | set(
        chain_hashes(branch, B))
    cache.flush()
    assert events.held_hashes() == set() and events.take()[-1] == AllBlocksCleared()


@pytest.mark.parametrize("pair_keys", [False, True])
def test_random_inserts_and_evictions_keep_the_event_stream_equal_to_the_tree(pair_keys):
    """Replaying the events gives exactly the blocks of the tree's paths, every BlockStored
    extends a stored parent, and nothing is stored twice or removed unstored."""
    rng = random.Random(3 + pair_keys)
    allocator, cache, events = _cache(pair_keys=pair_keys, num_slots=600)
    stems = [[rng.randrange(4) for _ in range(rng.randrange(2, 14))] for _ in range(6)]
    replayed: set[int] = set()
    pins = []
    for step in range(300):
        roll = rng.random()
        if roll < 0.6:
            tokens = rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
            need = len(tokens) - cache.evictable_size
            if allocator.num_free < len(tokens):
                cache.evict(len(tokens) - allocator.num_free)
            if allocator.num_free >= len(tokens) and need < allocator.num_free + cache.evictable_size:
                _insert(allocator, cache, tokens)
        elif roll < 0.75:
            cache.evict(rng.randrange(1, 20))
        elif roll < 0.85 and len(pins) < 3:
            pins.append(cache.acquire(cache.keys(rng.choice(stems), 10)))
        elif roll < 0.95 and pins:
            cache.release(pins.pop(rng.randrange(len(pins))))
        else:
            cache.flush()
        for event in events.take():
            if isinstance(event, BlockStored):
                assert event.parent_block_hash is None or event.parent_block_hash in replayed
                assert len(event.token_ids) == B * len(event.block_hashes)
                assert chain_hashes(event.token_ids, B, event.parent_block_hash) == list(
                    event.block_hashes)
                assert not replayed & set(event.block_hashes)
                replayed |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= replayed
                replayed -= set(event.block_hashes)
            else:
                assert not replayed or pins == [], "cleared while blocks were held"
                replayed.clear()
        assert replayed == _tree_block_hashes(cache) == events.held_hashes(), step
    for match in pins:
        cache.release(match)


def _tree_block_hashes(cache: RadixCache) -> set[int]:
    """Every whole block of every path in the tree, from its keys."""
    found = set()
    stack = [(child, []) for child in cache.root.children.values()]
    while stack:
        node, above = stack.pop()
        keys = above + node.key
        tokens = [k >> 32 for k in keys] if cache.pair_keys else keys
        found.update(chain_hashes(tokens, B))
        stack.extend((child, keys) for child in node.children.values())
    return found


# --- configuration --------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["localhost:5557", "tcp://host", "tcp://host:0",
                                      "tcp://host:70000", "http://host:5557", "ipc://", ""])
def test_a_bad_endpoint_is_refused_naming_the_flag(endpoint):
    with pytest.raises(ValueError, match=r"kv_events_endpoint \(--kv-events-endpoint\)"):
        EngineConfig(kv_events_endpoint=endpoint)
    with pytest.raises(ValueError, match=r"--kv-events-replay-endpoint"):
        EngineConfig(kv_events_endpoint="tcp://*:5557", kv_events_replay_endpoint=endpoint)


def test_the_other_fields_are_checked():
    with pytest.raises(ValueError, match="give that too"):
        EngineConfig(kv_events_replay_endpoint="tcp://*:5558")
    with pytest.raises(ValueError, match="--disable-prefix-cache"):
        EngineConfig(kv_events_endpoint="tcp://*:5557", enable_prefix_cache=False)
    with pytest.raises(ValueError, match="kv_events_block_size"):
        EngineConfig(kv_events_endpoint="tcp://*:5557", kv_events_block_size=0)
    EngineConfig(kv_events_endpoint="tcp://[::]:5557", kv_events_replay_endpoint="ipc:///tmp/r")


def test_off_by_default_no_publisher():
    context = zmq.Context()
    try:
        assert EngineConfig().kv_events_endpoint is None
        assert kv_event_publisher(EngineConfig(), context) is None
    finally:
        context.term()  # returns: no socket was made


# --- the publisher --------------------------------------------------------------------------
def test_the_payload_is_vllms_array_layout():
    events = [BlockStored((11, 12), None, (1, 2, 3, 4, 5, 6, 7, 8), 4), BlockRemoved((12,)),
              AllBlocksCleared()]
    ts, wire = msgpack.unpackb(encode_batch(events, "GPU", 12.5))
    assert ts == 12.5
    assert wire == [["BlockStored", [11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"],
                    ["BlockRemoved", [12], "GPU"], ["AllBlocksCleared"]]
    assert decode_batch(encode_batch(events, "GPU", 12.5)) == (12.5, events)
    with pytest.raises(ValueError, match="unknown KV-cache event 'BlockMoved'"):
        decode_batch(msgpack.packb([0.0, [["BlockMoved", [1]]]]))
    big = 2**64 - 1  # hashes are unsigned 64-bit
    assert msgpack.unpackb(encode_batch([BlockRemoved((big,))], None, 0.0))[1] == [
        ["BlockRemoved", [big], None]]


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


class _Subscriber:
    def __init__(self, context, address: str, topic: bytes = b""):
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(address)

    def receive(self, timeout_ms: int = 10_000):
        assert self.sub.poll(timeout_ms), "no event batch arrived"
        topic, sequence, payload = self.sub.recv_multipart()
        return topic, int.from_bytes(sequence, "big"), msgpack.unpackb(payload)

    def synchronise(self, publisher) -> int:
        """Publish probes until one arrives (a SUB joins late); returns its sequence."""
        for _ in range(200):
            publisher.publish([AllBlocksCleared()])
            if self.sub.poll(50):
                last = self.receive()[1]
                while self.sub.poll(50):  # probes still in flight
                    last = self.receive()[1]
                return last
        raise AssertionError("the subscriber never joined")

    def close(self):
        self.sub.close()


def test_batches_are_numbered_without_gaps_and_a_replay_returns_exactly_the_later_ones(context):
    port, replay_port = free_port(), free_port()
    publisher = KVEventPublisher(context, f"tcp://*:{port}", f"tcp://*:{replay_port}",
                                 topic="kv@pod@model", buffer_batches=1000)
    sub = _Subscriber(context, f"tcp://127.0.0.1:{port}", b"kv@")
    try:
        last = sub.synchronise(publisher)
        live = {}
        for i in range(20):
            publisher.publish([BlockRemoved((i + 1,))], "GPU")
            publisher.publish([])  # nothing to say: no batch
        for i in range(20):
            topic, sequence, (ts, wire) = sub.receive()
            assert topic == b"kv@pod@model" and sequence == last + 1 + i
            assert wire == [["BlockRemoved", [i + 1], "GPU"]] and ts > 0
            live[sequence] = wire
        start = last + 8
        replayed = replay_kv_events(context, f"tcp://127.0.0.1:{replay_port}", start)
        assert [s for s, _ in replayed] == list(range(start, last + 21))
        assert all(msgpack.unpackb(p)[1] == live[s] for s, p in replayed)
        assert replay_kv_events(context, f"tcp://127.0.0.1:{replay_port}", last + 21) == []  # none yet
    finally:
        sub.close()
        publisher.close()


def test_the_replay_buffer_is_bounded_and_a_malformed_request_is_ignored(context):
    port, replay_port = free_port(), free_port()
    publisher = KVEventPublisher(context, f"tcp://*:{port}", f"tcp://*:{replay_port}",
                                 buffer_batches=3)
    try:
        for i in range(10):
            publisher.publish([BlockRemoved((i + 1,))])
        bad = context.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(f"tcp://127.0.0.1:{replay_port}")
        bad.send_multipart([b"", b"\x01"])  # not 8 bytes
        replayed = replay_kv_events(context, f"tcp://127.0.0.1:{replay_port}", 0)
        assert [s for s, _ in replayed] == [7, 8, 9]  # the last three of 0..9
        assert [msgpack.unpackb(p)[1] for _, p in replayed] == [
            [["BlockRemoved", [i], None]] for i in (8, 9, 10)]
        assert not bad.poll(100)  # answered with nothing
    finally:
        publisher.close()


def test_a_host_that_is_not_a_wildcard_is_connected_to(context):
    port = free_port()
    sub = context.socket(zmq.SUB)  # the indexer binds (llm-d's central mode)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    publisher = KVEventPublisher(context, f"tcp://127.0.0.1:{port}")
    try:
        for _ in range(200):
            publisher.publish([AllBlocksCleared()])
            if sub.poll(50):
                break
        _, sequence, payload = sub.recv_multipart()
        assert msgpack.unpackb(payload)[1] == [["AllBlocksCleared"]]
    finally:
        publisher.close()
        sub.close()


def test_a_busy_port_is_an_error_naming_the_flag(context):
    port = free_port()
    taken = context.socket(zmq.PUB)
    taken.setsockopt(zmq.LINGER, 0)
    taken.bind(f"tcp://*:{port}")
    try:
        with pytest.raises(ValueError, match=rf"kv_events_endpoint \(--kv-events-endpoint\): "
                                             rf"cannot bind tcp://\*:{port}"):
            KVEventPublisher(context, f"tcp://*:{port}")
        with pytest.raises(ValueError, match=r"--kv-events-replay-endpoint\): cannot bind"):
            KVEventPublisher(context, f"tcp://*:{free_port()}", f"tcp://*:{port}")
    finally:
        taken.close()
