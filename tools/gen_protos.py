"""Generate the Python code of protos/specserve/v1/*.proto into specserve/proto/ (`make proto`).

The generated package, `specserve.proto`, belongs to none of engine/, server/ and clients/:
all three import it.

The committed code is made with an old grpcio-tools (see PROTO_GRPC_TOOLS in the Makefile) so
that its protobuf version guard accepts every runtime from 5.27.2 on; the generated code then
runs on older deployments (e.g. a GPU image with grpcio 1.84) and on the newest protobuf alike.

protoc writes `from specserve.v1 import generate_pb2`, which would resolve against our own
`specserve` package; the import is rewritten to a relative one so the package is self-contained.

Usage: python tools/gen_protos.py [--out DIR]   (default: specserve/proto)
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
PROTO_PACKAGE = "specserve/v1"
SERVICE_PROTOS = ["generate.proto"]   # these also get *_pb2_grpc.py
MESSAGE_PROTOS = ["engine_ipc.proto"]
DEFAULT_OUT = REPO / "specserve" / "proto"

_ABSOLUTE_IMPORT = re.compile(r"^from specserve\.v1 import (\w+_pb2) as", re.MULTILINE)


def _run_protoc(out_dir: Path, protos: list[str], with_grpc: bool) -> None:
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}"]
    if with_grpc:
        args.append(f"--grpc_python_out={out_dir}")
    args += [f"{PROTO_PACKAGE}/{name}" for name in protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules into out_dir (flat); return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        _run_protoc(tmp_dir, SERVICE_PROTOS, with_grpc=True)
        _run_protoc(tmp_dir, MESSAGE_PROTOS, with_grpc=False)
        for src in sorted((tmp_dir / PROTO_PACKAGE).iterdir()):
            text = _ABSOLUTE_IMPORT.sub(r"from . import \1 as", src.read_text())
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    init = out_dir / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protobuf and gRPC code (tools/gen_protos.py; do not edit)."""\n')
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.out == DEFAULT_OUT:
        for old in DEFAULT_OUT.glob("*_pb2*.py*"):
            old.unlink()
    for path in generate(args.out):
        print(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
