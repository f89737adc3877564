"""gRPC Tokenize/Detokenize and chat messages on Generate, through a real server and the SDK:
the same ids and text as the HTTP front's /tokenize, /detokenize and chat endpoint (one shared
code path), one BOS for a rendered template, refusals naming the field."""
from __future__ import annotations

import json
import os

import grpc
import httpx
import pytest

from helpers import make_tiny_checkpoint
from server_harness import ServerProcess, free_port
from specserve.clients import InvalidArgument
from specserve.engine.tokenizer import Tokenizer
from specserve.proto import generate_pb2 as pb
from specserve.proto import generate_pb2_grpc as pb_grpc
from specserve.server.errors import InvalidRequest
from specserve.server.text.validation import RequestLimits, RequestValidator

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
RENDERED = "<|system|>be brief\n<|user|>hello\n<|assistant|>"
BOS = 1


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("chat")), "llama")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": CHAT_TEMPLATE}, f)
    return path


@pytest.fixture(scope="module")
def server(model):
    server = ServerProcess(model, "--http-port", str(free_port()))
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    with server.client() as client:
        yield client


def test_tokenize_text_with_and_without_special_tokens(server, client):
    ids = client.tokenize("def add(a, b):")
    assert ids[0] == BOS and ids[1:] == client.tokenize("def add(a, b):",
                                                       add_special_tokens=False)
    assert ids == httpx.post(server.http_url + "/tokenize",
                             json={"prompt": "def add(a, b):"}).json()["tokens"]
    # The ids are those Generate gives the same prompt.
    assert client.generate("def add(a, b):", max_new_tokens=1).usage.prompt_tokens == len(ids)
    assert client.generate("def add(a, b):", add_special_tokens=False,
                           max_new_tokens=1).usage.prompt_tokens == len(ids) - 1


def test_tokenize_messages_renders_the_template_with_one_bos(server, client):
    ids = client.tokenize(messages=MESSAGES)
    # The template writes the BOS (as text); the tokenizer adds none of its own.
    assert ids == client.tokenize("<bos>" + RENDERED, add_special_tokens=False)
    assert ids[0] == BOS and ids[1] != BOS
    assert ids == httpx.post(server.http_url + "/tokenize",
                             json={"messages": MESSAGES}).json()["tokens"]
    without_prompt = client.tokenize(messages=MESSAGES, add_generation_prompt=False)
    assert without_prompt == client.tokenize("<bos>" + RENDERED[:-len("<|assistant|>")],
                                             add_special_tokens=False)
    assert client.tokenize(messages=MESSAGES, add_special_tokens=True)[:2] == [BOS, BOS]


def test_detokenize_matches_http(server, client):
    ids = client.tokenize("héllo ✓", add_special_tokens=False)
    assert client.detokenize(ids) == "héllo ✓"
    assert client.detokenize(ids) == httpx.post(server.http_url + "/detokenize",
                                                json={"tokens": ids}).json()["prompt"]


def test_generate_with_messages_equals_http_chat(server, client):
    want = client.generate(prompt_token_ids=client.tokenize(messages=MESSAGES),
                           max_new_tokens=10, temperature=0)
    got = client.generate(messages=MESSAGES, max_new_tokens=10, temperature=0)
    assert (got.text, got.token_ids) == (want.text, want.token_ids)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens,
                                                                      want.usage.completion_tokens)
    # The same prompt again: all of it but its last token comes from the prefix cache.
    assert got.usage.cached_tokens == want.usage.prompt_tokens - 1
    chat = httpx.post(server.http_url + "/v1/chat/completions",
                      json={"messages": MESSAGES, "max_tokens": 10, "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"] == got.text


@pytest.mark.parametrize("call, field", [
    (lambda c: c.tokenize(messages=[]), "messages"),
    (lambda c: c.generate(messages=[], max_new_tokens=1), "messages"),
    (lambda c: c.detokenize([10**6]), "token_ids"),
    (lambda c: c.detokenize([1] * 10**5), "token_ids"),
    (lambda c: c.tokenize("x" * 10**7), "text"),
    (lambda c: c.tokenize(messages=[{"role": "user", "content": "x" * 10**7}]), "messages"),
    (lambda c: c.generate(messages=[*MESSAGES, {"role": "robot", "content": "x"}],
                          max_new_tokens=1), "messages[2].role"),
    (lambda c: c.tokenize(messages=[{"role": "", "content": "x"}]), "messages[0].role"),
])
def test_refusals_name_the_field(client, call, field):
    with pytest.raises(InvalidArgument) as error:
        call(client)
    assert error.value.details.startswith(f"{field}: ")


def test_messages_without_a_chat_template_name_messages(model):
    limits = RequestLimits(vocab_size=300, max_prompt_tokens=100, max_new_tokens_cap=10)
    validator = RequestValidator(Tokenizer(model, [2]), limits, chat_template=None)
    request = pb.GenerateRequest(messages=pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content="hi")]))
    with pytest.raises(InvalidRequest, match="^messages: this model has no chat template"):
        validator.validate(request)


def test_a_malformed_tokenize_request_names_request(server):
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary("/specserve.v1.GenerationService/Tokenize",
                                   request_serializer=lambda b: b,
                                   response_deserializer=pb.TokenizeResponse.FromString)
        with pytest.raises(grpc.RpcError) as error:
            call(b"\xff\xff\xff", timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith("request: ")
        stub = pb_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.Tokenize(pb.TokenizeRequest(), timeout=10)
        assert error.value.details().startswith("prompt: ")
