"""The committed generated code matches protos/, runs on old runtimes, and the API's documented
defaults are the engine's."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.engine import SamplingParams
from specserve.proto import generate_pb2 as pb
from specserve.server.text.validation import RequestLimits, RequestValidator

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "specserve" / "proto"
GENERATED_FILES = ["generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py",
                   "engine_ipc_pb2.py", "engine_ipc_pb2.pyi"]
_VERSION_GUARD = re.compile(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
                            r"\s*(\d+),\s*(\d+),\s*(\d+),")
_GRPC_VERSION = re.compile(r"^GRPC_GENERATED_VERSION = '([\d.]+)'", re.MULTILINE)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("proto")
    subprocess.run([sys.executable, str(REPO / "tools" / "gen_protos.py"), "--out", str(out)],
                   check=True, capture_output=True)
    return out


def _strip_versions(text: str) -> str:
    text = re.sub(r"^# Protobuf Python Version: .*$", "", text, flags=re.MULTILINE)
    return _VERSION_GUARD.sub("ValidateProtobufRuntimeVersion(VERSION", text)


def _rpc_table(text: str) -> list[tuple[str, str, str]]:
    """(method path, request type, response type) for every stub method."""
    return re.findall(r"'(/[\w.]+/\w+)',\s*request_serializer=[\w.]+?\.(\w+)\.SerializeToString,"
                      r"\s*response_deserializer=[\w.]+?\.(\w+)\.FromString", text)


def test_committed_code_is_current(regenerated):
    committed_grpc = (COMMITTED / "generate_pb2_grpc.py").read_text()
    fresh_grpc = (regenerated / "generate_pb2_grpc.py").read_text()
    if _GRPC_VERSION.search(committed_grpc).group(1) == _GRPC_VERSION.search(fresh_grpc).group(1):
        for name in GENERATED_FILES:  # same generator: byte for byte
            assert (COMMITTED / name).read_text() == (regenerated / name).read_text(), name
        return
    # A newer grpcio-tools formats some lines differently; compare what the code means.
    for name in ("generate_pb2.py", "engine_ipc_pb2.py"):
        assert _strip_versions((COMMITTED / name).read_text()) == \
            _strip_versions((regenerated / name).read_text()), f"{name} is stale: run make proto"
    assert _rpc_table(committed_grpc) == _rpc_table(fresh_grpc) != []
    assert "from . import generate_pb2" in committed_grpc


def test_generated_code_accepts_old_runtimes():
    """The guard admits protobuf 5.x runtimes and grpcio 1.84 (the GPU image), and pyproject
    asks for exactly those minimums."""
    pyproject = (REPO / "pyproject.toml").read_text()
    for name in ("generate_pb2.py", "engine_ipc_pb2.py"):
        guard = tuple(int(x) for x in _VERSION_GUARD.search((COMMITTED / name).read_text()).groups())
        assert guard[0] == 5, f"{name}: gencode {guard} rejects protobuf 5.x runtimes"
        assert f'"protobuf>={".".join(map(str, guard))}"' in pyproject
    grpc_version = _GRPC_VERSION.search((COMMITTED / "generate_pb2_grpc.py").read_text()).group(1)
    assert _version(grpc_version) <= (1, 84, 0)
    assert f'"grpcio>={grpc_version}"' in pyproject


def _documented_defaults() -> dict[str, str]:
    proto = (REPO / "protos" / "specserve" / "v1" / "generate.proto").read_text()
    message = proto[proto.index("message SamplingParams"):]
    message = message[:message.index("\n}")]
    return dict((name, default) for default, name in re.findall(
        r"// Unset: (\d+(?:\.\d+)?|true|false|no)\b.*?\n(?:\s*//.*\n)*\s*optional \w+ (\w+) =", message))


def test_documented_defaults_are_the_engine_defaults():
    documented = _documented_defaults()
    assert set(documented) == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                               "max_new_tokens", "min_new_tokens", "ignore_eos", "seed", "logprobs",
                               "presence_penalty", "frequency_penalty", "top_logprobs",
                               "prompt_logprobs", "n"}
    validator = RequestValidator(tokenizer=None, limits=RequestLimits(320, 100, 1000))
    resolved = validator.validate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5]))).sampling
    assert resolved == SamplingParams()
    for name, text in documented.items():
        value = getattr(resolved, name)
        if text == "no":  # "Unset: no seed", "Unset: no prompt scoring"
            assert value is None
        elif isinstance(value, bool):
            assert value == (text == "true"), name
        else:
            assert value == float(text), name
