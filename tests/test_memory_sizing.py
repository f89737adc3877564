"""Sizing the KV pool by the engine's share of a device (--gpu-memory-utilization): the
arithmetic (kvcache/sizing.py), the builder's measurements on a fake CUDA device, the flag, and
a Ray replica on a fraction of a GPU passing its share down. No GPU needed."""
from __future__ import annotations

import types

import pytest
import torch

from specserve import cli
from specserve.engine import builder
from specserve.engine.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.grammar.bitmask import apply_token_bitmask, bitmask_width, bitmask_workspace_bytes
from specserve.engine.kvcache.pools import TokenToKVPool
from specserve.engine.kvcache.sizing import (GiB, MiB, NON_TORCH_BYTES, SLOT_INDEX_BYTES,
                                             TABLES_BYTES, MemoryShare, forward_workspace_bytes,
                                             kv_pool_slots)
from specserve.engine.layers.sampler import SamplingInfo, draw_workspace_bytes, sample
from specserve.engine.models.model_config import ModelConfig
from specserve.server.cluster.config import ClusterConfig, replica_engine_config
from specserve.server.cluster.replica_set import ReplicaSet
from specserve.server.config import ServerConfig

from peak_bytes import PeakBytes

H100 = 80 * GiB
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 8192}


# --- the arithmetic ------------------------------------------------------------------------------
def test_the_pool_gets_the_share_less_what_the_engine_holds_and_reserves():
    share = MemoryShare(total=H100, free=H100, fraction=0.4, held=3 * GiB, reserve=2 * GiB)
    assert share.budget == 32 * GiB
    assert kv_pool_slots(share, bytes_per_slot=128 * 1024, min_slots=2) == 27 * GiB // (128 * 1024)
    # The same engine on a larger share: every extra byte goes to the pool.
    larger = MemoryShare(total=H100, free=H100, fraction=0.8, held=3 * GiB, reserve=2 * GiB)
    assert (kv_pool_slots(larger, 128 * 1024, 2) - kv_pool_slots(share, 128 * 1024, 2)) \
        == int(H100 * 0.4) // (128 * 1024)


def test_two_engines_of_045_fit_one_device_whatever_starts_first():
    """Sized by the device's total, each takes its own share: the second sees the first's memory
    gone from the free memory, and still fits."""
    per_slot, held, reserve = 64 * 1024, 3 * GiB, 2 * GiB
    first = MemoryShare(total=H100, free=H100 - 600 * MiB, fraction=0.45, held=held, reserve=reserve)
    first_slots = kv_pool_slots(first, per_slot, 2)
    first_total = held + reserve + first_slots * per_slot
    assert first_total <= first.budget
    second = MemoryShare(total=H100, free=H100 - 600 * MiB - first_total, fraction=0.45,
                         held=held, reserve=reserve)
    assert kv_pool_slots(second, per_slot, 2) == first_slots
    assert 2 * first_total <= H100


def test_a_share_that_leaves_no_room_for_one_request_is_refused_by_name():
    share = MemoryShare(total=H100, free=H100, fraction=0.05, held=3 * GiB, reserve=1 * GiB)
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization \(--gpu-memory-utilization\): "
                                         r"gpu_memory_utilization 0.05 of 80.0 GiB is 4.00 GiB.*"
                                         r"fewer than one request needs \(9\)"):
        kv_pool_slots(share, bytes_per_slot=128 * 1024, min_slots=9)
    # Room for exactly one request's slots is enough.
    exact = MemoryShare(total=100 * 1024, free=100 * 1024, fraction=1.0, held=10 * 1024,
                        reserve=10 * 1024)
    assert kv_pool_slots(exact, bytes_per_slot=10 * 1024, min_slots=8) == 8
    with pytest.raises(ValueError, match="^gpu_memory_utilization"):
        kv_pool_slots(exact, bytes_per_slot=10 * 1024, min_slots=9)


def test_a_share_other_processes_already_hold_is_refused_by_name():
    """0.6 of a device of which another process holds half: the pool cannot be allocated."""
    share = MemoryShare(total=H100, free=H100 // 2, fraction=0.6, held=3 * GiB, reserve=2 * GiB)
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization .*only 40.00 GiB of the device "
                                         r"are free"):
        kv_pool_slots(share, bytes_per_slot=128 * 1024, min_slots=2)
    # A smaller share fits beside it.
    smaller = MemoryShare(total=H100, free=H100 // 2, fraction=0.45, held=3 * GiB, reserve=2 * GiB)
    assert kv_pool_slots(smaller, 128 * 1024, 2) > 0


def test_forward_workspace_counts_activations_per_token_and_float32_logits():
    assert forward_workspace_bytes(tokens=10, logit_rows=3, hidden_size=8, intermediate_size=16,
                                   vocab_size=100, act_bytes=2) == 10 * (32 + 48) * 2 + 2 * 3 * 100 * 4
    assert forward_workspace_bytes(0, 0, 8, 16, 100, 2) == 0


# --- the builder's measurements (a fake CUDA device) ----------------------------------------------
@pytest.fixture
def fake_device(monkeypatch):
    """torch.cuda's memory queries answering for an 80 GiB device of which `state` says what
    is free and allocated."""
    state = types.SimpleNamespace(free=H100, allocated=0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state.free, H100))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state.allocated)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return state


def _slots(config: EngineConfig, allocated_before: int, spec=None, constrained: bool = False) -> int:
    cfg = ModelConfig.from_dict(LLAMA_8B)
    return builder._num_kv_slots(config, cfg, types.SimpleNamespace(num_kv_heads=8), torch.bfloat16,
                                 torch.bfloat16, torch.device("cuda"), 64, spec, 8192,
                                 1 if spec is None else spec.kv_reserve_per_request,
                                 allocated_before, constrained=constrained)


def test_the_builder_counts_what_this_engine_allocated_and_its_reserve(fake_device):
    weights = 16 * GiB
    fake_device.allocated = 5 * GiB + weights  # 5 GiB: another engine of this process
    config = EngineConfig(gpu_memory_utilization=0.5)
    slots = _slots(config, allocated_before=5 * GiB)
    per_slot = TokenToKVPool.bytes_per_slot(32, 8, 128, torch.bfloat16) + SLOT_INDEX_BYTES
    reserve = builder._reserve_bytes(config, ModelConfig.from_dict(LLAMA_8B), torch.bfloat16, 64,
                                     None, 8192, constrained=False)
    assert slots == (int(H100 * 0.5) - weights - NON_TORCH_BYTES - reserve) // per_slot
    # The reserve: a 2048-token chunk eagerly (its prompt logprobs' logits too) or a decode
    # step drawing its 64 rows, and the graphs' pool (a 2048-token captured extend, logits of
    # 64 rows and 32 requests, the sampled variants' draw of 64 rows), and the tables.
    graphs = forward_workspace_bytes(2048, 96, 4096, 14336, 128256, 2) + draw_workspace_bytes(64, 128256)
    assert reserve == (forward_workspace_bytes(2048, 2048, 4096, 14336, 128256, 2)
                       + draw_workspace_bytes(64, 128256) + graphs + TABLES_BYTES)
    eager_only = builder._reserve_bytes(config.replace(cuda_graph=False),
                                        ModelConfig.from_dict(LLAMA_8B), torch.bfloat16, 64, None, 8192,
                                        constrained=False)
    assert eager_only == reserve - graphs
    # With a tokenizer (grammars served), both also mask their rows' logits.
    assert _slots(config, allocated_before=5 * GiB, constrained=True) == (
        int(H100 * 0.5) - weights - NON_TORCH_BYTES - reserve - 2 * bitmask_workspace_bytes(64, 128256)
    ) // per_slot


def test_mixed_steps_reserve_the_buffer_their_graphs_share(fake_device):
    cfg = ModelConfig.from_dict(LLAMA_8B)
    config = EngineConfig()

    def reserve(config, spec=None, rows=64):
        return builder._reserve_bytes(config, cfg, torch.bfloat16, rows, spec, 8192, constrained=False)

    extra = reserve(config.replace(mixed_steps=True)) - reserve(config)
    assert extra == 2048 * 4 * 4096 * 2  # hidden states and up to three EAGLE-3 layers, bf16
    assert reserve(config.replace(mixed_steps=True, cuda_graph=False)) == \
        reserve(config.replace(cuda_graph=False))
    # Chain speculation: the wrap's graphs share one snapshot of every row's table row (int64
    # slots) and 16 chunks' float32 logits; the outputs hold a verify of every row where that is
    # more than 2048 tokens; the mixed forwards' own pool holds a 2048-token forward's transients.
    chain = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    wrap = 16 * 128256 * 4 + forward_workspace_bytes(2048, 0, 4096, 14336, 128256, 2)
    extra = reserve(config.replace(mixed_steps=True), chain) - reserve(config, chain)
    assert extra == 2048 * 4 * 4096 * 2 + 64 * 8192 * 8 + wrap
    extra = reserve(config.replace(mixed_steps=True), chain, 1024) - reserve(config, chain, 1024)
    assert extra == 4096 * 4 * 4096 * 2 + 1024 * 8192 * 8 + wrap
    extra = reserve(config.replace(mixed_steps=True), TREE) - reserve(config, TREE)
    assert extra == 2048 * 4 * 4096 * 2  # tree verify rows' mixed steps: no wrap graphs


def test_the_builder_reserves_for_a_speculative_step_and_splits_the_mlp_by_tp(fake_device):
    cfg = ModelConfig.from_dict(LLAMA_8B)
    chain = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    config = EngineConfig(max_running_requests=1024, chunked_prefill_size=1024, spec=None)
    # 1024 rows x 4 draft tokens outgrow the 1024-token chunk.
    draws = 2 * draw_workspace_bytes(4096, 128256)  # the eager step's and the sampled graphs'
    assert builder._reserve_bytes(config, cfg, torch.bfloat16, 1024, chain, 8192, constrained=False) == (
        forward_workspace_bytes(4096, 4096, 4096, 14336, 128256, 2)
        + forward_workspace_bytes(4096, 4096 + 32, 4096, 14336, 128256, 2) + draws + TABLES_BYTES)
    tp2 = config.replace(tp_size=2)
    assert builder._reserve_bytes(tp2, cfg, torch.bfloat16, 1024, chain, 8192, constrained=False) == (
        forward_workspace_bytes(4096, 4096, 4096, 7168, 128256, 2)
        + forward_workspace_bytes(4096, 4096 + 32, 4096, 7168, 128256, 2) + draws + TABLES_BYTES)


TREE = SpecConfig(num_steps=5, topk=4, num_draft_tokens=8)  # bench/drafters.py's eagle3-tree


def test_the_graph_reserve_counts_every_variant_of_the_largest_tree_step(fake_device):
    """256 rows of a tree verify are 2048 logit rows of 128256: the graphs' pool is reserved for
    the forward, the sampled variants' draw and the constrained variants' mask over all of
    them (rows x vocab x bytes), each only where the engine captures that variant."""
    cfg, rows, vocab = ModelConfig.from_dict(LLAMA_8B), 256 * 8, 128256
    config = EngineConfig(max_running_requests=256, chunked_prefill_size=8192, spec=None)
    forward = forward_workspace_bytes(rows, rows + 32, 4096, 14336, vocab, 2)
    draw, mask = draw_workspace_bytes(rows, vocab), bitmask_workspace_bytes(rows, vocab)
    assert draw == 32 * vocab * 64 + rows * 1024  # one 32-row chunk at 64 bytes an element
    assert mask == (rows * vocab + 32) * 8
    graphs = lambda config, constrained: builder._graph_reserve_bytes(  # noqa: E731
        config, cfg, torch.bfloat16, 256, TREE, constrained, 8192)
    assert graphs(config, True) == forward + draw + mask
    assert graphs(config, False) == forward + draw
    assert graphs(config.replace(cuda_graph_sampled=False), True) == forward + mask
    assert graphs(config.replace(cuda_graph_sampled=False), False) == forward


def test_the_reserve_holds_what_a_sampled_constrained_tree_verify_allocates():
    """What the verify of the largest tree bucket runs after its forward, measured (meta
    tensors: nothing allocated): a grammar's mask over 2048 x 128k logits, then the draw. It
    fits in what the builder reserves for picking tokens, which the draw of the whole batch at
    once (6.9 GiB: the OOM capturing bench/drafters.py's eagle3-tree at bs 256) did not."""
    cfg, rows, vocab = ModelConfig.from_dict(LLAMA_8B), 256 * 8, 128256
    logits = torch.empty(rows, vocab, device="meta")
    words = torch.empty(rows, bitmask_width(vocab), dtype=torch.int32, device="meta")
    params = [SamplingParams(temperature=0.7, top_p=0.9)] * rows
    info = SamplingInfo.build(params, list(range(rows)), [0] * rows, [], vocab, "meta")
    index = torch.arange(rows, device="meta")
    with PeakBytes() as measured:
        sample(apply_token_bitmask(logits, words), info, index, index + 1)
    reserved = builder._pick_bytes(cfg, rows, sampled=True, constrained=True)
    assert rows * vocab * 8 <= measured.peak <= reserved < rows * vocab * 10


def test_the_builder_refuses_a_share_smaller_than_the_weights(fake_device):
    fake_device.allocated = 16 * GiB
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization .*the engine holds 17.00 GiB"):
        _slots(EngineConfig(gpu_memory_utilization=0.2), allocated_before=0)


def test_max_total_tokens_still_sets_the_pool_exactly(fake_device):
    fake_device.free = 1 * GiB  # not consulted
    assert _slots(EngineConfig(max_total_tokens=4096), allocated_before=0) == 4096


# --- the option ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, float("nan"), True, "0.5"])
def test_gpu_memory_utilization_must_be_a_fraction(value):
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization \(--gpu-memory-utilization\): "
                                         r"must be a fraction in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=value)


def test_the_flag_sets_the_share():
    args = cli.build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.45"])
    assert cli.engine_config_from_args(args).gpu_memory_utilization == 0.45
    args = cli.build_parser().parse_args(["serve"])
    assert cli.engine_config_from_args(args).gpu_memory_utilization == 0.9


def test_a_replica_on_a_fraction_of_a_gpu_takes_that_fraction_of_the_share():
    config = EngineConfig(gpu_memory_utilization=0.9)
    assert replica_engine_config(config, 1, 0.5).gpu_memory_utilization == pytest.approx(0.45)
    assert replica_engine_config(config, 0, 0.25).gpu_memory_utilization == pytest.approx(0.225)
    for whole in (None, 1.0, 2.0, 0):  # a GPU or more per rank (0: CPU replicas): unchanged
        assert replica_engine_config(config, 1, whole) == config
    with pytest.raises(ValueError, match=r"^gpus_per_rank \(--gpus-per-rank\): 0.5 would put "
                                         r"tensor-parallel ranks"):
        replica_engine_config(config.replace(tp_size=2), 0, 0.5)


def test_the_replica_set_starts_each_engine_on_its_share():
    config = EngineConfig(gpu_memory_utilization=0.8, kv_events_endpoint="tcp://*:5557")
    replicas = ReplicaSet(config, ServerConfig(), ClusterConfig(data_parallel=2, gpus_per_rank=0.5))
    second = replicas.engine_config(1)
    assert second.gpu_memory_utilization == pytest.approx(0.4)
    assert second.kv_events_endpoint == "tcp://*:5558"
    whole = ReplicaSet(config, ServerConfig(), ClusterConfig(data_parallel=2))
    assert whole.engine_config(1).gpu_memory_utilization == 0.8


def test_serve_refuses_a_fraction_of_a_gpu_per_rank_with_tp(capsys):
    pytest.importorskip("ray")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--data-parallel", "2", "--tp", "2", "--gpus-per-rank", "0.5"])
    assert exit_.value.code == 2
    assert "gpus_per_rank (--gpus-per-rank): 0.5 would put" in capsys.readouterr().err
