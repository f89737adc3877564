"""Speculative decoding through the server: greedy output unchanged, spec stats reported."""
from __future__ import annotations

import os

import pytest

from helpers import make_predictable_pair
from server_harness import ServerProcess, engine_is_idle, wait_until


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


@pytest.fixture(scope="module")
def server(pair):
    target, head = pair
    server = ServerProcess(target, "--draft-model", head, "--speculative-algorithm", "eagle",
                           "--speculative-num-steps", "3", speculative=True)
    yield server
    assert server.stop() == 0


def test_spec_stats_and_greedy_parity(server, pair):
    from specserve.engine import Engine, EngineConfig, SamplingParams

    target, head = pair
    prompts = ["def add(a, b):", "class Stack"]
    with Engine(EngineConfig(model=target, device="cpu", dtype="float32", spec=None)) as engine:
        expected = engine.generate(prompts=prompts,
                                   sampling=SamplingParams(max_new_tokens=32, temperature=0.0,
                                                           ignore_eos=True))
    with server.client() as client:
        info = client.model_info()
        assert (info.spec.algorithm, info.spec.num_steps, info.spec.num_draft_tokens) == \
            ("eagle", 3, 4)
        # Names, not the server's paths.
        assert (info.model, info.spec.draft_model) == (os.path.basename(target),
                                                       os.path.basename(head))
        for prompt, want in zip(prompts, expected):
            chunks = list(client.generate_stream(prompt, max_new_tokens=32, temperature=0,
                                                 ignore_eos=True))
            assert [t for c in chunks for t in c.token_ids] == want.token_ids
            spec = chunks[-1].spec
            assert spec.verify_steps > 0
            # A verify emits its accepted drafts plus one token (the prefill emits the first);
            # the last verify may accept more than max_new_tokens leaves room for.
            assert spec.verify_steps + spec.accepted_drafts >= 31
            assert spec.accept_length == pytest.approx(32 / spec.verify_steps)
            assert spec.accepted_drafts > 0 and max(len(c.token_ids) for c in chunks) > 1
        assert client.server_load().mean_accept_length > 1.0
        assert wait_until(lambda: engine_is_idle(client))
