"""GPU checks of memory (`pytest -m gpu`): the CUDA graphs of every batch size and step kind
share one memory pool captured on one stream, give the outputs of graphs captured each into a
pool of its own, and hold less; two engines of gpu_memory_utilization 0.4 start and serve side
by side on one GPU, in one process and as two processes started together (as two Ray replicas
on --gpus-per-rank 0.5 do); a tree engine of 256 rows and a 128k vocabulary captures its
sampled verify graphs within its share."""
from __future__ import annotations

import gc
import json
import multiprocessing

import pytest
import torch

from helpers import make_predictable_pair, random_prompts, save_byte_tokenizer

from specserve.engine import GrammarSpec, SamplingParams, SpecConfig
from specserve.engine import builder
from specserve.engine.layers import sampler
from specserve.engine.runtime import cuda_graph

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12, seed=33, max_len=50)


def _outputs(engine, prompts) -> list:
    return [[o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=sampling)]
            for sampling in (GREEDY, SAMPLED)]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "chain"])
def test_one_shared_graph_pool_equals_a_pool_per_capture(pair, make_engine, prompts, monkeypatch,
                                                         speculative):
    target, head = pair
    spec = SpecConfig(algorithm="eagle", draft_model=head, **CHAIN) if speculative else None
    kwargs = dict(device="cuda", attention_backend="triton", cuda_graph=True, spec=spec,
                  max_running_requests=64, max_total_tokens=8192)
    shared = make_engine(target, **kwargs)
    shared_outputs, shared_bytes = _outputs(shared, prompts), shared.core.graph_memory_bytes

    capture = cuda_graph.GraphedStep._capture

    def own_pool(self, bs):  # before the shared pool: every bucket a pool (and stream) of its own
        self.pool = cuda_graph.GraphPool(self.device)
        capture(self, bs)

    monkeypatch.setattr(cuda_graph.GraphedStep, "_capture", own_pool)
    separate = make_engine(target, **kwargs)
    assert _outputs(separate, prompts) == shared_outputs
    assert 0 < shared_bytes < separate.core.graph_memory_bytes


def test_two_engines_of_04_share_one_gpu(pair, make_engine, prompts):
    """Each sizes its KV pool from 0.4 of the device's total, not from what is free: the second
    fits beside the first, and together they stay within 0.8 of the device."""
    target, head = pair
    spec = SpecConfig(algorithm="eagle", draft_model=head, **CHAIN)
    _, total = torch.cuda.mem_get_info()
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved()  # earlier tests' leftovers are not theirs
    engines = [make_engine(target, device="cuda", attention_backend="triton", cuda_graph=True,
                           spec=spec, gpu_memory_utilization=0.4) for _ in range(2)]
    first, second = engines
    assert first.core.allocator.num_slots > 0
    # The second saw 0.4 of the device gone, and still took the same share.
    assert second.core.allocator.num_slots == pytest.approx(first.core.allocator.num_slots, rel=0.01)
    assert torch.cuda.memory_reserved() - reserved_before <= 0.8 * total
    expected = _outputs(first, prompts)
    assert _outputs(second, prompts) == expected


def _engine_on_a_share(target: str, head: str, prompts: list, fraction: float, results) -> None:
    """One engine process: start on `fraction` of the GPU, generate, report."""
    from specserve.engine import Engine, EngineConfig

    try:
        spec = SpecConfig(algorithm="eagle", draft_model=head, **CHAIN)
        with Engine(EngineConfig(model=target, device="cuda", attention_backend="triton",
                                 cuda_graph=True, spec=spec,
                                 gpu_memory_utilization=fraction)) as engine:
            outs = engine.generate(prompt_token_ids=prompts, sampling=GREEDY)
            results.put(("ok", engine.core.allocator.num_slots, [o.token_ids for o in outs]))
    except BaseException as e:  # reported, so that the test says why
        results.put(("failed", repr(e), None))


def test_two_engine_processes_of_04_start_together_on_one_gpu(pair, prompts):
    """Both size their pools while the other loads and allocates: each from its own share of
    the device's total, so both fit, whichever allocates first."""
    target, head = pair
    gc.collect()  # earlier tests' engines and this process's cached blocks leave the device
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    assert free >= 0.85 * total, f"the two engines need 0.8 of the device; {free / 2**30:.1f} GiB is free"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_engine_on_a_share,
                                 args=(target, head, prompts, 0.4, results)) for _ in range(2)]
    for process in processes:
        process.start()
    try:
        reports = [results.get(timeout=280) for _ in processes]  # within pytest's 300 s
    finally:
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
    assert [status for status, _, _ in reports] == ["ok", "ok"], reports
    (_, first_slots, first_tokens), (_, second_slots, second_tokens) = reports
    assert second_slots == pytest.approx(first_slots, rel=0.02)
    assert first_tokens == second_tokens


def _tree_shape(root) -> tuple[str, str]:
    """Random-weight folders (config.json only): a small Llama with Llama 3's 128256-token
    vocabulary and an EAGLE-3 head of its width (bench/one_batch.py's write_shape, shrunk)."""
    target, draft = root / "target", root / "eagle3"
    cfg = dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512,
               num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, vocab_size=128256,
               max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=500000.0,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    for path, config in ((target, cfg), (draft, dict(cfg, architectures=["LlamaForCausalLMEagle3"],
                                                     num_hidden_layers=1, draft_vocab_size=32000))):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    return str(target), str(draft)


@pytest.mark.parametrize("grammar", [False, True], ids=["sampled", "sampled-and-constrained"])
def test_a_tree_engine_of_256_rows_and_a_128k_vocabulary_captures_within_its_share(tmp_path, make_engine,
                                                                                   grammar):
    """bench/drafters.py's eagle3-tree (5 steps, top-4, 8 nodes) at max batch size 256: the
    sampled verify of the largest bucket draws 2048 rows of 128256 tokens, which ran the capture
    out of memory when the whole batch's noise was drawn at once and the KV pool left no room
    for it. Now every variant is captured (with a tokenizer, the constrained ones too, which
    also mask 2048 rows), the process never holds more than the engine's share, the graphs'
    pool stays within what sizing reserved for it, and sampled requests run."""
    target, draft = _tree_shape(tmp_path)
    if grammar:
        save_byte_tokenizer(target, 512)
    gc.collect()
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info()
    reserved_before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    spec = SpecConfig(algorithm="eagle3", draft_model=draft, num_steps=5, topk=4, num_draft_tokens=8)
    engine = make_engine(target, device="cuda", dtype="bfloat16", load_format="dummy",
                         attention_backend="triton", cuda_graph=True, spec=spec, max_running_requests=256,
                         max_context_len=1024, chunked_prefill_size=2048, gpu_memory_utilization=0.9)
    core = engine.core
    variants = {sampler.SAMPLED, sampler.FILTERED}  # the graph variants (not this module's params)
    assert set(core.worker.sampled_graphs) == variants
    assert max(core.worker.sampled_graphs[sampler.SAMPLED].captured) == 256
    assert set(core.worker.constrained_graphs) == ({sampler.GREEDY} | variants if grammar else set())
    assert torch.cuda.max_memory_reserved() - reserved_before <= 0.9 * total
    assert 0 < core.graph_memory_bytes <= builder._graph_reserve_bytes(
        core.config, core.model_config, core.dtype, 256, core.spec, constrained=grammar,
        row_width=core.req_to_token.row_width)
    sampling = [SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9 if i % 2 else 1.0, seed=i,
                               ignore_eos=True) for i in range(64)]
    outs = engine.generate(prompt_token_ids=[[5 + i, 6, 7] for i in range(64)], sampling=sampling)
    assert [len(o.token_ids) for o in outs] == [8] * 64
    if grammar:
        outs = engine.generate(prompt_token_ids=[[5, 6, 7]] * 4, sampling=[SamplingParams(
            max_new_tokens=12, temperature=1.0, seed=seed, grammar=GrammarSpec("regex", "(yes|no)!"))
            for seed in range(4)])
        assert all(o.text in ("yes!", "no!") for o in outs), [o.text for o in outs]
