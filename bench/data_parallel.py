"""Data-parallel replicas: throughput of --data-parallel N vs one engine, and TTFT of prefix
affinity routing vs round robin on shared system prompts.

    # one GPU holding two small replicas (Ray reserves half a GPU each; each KV pool is sized)
    python bench/data_parallel.py --launch demo --gpus-per-rank 0.5 --out dp_h100.json

    # several GPUs of one host: one replica per GPU (llama-8b shape, 4 replicas vs 1)
    python bench/data_parallel.py --launch llama-8b --data-parallel 4 --gpus-per-rank 1 ...

    # several hosts: start Ray on each (ray start --head / ray start --address=HEAD:6379), then
    python bench/data_parallel.py --launch llama-8b --data-parallel 8 --ray-address auto ...

Two parts, each against servers this script starts (one at a time, the same engine config):

- throughput: random prompts, all at once, at each --concurrency (64-256 streams), one engine
  (no Ray: the server as it runs today) vs --data-parallel N replicas;
- ttft: --tenants system prompts of --system-prompt-tokens (each request one of them, picked at
  random, plus its own question) at --rate requests/s, N replicas routed by prefix affinity vs
  round robin. With affinity each tenant's prompt stays cached on one replica (a hit for all
  but its first request); round robin makes every replica prefill every tenant's prompt, and
  holds N copies of it in KV.

Every run starts with a cold prefix cache (bench/serving.py flushes it). Writes --out (JSON rows)
and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import random
import time

from serving import launched_engine_config, make_prompts, run_load, serve_launched

from specserve.server.cluster.config import ClusterConfig
from specserve.server.cluster.routing import RoutingConfig, RoutingPolicy


def tenants_workload(n: int, tenants: int, system_tokens: int, words: int, vocab: int,
                     seed: int) -> list[dict]:
    rng = random.Random(seed)
    new = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    systems = [new(system_tokens) for _ in range(tenants)]
    return [{"prompt_token_ids": rng.choice(systems) + new(words)} for _ in range(n)]


def run_server_and_load(engine_config, cluster, port: int, workloads) -> list[dict]:
    """Start a server (cluster None: one engine, no Ray), run each (prompts, rate, concurrency,
    max_new_tokens) load against it, stop it."""
    server = multiprocessing.get_context("spawn").Process(
        target=serve_launched, args=(engine_config, port, None, cluster))
    server.start()
    try:
        return [asyncio.run(run_load(f"127.0.0.1:{port}", prompts, rate, concurrency,
                                     max_new_tokens, seed=0, client_procs=client_procs))
                for prompts, rate, concurrency, max_new_tokens, client_procs in workloads]
    finally:
        server.terminate()  # SIGTERM: drains, stops the engines (and its local Ray), exits
        server.join(180)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launch", choices=["demo", "llama-1b", "llama-8b"], default="demo")
    ap.add_argument("--spec", choices=["plain", "chain", "tree"], default="chain")
    ap.add_argument("--accept-len", type=int, default=3, help="shapes: forced accept length")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data-parallel", type=int, default=2)
    ap.add_argument("--ray-address", default=None, help="join this Ray cluster (default: local)")
    ap.add_argument("--gpus-per-rank", type=float, default=None,
                    help="0.5: two replicas share one GPU (default: 1 per rank on GPUs)")
    ap.add_argument("--max-total-tokens", type=int, default=131072,
                    help="KV slots per replica (and of the one engine), so shares of a GPU fit")
    ap.add_argument("--max-context-len", type=int, default=4096)
    ap.add_argument("--concurrency", default="64,128,256", help="throughput part")
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tenants", type=int, default=8, help="ttft part: system prompts")
    ap.add_argument("--system-prompt-tokens", type=int, default=2048)
    ap.add_argument("--ttft-requests", type=int, default=256)
    ap.add_argument("--rate", type=float, default=16.0, help="ttft part: requests/s (Poisson)")
    ap.add_argument("--ttft-concurrency", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--port", type=int, default=50071)
    ap.add_argument("--parts", default="throughput,ttft")
    ap.add_argument("--out", default="bench_data_parallel.json")
    args = ap.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    engine_config = dataclasses.replace(
        launched_engine_config(args.launch, args.spec, args.accept_len, max(concurrencies),
                               args.max_context_len, args.device),
        max_total_tokens=args.max_total_tokens)

    def cluster(policy: RoutingPolicy) -> ClusterConfig:
        return ClusterConfig(data_parallel=args.data_parallel, ray_address=args.ray_address,
                             gpus_per_rank=args.gpus_per_rank,
                             routing=RoutingConfig(policy=policy))

    rows = []

    def record(part: str, label: str, results: list[dict]) -> None:
        for result in results:
            rows.append(dict(part=part, label=label, **result))
            print(json.dumps(rows[-1]), flush=True)

    parts = args.parts.split(",")
    if "throughput" in parts:
        workloads = [(make_prompts(2 * c, 0, args.prompt_words, args.vocab,
                                   token_ids=args.launch != "demo"), float("inf"), c,
                      args.max_new_tokens, args.client_procs) for c in concurrencies]
        record("throughput", "one engine",
               run_server_and_load(engine_config, None, args.port, workloads))
        record("throughput", f"dp={args.data_parallel}",
               run_server_and_load(engine_config, cluster(RoutingPolicy.PREFIX), args.port,
                                   workloads))
    if "ttft" in parts:
        prompts = tenants_workload(args.ttft_requests, args.tenants, args.system_prompt_tokens,
                                   args.prompt_words, args.vocab, seed=1)
        workload = [(prompts, args.rate, args.ttft_concurrency, 32, args.client_procs)]
        for policy in RoutingPolicy:
            record("ttft", f"dp={args.data_parallel} {policy.value}",
                   run_server_and_load(engine_config, cluster(policy), args.port, workload))
    json.dump({"launch": args.launch, "spec": args.spec, "data_parallel": args.data_parallel,
               "gpus_per_rank": args.gpus_per_rank, "date": time.strftime("%Y-%m-%d"),
               "rows": rows}, open(args.out, "w"), indent=1)
    print(f"\n{'part':>10} {'label':>22} {'conc':>4} {'rate':>5} {'tok/s':>8} {'TTFT p50':>9} "
          f"{'p99':>7} {'TPOT p50':>9} {'cached':>7}")
    for r in rows:
        print(f"{r['part']:>10} {r['label']:>22} {r['concurrency']:>4} {r['rate']:>5} "
              f"{r['output_tokens_per_s']:8.1f} {r['ttft_ms_p50']:9.1f} {r['ttft_ms_p99']:7.1f} "
              f"{r['tpot_ms_p50']:9.2f} {r['cached_tokens_mean']:7.1f}")


if __name__ == "__main__":
    main()
