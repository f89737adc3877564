"""Tensor parallelism on the CPU: two ranks over gloo give exactly the single-rank output,
structured outputs included."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import (assert_no_leaks, drive, make_predictable_pair, make_tiny_checkpoint, process_exited,
                     random_prompts)

from specserve.engine import SamplingParams, SpecConfig
from specserve.engine.runtime.tp_group import RankState

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


@pytest.mark.parametrize("spec,overlap", [
    (None, True), (None, False),
    (dict(num_steps=3, topk=1, num_draft_tokens=4), True),
    (dict(num_steps=3, topk=2, num_draft_tokens=6), False),
], ids=["plain-overlap", "plain-normal", "chain-overlap", "tree-normal"])
def test_tp2_matches_tp1(pair, make_engine, spec, overlap):
    target, head = pair
    prompts = random_prompts(5, seed=13, max_len=30)
    params = [GREEDY, GREEDY, SamplingParams(max_new_tokens=20, temperature=0.9, seed=4, ignore_eos=True),
              GREEDY, SamplingParams(max_new_tokens=3, temperature=0.0)]
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    outs = []
    for tp in (1, 2):
        engine = make_engine(target, tp_size=tp, spec=spec_cfg, enable_overlap=overlap)
        outs.append([o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)])
        if tp == 2:
            assert engine.core.runner.model.layers[0].self_attn.num_heads == 2
            assert engine.core.kv_pool.k_buffer[0].shape[1] == 1  # one of the two KV heads
    assert outs[0] == outs[1]


@pytest.mark.parametrize("spec,overlap", [
    (None, True),
    (dict(num_steps=3, topk=1, num_draft_tokens=4), False),
    (dict(num_steps=3, topk=2, num_draft_tokens=6), True),
], ids=["plain-overlap", "chain-normal", "tree-overlap"])
def test_tp4_matches_tp1(pair, make_engine, spec, overlap):
    """Four ranks: one query head each, and fewer KV heads (2) than ranks, so each KV head is
    replicated on two ranks; the EAGLE head and the vocabulary are split four ways too."""
    target, head = pair
    prompts = random_prompts(4, seed=31, max_len=30)
    params = [GREEDY, SamplingParams(max_new_tokens=16, temperature=0.8, seed=9, ignore_eos=True),
              GREEDY, SamplingParams(max_new_tokens=5, temperature=0.0)]
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    outs = []
    for tp in (1, 4):
        engine = make_engine(target, tp_size=tp, spec=spec_cfg, enable_overlap=overlap)
        outs.append([o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)])
        if tp == 4:
            attn = engine.core.runner.model.layers[0].self_attn
            assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
    assert outs[0] == outs[1]


def test_tp2_eagle3_reads_reduced_features(pair, make_engine, tmp_path):
    """At tp > 1 a Llama block passes its MLP's partial sum on (the next norm reduces it), and
    the layers an EAGLE-3 head reads are reduced on a copy: the outputs and accept lengths equal
    tp=1's with the deferred reductions on. (The random head's drafts are rarely accepted, so
    this checks the path runs exactly, not the features' values.)"""
    from helpers import make_eagle3_head

    head = make_eagle3_head(str(tmp_path / "head"), target_layers=2)
    prompts = random_prompts(3, seed=5, max_len=30)
    spec = SpecConfig(algorithm="eagle3", draft_model=head, num_steps=3, topk=1, num_draft_tokens=4)
    runs = []
    for tp in (1, 2):
        engine = make_engine(pair[0], tp_size=tp, spec=spec)
        runs.append(([o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=GREEDY)],
                     engine.metrics.mean_accept_length))
        if tp == 2:
            assert engine.core.runner.model.partial_sums
    assert runs[0] == runs[1]


@pytest.mark.parametrize("spec,overlap", [
    (None, True), (dict(num_steps=3, topk=2, num_draft_tokens=6), False),
], ids=["plain-overlap", "tree-normal"])
def test_tp2_mixed_steps_match_tp1(pair, make_engine, spec, overlap):
    """Requests arriving while others decode ride in their steps (mixed steps) on every rank
    alike: the ranks' policies decide the same, and the output is the single rank's."""
    target, head = pair
    prompts = random_prompts(4, seed=17, min_len=8, max_len=30)
    arrivals = [(0, "a", prompts[0], GREEDY), (2, "b", prompts[1], GREEDY),
                (3, "c", prompts[2], SamplingParams(max_new_tokens=10, temperature=0.8, seed=3, ignore_eos=True)),
                (5, "d", prompts[3], GREEDY)]
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    outs = []
    for tp in (1, 2):
        engine = make_engine(target, tp_size=tp, spec=spec_cfg, enable_overlap=overlap,
                             prefill_interleave_tokens=16, mixed_steps=True)
        outs.append(drive(engine, arrivals))
        assert engine.metrics.num_mixed_steps > 0
    assert outs[0] == outs[1]


def test_tp2_replicates_a_single_kv_head(tmp_path, make_engine):
    path = make_tiny_checkpoint(str(tmp_path), "qwen2", num_kv_heads=1, seed=2)
    prompts = random_prompts(3, seed=2)
    outs = [[o.token_ids for o in make_engine(path, tp_size=tp).generate(prompt_token_ids=prompts, sampling=GREEDY)]
            for tp in (1, 2)]
    assert outs[0] == outs[1]


def test_tp_errors_name_the_field(tmp_path):
    from specserve.engine import Engine, EngineConfig

    path = make_tiny_checkpoint(str(tmp_path), "llama")
    with pytest.raises(ValueError, match="^tp_size"):
        EngineConfig(tp_size=0)
    with pytest.raises(ValueError, match="^tp_size: 3 does not divide num_attention_heads"):
        Engine(EngineConfig(model=path, device="cpu", tp_size=3, spec=None))


@pytest.fixture(scope="module")
def shared_embedding_pair(pair, tmp_path_factory):
    """The pair with a head that shares the target's (vocabulary-parallel) embedding, so the
    draft forward all-reduces: ranks drafting different tokens would mix their partial sums."""
    import shutil

    from safetensors.torch import load_file, save_file

    head = str(tmp_path_factory.mktemp("shared") / "head")
    shutil.copytree(pair[1], head)
    weights = load_file(f"{head}/model.safetensors")
    del weights["embed_tokens.weight"]
    save_file(weights, f"{head}/model.safetensors", metadata={"format": "pt"})
    return pair[0], head


def _constrained_batch():
    from specserve.engine import GrammarSpec

    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer", "maximum": 99},
                                                          "bb": {"type": "string", "maxLength": 3}},
                         "required": ["a", "bb"], "additionalProperties": False})
    prompts = random_prompts(6, seed=11, max_len=12)
    params = [SamplingParams(max_new_tokens=28, temperature=0.0, grammar=GrammarSpec("json_schema", schema)),
              SamplingParams(max_new_tokens=20, temperature=0.0, grammar=GrammarSpec("regex", "(yes|no)!")),
              SamplingParams(max_new_tokens=20, temperature=0.0, grammar=GrammarSpec("ebnf", 'root ::= "(" [0-9]+ ")"')),
              SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, n=2, grammar=GrammarSpec("json_object")),
              SamplingParams(max_new_tokens=4, grammar=GrammarSpec("regex", "a(b"))]
    return prompts, params


def _summary(outs):
    return [(o.token_ids, o.finish_reason, o.error, o.num_verify_steps, o.num_accepted_drafts) for o in outs]


# Every mode on the default (overlap) loop, and the normal loop once: a chain's masks reach the
# draft steps on both loops (the loops' grammar paths are compared at tp=1 elsewhere).
@pytest.mark.parametrize("spec,overlap", [
    (None, True),
    (dict(num_steps=3, topk=1, num_draft_tokens=4), True),
    (dict(num_steps=3, topk=1, num_draft_tokens=4), False),
    (dict(num_steps=3, topk=2, num_draft_tokens=6), True),
], ids=["plain-overlap", "chain-overlap", "chain-normal", "tree-overlap"])
def test_tp2_structured_outputs_match_tp1(shared_embedding_pair, make_engine, spec, overlap):
    """JSON schema, regex, EBNF, n=2 sampled and unconstrained requests in one batch give at
    tp=2 exactly tp=1's tokens, and the same accepted drafts (every rank drafts under rank 0's
    masks); a grammar that does not compile fails its request by field on both; afterwards no
    rank holds a request, a row or a KV slot."""
    from specserve.engine import Engine, EngineConfig

    target, head = shared_embedding_pair
    prompts, params = _constrained_batch()
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    expected = make_engine(target, spec=spec_cfg, enable_overlap=overlap).generate(
        prompt_token_ids=prompts, sampling=params)
    engine = Engine(EngineConfig(model=target, device="cpu", dtype="float32", spec=spec_cfg, tp_size=2,
                                 enable_overlap=overlap))
    try:
        outs = engine.generate(prompt_token_ids=prompts, sampling=params)
        assert_no_leaks(engine)
        rows = engine.core.req_to_token.num_rows
    finally:
        engine.shutdown()
    assert _summary(outs) == _summary(expected)
    assert outs[1].text in ("yes!", "no!") and outs[2].text.startswith("(") and outs[2].text.endswith(")")
    assert json.loads(outs[0].text).keys() == {"a", "bb"}
    assert [o.index for o in outs[4:6]] == [0, 1]
    bad = outs[6]
    assert bad.finish_reason == "error" and bad.error.code == "INVALID_ARGUMENT" and bad.token_ids == []
    assert bad.error.message.startswith("structured_output.regex: ")
    assert engine.rank_states == [RankState(0, rows, 0)] * 2


def test_tp2_constrained_requests_fail_on_every_rank_when_the_grammar_process_dies(pair):
    """Rank 0's grammar process killed mid-run: every rank ends the constrained requests
    (UNAVAILABLE) at the same step, the unconstrained one runs to its end as at tp=1, and the
    service restarts and serves again; no rank holds anything afterwards."""
    from specserve.engine import Engine, EngineConfig, GrammarSpec

    prompts = random_prompts(3, seed=5, max_len=10)
    bound = SamplingParams(max_new_tokens=40, temperature=0.0, grammar=GrammarSpec("regex", "[ab]{60}"))
    free = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(model=pair[0], device="cpu", dtype="float32", spec=None, tp_size=2))
    try:
        alone = engine.generate(prompt_token_ids=[prompts[2]], sampling=free)[0].token_ids
        for rid, prompt, params in (("c0", prompts[0], bound), ("c1", prompts[1], bound), ("u", prompts[2], free)):
            engine.add_request(rid, prompt, params)
        got = {rid: [[], None, None] for rid in ("c0", "c1", "u")}
        killed = False
        while engine.has_unfinished():
            for out in engine.step():
                got[out.rid][0] += out.new_token_ids
                if out.finished:
                    got[out.rid][1:] = [out.finish_reason, out.error]
            if not killed and len(got["c0"][0]) >= 3:
                os.kill(engine.core.scheduler.grammars._proc.pid, signal.SIGKILL)
                killed = True
        assert killed
        for rid in ("c0", "c1"):
            assert got[rid][1] == "error" and got[rid][2].code == "UNAVAILABLE", got[rid]
            assert set(engine.tokenizer.decode(got[rid][0])) <= {"a", "b"}
        assert got["u"][:2] == [alone, "length"]
        # Restarted at most RESTART_INTERVAL_SECONDS after its last start.
        deadline = time.monotonic() + 60
        while True:
            again = engine.generate(prompt_token_ids=[prompts[0]], sampling=SamplingParams(
                max_new_tokens=8, temperature=0.0, grammar=GrammarSpec("regex", "(yes|no)!")))[0]
            if again.finish_reason != "error":
                break
            assert again.error.code == "UNAVAILABLE" and time.monotonic() < deadline
            time.sleep(0.2)
        assert again.text in ("yes!", "no!") and engine.grammar_health() == (True, 1, "")
        assert_no_leaks(engine)
        rows = engine.core.req_to_token.num_rows
    finally:
        engine.shutdown()
    assert engine.rank_states == [RankState(0, rows, 0)] * 2


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("overlap", [True, False])
def test_a_dead_follower_fails_the_engine_instead_of_hanging(pair, overlap):
    """SIGKILL rank 1 mid-generation: rank 0's next step raises TPRankDied naming it (the
    collective with the dead peer fails, no wait), every later step refuses, and shutdown
    returns without waiting for the dead rank. Killed while the engine is idle, the next
    check_ranks() says so before any collective is tried."""
    from specserve.engine import Engine, EngineConfig
    from specserve.engine.tp import TPRankDied

    for when in ("running", "idle"):
        engine = Engine(EngineConfig(model=pair[0], device="cpu", dtype="float32", spec=None, tp_size=2,
                                     enable_overlap=overlap))
        try:
            follower = engine._followers[0]
            if when == "running":
                for i, prompt in enumerate(random_prompts(3, seed=1, max_len=12)):
                    engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=400, temperature=0.0,
                                                                       ignore_eos=True))
                for _ in range(3):
                    engine.step()
                assert engine.has_unfinished() and engine.rank_failure() is None
            os.kill(follower.pid, signal.SIGKILL)
            with pytest.raises(TPRankDied, match=rf"^tp_size: rank 1 \(pid {follower.pid}\) died"):
                if when == "idle":
                    assert _wait_until(lambda: engine.rank_failure() is not None, 30)
                    engine.check_ranks()
                while engine.has_unfinished():  # a step or two at most: the next collective fails
                    engine.step()
            with pytest.raises(RuntimeError, match="^tp_size: "):
                engine.step()
        finally:
            started = time.monotonic()
            engine.shutdown()
        assert time.monotonic() - started < 30  # it waited for no collective
        assert engine.rank_states is None


def test_a_follower_exits_when_rank_0_dies(pair, tmp_path):
    """Rank 0's process SIGKILLed (its followers are orphaned while they wait in a collective):
    the follower exits by itself."""
    script = tmp_path / "rank0.py"
    script.write_text(
        "import time\n"
        "from specserve.engine import Engine, EngineConfig\n"
        "if __name__ == '__main__':\n"
        f"    engine = Engine(EngineConfig(model={pair[0]!r}, device='cpu', dtype='float32', spec=None, tp_size=2))\n"
        "    print(engine._followers[0].pid, flush=True)\n"
        "    time.sleep(600)\n")

    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    follower = None
    try:
        follower = int(rank0.stdout.readline())
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.wait(30)
        assert _wait_until(lambda: process_exited(follower), 60), "the follower outlived rank 0"
    finally:
        rank0.kill()
        if follower is not None and not process_exited(follower):
            with contextlib.suppress(ProcessLookupError):
                os.kill(follower, signal.SIGKILL)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("spec", [None, dict(num_steps=3, topk=1, num_draft_tokens=4),
                                  dict(num_steps=3, topk=2, num_draft_tokens=6)], ids=["plain", "chain", "tree"])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("custom_all_reduce", [False, True], ids=["nccl", "custom-ar"])
def test_gpu_tp_matches_tp1(pair, make_engine, spec, graphs, tp, custom_all_reduce):
    """2, 4 or 8 GPUs of one host (each size skips where fewer GPUs are present), all-reduces
    through NCCL or the symmetric-memory one- and two-shot kernels."""
    import torch

    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    target, head = pair
    prompts = random_prompts(6, seed=17, max_len=40)
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    outs = [[o.token_ids for o in make_engine(target, device="cuda", attention_backend="triton", cuda_graph=graphs,
                                              tp_size=size, spec=spec_cfg, max_total_tokens=4096,
                                              custom_all_reduce=custom_all_reduce,
                                              max_running_requests=8).generate(prompt_token_ids=prompts,
                                                                               sampling=GREEDY)]
            for size in (1, tp)]
    assert outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("spec", [None, dict(num_steps=3, topk=1, num_draft_tokens=4),
                                  dict(num_steps=3, topk=2, num_draft_tokens=6)], ids=["plain", "chain", "tree"])
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_tp_structured_outputs_match_tp1(shared_embedding_pair, make_engine, spec, graphs, tp):
    """As test_tp2_structured_outputs_match_tp1 over NCCL, the masks' broadcast inside the
    constrained CUDA graphs included."""
    import torch

    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    target, head = shared_embedding_pair
    prompts, params = _constrained_batch()
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    outs = [_summary(make_engine(target, device="cuda", attention_backend="triton", cuda_graph=graphs,
                                 tp_size=size, spec=spec_cfg, max_total_tokens=4096,
                                 max_running_requests=8).generate(prompt_token_ids=prompts, sampling=params))
            for size in (1, tp)]
    assert outs[0] == outs[1]


def test_rendezvous_keeps_its_port_until_dropped():
    """The ranks' meeting point stays bound while its holder lives, so no other process can
    take the port between choosing it and the ranks joining (the old pick-then-release race)."""
    import socket

    from specserve.engine.runtime.tp_group import Rendezvous

    rendezvous = Rendezvous()
    host, port = rendezvous.init_method.removeprefix("tcp://").rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    with socket.socket() as s, pytest.raises(OSError):
        s.bind((host, int(port)))
