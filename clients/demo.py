"""Stream one generation from a running server; print the text, tokens/s and accept length.

    python -m specserve.clients.demo --server 127.0.0.1:50051 --prompt "def fibonacci(n):"
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

from specserve.clients.client import Client


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--wait", type=float, default=60.0,
                        help="seconds to wait for the server to report SERVING")
    args = parser.parse_args(argv)
    with Client(args.server) as client:
        client.wait_until_serving(args.wait)
        print(args.prompt, end="", flush=True)
        started = time.perf_counter()
        num_tokens, last = 0, None
        with client.generate_stream(args.prompt, max_new_tokens=args.max_new_tokens,
                                    temperature=0) as stream:
            for chunk in stream:
                print(chunk.text, end="", flush=True)
                num_tokens += len(chunk.token_ids)
                last = chunk
        elapsed = time.perf_counter() - started
    accept = (f"accept length {last.spec.accept_length:.2f} "
              f"({last.spec.accepted_drafts} drafts accepted in {last.spec.verify_steps} verifies)"
              if last.spec is not None else "no speculative decoding")
    print(f"\n--- {num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s, "
          f"{accept}; finish: {last.finish_reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
