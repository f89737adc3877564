"""The HTTP front bounded like the gRPC one, through a real server: bodies over
--max-message-bytes are a 413 (a Content-Length before the body is read, a chunked body as it
grows); every refusal has OpenAI's error shape (malformed JSON, nesting deeper than JSON
decodes, unknown paths, wrong methods); GET /v1/models/{id}; with the HTTP connection cap
reached in a process whose descriptors would otherwise run out, gRPC health and Generate still
answer and HTTP serves again once the connections close. Bodies are read and decoded by
bodies.read_body: within the limit, and in a thread when large."""
from __future__ import annotations

import json
import os
import resource
import select
import socket
import threading
import time

import httpx
import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, field_validator

from server_harness import ServerProcess, free_port, wait_until
from specserve.server.fronts.openai.bodies import (MAX_NESTING, OFF_LOOP_BYTES, BodyTooLarge,
                                                   parse_body, read_body)

MAX_BODY = 64 * 1024  # --max-message-bytes
CAP = 48              # --http-max-connections
BODY_TIMEOUT_S = 3.0  # --http-body-timeout
SLACK_S = 30.0


@pytest.fixture(scope="module")
def server(tiny_model):
    # A long header timeout: the cap's test holds idle connections open.
    server = ServerProcess(tiny_model, "--http-port", str(free_port()),
                           "--max-message-bytes", str(MAX_BODY),
                           "--http-max-connections", str(CAP), "--http-header-timeout", "300",
                           "--http-body-timeout", str(BODY_TIMEOUT_S))
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.http_url


@pytest.fixture(scope="module")
def name(tiny_model) -> str:
    return os.path.basename(tiny_model)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _raw_request(url: str, head: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=SLACK_S)
    sock.sendall(head.encode())
    return sock


def _read_response(sock: socket.socket) -> tuple[str, dict]:
    """A whole response with a Content-Length: (its head, its JSON body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return head.decode(), json.loads(body)


# --- the body limit -----------------------------------------------------------------------------
def test_body_over_the_limit_is_413(url, name):
    prompt = "x" * MAX_BODY
    error = _error(httpx.post(url + "/v1/completions", json={"model": name, "prompt": prompt}), 413)
    assert (error["param"], error["type"]) == ("body", "invalid_request_error")
    assert error["message"] == (f"body: larger than the server limit of {MAX_BODY} bytes "
                                f"(--max-message-bytes)")
    # Just under the limit: read and validated (the prompt is then over max tokens: a 400).
    small = {"model": name, "prompt": "x" * (MAX_BODY - 100)}
    assert httpx.post(url + "/v1/completions", json=small).status_code == 400


def test_a_content_length_over_the_limit_is_refused_before_the_body_is_sent(url):
    with _raw_request(url, "POST /v1/completions HTTP/1.1\r\nhost: t\r\n"
                           "content-type: application/json\r\n"
                           f"content-length: {100 * 1024 * 1024}\r\n\r\n") as sock:
        head, body = _read_response(sock)  # no byte of the body sent
    assert head.startswith("HTTP/1.1 413") and body["error"]["param"] == "body"


def test_a_chunked_body_is_refused_as_it_grows_past_the_limit(url):
    chunk = b"[" * 8192
    sent = 0
    with _raw_request(url, "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n"
                           "transfer-encoding: chunked\r\n\r\n") as sock:
        # An endless body: sent until the server answers.
        while not select.select([sock], [], [], 0)[0]:
            assert sent < 2000 * MAX_BODY, "no answer to a chunked body far over the limit"
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        head, body = _read_response(sock)
    assert head.startswith("HTTP/1.1 413") and body["error"]["param"] == "body"
    assert sent > MAX_BODY


def test_a_slow_body_is_cut_off_quietly(server, url):
    """A body that never completes: the connection is closed after the body timeout, and the
    route reading it ends as a client that left (no error logged)."""
    log_lines = len(server.log)
    start = time.monotonic()
    with _raw_request(url, "POST /v1/completions HTTP/1.1\r\nhost: t\r\n"
                           "content-length: 1000\r\n\r\n{\"prompt\": ") as sock:
        try:
            while sock.recv(65536):  # the server sends nothing: this returns at the cut-off
                pass
        except ConnectionResetError:
            pass
    assert BODY_TIMEOUT_S - 0.01 <= time.monotonic() - start < BODY_TIMEOUT_S + SLACK_S
    assert httpx.get(url + "/health").status_code == 200
    assert not [line for line in server.log[log_lines:] if "Traceback" in line or "ERROR" in line]


# --- OpenAI's error shape for every refusal -----------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/detokenize"])
@pytest.mark.parametrize("body, message", [
    (b'{"prompt": "hi",}', "body: not valid JSON (Expecting property name"),
    (b'{"prompt": "hi"', "body: not valid JSON (Expecting ',' delimiter"),
    (b"", "body: not valid JSON (Expecting value"),
    (b'\xff{"prompt": 1}', "body: not valid JSON ("),
    # Deeper than json.loads goes, and deeper than the limit (what later steps can take).
    (b"[" * 30_000 + b"]" * 30_000, f"body: arrays and objects nested deeper than {MAX_NESTING}"),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "body: arrays and objects nested deeper"),
    (b'{"prompt": ' + b"[" * MAX_NESTING + b"]" * MAX_NESTING + b"}",
     f"body: arrays and objects nested deeper than {MAX_NESTING} levels"),
])
def test_malformed_and_deeply_nested_json_is_a_400_naming_the_body(url, path, body, message):
    error = _error(httpx.post(url + path, content=body,
                              headers={"content-type": "application/json"}), 400)
    assert (error["param"], error["type"]) == ("body", "invalid_request_error")
    assert error["message"].startswith(message), error


def _nested_schema_body(levels: int) -> bytes:
    """A completion whose body nests `levels` deep, in its response_format's schema."""
    schema = b"{}"
    for _ in range(levels - 4):  # the body, response_format, json_schema and schema itself
        schema = b'{"a": ' + schema + b"}"
    return (b'{"prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_schema", '
            b'"json_schema": {"name": "x", "schema": ' + schema + b"}}}")


def test_nesting_up_to_the_limit_is_served_and_deeper_is_a_400(url):
    """A body nested as deep as the limit goes on through the request path (it is pickled
    for the tokenizer workers, which breaks at about 490 levels): never a 500."""
    response = httpx.post(url + "/v1/completions", content=_nested_schema_body(MAX_NESTING),
                          timeout=SLACK_S)
    # Served, or refused by the grammar's own limits: not a server error, not the body's.
    assert response.status_code == 200 or _error(response, 400)["param"] != "body", response.text
    error = _error(httpx.post(url + "/v1/completions",
                              content=_nested_schema_body(MAX_NESTING + 1)), 400)
    assert error["param"] == "body" and "nested deeper than" in error["message"]


class _Anything(BaseModel):
    value: object


def test_nesting_is_measured_in_arrays_and_objects():
    def nested(levels: int) -> bytes:  # the body's object, then arrays and objects in turn
        inner = levels - 1
        return (b'{"value": ' + b'[{"a": ' * (inner // 2) + b"[" * (inner % 2) + b"1"
                + b"]" * (inner % 2) + b"}]" * (inner // 2) + b"}")

    assert parse_body(nested(MAX_NESTING), _Anything).value
    with pytest.raises(RequestValidationError, match=f"deeper than {MAX_NESTING} levels"):
        parse_body(nested(MAX_NESTING + 1), _Anything)
    # Many brackets, little nesting: taken (and brackets inside strings do not count).
    wide = json.dumps({"value": [[{"[": "{[{["}]] * 10 * MAX_NESTING}).encode()
    assert len(parse_body(wide, _Anything).value) == 10 * MAX_NESTING


def test_a_body_that_is_not_an_object_is_a_400(url):
    error = _error(httpx.post(url + "/v1/completions", json=[1, 2]), 400)
    assert error["param"] == "body" and error["message"].startswith("body: "), error


def test_a_field_of_the_wrong_type_is_still_named(url):
    error = _error(httpx.post(url + "/v1/completions", json={"prompt": "hi", "n": "x"}), 400)
    assert error["param"] == "n" and error["message"].startswith("n: "), error


@pytest.mark.parametrize("method, path, status, message", [
    ("GET", "/v1/nothing", 404, "Invalid URL (GET /v1/nothing)"),
    ("POST", "/v2/completions", 404, "Invalid URL (POST /v2/completions)"),
    ("GET", "/v1/completions", 405, "Method not allowed (GET /v1/completions)"),
    ("DELETE", "/v1/models", 405, "Method not allowed (DELETE /v1/models)"),
])
def test_unknown_paths_and_wrong_methods_have_openai_errors(url, method, path, status, message):
    response = httpx.request(method, url + path)
    error = _error(response, status)
    assert error == {"message": message, "type": "invalid_request_error", "param": None,
                     "code": None}
    if status == 405:
        assert response.headers["allow"] in ("POST", "GET")


# --- GET /v1/models/{id} --------------------------------------------------------------------------
def test_retrieve_model(url, name, oai):
    listed = httpx.get(url + "/v1/models").json()["data"]
    assert httpx.get(f"{url}/v1/models/{name}").json() == listed[0]
    assert oai.models.retrieve(name).id == name
    for unknown in ("gpt-4", "org/some-model"):
        error = _error(httpx.get(f"{url}/v1/models/{unknown}"), 404)
        assert (error["param"], error["code"]) == ("model", "model_not_found")
        assert unknown in error["message"]


# --- the connection cap leaves gRPC its descriptors ---------------------------------------------
def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_grpc_answers_with_the_http_cap_reached_and_http_recovers(server, url, name):
    """The server's descriptor limit is cut to what it has open plus the cap and a margin: 2x
    the cap of idle HTTP connections would take every descriptor left without the cap (and
    gRPC could not accept a connection). With it, the connections past the cap are refused."""
    pid = server.process.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (_open_fds(pid) + CAP + 32, hard))
    host, port = url.removeprefix("http://").split(":")
    held: list[socket.socket] = []
    try:
        for _ in range(2 * CAP):
            held.append(socket.create_connection((host, int(port)), timeout=SLACK_S))
        # The server took CAP of them (fewer if a connection of an earlier test is still
        # open); the others were answered 503 and closed.
        def answered() -> list[socket.socket]:
            return [sock for sock in held if select.select([sock], [], [], 0)[0]]

        assert wait_until(lambda: len(answered()) >= CAP, SLACK_S), len(answered())
        for sock in answered():
            data = sock.recv(65536)
            assert data.startswith(b"HTTP/1.1 503"), data
        with server.client() as fresh:  # a new gRPC connection, while the HTTP ones are held
            assert fresh.health() == "SERVING"
            assert fresh.generate("def add", max_new_tokens=4, ignore_eos=True).usage \
                .completion_tokens == 4
    finally:
        for sock in held:
            sock.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))

    def http_serves() -> bool:
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(http_serves, SLACK_S)


# --- bodies.read_body: bounded reads, large bodies decoded in a thread ----------------------------
class _Recorded(BaseModel):
    prompt: str

    @field_validator("prompt")
    @classmethod
    def _record_thread(cls, value: str) -> str:
        _Recorded.threads.append(threading.get_ident())
        return value


_Recorded.threads = []


class _Request:
    """What read_body uses of a starlette Request: headers and the body's chunks."""

    def __init__(self, chunks: list[bytes], content_length: bool = True):
        self.headers = ({"content-length": str(sum(map(len, chunks)))} if content_length else {})
        self.chunks_read = 0
        self._chunks = chunks

    async def stream(self):
        for chunk in self._chunks:
            self.chunks_read += 1
            yield chunk


@pytest.mark.asyncio
async def test_large_bodies_are_decoded_off_the_event_loop():
    loop_thread = threading.get_ident()
    small = json.dumps({"prompt": "x" * 100}).encode()
    large = json.dumps({"prompt": "x" * OFF_LOOP_BYTES}).encode()
    _Recorded.threads.clear()
    assert (await read_body(_Request([small]), _Recorded, 10 * OFF_LOOP_BYTES)).prompt == "x" * 100
    assert (await read_body(_Request([large[:10], large[10:]]), _Recorded,
                            10 * OFF_LOOP_BYTES)).prompt == "x" * OFF_LOOP_BYTES
    assert _Recorded.threads[0] == loop_thread and _Recorded.threads[1] != loop_thread


@pytest.mark.asyncio
async def test_a_body_is_read_no_further_than_its_limit():
    chunks = [b"x" * 1000] * 50
    declared = _Request(chunks)
    with pytest.raises(BodyTooLarge):
        await read_body(declared, _Recorded, 10_000)
    assert declared.chunks_read == 0  # refused on its Content-Length
    chunked = _Request(chunks, content_length=False)
    with pytest.raises(BodyTooLarge):
        await read_body(chunked, _Recorded, 10_000)
    assert chunked.chunks_read == 11  # the chunk that went past the limit, and no further
