"""Overlap loop vs normal loop, FutureMap, and the needs_cpu_seq_lens decision."""
from __future__ import annotations

import random

import pytest
import torch

from helpers import random_prompts

from specserve.engine import SamplingParams
from specserve.engine.attention.base import decide_needs_cpu_seq_lens


def _workload(seed: int, n: int = 36):
    """Random prompts, arrival steps, lengths (1 included), stop tokens, and two aborts."""
    rng = random.Random(seed)
    prompts = random_prompts(n, seed=seed, max_len=30)
    reqs = []
    for i, p in enumerate(prompts):
        greedy = i % 3 != 0
        params = SamplingParams(
            max_new_tokens=rng.choice([1, 2, 5, 17, 40]), temperature=0.0 if greedy else 0.8,
            seed=None if greedy else 1000 + i, stop_token_ids=[rng.randrange(3, 320) for _ in range(3)],
            ignore_eos=True)
        reqs.append((rng.randrange(0, 25), f"r{i}", p, params))
    aborts = {f"r{rng.randrange(n)}" for _ in range(2)}
    return reqs, aborts


def _run(engine, reqs, aborts):
    outputs, reasons = {}, {}
    step = 0
    while step < 2000:
        for arrive, rid, prompt, params in reqs:
            if arrive == step:
                engine.add_request(rid, prompt, params)
        if step == 12:
            for rid in aborts:
                engine.abort(rid)
        for out in engine.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.rid] = out.finish_reason
        step += 1
        if step > 25 and not engine.has_unfinished():
            break
    assert len(reasons) == len(reqs)
    return {rid: (outputs.get(rid, []), reasons[rid]) for rid in reasons if reasons[rid] != "abort"}


@pytest.mark.parametrize("needs_cpu", [True, False])
def test_overlap_matches_normal_loop(tiny_model, make_engine, needs_cpu):
    reqs, aborts = _workload(seed=5)
    normal = _run(make_engine(tiny_model, enable_overlap=False, needs_cpu_seq_lens=needs_cpu), reqs, aborts)
    overlap = _run(make_engine(tiny_model, enable_overlap=True, needs_cpu_seq_lens=needs_cpu), reqs, aborts)
    assert normal == overlap
    assert sum(reason == "stop" for _, reason in normal.values()) > 0
    assert len(normal) >= len(reqs) - len(aborts)


def test_overlap_under_random_forward_delays(tiny_model, make_engine, monkeypatch):
    """Seeded sleeps before and after each forward reorder host and device progress."""
    reqs, aborts = _workload(seed=9, n=32)
    reference = _run(make_engine(tiny_model, enable_overlap=False), reqs, aborts)
    monkeypatch.setenv("SPECSERVE_FORWARD_DELAY", "3:4")
    delayed = _run(make_engine(tiny_model, enable_overlap=True, max_total_tokens=400), reqs, aborts)
    assert delayed == reference


def test_both_needs_cpu_seq_lens_settings_agree(tiny_model, make_engine):
    prompts = random_prompts(8, seed=2)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    a = make_engine(tiny_model, needs_cpu_seq_lens=True)
    b = make_engine(tiny_model, needs_cpu_seq_lens=False)
    assert a.core.needs_cpu_seq_lens and not b.core.needs_cpu_seq_lens
    assert [o.token_ids for o in a.generate(prompt_token_ids=prompts, sampling=params)] == \
        [o.token_ids for o in b.generate(prompt_token_ids=prompts, sampling=params)]


def test_overlap_really_overlaps_and_reports_metrics(tiny_model, make_engine):
    engine = make_engine(tiny_model, enable_overlap=True)
    engine.generate(prompt_token_ids=random_prompts(4, seed=1),
                    sampling=SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))
    m = engine.metrics
    assert m.num_steps >= 30 and m.host_blocked_seconds >= 0
    assert engine.core.ctx.busy_seconds() > 0


class _Flagged:
    def __init__(self, flag):
        self.needs_cpu_seq_lens = flag


def test_decide_needs_cpu_seq_lens():
    assert decide_needs_cpu_seq_lens([_Flagged(False), None, _Flagged(False)]) is False
    assert decide_needs_cpu_seq_lens([_Flagged(False), _Flagged(True)]) is True
    assert decide_needs_cpu_seq_lens([_Flagged(False), object()]) is True   # missing flag
    assert decide_needs_cpu_seq_lens([None]) is False
    assert decide_needs_cpu_seq_lens([_Flagged(False)], force=True) is True


def _future_map(debug: bool, monkeypatch):
    from specserve.engine.runtime.device import CpuDeviceContext
    from specserve.engine.runtime.future_map import FutureMap

    monkeypatch.setenv("SPECSERVE_DEBUG_FUTURE_MAP", "1" if debug else "0")
    return FutureMap(8, CpuDeviceContext(torch.device("cpu")), needs_cpu_seq_lens=True)


def test_future_map_resolves_sentinels(monkeypatch):
    fm = _future_map(True, monkeypatch)
    fm.stash_tokens(torch.tensor([3, 5]), torch.tensor([42, 43]))
    ids = torch.tensor([-5, 7, -3])
    assert fm.resolve_input_ids(ids).tolist() == [43, 7, 42]


def test_future_map_resolves_sentinels_in_one_kernel():
    """The Triton path (the interpreter here) replaces the sentinels as the torch path does."""
    pytest.importorskip("triton")
    from specserve.engine.runtime.future_map import resolve_sentinels

    table = torch.arange(100, 140)
    gen = torch.Generator().manual_seed(4)
    for n in (1, 7, 300, 2100):  # one block, and several
        ids = torch.randint(-39, 5000, (n,), generator=gen)
        expected = torch.where(ids < 0, table[(-ids).clamp(min=0)], ids)
        assert torch.equal(resolve_sentinels(ids, table), expected)
    assert resolve_sentinels(torch.empty(0, dtype=torch.int64), table).numel() == 0
    strided = torch.tensor([-3, 99, 7, 99, -1, 99])[::2]
    assert resolve_sentinels(strided, table).tolist() == [103, 7, 101]


def test_future_map_debug_detects_a_second_read(monkeypatch):
    fm = _future_map(True, monkeypatch)
    fm.stash_tokens(torch.tensor([2]), torch.tensor([9]))
    assert fm.resolve_input_ids(torch.tensor([-2])).tolist() == [9]
    with pytest.raises(RuntimeError, match="FutureMap"):
        fm.resolve_input_ids(torch.tensor([-2]))   # consumed, not stashed again


def test_future_map_publish_and_resolve_seq_lens(monkeypatch):
    fm = _future_map(True, monkeypatch)
    fm.publish(torch.tensor([1, 4]), torch.tensor([10, 20]))
    fm.new_publish_event().record()
    dev, host = fm.resolve_seq_lens(torch.tensor([4, 1]))
    assert dev.tolist() == [20, 10] and host == [20, 10]
    fm.needs_cpu_seq_lens = False
    fm.publish(torch.tensor([1]), torch.tensor([11]))
    fm.new_publish_event().record()
    dev, host = fm.resolve_seq_lens(torch.tensor([1]))
    assert dev.tolist() == [11] and host is None
