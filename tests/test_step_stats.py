"""The engine's timing for the server's TTFT breakdown and step metrics (E24): every sequence's
first output with tokens carries its stamps (scheduler got it <= first prefill chunk launched
<= first token on the host) and no later output does; every processed step is reported once,
extends with their prefill tokens and the decoding requests they held up; a mixed step (prompt
chunks riding in a decode step) is a decode step that held nobody up."""
from __future__ import annotations

import time

import pytest

from helpers import random_prompts

from specserve.engine import SamplingParams


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "separate"])
@pytest.mark.parametrize("overlap", [True, False])
def test_stamps_and_step_stats(make_engine, tiny_model, overlap, mixed):
    engine = make_engine(tiny_model, enable_overlap=overlap, chunked_prefill_size=16, mixed_steps=mixed)
    prompts = random_prompts(6, seed=3, max_len=30)
    before = time.perf_counter()
    stamps, outputs, steps = {}, {}, []
    engine.add_request("r0", prompts[0], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    for step in range(500):
        if step == 3:  # later arrivals: their prefill runs while r0 decodes
            for i, prompt in enumerate(prompts[1:], 1):
                engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=4, temperature=0.0,
                                                                   ignore_eos=True))
        for out in engine.step():
            outputs.setdefault(out.rid, []).append(out)
            if out.stamps is not None:
                assert out.rid not in stamps and out.new_token_ids  # once, with the first tokens
                stamps[out.rid] = out.stamps
        steps += engine.metrics.take_step_stats()
        if not engine.has_unfinished():
            break
    assert sorted(stamps) == sorted(outputs) == [f"r{i}" for i in range(6)]
    for rid, (received, admitted, first_token) in stamps.items():
        assert before <= received <= admitted <= first_token <= time.perf_counter(), rid
        assert outputs[rid][0].stamps is not None or not outputs[rid][0].new_token_ids
    extends = [s for s in steps if s.extend]
    # Every prompt token was prefilled in some extend (chunks of at most 16 tokens), or rode in
    # a decode step of r0's.
    rode = engine.metrics.num_mixed_prompt_tokens
    assert sum(s.tokens for s in extends) + rode == sum(len(p) for p in prompts)
    assert all(0 < s.tokens <= 16 for s in extends)
    if mixed:  # the later arrivals rode: only r0's own prefill was an extend, holding nobody up
        assert sum(s.tokens for s in extends) == len(prompts[0]) and not any(s.others for s in extends)
    else:
        assert not rode and any(s.others for s in extends)  # r0 was decoding while the others prefilled
    decodes = [s for s in steps if not s.extend]
    assert decodes and all(s.seconds >= 0 for s in steps)
    assert engine.metrics.take_step_stats() == []
