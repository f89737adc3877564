"""The step log (engine/scheduler/step_log.py, `--step-log PATH`): a row per step, consistent
with the scheduler's own decisions, counters and timed steps, the prompt budget's binding term
(scheduler/mixed_batch.py plan_prompt_budget), graph buckets, retractions, rank 0 only, off by
default, a bad path refused naming the flag; and its report (bench/step_log_report.py) on a
synthetic log."""
from __future__ import annotations

import gc
import json
import math
import pathlib
import sys

from types import SimpleNamespace

import pytest

from helpers import (FakeClock, assert_no_leaks, blocking_syncs_fail, drive, graphed_engine, make_predictable_pair,
                     random_prompts, record_steps, step_seconds)

from specserve.cli import build_parser, engine_config_from_args
from specserve.engine import Engine, EngineConfig, SamplingParams, SpecConfig
from specserve.engine.forward_batch import ForwardMode
from specserve.engine.runtime.step import Launched
from specserve.engine.scheduler.mixed_batch import FLOOR_SHARE, PromptBudget, plan_prompt_budget
from specserve.engine.scheduler.schedule_batch import Decision, InflightBatch
from specserve.engine.scheduler.step_cost import StepCost, StepCostFit
from specserve.engine.scheduler.step_log import StepLog
from specserve.server.cluster.config import replica_engine_config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import step_log_report  # noqa: E402

CAP = 64
SLOW = StepCost(fixed=0.010, per_token=0.0005, knee=0)  # a FakeClock's step times: 20 tokens cost half a step
KIND = {(True, False): "extend", (False, True): "mixed", (False, False): "decode"}


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def _arrivals():
    """Four requests decoding, a burst of prompts (the backlog sets what rides), then one every
    other step."""
    prompts = random_prompts(24, seed=21, min_len=20, max_len=60)
    return ([(0, f"d{i}", prompts[i], _greedy(60)) for i in range(4)]
            + [(3 if i < 10 else 2 * i, f"a{i}", prompts[4 + i], _greedy(4)) for i in range(20)])


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _closed_rows(engine, path) -> list[dict]:
    """The rows, once the engine's scheduler wrote its last ones (as at shutdown)."""
    engine.core.scheduler.close_step_log()
    return _rows(path)


# --- the rows ------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_row_per_step_consistent_with_the_schedulers_decisions_counters_and_times(tiny_model, make_engine,
                                                                                    tmp_path, overlap):
    log = tmp_path / "steps.jsonl"
    engine = make_engine(tiny_model, mixed_steps=True, prefill_interleave_tokens=CAP, enable_overlap=overlap,
                         step_log=str(log))
    scheduler = engine.core.scheduler
    policy = scheduler.policy
    # The tiny model's forwards are tens of tokens: a knee at 0 and a prior at that scale.
    policy.step_cost = StepCostFit(knee=0, prior_fixed_tokens=64, prior_spread=2)
    FakeClock().drive(engine, step_seconds(SLOW.fixed, SLOW.per_token, SLOW.knee, policy, extend=0.05))
    steps = record_steps(engine)
    drive(engine, _arrivals())
    rows = _closed_rows(engine, log)
    metrics = scheduler.metrics
    stats = list(metrics.step_stats)
    assert len(rows) == len(steps) == metrics.num_steps == len(stats) > 40
    assert [r["step"] for r in rows] == list(range(len(rows)))
    assert rows[0]["t"] == 0.0 and all(a["t"] <= b["t"] for a, b in zip(rows, rows[1:]))
    # What each step was: the scheduler's own decisions, in launch order, and its counters.
    assert [r["kind"] for r in rows] == [KIND[s.extend, s.mixed] for s in steps]
    assert [r["prompt_tokens"] for r in rows] == [s.computed for s in steps]
    assert [r["prompt_reqs"] for r in rows] == [len(s.reqs) if s.extend or s.mixed else 0 for s in steps]
    assert [r["decode_rows"] for r in rows] == [s.num_decode for s in steps]
    assert all(r["verify_tokens"] == r["decode_rows"] for r in rows)  # plain decoding: one token a row
    mixed = [r for r in rows if r["kind"] == "mixed"]
    assert len(mixed) == metrics.num_mixed_steps > 10
    assert sum(r["prompt_tokens"] for r in mixed) == metrics.num_mixed_prompt_tokens
    # What each took: the scheduler's timed steps (the fake clock's exact times).
    assert [(r["seconds"], r["others"]) for r in rows] == [(s.seconds, s.others) for s in stats]
    for r in rows:
        expected = 0.05 if r["kind"] == "extend" else SLOW.seconds(r["verify_tokens"] + r["prompt_tokens"])
        assert r["seconds"] == pytest.approx(expected)
        assert 0.0 <= r["wait_s"] <= r["seconds"] + 1e-9
        assert r["launch_s"] == 0.0  # the fake clock moves only while a result is waited for
    # Why: the plan of every priced step (the mixed ones and the decode steps that could mix);
    # nothing for the others. Its prediction is the model's at the time, which the fit learns.
    assert [r["budget"] is not None for r in rows] == [s.priced for s in steps]
    for r in rows:
        if r["budget"] is None:
            assert r["bound"] is r["backlog"] is r["predicted_s"] is r["decode_alone_s"] is None
            continue
        assert r["prompt_tokens"] <= r["budget"] and r["backlog"] >= 0
        assert r["bound"] in ("ratio", "cap", "floor", "backlog", "stretch")
        assert r["predicted_s"] >= r["decode_alone_s"] > 0.0
        assert (r["predicted_s"] == r["decode_alone_s"]) == (r["kind"] == "decode")
    # The k-th priced step was priced by a model fitted from the priced steps before it that
    # were processed: all of them, or all but the one in flight (overlap).
    fits = [r["fit_steps"] for r in rows if r["budget"] is not None]
    assert all(k - overlap <= f <= k for k, f in enumerate(fits))
    settled = [r for r in mixed if r["fit_steps"] >= 20]
    assert settled and all(r["predicted_s"] == pytest.approx(r["seconds"], rel=0.2) for r in settled)
    assert {r["bound"] for r in mixed} >= {"backlog"}  # the burst's backlog sets what rides
    assert all(r["graph"] == 0 for r in rows)  # no graphs on this engine


def test_graph_buckets_are_logged(tiny_model, make_engine, monkeypatch, tmp_path):
    """With (CPU stand-ins for) graphs: a mixed step's token bucket, a decode step's batch-size
    bucket; the forward fits in it."""
    log = tmp_path / "steps.jsonl"
    engine, _ = graphed_engine(make_engine, monkeypatch, tiny_model, mixed_steps=True,
                               prefill_interleave_tokens=CAP, step_log=str(log))
    drive(engine, _arrivals()[:12])
    rows = _closed_rows(engine, log)
    buckets = engine.core.scheduler.policy.mixed_graph_tokens
    decode_buckets = engine.core.worker.graphs.buckets
    mixed = [r for r in rows if r["kind"] == "mixed"]
    assert mixed and all(r["graph"] in buckets and r["graph"] >= r["verify_tokens"] + r["prompt_tokens"]
                         for r in mixed)
    decode = [r for r in rows if r["kind"] == "decode"]
    assert decode and all(r["graph"] in decode_buckets and r["graph"] >= r["decode_rows"] for r in decode)


@pytest.mark.gpu
def test_gpu_chain_mixed_steps_log_their_graph_buckets_without_a_blocking_sync(make_engine, tmp_path):
    """On CUDA (chain drafts, graphs): logging adds no blocking host sync to the steps (CUDA's
    sync debug mode raises on one), and the rows show the buckets the steps replayed."""
    target, head = make_predictable_pair(str(tmp_path / "pair"))
    log = tmp_path / "steps.jsonl"
    engine = make_engine(target, device="cuda", attention_backend="triton", cuda_graph=True, mixed_steps=True,
                         spec=SpecConfig(algorithm="eagle", draft_model=head, num_steps=3, topk=1,
                                         num_draft_tokens=4), step_log=str(log))
    engine.add_request("long", [5, 6, 7, 8], _greedy(400))
    for _ in range(4):
        engine.step()
    with blocking_syncs_fail():
        for i in range(24):
            if i % 3 == 0:
                engine.add_request(f"a{i}", list(range(10, 40)), _greedy(3))
            engine.step()
    engine.abort("long")
    while engine.has_unfinished():
        engine.step()
    rows = _closed_rows(engine, log)
    assert len(rows) == engine.metrics.num_steps
    mixed = [r for r in rows if r["kind"] == "mixed"]
    assert len(mixed) == engine.metrics.num_mixed_steps > 0
    assert all(r["verify_tokens"] == 4 * r["decode_rows"] and r["draft_depth"] == 3 for r in mixed)
    assert all(r["graph"] in engine.core.scheduler.policy.mixed_graph_tokens for r in mixed)
    assert any(r["kind"] == "decode" and r["graph"] >= r["decode_rows"] > 0 for r in rows)


def test_retractions_are_logged_at_the_step_they_made_room_for(tiny_model, make_engine, tmp_path):
    log = tmp_path / "steps.jsonl"
    engine = make_engine(tiny_model, max_total_tokens=130, step_log=str(log))  # forces retractions
    engine.generate(prompt_token_ids=random_prompts(6, seed=7, min_len=1, max_len=60), sampling=_greedy(32))
    rows = _closed_rows(engine, log)
    retracted = [r for r in rows if r["retracted"]]
    assert engine.metrics.num_retractions > 0
    assert sum(r["retracted"] for r in rows) == engine.metrics.num_retractions
    # A retraction frees a decode step's room: the step scheduled right after it decodes.
    assert all(r["kind"] == "decode" for r in retracted)


# --- on, off, where ------------------------------------------------------------------------------
def test_off_by_default_no_log_no_file(tiny_model, make_engine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert EngineConfig().step_log is None
    engine = make_engine(tiny_model, mixed_steps=True)
    assert engine.core.scheduler.step_log is None
    engine.generate(prompt_token_ids=[[1, 2, 3]], sampling=_greedy(4))
    assert list(tmp_path.iterdir()) == []


def test_a_bad_path_is_refused_naming_the_flag(tmp_path):
    parse = lambda *flags: engine_config_from_args(build_parser().parse_args(["serve", *flags]))  # noqa: E731
    good = str(tmp_path / "steps.jsonl")
    assert parse("--step-log", good).step_log == good
    assert parse().step_log is None
    (tmp_path / "file").write_text("")
    for bad in (str(tmp_path / "missing" / "steps.jsonl"), str(tmp_path), "", " ", 5,
                str(tmp_path / "file" / "steps.jsonl")):
        with pytest.raises(ValueError, match=r"step_log \(--step-log\)"):
            EngineConfig(step_log=bad)
    with pytest.raises(ValueError, match=r"step_log \(--step-log\)"):
        parse("--step-log", str(tmp_path / "missing" / "steps.jsonl"))
    # A path the config cannot judge (no permission, ...) is refused when the engine opens it.
    with pytest.raises(ValueError, match=r"step_log \(--step-log\): cannot write"):
        StepLog(str(tmp_path / "file" / "steps.jsonl"), verify_width=1)


def test_a_failed_write_ends_the_log_not_the_engine(caplog):
    """/dev/full takes the open and refuses every write (ENOSPC)."""
    policy = SimpleNamespace(num_retractions=0, step_cost=None, running=[], waiting=[])
    batch = InflightBatch(Decision(ForwardMode.DECODE, [object()]), Launched(None, None, None), 0.0, 0)
    log = StepLog("/dev/full", verify_width=1, flush_every=2)
    for i in range(5):
        log.launched(policy, float(i), 0.0)
        log.processed(batch, 0.01, 0.0)
    assert log.failed and "no more steps are written" in caplog.text
    assert len(log._rows) == 1  # still bounded: dropped at every flush
    log.close()


def test_rows_carry_the_host_pauses_since_the_step_before(tmp_path, monkeypatch):
    """A collection and a Triton compile between two steps land in the later step's row, once;
    Triton hooks set before the log are chained and come back when it closes."""
    from triton import knobs

    seen = []
    earlier = (lambda **kw: seen.append("cache") or None, lambda **kw: seen.append("post") or None)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", earlier[0])
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", earlier[1])
    policy = SimpleNamespace(num_retractions=0, step_cost=None, running=[], waiting=[])
    batch = InflightBatch(Decision(ForwardMode.DECODE, [object()]), Launched(None, None, None), 0.0, 0)
    log = StepLog(str(tmp_path / "steps.jsonl"), verify_width=1)
    gc.disable()  # no automatic collection in between
    try:
        log.launched(policy, 0.0, 0.002)
        log.processed(batch, 0.01, 0.0)  # nothing paused: zeros
        log.launched(policy, 1.0, 0.003)
        gc.collect()
        assert knobs.runtime.jit_cache_hook(fn=SimpleNamespace(name="_decode_kernel")) is None
        knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name="_decode_kernel"))
        log.processed(batch, 0.5, 0.0)
    finally:
        gc.enable()
        log.close()
    assert seen == ["cache", "post"]
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == earlier
    quiet, paused = _rows(tmp_path / "steps.jsonl")
    assert (quiet["gc_s"], quiet["gc_full"], quiet["compile_s"], quiet["compiled"]) == (0.0, 0, 0.0, [])
    assert (quiet["launch_s"], paused["launch_s"]) == (0.002, 0.003)  # each its own launch's
    assert paused["gc_s"] > 0 and paused["gc_full"] == 1 and paused["compiled"] == ["_decode_kernel"]
    assert paused["compile_s"] >= 0
    # the scheduler thread's CPU time over the interval (the collection ran on it) and its
    # involuntary switches: a long step with little CPU was spent off the CPU
    assert paused["cpu_s"] > 0 and quiet["preempted"] >= 0 and paused["preempted"] >= 0


def test_the_warm_up_runs_mixed_steps_with_a_chunk_of_each_warm_up_length(tiny_model, tmp_path):
    """With mixed steps the engine process's warm-up makes prompts of MIXED_WARMUP_PROMPTS's
    lengths (the CPU's first three) ride mixed steps, then a 1-token chunk behind a cached
    prefix, greedy and sampled, and frees their KV."""
    from specserve.engine.process import MIXED_WARMUP_PROMPTS, start_warm_engine

    log = tmp_path / "steps.jsonl"
    engine = start_warm_engine(EngineConfig(model=tiny_model, device="cpu", dtype="float32", spec=None,
                                            mixed_steps=True, step_log=str(log)))
    try:
        assert_no_leaks(engine)
    finally:
        engine.shutdown()
    chunks = [r["prompt_tokens"] for r in _rows(log) if r["kind"] == "mixed"]
    assert sorted(chunks) == sorted(2 * (*MIXED_WARMUP_PROMPTS[:3], 1)), chunks


def test_each_data_parallel_replica_writes_its_own_log(tmp_path):
    config = EngineConfig(step_log=str(tmp_path / "steps.jsonl"))
    assert replica_engine_config(config, 0).step_log == str(tmp_path / "steps.jsonl")
    assert replica_engine_config(config, 2).step_log == str(tmp_path / "steps.2.jsonl")
    assert replica_engine_config(EngineConfig(), 1).step_log is None


def test_tensor_parallel_rank_0_writes_it_alone(tiny_model, tmp_path):
    """Every rank gets the same config; only rank 0 opens the log (a follower that wrote too
    would truncate or double its rows)."""
    log = tmp_path / "steps.jsonl"
    engine = Engine(EngineConfig(model=tiny_model, device="cpu", dtype="float32", spec=None, tp_size=2,
                                 mixed_steps=True, prefill_interleave_tokens=16, step_log=str(log)))
    try:
        drive(engine, _arrivals()[:6])
        num_steps = engine.metrics.num_steps
        assert_no_leaks(engine)
    finally:
        engine.shutdown()
    rows = _rows(log)
    assert [r["step"] for r in rows] == list(range(num_steps))
    assert list(tmp_path.iterdir()) == [log]


# --- the binding term ------------------------------------------------------------------------
def test_the_budget_names_the_term_that_set_it():
    buckets = (64, 128, 256, 512, 768, 1024, 1536, 2048)
    assert plan_prompt_budget(256, 1024, 300.7) == PromptBudget(300, "ratio")
    assert plan_prompt_budget(256, 1024, math.inf) == PromptBudget(1024, "cap")
    assert plan_prompt_budget(256, 1024, 3.0) == PromptBudget(1024 // FLOOR_SHARE, "floor")
    assert plan_prompt_budget(1024, 1024, 100.0, backlog=1500) == PromptBudget(750, "backlog")
    assert plan_prompt_budget(1024, 1024, 100.0, backlog=1500, stretch=600.7) == PromptBudget(600, "stretch")
    assert plan_prompt_budget(0, 1024, 0.0, backlog=10 ** 6) == PromptBudget(1024, "cap")
    assert plan_prompt_budget(256, 1024, 0.0, backlog=100) == PromptBudget(128, "floor")
    assert plan_prompt_budget(256, 1024, 0.0, backlog=10 ** 6, stretch=5.0) == PromptBudget(128, "floor")
    assert plan_prompt_budget(256, 1024, 300.0, backlog=200) == PromptBudget(300, "ratio")
    # With graphs: filled up to the bucket it replays, shrunk to a smaller one, or as it was.
    assert plan_prompt_budget(256, 700, 800.0, buckets) == PromptBudget(768, "bucket")
    assert plan_prompt_budget(256, 1024, 0.0, buckets) == PromptBudget(256, "bucket")
    assert plan_prompt_budget(256, 1024, 600.0, buckets) == PromptBudget(512, "smaller_bucket")
    assert plan_prompt_budget(128, 1024, 0.0, buckets) == PromptBudget(128, "floor")
    assert plan_prompt_budget(1800, 1024, 300.0, buckets) == PromptBudget(300, "ratio")  # eager


# --- the report ------------------------------------------------------------------------------
def _row(step, t, kind, seconds, *, rows=8, prompt=0, bound=None, predicted=None, alone=None, graph=0,
         fit=100, retracted=0, launch=0.001):
    plan = kind != "extend"
    return {"step": step, "t": t, "kind": kind, "decode_rows": 0 if kind == "extend" else rows,
            "verify_tokens": 0 if kind == "extend" else 4 * rows, "prompt_tokens": prompt,
            "prompt_reqs": 1 if prompt else 0, "running": rows + (prompt > 0), "waiting": 0, "others": 0,
            "retracted": retracted, "backlog": 0 if plan else None, "budget": 256 if plan else None,
            "bound": bound if plan else None, "predicted_s": predicted if plan else None,
            "decode_alone_s": alone if plan else None, "fit_steps": fit, "graph": graph, "draft_depth": 3,
            "seconds": seconds, "wait_s": seconds / 2, "launch_s": launch}


def _synthetic_log() -> list[dict]:
    """An engine's warm-up (3 steps), 1 s idle, then a run: a 2 s burst of 40 ms mixed steps
    bound by the backlog, then 10 ms decode and 14 ms mixed steps alternating, every 50th mixed
    one eager, filled to a bucket and 35 ms (2.5x its predicted 14 ms, 3.5x its rows' 10 ms)."""
    rows, t = [], 0.0
    for i in range(3):
        rows.append(_row(len(rows), t, "extend", 0.02, fit=0))
        t += 0.02
    t += 1.0
    start = t
    while t < start + 2.0:
        rows.append(_row(len(rows), t, "mixed", 0.04, prompt=200, bound="backlog", predicted=0.02, alone=0.01,
                         graph=512))
        t += 0.04
    for i in range(1000):
        if i % 2:
            slow = i % 100 == 1
            rows.append(_row(len(rows), t, "mixed", 0.035 if slow else 0.014, prompt=300 if slow else 64,
                             bound="bucket" if slow else "ratio", predicted=0.014, alone=0.010,
                             graph=0 if slow else 512, fit=10 if i < 20 else 100,
                             launch=0.02 if slow else 0.001))
        else:
            rows.append(_row(len(rows), t, "decode", 0.010, bound="ratio", predicted=0.010, alone=0.010, graph=64))
        t += rows[-1]["seconds"]
    return rows


def test_the_report_splits_segments_and_the_burst_and_finds_what_the_slow_steps_carry(tmp_path, capsys):
    path = tmp_path / "steps.jsonl"
    rows = _synthetic_log()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 99999, "t"')  # cut short
    out = tmp_path / "report.json"
    rep = step_log_report.main([str(path), "--out", str(out), "--burst-s", "2", "--top", "5"])
    assert json.loads(out.read_text().replace("NaN", "null"))["steps"] == len(rows) == rep["steps"]
    warmup, run = rep["segments"]
    assert warmup["parts"]["all"]["steps"] == 3 and warmup["peak_running"] == 8
    burst, steady = run["parts"]["burst"], run["parts"]["steady"]
    assert burst["steps"] == 50 and burst["kinds_ms"]["mixed"]["p50"] == pytest.approx(40)
    assert burst["above_p95"]["n"] == 0  # every burst step alike
    assert steady["steps"] == 1000
    assert steady["kinds_ms"]["decode"]["p50"] == pytest.approx(10)
    assert steady["kinds_ms"]["mixed"]["p50"] == pytest.approx(14)
    assert steady["kinds_ms"]["mixed"]["max"] == pytest.approx(35)
    # The 10 slow steps are the 1 % above the p99: all eager, bucket-filled, 300 prompt tokens.
    assert steady["decode_side_p99_ms"] == pytest.approx(14)
    slow = steady["above_p99"]
    assert slow["n"] == 10 and slow["kinds"] == {"mixed": 10} and slow["bounds"] == {"bucket": 10}
    assert slow["graphed"] == 0.0 and slow["mean_prompt_tokens"] == 300
    assert slow["mean_launch_ms"] == pytest.approx(20) and steady["below_p95"]["mean_launch_ms"] == pytest.approx(1)
    assert steady["below_p95"]["graphed"] == 1.0
    assert [s["measured_ms"] for s in steady["slowest"]] == [pytest.approx(35)] * 5
    assert steady["slowest"][0]["x_predicted"] == pytest.approx(2.5)
    assert steady["slowest"][0]["launch_ms"] == pytest.approx(20)
    # Measured over predicted: only steps priced by a model fitted from >= 32 steps (the first
    # slow one was not).
    ratios = steady["ratios"]
    assert ratios["decode"]["n"] == 500 and ratios["decode"]["max"] == pytest.approx(1.0)
    assert ratios["mixed"]["n"] == 490 and ratios["mixed"]["max"] == pytest.approx(2.5)
    assert ratios["mixed_over_alone"]["over_2x"] == 9 and ratios["mixed_over_alone"]["predicted_over_2x"] == 0
    # Per graph bucket: the eager ones are the slow ones, 2.5x their prediction.
    assert steady["mixed_by_graph"]["0"]["ms"]["n"] == 10 and steady["mixed_by_graph"]["0"]["ms"]["p50"] == 35
    assert steady["mixed_by_graph"]["0"]["x_predicted"]["p50"] == pytest.approx(2.5)
    assert steady["mixed_by_graph"]["512"]["x_predicted"]["max"] == pytest.approx(1.0)
    # Decode gaps: result to result, 14 ms after a mixed step's, 10 ms after a decode step's.
    assert steady["decode_gap_ms"]["p50"] in (pytest.approx(10), pytest.approx(14))
    assert steady["decode_gap_ms"]["max"] == pytest.approx(35)
    printed = capsys.readouterr().out
    assert "# segment 1" in printed and "## steady (1000 steps)" in printed and "bucket" in printed
