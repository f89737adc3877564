"""The columnar BatchOutput (engine/wire.py encode_batch / decode_batch) round-trips every
field of random steps' outputs: empty outputs, finished ones, logprobs, top and prompt
logprobs; and reads what the old per-request messages read (float32 logprobs)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from specserve.engine.outputs import EngineLoad, FinishError, StepOutput, StepStat
from specserve.engine.wire import decode_batch, decode_load, decode_step_stats, encode_batch
from specserve.proto import engine_ipc_pb2 as ipc


def _f32(x: float) -> float:
    return float(np.float32(x))


def _tops(rng: random.Random, positions: int) -> list:
    return [[(rng.randrange(1 << 17), _f32(-rng.random() * 9)) for _ in range(rng.randrange(0, 5))]
            for _ in range(positions)]


def _random_output(rng: random.Random, i: int) -> StepOutput:
    n = rng.choice([0, 0, 1, 1, 2, 3, 5])
    finished = rng.random() < 0.3
    reason = rng.choice(["stop", "length", "abort", "error"]) if finished else None
    out = StepOutput(rid=f"r{i}-{rng.randrange(1 << 30):x}", index=rng.randrange(4),
                     new_token_ids=[rng.randrange(1 << 32) for _ in range(n)],
                     finished=finished, finish_reason=reason,
                     matched_stop=rng.choice([None, 0, 7, 128001]) if reason == "stop" else None,
                     prompt_tokens=rng.randrange(1 << 20), completion_tokens=rng.randrange(1 << 16),
                     num_verify_steps=rng.randrange(1 << 16), num_accepted_drafts=rng.randrange(999),
                     cached_tokens=rng.randrange(1 << 20))
    if reason == "error":
        out.error = FinishError(rng.choice(["UNAVAILABLE", "INTERNAL"]), f"structured output: {i}")
    if n and rng.random() < 0.5:
        out.new_logprobs = [_f32(-rng.random() * 20) for _ in range(n)]
        if rng.random() < 0.5:
            out.new_top_logprobs = _tops(rng, n)
    if rng.random() < 0.2:
        prompt = rng.randrange(1, 9)
        out.prompt_logprobs = [_f32(-rng.random()) for _ in range(prompt)]
        if rng.random() < 0.5:
            out.prompt_top_logprobs = _tops(rng, prompt)
    if n and rng.random() < 0.3:  # a first output: the engine's TTFT stamps (float64)
        out.stamps = tuple(1e5 + rng.random() * 1e4 for _ in range(3))
    return out


def _normalised(out: StepOutput) -> StepOutput:
    """What the receiver sees: empty lists as None (as the per-request messages read them)."""
    out.new_logprobs = out.new_logprobs or None
    out.prompt_logprobs = out.prompt_logprobs or None
    out.new_top_logprobs = out.new_top_logprobs or None
    out.prompt_top_logprobs = out.prompt_top_logprobs or None
    return out


@pytest.mark.parametrize("seed", range(40))
def test_random_batches_round_trip(seed):
    rng = random.Random(seed)
    outputs = [_random_output(rng, i) for i in range(rng.choice([0, 1, 2, 7, 64]))]
    steps = [StepStat(rng.random() < 0.5, rng.random() / 7, rng.randrange(1 << 16), rng.randrange(300),
                      rng.randrange(17))
             for _ in range(rng.choice([0, 1, 3]))]
    load = None if rng.random() < 0.3 else EngineLoad(
        num_running=rng.randrange(300), num_waiting=rng.randrange(300),
        kv_used_tokens=rng.randrange(1 << 40), kv_total_tokens=rng.randrange(1 << 40),
        mean_accept_length=_f32(rng.random() * 4), num_retractions=rng.randrange(1 << 20),
        kv_cached_tokens=rng.randrange(1 << 40), prefix_cache_hit_rate=_f32(rng.random()))
    wire = ipc.EngineToServer(batch=encode_batch(outputs, steps, load)).SerializeToString()
    batch = ipc.EngineToServer.FromString(wire).batch
    assert decode_batch(batch) == [_normalised(out) for out in outputs]
    assert decode_step_stats(batch) == steps
    assert decode_load(batch) == load


def test_logprobs_are_float32_as_before():
    out = StepOutput(rid="a", new_token_ids=[1, 2], new_logprobs=[-0.1, -1 / 3])
    [back] = decode_batch(encode_batch([out]))
    assert back.new_logprobs == [_f32(-0.1), _f32(-1 / 3)]


def test_a_step_is_one_message_of_columns():
    outputs = [StepOutput(rid=f"r{i}", new_token_ids=[i, i + 1]) for i in range(64)]
    msg = encode_batch(outputs)
    assert len(msg.rids) == 64 and len(msg.token_ids) == 4 * 128
    assert not msg.logprobs and not msg.top_counts  # absent columns cost nothing
    assert not msg.stamps and not msg.step_seconds
