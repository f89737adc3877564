"""`specserve serve` configured with something it cannot serve ends at once with one error line
that names the problem and exit status 1, before any port is bound (server/preflight.py): a
model folder that is missing or not a checkpoint (its config, its weight files' headers), a
draft model, TLS files, a host that does not resolve, --http-port without the `http` extra.
What only the engine finds out (a tensor the checkpoint lacks) ends it with one line too, from
the engine process (tests/test_server_lifecycle.py); and the engine client's side of that."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket

import pytest

from server_harness import assert_one_error_line, serve_and_exit
from specserve.cli import main


@pytest.fixture
def taken_ports():
    """Three listening ports: a server that binds before its checks would report one of them."""
    sockets = [socket.socket() for _ in range(3)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
    yield [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()


def test_a_missing_model_is_refused_before_any_port_is_bound(tmp_path, taken_ports):
    grpc_port, metrics_port, http_port = taken_ports
    missing = str(tmp_path / "no-such-model")
    result = serve_and_exit(missing, "--metrics-port", str(metrics_port),
                            "--http-port", str(http_port), port=grpc_port)
    # Not "cannot listen on ...": the model was checked first, with every port still unbound.
    assert_one_error_line(result, f"--model: {missing}: no such directory")


def _copy(model: str, tmp_path) -> str:
    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    return str(folder)


def _write(path: str, name: str, text: str) -> None:
    with open(os.path.join(path, name), "w") as f:
        f.write(text)


def _unsupported_architecture(model: str) -> None:
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    _write(model, "config.json", json.dumps(dict(config, architectures=["GPT2LMHeadModel"])))


@pytest.mark.parametrize("breaks, message", [
    (lambda m: os.path.join(m, "config.json"), "/config.json: not a directory"),
    (lambda m: os.remove(os.path.join(m, "config.json")), ": no config.json"),
    (lambda m: _write(m, "config.json", "{not json"), "/config.json: cannot be read as JSON"),
    (lambda m: _write(m, "config.json", "[]"), "/config.json: not a JSON object"),
    (_unsupported_architecture, ": unsupported architecture ['GPT2LMHeadModel']; supported: "),
    (lambda m: _write(m, "config.json", '{"architectures": ["LlamaForCausalLM"]}'),
     "/model: config.json has no 'num_attention_heads'"),
    (lambda m: os.remove(os.path.join(m, "model.safetensors")), ": no *.safetensors weight files"),
    (lambda m: _write(m, "model.safetensors", "junk"),
     "/model.safetensors: not a readable safetensors file ("),
    (lambda m: _write(m, "model.safetensors.index.json",
                      '{"weight_map": {"a": "model-00001-of-00002.safetensors"}}'),
     ": the index names model-00001-of-00002.safetensors, which is not there"),
], ids=["a-file", "no-config", "bad-json", "not-an-object", "architecture", "no-field", "no-weights",
        "corrupt-weights", "index-names-a-missing-shard"])
def test_a_folder_that_is_not_a_checkpoint_is_one_line(tiny_model, tmp_path, breaks, message):
    model = _copy(tiny_model, tmp_path)
    given = breaks(model) or model  # a lambda may give another path to serve
    result = serve_and_exit(given)
    assert_one_error_line(result, "--model: ")
    assert message in result.stderr, result.stderr


def test_a_missing_draft_model_is_one_line(tiny_model, tmp_path):
    missing = str(tmp_path / "no-such-draft")
    result = serve_and_exit(tiny_model, "--speculative-algorithm", "eagle", "--draft-model",
                            missing, speculative=True)
    assert_one_error_line(result, f"--draft-model: {missing}: no such directory")


def test_missing_tls_files_are_one_line(tiny_model, tmp_path):
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    result = serve_and_exit(tiny_model, "--tls-cert", cert, "--tls-key", key)
    assert_one_error_line(result, f"--tls-cert {cert}: No such file or directory")


def test_a_tls_file_that_is_not_pem_is_one_line(tiny_model, tmp_path):
    """Not gRPC's "Failed to bind to address" after three lines of its own log."""
    bad = tmp_path / "cert.pem"
    bad.write_text("not a certificate\n")
    result = serve_and_exit(tiny_model, "--tls-cert", str(bad), "--tls-key", str(bad))
    assert_one_error_line(result, f"--tls-cert {bad}, --tls-key {bad}: not a PEM certificate "
                                  f"chain and its unencrypted private key")


def test_a_host_that_does_not_resolve_is_one_line(tiny_model):
    result = serve_and_exit(tiny_model, "--host", "no-such-host.invalid")
    assert_one_error_line(result, "cannot listen on no-such-host.invalid:0 (--port): ")


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--http-port"])
def test_a_port_out_of_range_is_a_usage_error(capsys, flag):
    """gRPC would have bound 70000 % 65536."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", flag, "70000"])
    assert exit_info.value.code == 2
    name = flag[2:].replace("-", "_")
    assert f"{name}: must be a port number in 0..65535, got 70000" in capsys.readouterr().err


def test_http_port_without_the_http_extra_says_what_to_install(tiny_model, tmp_path):
    # A fastapi module that is "not installed" shadows the real one.
    (tmp_path / "fastapi.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'fastapi'\", name='fastapi')\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    result = serve_and_exit(tiny_model, "--http-port", "0", env={"PYTHONPATH": path})
    assert_one_error_line(result, "--http-port: the OpenAI-compatible HTTP front needs the "
                                  "`http` extra (FastAPI, uvicorn): pip install 'specserve[http]'")


def test_replicas_elsewhere_skip_the_model_folder_checks(tmp_path):
    """Data-parallel replicas may run on nodes whose paths this host does not have."""
    from specserve.engine.config import EngineConfig
    from specserve.server.config import ServerConfig
    from specserve.server.preflight import StartupError, check_startup

    engine = EngineConfig(model=str(tmp_path / "on-another-node"))
    with pytest.raises(StartupError, match="^--model: .*: no such directory$"):
        check_startup(engine, ServerConfig())
    check_startup(engine, ServerConfig(), local_engine=False)


def test_speculative_flags_with_no_speculative_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:  # before the (missing) model is looked at
        main(["serve", "--model", "/no/such/model", "--no-speculative",
              "--draft-model", "/d", "--speculative-num-steps", "3"])
    assert exit_info.value.code == 2
    assert ("--draft-model, --speculative-num-steps: have no effect with --no-speculative"
            in capsys.readouterr().err)


# --- the engine's start-up failure, as the server's engine client sees it --------------------
async def _start_failure(monkeypatch, messages_after_exit: list) -> str:
    """What wait_ready raises when the engine process exits at start-up and then (the reader
    thread being late) its reports arrive."""
    from specserve.engine.config import EngineConfig
    from specserve.proto import engine_ipc_pb2 as ipc
    from specserve.server import engine_client
    from specserve.server.ops.watchdog import EngineWatchdog

    monkeypatch.setattr(engine_client, "EXIT_REPORT_GRACE_S", 0.5)
    client = engine_client.EngineClient(EngineConfig(device="cpu"), EngineWatchdog(4.0, None))
    loop = asyncio.get_running_loop()
    client._ready = loop.create_future()
    try:
        client._on_process_exit("engine process exited with code 1")
        for message in messages_after_exit:  # a little later, within the grace
            loop.call_later(0.1, client._on_message,
                            ipc.EngineToServer(failed=ipc.EngineFailed(message=message)))
        with pytest.raises(engine_client.EngineUnavailable) as error:
            await asyncio.wait_for(client.wait_ready(), 5)
        return str(error.value)
    finally:
        await client.shutdown()


@pytest.mark.asyncio
async def test_a_start_up_failure_reported_after_the_exit_is_what_the_server_says(monkeypatch):
    trace = "Traceback (most recent call last):\n  ...\nValueError: device: no CUDA\n"
    assert await _start_failure(monkeypatch, [f"device: no CUDA\n{trace}"]) == "device: no CUDA"


@pytest.mark.asyncio
async def test_an_engine_that_exits_without_a_report_says_its_exit_code(monkeypatch):
    assert await _start_failure(monkeypatch, []) == "engine process exited with code 1"
