"""The data-parallel router reads its replicas' KV-cache events (no Ray: synthetic events and
an in-process publisher): its choice follows what the engines store, evict and clear; lost
batches drop a replica's view (an undecodable one is skipped); each replica's user endpoint
gets a port of its own."""
from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from specserve.engine import EngineConfig
from specserve.engine.kv_events import KVEventPublisher, encode_batch
from specserve.engine.kvcache.block_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                                    chain_hashes)
from specserve.server.cluster.cache_events import ReplicaCacheEvents
from specserve import cli
from specserve.server.cluster.config import ClusterConfig, replica_engine_config
from specserve.server.cluster.replica_set import ReplicaSet
from specserve.server.cluster.routing import PrefixRouter, ReplicaState, RoutingConfig
from specserve.server.config import ServerConfig

B = 4
PROMPT = list(range(100, 112))  # 3 whole blocks


def _idle(n: int = 2) -> list[ReplicaState]:
    return [ReplicaState(i, 0) for i in range(n)]


def _stored(tokens, parent=None) -> BlockStored:
    return BlockStored(tuple(chain_hashes(tokens, B, parent)), parent, tuple(tokens), B)


def test_the_choice_follows_stores_evictions_and_clears():
    router = PrefixRouter(2, RoutingConfig(block_size=B))
    hashes = chain_hashes(PROMPT, B)
    router.apply_events(1, [_stored(PROMPT)])  # cached by a request of another front, say
    route = router.route(PROMPT + [1], _idle())
    assert (route.replica, route.reason, route.matched_tokens) == (1, "affinity", 12)
    router.apply_events(1, [BlockRemoved((hashes[2],))])  # the engine evicted the tail
    assert router.route(PROMPT, _idle()).matched_tokens == 8
    router.apply_events(1, [AllBlocksCleared()])
    router.apply_events(0, [AllBlocksCleared()])
    assert router.route(PROMPT, _idle()).reason == "least_loaded"


def test_what_was_routed_and_then_evicted_is_forgotten():
    router = PrefixRouter(2, RoutingConfig(block_size=B))
    home = router.route(PROMPT, _idle()).replica
    assert router.route(PROMPT, _idle()).reason == "affinity"  # before any event: the guess
    router.apply_events(home, [BlockRemoved(tuple(chain_hashes(PROMPT, B)))])
    assert router.route(PROMPT, _idle()).matched_tokens == 0


def test_a_replica_set_names_blocks_as_its_engines_and_spreads_user_endpoints():
    config = EngineConfig(kv_events_endpoint="tcp://*:5557",
                          kv_events_replay_endpoint="tcp://*:6000", kv_events_block_size=8)
    replicas = ReplicaSet(config, ServerConfig(), ClusterConfig(data_parallel=3))
    assert replicas.router.config.block_size == 8
    assert replica_engine_config(config, 0) == config
    second = replica_engine_config(config, 2)
    assert (second.kv_events_endpoint, second.kv_events_replay_endpoint) == (
        "tcp://*:5559", "tcp://*:6002")
    ipc = EngineConfig(kv_events_endpoint="ipc:///tmp/kv")
    assert replica_engine_config(ipc, 1).kv_events_endpoint == "ipc:///tmp/kv-1"
    with pytest.raises(ValueError, match="kv_events_endpoint"):  # past the last port
        replica_engine_config(EngineConfig(kv_events_endpoint="tcp://*:65535"), 1)


def test_the_cli_refuses_replica_ports_past_the_last(capsys):
    pytest.importorskip("ray")  # --data-parallel needs it before the ports are checked
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--data-parallel", "2", "--kv-events-endpoint", "tcp://*:65535"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "kv_events_endpoint (--kv-events-endpoint): must be tcp://HOST:PORT" in error
    assert "data-parallel replica 1 publishes at the port + 1" in error


def test_an_engines_publisher_reaches_the_router_through_the_replicas_socket(tmp_path):
    router = PrefixRouter(2, RoutingConfig(block_size=B))
    gaps = []

    async def scenario():
        events = ReplicaCacheEvents(zmq.asyncio.Context.instance(), "127.0.0.1", str(tmp_path),
                                    "replica-1", lambda e: router.apply_events(1, e),
                                    lambda: gaps.append(1))
        events.start()
        context = zmq.Context()
        publisher = KVEventPublisher(context, None, servers=[events.address])
        try:
            for _ in range(200):  # a PUB that connects sends once the subscription arrives
                publisher.publish([_stored(PROMPT)])
                await asyncio.sleep(0.05)
                if router._seen[1]:
                    break
            assert list(router._seen[1]) == chain_hashes(PROMPT, B) and not router._seen[0]
            route = router.route(PROMPT, _idle())
            assert (route.replica, route.reason) == (1, "affinity")
            publisher.publish([AllBlocksCleared()])
            for _ in range(200):
                await asyncio.sleep(0.05)
                if router._seen[1] == {}:
                    break
            assert router._seen[1] == {} and gaps == []
        finally:
            publisher.close()
            context.term()
            await events.close()

    asyncio.run(scenario())


def test_lost_batches_drop_the_replicas_view(tmp_path):
    router = PrefixRouter(2, RoutingConfig(block_size=B))

    async def scenario():
        events = ReplicaCacheEvents(zmq.asyncio.Context.instance(), None, str(tmp_path),
                                    "replica-0", lambda e: router.apply_events(0, e),
                                    lambda: router.forget(0))
        events.start()
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(events.address)

        def send(sequence, batch):
            pub.send_multipart([b"", sequence.to_bytes(8, "big"), encode_batch(batch, None, 0.0)])

        try:
            sequence = 0
            for _ in range(200):  # until the socket is joined (each probe numbered in turn)
                send(sequence, [_stored(PROMPT)])
                sequence += 1
                await asyncio.sleep(0.05)
                if router._seen[0]:
                    break
            assert router.route(PROMPT, [ReplicaState(0, 0)]).matched_tokens == 12
            other = list(range(300, 308))
            pub.send_multipart([b"", sequence.to_bytes(8, "big"), b"\xc1"])  # not msgpack: skipped
            send(sequence + 4, [_stored(other)])  # three batches lost
            for _ in range(200):
                await asyncio.sleep(0.05)
                if len(router._seen[0]) == 2:
                    break
            # The view was dropped, then rebuilt from the batch after the gap.
            assert list(router._seen[0]) == chain_hashes(other, B)
        finally:
            pub.close()
            context.term()
            await events.close()

    asyncio.run(scenario())
