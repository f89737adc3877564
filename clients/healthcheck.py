"""grpc.health.v1 probe for Docker HEALTHCHECK and scripts (no Go grpc_health_probe needed).

    python -m specserve.clients.healthcheck --addr 127.0.0.1:50051 [--service NAME]

Prints the status; exit status 0 when SERVING, 1 otherwise (Docker's healthy / unhealthy).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from specserve.clients.client import Client
from specserve.clients.errors import SpecserveError


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default="127.0.0.1:50051", help="HOST:PORT")
    parser.add_argument("--service", default="",
                        help='"" (default) for liveness, specserve.v1.GenerationService for readiness')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--tls-root-cert", default=None, help="PEM to trust for a TLS server")
    args = parser.parse_args(argv)
    try:
        with Client(args.addr, tls_root_cert=args.tls_root_cert) as client:
            status = client.health(args.service, timeout=args.timeout)
    except SpecserveError as e:
        status = e.code.name
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
