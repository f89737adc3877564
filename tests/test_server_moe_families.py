"""Qwen3-MoE and Mixtral served as users run them: `specserve serve` with an EAGLE-3 head
(chain drafting), greedy tokens streamed through the gRPC client equal to transformers'
generate, the OpenAI HTTP front's completions equal to the gRPC path's, and the KV freed."""
from __future__ import annotations

import os

import pytest
import torch

from helpers import cached_checkpoints, hf_greedy, hf_logits, make_eagle3_head, random_prompts
from server_harness import ServerProcess, engine_is_idle, free_port, wait_until

MAX_NEW = 12
# family -> (arch, options): 3 layers; Qwen3-MoE's middle one is its only MoE layer.
CONFIGS = {
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, top_k=2, sparse_step=2)),
    "mixtral": ("mixtral", dict(num_experts=4, top_k=2)),
}
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
PROMPTS = random_prompts(2, seed=12, min_len=4, max_len=20)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return cached_checkpoints(tmp_path_factory, CONFIGS)


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(checkpoints, family) -> str:
    return checkpoints(family)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    head = make_eagle3_head(str(tmp_path_factory.mktemp("eagle3")), target_layers=3)
    server = ServerProcess(model, "--draft-model", head, "--speculative-algorithm", "eagle3",
                           "--speculative-num-steps", "3", "--http-port", str(free_port()),
                           speculative=True)
    yield server
    assert server.stop() == 0


def test_streamed_greedy_with_eagle3_equals_transformers(client, model, family):
    info = client.model_info()
    assert info.architecture == ARCHITECTURES[family]
    assert (info.spec.algorithm, info.spec.num_steps, info.spec.num_draft_tokens) == ("eagle3", 3, 4)
    expected = hf_greedy(model, PROMPTS, MAX_NEW)
    for prompt, want in zip(PROMPTS, expected):
        chunks = list(client.generate_stream(prompt_token_ids=prompt, max_new_tokens=MAX_NEW,
                                             temperature=0, ignore_eos=True, logprobs=True))
        assert [t for c in chunks for t in c.token_ids] == want
        # The verify passes' log-probabilities: the target's own, to fp32 precision.
        logits = hf_logits(model, prompt + want)[len(prompt) - 1:-1]
        reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(want)[:, None])[:, 0]
        assert [lp for c in chunks for lp in c.logprobs] == pytest.approx(reference.tolist(), abs=1e-4)
        assert chunks[-1].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == MAX_NEW
        assert chunks[-1].spec.verify_steps > 0  # the head drafted, the target verified
    assert wait_until(lambda: engine_is_idle(client)), "KV or requests left after the streams"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_http_completion_equals_grpc(oai, client, model, stream):
    name = os.path.basename(model)
    for prompt in ["def add(a, b):", PROMPTS[0]]:
        kwargs = dict(prompt_token_ids=prompt) if isinstance(prompt, list) else dict(prompt=prompt)
        want = client.generate(**kwargs, max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True,
                               logprobs=True)
        assert len(want.token_ids) == MAX_NEW
        got = oai.completions.create(model=name, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                     logprobs=0, stream=stream, extra_body={"ignore_eos": True},
                                     **(dict(stream_options={"include_usage": True}) if stream else {}))
        chunks = list(got) if stream else [got]
        choices = [c.choices[0] for c in chunks if c.choices]
        assert "".join(c.text for c in choices) == want.text
        # The tokens themselves: one entry per generated token, its text and logprob the gRPC's.
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
        assert tokens == [client.detokenize([t]) for t in want.token_ids]
        logprobs = [lp for c in choices if c.logprobs for lp in c.logprobs.token_logprobs]
        assert logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert choices[-1].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == MAX_NEW
    assert wait_until(lambda: engine_is_idle(client)), "KV or requests left after the requests"
