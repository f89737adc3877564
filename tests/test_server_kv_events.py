"""KV-cache events from a real server (--kv-events-endpoint): a plain ZeroMQ SUB socket and
msgpack see a prompt's whole blocks stored, the same hashes for the same prefix, BlockRemoved on
eviction, AllBlocksCleared on a flush, sequence numbers without gaps, and a replay of exactly the
later batches; without the flag the engine binds nothing; a bad or busy endpoint stops the start
with one error naming the flag."""
from __future__ import annotations

import msgpack
import pytest
import zmq

from helpers import make_tiny_checkpoint, random_prompts
from server_harness import (ServerProcess, replay_kv_events, engine_is_idle, free_port, listening_tcp_ports,
                            serve_and_exit, wait_until)
from specserve.engine.kvcache.block_events import chain_hashes

BLOCK = 16
TOPIC = b"kv@10.0.0.7@tiny"
KV_SLOTS = 512
PROMPT = random_prompts(1, seed=5, min_len=40, max_len=40)[0]  # 2 whole blocks, 8 tokens over


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("kv-events-llama")), "llama")


@pytest.fixture(scope="module")
def server(model):
    port, replay_port = free_port(), free_port()
    server = ServerProcess(model, "--kv-events-endpoint", f"tcp://*:{port}",
                           "--kv-events-replay-endpoint", f"tcp://*:{replay_port}",
                           "--kv-events-topic", TOPIC.decode(), "--max-total-tokens", str(KV_SLOTS))
    server.events_port, server.replay_port = port, replay_port
    yield server
    assert server.stop() == 0


class EventStream:
    """Everything the subscriber received: (sequence, payload) in order, gaps refused."""

    def __init__(self, server):
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(f"tcp://127.0.0.1:{server.events_port}")
        self.received: list[tuple[int, bytes]] = []
        self.events: list[list] = []  # every event received, in order

    def receive(self, timeout_ms: int) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        topic, sequence, payload = self.sub.recv_multipart()
        sequence = int.from_bytes(sequence, "big")
        assert topic == TOPIC
        if self.received:
            assert sequence == self.received[-1][0] + 1, "a gap in the sequence numbers"
        self.received.append((sequence, payload))
        timestamp, events = msgpack.unpackb(payload)
        assert isinstance(timestamp, float) and events
        self.events.extend(events)
        return True

    def until(self, predicate, timeout_ms: int = 30_000) -> list:
        """Receive until predicate(events since the call) holds; returns those events."""
        start = len(self.events)
        for _ in range(timeout_ms // 100):
            if predicate(self.events[start:]):
                return self.events[start:]
            self.receive(100)
        raise AssertionError(f"events never matched; got {self.events[start:]}")

    def close(self):
        self.sub.close()
        self.context.term()


@pytest.fixture(scope="module")
def stream(server, client):
    stream = EventStream(server)
    # A SUB joins late: flush (each flush of an empty cache says AllBlocksCleared) until one
    # arrives, then take the rest of the probes.
    for _ in range(100):
        client.flush_cache()
        if stream.receive(200):
            break
    assert stream.received, "the subscriber never received a batch"
    while stream.receive(300):
        pass
    yield stream
    stream.close()


def _stored(events) -> list[list]:
    return [e for e in events if e[0] == "BlockStored"]


def _removed_hashes(events) -> set[int]:
    return {h for e in events if e[0] == "BlockRemoved" for h in e[1]}


def _generate(client, prompt, n=2):
    return client.generate(prompt_token_ids=prompt, max_new_tokens=n, temperature=0, ignore_eos=True)


def test_a_prompts_whole_blocks_are_stored_chained(client, stream):
    client.flush_cache()
    stream.until(lambda events: ["AllBlocksCleared"] in events)
    _generate(client, PROMPT)
    hashes = chain_hashes(PROMPT, BLOCK)
    assert len(hashes) == 2
    events = stream.until(lambda events: sum(len(e[1]) for e in _stored(events)) >= 2)
    stored = _stored(events)
    assert [h for e in stored for h in e[1]] == hashes
    first = stored[0]
    assert first[2] is None and first[4] == BLOCK and first[6] == "CPU"  # parent, size, medium
    assert [t for e in stored for t in e[3]] == PROMPT[:32]
    # A prompt sharing the first block: only its second block is new, child of the first.
    other = PROMPT[:16] + random_prompts(1, seed=6, min_len=24, max_len=24)[0]
    _generate(client, other)
    events = stream.until(lambda events: _stored(events))
    assert _stored(events)[0][1:4] == [[chain_hashes(other, BLOCK)[1]], hashes[0], other[16:32]]


def test_a_flush_removes_every_block_and_the_same_prefix_gets_the_same_hashes(client, stream):
    _generate(client, PROMPT)
    assert wait_until(lambda: engine_is_idle(client))
    client.flush_cache()
    events = stream.until(lambda events: ["AllBlocksCleared"] in events)
    assert set(chain_hashes(PROMPT, BLOCK)) <= _removed_hashes(events)
    assert events[-1] == ["AllBlocksCleared"]
    _generate(client, PROMPT)
    events = stream.until(lambda events: sum(len(e[1]) for e in _stored(events)) >= 2)
    assert [h for e in _stored(events) for h in e[1]] == chain_hashes(PROMPT, BLOCK)


def test_eviction_sends_block_removed_for_what_it_evicts(client, stream):
    client.flush_cache()
    stream.until(lambda events: ["AllBlocksCleared"] in events)
    start = len(stream.events)
    _generate(client, PROMPT)
    # Twice the pool's slots of other prompts: the oldest (PROMPT's) blocks must go.
    for prompt in random_prompts(KV_SLOTS * 2 // 100, seed=7, min_len=100, max_len=100):
        _generate(client, prompt)
    prompt_hashes = set(chain_hashes(PROMPT, BLOCK))
    stream.until(lambda events: prompt_hashes <= _removed_hashes(events))
    assert wait_until(lambda: engine_is_idle(client))
    while stream.receive(300):
        pass
    # Replaying the stream: nothing removed that was not stored, nothing stored twice, and
    # never more cached than the pool holds.
    held: set[int] = set()
    for event in stream.events[start:]:
        if event[0] == "BlockStored":
            assert event[2] is None or event[2] in held
            assert not held & set(event[1])
            held |= set(event[1])
        elif event[0] == "BlockRemoved":
            assert set(event[1]) <= held
            held -= set(event[1])
        assert len(held) * BLOCK <= KV_SLOTS
    assert held and not prompt_hashes & held


def test_sequence_numbers_have_no_gaps_and_a_replay_returns_exactly_the_later_batches(
        server, client, stream):
    _generate(client, PROMPT)
    client.flush_cache()
    stream.until(lambda events: ["AllBlocksCleared"] in events)
    sequences = [s for s, _ in stream.received]
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))
    start = sequences[len(sequences) // 2]
    context = zmq.Context()
    try:
        replayed = replay_kv_events(context, f"tcp://127.0.0.1:{server.replay_port}", start)
    finally:
        context.term()
    while stream.received[-1][0] < replayed[-1][0]:  # any batch still on its way live
        assert stream.receive(10_000)
    assert replayed == [(s, p) for s, p in stream.received if s >= start]


def test_the_engine_listens_on_the_event_ports(server):
    assert {server.events_port, server.replay_port} <= listening_tcp_ports(server.engine_pid)


def test_without_the_flag_the_engine_binds_no_port(model):
    plain = ServerProcess(model)
    try:
        assert listening_tcp_ports(plain.engine_pid) == set()
    finally:
        assert plain.stop() == 0


def test_a_bad_endpoint_is_a_usage_error_naming_the_flag(model):
    result = serve_and_exit(model, "--kv-events-endpoint", "localhost:5557")
    assert result.returncode == 2
    assert "kv_events_endpoint (--kv-events-endpoint): must be tcp://HOST:PORT" in result.stderr


def test_a_busy_endpoint_stops_the_start_naming_the_flag(model):
    context = zmq.Context()
    taken = context.socket(zmq.PUB)
    taken.setsockopt(zmq.LINGER, 0)
    port = free_port()
    taken.bind(f"tcp://*:{port}")
    try:
        result = serve_and_exit(model, "--kv-events-endpoint", f"tcp://*:{port}")
    finally:
        taken.close()
        context.term()
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "the engine failed to start: kv_events_endpoint " \
        f"(--kv-events-endpoint): cannot bind tcp://*:{port}" in errors[0], result.stderr
