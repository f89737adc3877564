"""Tensor parallelism on the CPU: two ranks over gloo give exactly the single-rank output."""
from __future__ import annotations

import pytest

from helpers import make_predictable_pair, make_tiny_checkpoint, random_prompts

from specserve.engine import SamplingParams, SpecConfig

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


def test_tp_refuses_structured_outputs(pair, make_engine):
    """Unsupported, so refused by name: the grammar process masks one rank's logits only."""
    from specserve.engine import GrammarSpec

    engine = make_engine(pair[0], tp_size=2, spec=None)
    constrained = SamplingParams(max_new_tokens=4, grammar=GrammarSpec(kind="json_object"))
    with pytest.raises(ValueError, match="^structured_output: not supported with tp_size=2"):
        engine.add_request("json", [1, 2, 3], constrained)
    assert not engine.has_unfinished()
    assert engine.generate(prompt_token_ids=[[1, 2, 3]], sampling=GREEDY)[0].token_ids  # still serves


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
