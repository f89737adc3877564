"""A real `specserve serve` process on 127.0.0.1 for tests: start, read its log, stop."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Optional

from specserve.clients import Client

START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: str, *extra_args: str, speculative: bool = False,
                  port: Optional[int] = 0) -> list[str]:
    """`specserve serve` on the tiny CPU model; port None leaves --port out."""
    return [sys.executable, "-m", "specserve.cli", "serve", "--model", model,
            "--device", "cpu", "--dtype", "float32",
            *([] if speculative else ["--no-speculative"]), "--host", "127.0.0.1",
            *([] if port is None else ["--port", str(port)]), "--max-total-tokens", "8192",
            *extra_args]


EXIT_TIMEOUT_S = 120.0  # a server that refuses to start exits long before this


def serve_and_exit(model: str, *args: str, env: Optional[dict[str, str]] = None,
                   **kwargs) -> subprocess.CompletedProcess:
    """`specserve serve` expected to refuse to start: run it to its exit."""
    return subprocess.run(serve_command(model, *args, **kwargs), capture_output=True, text=True,
                          timeout=EXIT_TIMEOUT_S, env=None if env is None else {**os.environ, **env})


def assert_one_error_line(result: subprocess.CompletedProcess, message: str) -> None:
    """Exit status 1 and, on stderr, one line only: the error, naming the problem (no
    traceback, no "serving on", no engine or other process started)."""
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and " ERROR " in lines[0] and message in lines[0], output
    assert not result.stdout, output


class ServerProcess:
    """`specserve serve --port 0` on the tiny CPU model; the bound port and the engine's pid
    are read from the server's log."""

    def __init__(self, model: str, *extra_args: str, wait_serving: bool = True,
                 speculative: bool = False, port: Optional[int] = 0,
                 env: Optional[dict[str, str]] = None, new_session: bool = False):
        """new_session: the server leads a process group of its own (signals to the group)."""
        self.command = serve_command(model, *extra_args, speculative=speculative, port=port)
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        env=None if env is None else {**os.environ, **env},
                                        start_new_session=new_session)
        self.log: list[str] = []
        self._log_changed = threading.Condition()
        threading.Thread(target=self._read_log, daemon=True).start()
        self.port = int(self.wait_for_log(r"serving on [\d.]+:(\d+)").group(1))
        # One engine: "(pid N)"; a data-parallel replica: "(replica i: pid N on HOST, ...)".
        self.engine_pid = int(self.wait_for_log(
            r"engine process started \((?:replica \d+: )?pid (\d+)").group(1))
        self.address = f"127.0.0.1:{self.port}"
        if wait_serving:
            self.wait_for_log(r"SERVING")

    def _read_log(self) -> None:
        for line in self.process.stdout:
            with self._log_changed:
                self.log.append(line.rstrip("\n"))
                self._log_changed.notify_all()
        with self._log_changed:
            self._log_changed.notify_all()

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible front's address (http://host:port) of a server started with
        --http-port, from its log."""
        return "http://" + self.wait_for_log(r"OpenAI-compatible API on http://([\d.]+:\d+)/v1").group(1)

    def openai_client(self):
        """An OpenAI SDK client of the HTTP front (no retries: a test sees every failure)."""
        import openai

        return openai.OpenAI(base_url=self.http_url + "/v1", api_key="none", max_retries=0)

    def wait_for_log(self, pattern: str, timeout: float = START_TIMEOUT_S) -> re.Match:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._log_changed:
            while True:
                for line in self.log:
                    match = regex.search(line)
                    if match:
                        return match
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.process.poll() is not None and self.process.stdout.closed):
                    raise AssertionError(f"no log line matching {pattern!r}; log:\n" +
                                         "\n".join(self.log))
                self._log_changed.wait(min(remaining, 0.5))

    def client(self, **kwargs) -> Client:
        return Client(self.address, **kwargs)

    def stop(self, timeout: float = 60.0) -> Optional[int]:
        """SIGTERM, wait for a clean exit (killing it past timeout); returns the exit status.
        A killed server's engine exits by itself once it sees its parent gone."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def engine_is_idle(client: Client) -> bool:
    load = client.server_load()
    return load.num_running == 0 and load.num_waiting == 0 and load.kv_used_tokens == 0


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def http_get(url: str) -> tuple[int, str]:
    """(status, body) of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    """A /metrics page's samples: (name, its labels sorted) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_get(url)
    assert status == 200, (status, body)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def assert_spec_method_metrics(metrics_url: str, method: str, outputs: list, draft_depth: int) -> None:
    """/metrics counts the verify steps and accepted drafts of `outputs` (the client's
    generate results, all of this server's calls) under their draft method, and its depth."""
    samples = metric_samples(metrics_url)
    labels = (("method", method),)
    assert samples[("specserve_spec_method_verify_steps_total", labels)] == sum(o.spec.verify_steps for o in outputs)
    assert samples[("specserve_spec_method_accepted_draft_tokens_total", labels)] == \
        sum(o.spec.accepted_drafts for o in outputs)
    assert samples[("specserve_spec_draft_depth", labels)] == draft_depth
    # A fixed shape: every decode step verified draft_depth drafts a request (a step per verify
    # of a lone request, and more where several ran together or one ran past its end).
    depths = {dict(k[1])["depth"]: v for k, v in samples.items()
              if k[0] == "specserve_spec_decode_steps_total" and dict(k[1])["method"] == method}
    assert set(depths) == {str(draft_depth)}
    assert 0 < depths[str(draft_depth)] and max(o.spec.verify_steps for o in outputs) <= depths[str(draft_depth)]


# server/request_record.py TTFT_STAGES, in order (the access log's ttft_stages_ms, the
# specserve_ttft_stage_seconds labels).
TTFT_STAGE_NAMES = ("prepare", "submit", "to_engine", "engine_queue", "prefill", "to_server",
                    "to_consumer", "write")


def ttft_stages(access_log_line: str) -> dict[str, float]:
    """An access-log line's ttft_stages_ms, in the order logged; {} for "-"."""
    value = re.search(r" ttft_stages_ms=(\S+)$", access_log_line).group(1)
    if value == "-":
        return {}
    return {name: float(ms) for name, ms in (part.split(":") for part in value.split(","))}


def assert_complete_ttft_stages(access_log_line: str) -> None:
    """Every stage, in order, none negative: the request's stamps were all taken and are
    monotone (each stage is a later stamp minus an earlier one)."""
    stages = ttft_stages(access_log_line)
    assert tuple(stages) == TTFT_STAGE_NAMES, access_log_line
    assert all(ms >= 0 for ms in stages.values()), access_log_line


def listening_tcp_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (Linux /proc: its socket inodes in LISTEN)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def replay_kv_events(context, address: str, start: int) -> list[tuple[int, bytes]]:
    """The batches a KV-event replay socket sends back from sequence `start` (a DEALER: the
    replay is several messages, then END_OF_REPLAY)."""
    import zmq

    from specserve.engine.kv_events import END_OF_REPLAY

    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        answers = []
        while True:
            assert dealer.poll(10_000), "the replay did not end"
            empty, sequence, payload = dealer.recv_multipart()
            assert empty == b""
            if sequence == END_OF_REPLAY:
                assert payload == b""
                return answers
            answers.append((int.from_bytes(sequence, "big"), payload))
    finally:
        dealer.close()
