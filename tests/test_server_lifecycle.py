"""Server lifecycle: health during warm-up, reflection, engine death, SIGTERM drain, TLS, metrics."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import time
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from server_harness import ServerProcess, engine_is_idle, free_port, wait_until
from specserve.clients import Client, Unavailable, healthcheck
from specserve.server.ops.health import GENERATION_SERVICE


def test_health_is_serving_only_after_warm_up(tiny_model):
    server = ServerProcess(tiny_model, wait_serving=False)
    try:
        with server.client() as client:
            # The server listens before the engine has even imported torch.
            with pytest.raises(Unavailable, match="starting"):
                client.generate("hi", max_new_tokens=2)
            statuses = [client.health(), client.health(GENERATION_SERVICE)]
            assert statuses == ["NOT_SERVING", "NOT_SERVING"]
            probe = ["--addr", server.address, "--service", GENERATION_SERVICE]
            assert healthcheck.main(probe) == 1  # the Docker HEALTHCHECK: unhealthy while warming
            assert wait_until(lambda: client.health(GENERATION_SERVICE) == "SERVING", 120)
            assert client.health() == "SERVING"
            assert healthcheck.main(probe) == 0
            # SERVING means warm: the first request is served at once.
            assert client.generate("hi", max_new_tokens=2).usage.completion_tokens == 2
            assert client.model_info().vocab_size == 320

            with pytest.raises(grpc.RpcError) as info:
                client._health.Check(_health_request("no.such.Service"), timeout=5)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND

            with grpc.insecure_channel(server.address) as channel:
                services = ProtoReflectionDescriptorDatabase(channel).get_services()
                assert GENERATION_SERVICE in services and "grpc.health.v1.Health" in services
                assert _v1_reflection_services(channel) == sorted(services)
    finally:
        assert server.stop() == 0


def _v1_reflection_services(channel: grpc.Channel) -> list[str]:
    """A client that speaks grpc.reflection.v1 only (the v1 messages encode like v1alpha's)."""
    from grpc_reflection.v1alpha import reflection_pb2 as pb

    list_services = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=pb.ServerReflectionRequest.SerializeToString,
        response_deserializer=pb.ServerReflectionResponse.FromString)
    replies = list(list_services(iter([pb.ServerReflectionRequest(list_services="")]), timeout=10))
    return sorted(s.name for s in replies[0].list_services_response.service)


def _health_request(service: str):
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckRequest(service=service)


def test_engine_death_fails_calls_fast_and_goes_not_serving(tiny_model):
    server = ServerProcess(tiny_model)
    try:
        with server.client() as client:
            stream = iter(client.generate_stream("def add", max_new_tokens=500, ignore_eos=True))
            next(stream)
            os.kill(server.engine_pid, signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(Unavailable, match="engine process"):
                for _ in stream:
                    pass
            assert time.monotonic() - killed_at < 5.0
            assert client.health() == "NOT_SERVING"
            assert client.health(GENERATION_SERVICE) == "NOT_SERVING"
            with pytest.raises(Unavailable):
                client.generate("hi", max_new_tokens=2)
            with pytest.raises(Unavailable):
                client.server_load()
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("to_group", [False, True], ids=["server", "process-group"])
def test_sigterm_drains_in_flight_calls_then_exits(tiny_model, to_group):
    """SIGTERM to the server, or to its whole process group (systemd, `kill -- -PGID`: the
    engine and the text workers get it too, and must leave stopping to the server)."""
    server = ServerProcess(tiny_model, new_session=to_group)
    with server.client() as client:
        stream = iter(client.generate_stream("def add", max_new_tokens=500, ignore_eos=True,
                                             temperature=0))
        first = next(stream)
        if to_group:
            os.killpg(server.process.pid, signal.SIGTERM)
        else:
            server.process.send_signal(signal.SIGTERM)
        server.wait_for_log("draining")
        with pytest.raises(Unavailable):
            client.generate("hi", max_new_tokens=2, timeout=10)
        rest = list(stream)
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 500
    assert server.process.wait(60) == 0
    assert wait_until(lambda: not os.path.exists(f"/proc/{server.engine_pid}"), 10)
    assert not [line for line in server.log if " ERROR " in line], server.log


def _self_signed_cert(directory) -> tuple[str, str]:
    cert, key = str(directory / "cert.pem"), str(directory / "key.pem")
    if importlib.util.find_spec("cryptography") is None:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is available")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-keyout", key, "-out", cert, "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                       check=True, capture_output=True)
        return cert, key
    return _cryptography_cert(cert, key)


def _cryptography_cert(cert_path: str, key_path: str) -> tuple[str, str]:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .sign(key, hashes.SHA256()))
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_round_trip_and_metrics(tiny_model, tmp_path):
    cert, key = _self_signed_cert(tmp_path)
    metrics_port = free_port()
    server = ServerProcess(tiny_model, "--tls-cert", cert, "--tls-key", key,
                           "--metrics-port", str(metrics_port))
    try:
        with Client(server.address, tls_root_cert=cert) as client:
            result = client.generate("hello", max_new_tokens=5, temperature=0)
            assert result.usage.completion_tokens == 5
        with Client(server.address) as plaintext:
            with pytest.raises(Unavailable):
                plaintext.generate("hello", max_new_tokens=2, timeout=5)
        def scrape() -> str:
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.read().decode()

        metrics = scrape()
        assert 'specserve_requests_total{code="OK"} 1.0' in metrics
        assert "specserve_generated_tokens_total 5.0" in metrics
        # Engine load gauges are refreshed in the background.
        assert wait_until(lambda: "specserve_kv_total_tokens 8192.0" in scrape(), 10)
    finally:
        assert server.stop() == 0


def test_engine_that_fails_to_start_stops_the_server(tiny_model, tmp_path):
    """A checkpoint that passes the server's checks but not the engine's loader (a tensor is
    missing): the engine process reports why and the server exits 1 with that one line (the
    traceback only at --log-level DEBUG)."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = str(model / "model.safetensors")
    tensors = load_file(weights)
    del tensors["model.norm.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    server = ServerProcess(str(model), wait_serving=False)
    assert server.process.wait(120) == 1
    server.wait_for_log("the engine failed to start")
    errors = [line for line in server.log if " ERROR " in line]
    assert len(errors) == 1, server.log
    assert errors[0].endswith("the engine failed to start: model: checkpoint is missing tensor "
                              "'model.norm.weight' (for norm.weight)"), errors
    assert not any("Traceback" in line for line in server.log), server.log
    assert wait_until(lambda: not os.path.exists(f"/proc/{server.engine_pid}"), 10)


def test_detokenizer_worker_death_ends_calls_and_frees_their_kv(tiny_model):
    """The detokenizer worker process is killed mid-stream: the call ends with UNAVAILABLE, the
    server goes NOT_SERVING for good, and the engine (still running) frees the request's KV."""
    # Slowed forwards (about 20 ms a step): the request is far from done when the worker dies,
    # so only the abort can free its KV within the check below.
    server = ServerProcess(tiny_model, env={"SPECSERVE_FORWARD_DELAY": "0:40"})
    try:
        worker_pid = int(server.wait_for_log(r"detokenizer worker started \(pid (\d+)\)").group(1))
        with server.client() as client:
            stream = iter(client.generate_stream("def add", max_new_tokens=500, ignore_eos=True))
            next(stream)
            assert client.server_load().kv_used_tokens > 0
            os.kill(worker_pid, signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(Unavailable, match="detokenizer worker"):
                for _ in stream:
                    pass
            assert time.monotonic() - killed_at < 5.0
            assert client.health(GENERATION_SERVICE) == "NOT_SERVING"
            with pytest.raises(Unavailable):
                client.generate("hi", max_new_tokens=2)
            assert wait_until(lambda: engine_is_idle(client), 3)  # nothing leaked
    finally:
        assert server.stop() == 0
