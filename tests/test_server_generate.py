"""Streaming generation through a real server: parity with the offline engine, text, stops,
concurrency, and KV freed after cancel and deadline."""
from __future__ import annotations

import os
import threading
import time

import pytest

from helpers import make_tiny_checkpoint, random_prompts
from server_harness import ServerProcess, engine_is_idle, wait_until
from specserve.clients import Cancelled, DeadlineExceeded
from specserve.engine import SamplingParams


# A context long enough that an unstopped request runs for many seconds: the cancel and
# deadline tests then see the KV freed long before the request could have ended by itself.
LONG_GENERATION = 16000


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("long-llama")), "llama",
                                max_position=LONG_GENERATION + 64)


@pytest.fixture(scope="module")
def server(model):
    server = ServerProcess(model, "--max-running-requests", "64",
                           "--max-total-tokens", str(2 * LONG_GENERATION))
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def offline(model):
    from specserve.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=model, device="cpu", dtype="float32", spec=None,
                                 max_total_tokens=8192))
    yield engine
    engine.shutdown()


def _greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)


def test_streamed_tokens_equal_offline_engine(client, offline):
    prompts = ["def add(a, b):", "héllo wörld ✓", "class Stack"]
    expected = offline.generate(prompts=prompts, sampling=_greedy(24))
    for prompt, want in zip(prompts, expected):
        chunks = list(client.generate_stream(prompt, max_new_tokens=24, temperature=0))
        got_ids = [t for c in chunks for t in c.token_ids]
        assert got_ids == want.token_ids
        assert chunks[-1].finish_reason == want.finish_reason
        assert chunks[-1].usage.prompt_tokens == want.prompt_tokens
        assert chunks[-1].usage.completion_tokens == len(want.token_ids)
        assert all(c.finish_reason is None for c in chunks[:-1])


def test_token_id_prompt_equals_offline_engine(client, offline):
    [prompt] = random_prompts(1, seed=3, min_len=5, max_len=12)
    [want] = offline.generate(prompt_token_ids=[prompt], sampling=_greedy(16))
    result = client.generate(prompt_token_ids=prompt, max_new_tokens=16, temperature=0)
    assert result.token_ids == want.token_ids


def test_text_is_the_detokenized_ids(client, offline):
    for prompt in ["héllo", "日本語", "print('hello world')", "✓✓"]:
        chunks = list(client.generate_stream(prompt, max_new_tokens=40, temperature=0,
                                             ignore_eos=True))
        ids = [t for c in chunks for t in c.token_ids]
        assert "".join(c.text for c in chunks) == offline.tokenizer.decode(ids)
        # Held-back partial characters are never streamed as a trailing replacement character.
        assert not any(c.text.endswith("\ufffd") for c in chunks[:-1] if c.text)


def test_stop_string_cuts_text_and_stops_generation(client, offline):
    full = client.generate("def add(a, b):", max_new_tokens=40, temperature=0, ignore_eos=True)
    clean = full.text.replace("\ufffd", "")
    stop = clean[len(clean) // 2:len(clean) // 2 + 2]
    cut_at = full.text.index(stop)
    result = client.generate("def add(a, b):", max_new_tokens=40, temperature=0, ignore_eos=True,
                             stop=[stop, "never-produced-xyz"])
    assert result.finish_reason == "stop"
    assert result.matched_stop == stop
    assert result.text == full.text[:cut_at]
    assert full.token_ids[:len(result.token_ids)] == result.token_ids
    assert len(result.token_ids) < len(full.token_ids)
    assert result.usage.completion_tokens == len(result.token_ids)
    assert wait_until(lambda: engine_is_idle(client)), "a stop string must abort the engine request"


def test_stop_token_id_and_logprobs(client):
    full = client.generate("class Stack", max_new_tokens=12, temperature=0, ignore_eos=True,
                           logprobs=True)
    assert len(full.logprobs) == len(full.token_ids)
    assert all(lp <= 0.0 for lp in full.logprobs)
    stop_id = full.token_ids[5]
    result = client.generate("class Stack", max_new_tokens=12, temperature=0, ignore_eos=True,
                             stop_token_ids=[stop_id])
    assert result.finish_reason == "stop"
    assert result.matched_stop == stop_id
    assert result.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]


def test_a_slow_consumer_gets_the_whole_stream(client, offline):
    """A reader slower than the engine (the server may then coalesce steps into one chunk)
    gets the same ids, text and logprobs, one logprob per token in every chunk."""
    fast = client.generate("def add(a, b):", max_new_tokens=48, temperature=0, ignore_eos=True,
                           logprobs=True, stop=["never-produced-xyz"])
    chunks = []
    for chunk in client.generate_stream("def add(a, b):", max_new_tokens=48, temperature=0,
                                        ignore_eos=True, logprobs=True,
                                        stop=["never-produced-xyz"]):
        chunks.append(chunk)
        time.sleep(0.05)
    assert [t for c in chunks for t in c.token_ids] == fast.token_ids
    assert "".join(c.text for c in chunks) == fast.text == offline.tokenizer.decode(fast.token_ids)
    assert [x for c in chunks for x in c.logprobs] == pytest.approx(fast.logprobs)
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert chunks[-1].usage.completion_tokens == 48


def test_cancelling_a_slow_stream_frees_kv(client):
    """Cancelled while chunks wait for it (coalesced on the server, or queued on the way)."""
    stream = client.generate_stream("def add(a, b):", max_new_tokens=LONG_GENERATION,
                                    ignore_eos=True)
    chunks = iter(stream)
    next(chunks)
    time.sleep(0.5)
    stream.cancel()
    with pytest.raises(Cancelled):
        for _ in chunks:
            pass
    assert wait_until(lambda: engine_is_idle(client), 5), client.server_load()
    assert wait_until(lambda: client.server_load().num_active_streams == 0)


def test_model_info(client, model):
    info = client.model_info()
    assert info.model == os.path.basename(model)  # a name, not the server's path
    assert info.vocab_size == 320 and info.max_context_len == LONG_GENERATION + 64
    assert info.max_prompt_tokens == info.max_context_len - 1
    assert not info.HasField("spec")


def test_64_concurrent_sync_streams(client, offline):
    prompts = random_prompts(64, seed=11, min_len=2, max_len=20)
    expected = offline.generate(prompt_token_ids=prompts, sampling=_greedy(12))
    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = client.generate(prompt_token_ids=prompts[i], max_new_tokens=12,
                                     temperature=0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert wait_until(lambda: engine_is_idle(client))


def test_cancel_mid_stream_frees_kv(client):
    stream = client.generate_stream("def add(a, b):", max_new_tokens=LONG_GENERATION,
                                    ignore_eos=True)
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    load = client.server_load()
    assert load.num_running == 1 and load.kv_used_tokens > 0 and load.num_active_streams == 1
    stream.cancel()
    with pytest.raises(Cancelled):
        next(chunks)
    assert wait_until(lambda: engine_is_idle(client), 5), client.server_load()
    assert wait_until(lambda: client.server_load().num_active_streams == 0)


def test_leaving_the_stream_context_early_cancels(client):
    with client.generate_stream("hello", max_new_tokens=LONG_GENERATION, ignore_eos=True) as stream:
        for _ in stream:
            break
    assert wait_until(lambda: engine_is_idle(client), 5), client.server_load()


def test_deadline_exceeded_frees_kv(client):
    with pytest.raises(DeadlineExceeded):
        client.generate("def add(a, b):", max_new_tokens=LONG_GENERATION, ignore_eos=True,
                        timeout=0.3)
    assert wait_until(lambda: engine_is_idle(client), 5), client.server_load()
    # The server still serves afterwards.
    assert client.generate("hi", max_new_tokens=3).usage.completion_tokens == 3


def test_cli_generate_through_the_server_and_offline_agree(server, model, capsys):
    import json

    from specserve.cli import main

    flags = ["--prompt", "def add", "--max-new-tokens", "6", "--temperature", "0", "--json"]
    assert main(["generate", "--server", server.address, *flags]) == 0
    via_server = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model", model, "--device", "cpu", "--dtype", "float32",
                 "--no-speculative", *flags]) == 0
    offline = json.loads(capsys.readouterr().out)
    assert via_server["token_ids"] == offline["token_ids"] and len(offline["token_ids"]) == 6
    assert via_server["text"] == offline["text"]


def test_sampling_fields_and_logprobs_through_the_sdk(client, offline):
    """Penalties, logit_bias, top_logprobs (with token text) and prompt logprobs go through
    the gRPC contract and the SDK and equal the offline engine's."""
    fields = dict(max_new_tokens=10, temperature=0.7, seed=3, presence_penalty=0.6,
                  frequency_penalty=0.3, logit_bias={65: 5.0, 66: -100.0}, logprobs=True,
                  top_logprobs=3, prompt_logprobs=2, ignore_eos=True)
    want = offline.generate(prompts=["class Stack"], sampling=SamplingParams(**fields))[0]
    chunks = list(client.generate_stream("class Stack", **fields))
    result = client.generate("class Stack", **fields)
    assert result.token_ids == want.token_ids and 66 not in result.token_ids
    assert chunks[0].prompt_logprobs is not None
    assert all(c.prompt_logprobs is None for c in chunks[1:])
    assert [[c.token_id for c in top] for top in result.top_logprobs] == \
        [[t for t, _ in top] for top in want.top_logprobs]
    assert result.top_logprobs[0][0].logprob == pytest.approx(want.top_logprobs[0][0][1], abs=1e-5)
    tokenizer = offline.tokenizer
    assert all(c.text == tokenizer.decode([c.token_id]) for top in result.top_logprobs for c in top)
    prompt_ids = tokenizer.encode("class Stack")
    first, *rest = result.prompt_logprobs
    assert first.logprob is None and first.top == [] and first.token_id == prompt_ids[0]
    assert [p.token_id for p in rest] == prompt_ids[1:]
    assert [p.logprob for p in rest] == pytest.approx(want.prompt_logprobs, abs=1e-5)
    assert [[t.token_id for t in p.top] for p in rest] == \
        [[t for t, _ in top] for top in want.prompt_top_logprobs]
    assert rest[0].text == tokenizer.decode([prompt_ids[1]])


def test_n_sequences_through_the_sdk(client, offline):
    """n = 3 over gRPC: each sequence equals the offline engine's, chunks name their sequence,
    a stop string ends one sequence while the others go on, and the KV is freed."""
    fields = dict(max_new_tokens=12, temperature=0.9, seed=11, ignore_eos=True)
    want = offline.generate(prompts=["def add"], sampling=SamplingParams(n=3, **fields))
    results = client.generate("def add", n=3, **fields)
    assert [r.token_ids for r in results] == [w.token_ids for w in want]
    assert [r.index for r in results] == [0, 1, 2]
    assert all(r.usage.prompt_tokens == want[0].prompt_tokens for r in results)
    # A stop string on text only the first sequence produces early.
    stop = results[0].text[2:5]
    assert stop and all(stop not in r.text for r in results[1:])
    chunks = list(client.generate_stream("def add", n=3, stop=[stop], **fields))
    stopped = [c for c in chunks if c.index == 0]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].matched_stop == stop
    assert [c.is_last for c in chunks].count(True) == 3
    for i in (1, 2):
        assert "".join(c.text for c in chunks if c.index == i) == results[i].text
    assert wait_until(lambda: engine_is_idle(client))


def test_stream_interval_chunks_carry_n_tokens_and_the_same_output(model, offline):
    """`specserve serve --stream-interval 4`: after the first, every chunk but the last carries
    at least 4 tokens; the tokens and text are the offline engine's."""
    server = ServerProcess(model, "--stream-interval", "4")
    try:
        with server.client() as client:
            [want] = offline.generate(prompts=["def add(a, b):"], sampling=_greedy(30))
            chunks = list(client.generate_stream("def add(a, b):", max_new_tokens=30,
                                                 temperature=0))
    finally:
        assert server.stop() == 0
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert "".join(c.text for c in chunks) == offline.tokenizer.decode(want.token_ids)
    sizes = [len(c.token_ids) for c in chunks]
    assert sizes[0] == 1 and all(size >= 4 for size in sizes[1:-1]) and len(sizes) < 30, sizes
