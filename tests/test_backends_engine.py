"""Engine-level parity between attention backends (Triton runs in the interpreter on the CPU)."""
from __future__ import annotations

import pytest

from helpers import make_predictable_pair, random_prompts

from specserve.engine import SamplingParams, SpecConfig

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


@pytest.mark.parametrize("spec", [None, dict(num_steps=3, topk=1, num_draft_tokens=4),
                                  dict(num_steps=2, topk=2, num_draft_tokens=4)], ids=["plain", "chain", "tree"])
def test_triton_engine_matches_torch_native(pair, make_engine, spec):
    target, head = pair
    prompts = random_prompts(3, seed=6, max_len=12)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    outs = {}
    for backend in ("torch", "triton"):
        engine = make_engine(target, attention_backend=backend, spec=spec_cfg, max_context_len=64)
        outs[backend] = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)]
    assert outs["triton"] == outs["torch"]
    assert not make_engine(target, attention_backend="triton").core.needs_cpu_seq_lens
