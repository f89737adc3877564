"""Data-parallel replicas: throughput of N replicas vs one engine (with where the front's time
goes), and TTFT of prefix affinity vs round robin on a load under cache pressure.

    # one GPU: two replicas sharing it (Ray reserves half a GPU each; each engine sizes its KV
    # pool from half of --gpu-memory-utilization)
    python bench/data_parallel.py --launch llama-1b --setups 2x1@0.5 --out dp_1gpu.json

    # four GPUs of one host: four replicas of one GPU each, then two of tp 2
    python bench/data_parallel.py --launch llama-8b --setups 4x1,2x2 --out dp_4gpu.json

    # several hosts: start Ray on each (ray start --head / ray start --address=HEAD:6379), then
    python bench/data_parallel.py --launch llama-8b --setups 8x1 --ray-address auto ...

    # four replicas fed by four front processes on one port (--front-processes)
    python bench/data_parallel.py --launch llama-8b --setups 4x1 --front-processes 4 ...

A setup `NxT[@G]` is N replicas of tensor-parallel size T, G GPUs per rank (default 1 on GPUs;
0.5: two replicas share a GPU). Each setup runs against servers this script starts, one at a
time:

- throughput: random prompts, all at once, at each --concurrency, --requests-per-stream
  requests a stream: one engine of tp T (no Ray: the server as it runs alone; measured once
  per T, at --baseline-concurrency) vs the N replicas (prefix routing; at N x a baseline load
  each replica sees what the one engine saw). With
  the replicas, the front's profile: each front process's CPU time (% of one core; its threads
  together; one front, the server process, unless --front-processes) and their
  tokenizer/detokenizer worker processes' together, and per replica its engine steps
  per second and how busy they kept it (step seconds / wall seconds, from
  specserve_replica_engine_step_seconds). Replicas far from busy while the front process sits
  near 100% of a core say the one front holds them back; busy replicas, that they are the
  limit.
- affinity: a cache-pressure load. --tenants system prompts of --system-prompt-tokens (default:
  as many as fill (N + 1) / 2 KV pools of --pressure-kv-tokens each: more than one replica can
  keep cached, while N replicas that split them by affinity hold (N + 1) / 2N <= 3/4 of a pool
  each), each request one of them at random plus its own question, at --rate-per-replica x N
  requests/s. Prefix affinity keeps each tenant on one replica (a hit after its first request);
  round robin makes every replica cache every tenant, so they evict one another.

Every run starts with a cold prefix cache (bench/serving.py flushes it). Writes --out (JSON rows)
and prints the tables.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import re
import time
import urllib.request
from typing import NamedTuple, Optional

from serving import (launched_engine_config, make_prompts, process_cpu_seconds, run_load,
                     serve_launched)

from specserve.server.cluster.config import ClusterConfig
from specserve.server.cluster.routing import RoutingConfig, RoutingPolicy


class Setup(NamedTuple):
    replicas: int
    tp: int
    gpus_per_rank: Optional[float]

    @property
    def label(self) -> str:
        share = "" if self.gpus_per_rank is None else f" @{self.gpus_per_rank:g} GPU"
        return f"{self.replicas}x tp{self.tp}{share}"


def parse_setup(text: str) -> Setup:
    match = re.fullmatch(r"(\d+)x(\d+)(?:@([\d.]+))?", text.strip())
    if match is None or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"--setups: {text!r} is not NxT or NxT@G (e.g. 4x1, "
                                         f"2x2, 2x1@0.5)")
    return Setup(int(match.group(1)), int(match.group(2)),
                 None if match.group(3) is None else float(match.group(3)))


def tenants_workload(n: int, tenants: int, system_tokens: int, words: int, vocab: int,
                     seed: int) -> list[dict]:
    rng = random.Random(seed)
    new = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    systems = [new(system_tokens) for _ in range(tenants)]
    return [{"prompt_token_ids": rng.choice(systems) + new(words)} for _ in range(n)]


def pressure_tenants(replicas: int, kv_tokens: int, system_tokens: int) -> int:
    """Tenants whose prompts fill (N + 1) / 2 pools of kv_tokens (at least 2 tenants/replica)."""
    return max(2 * replicas, math.ceil((replicas + 1) / 2 * kv_tokens / system_tokens))


# --- the front's profile ---------------------------------------------------------------------
REPLICA_COUNTER = re.compile(
    r'^specserve_replica_engine_(steps|step_seconds)_total\{replica="(\d+)"\} (\S+)$', re.M)


def replica_counters(metrics_url: str) -> dict:
    """{(steps | step_seconds, replica): value} from the server's /metrics ({} if unreadable)."""
    try:
        body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    except OSError:
        return {}
    return {(what, int(replica)): float(value)
            for what, replica, value in REPLICA_COUNTER.findall(body)}


REQUESTS_TOTAL = re.compile(r'^specserve_requests_total\{[^}]*\} (\S+)$', re.M)


def calls_answered(metrics_url: str) -> float:
    """Generate calls the server (one front) has answered, from its /metrics (0 if unreadable)."""
    try:
        body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    except OSError:
        return 0.0
    return sum(float(v) for v in REQUESTS_TOTAL.findall(body))


def worker_pids(pid: int, marker: bytes = b"multiprocessing") -> list[int]:
    """The server's multiprocessing children (its tokenizer and detokenizer workers; not a local
    Ray's processes, which are not started by multiprocessing); marker b"multiprocessing.spawn":
    the spawned ones only (a supervisor's front processes, not its resource tracker)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read().rpartition(")")[2].split()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if int(stat[1]) == pid and marker in cmdline:
            children.append(int(entry))
    return children


def front_profile(before: dict, after: dict, seconds: float, fronts_cpu: list[float],
                  workers_cpu: float, fronts_calls: list[float]) -> dict:
    """fronts_cpu, fronts_calls: each front process's CPU seconds and calls in the row."""
    replicas = sorted({replica for _, replica in after})
    delta = lambda what, r: after.get((what, r), 0.0) - before.get((what, r), 0.0)  # noqa: E731
    return {"front_cpu_pct": round(100 * sum(fronts_cpu) / seconds, 1),
            "fronts_cpu_pct": [round(100 * cpu / seconds, 1) for cpu in fronts_cpu],
            "fronts_calls": [int(calls) for calls in fronts_calls],
            "front_workers_cpu_pct": round(100 * workers_cpu / seconds, 1),
            "replica_steps_per_s": [round(delta("steps", r) / seconds, 1) for r in replicas],
            "replica_busy_pct": [round(100 * delta("step_seconds", r) / seconds, 1)
                                 for r in replicas]}


def wait_serving(health_url: str, timeout_s: float = 1200.0) -> None:
    """Until the server's /health says SERVING, so that no row counts its start-up (CPU,
    histograms, counters)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if urllib.request.urlopen(health_url, timeout=5).status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{health_url}: not serving after {timeout_s:.0f} s")
        time.sleep(1.0)


# --- one server, its loads ---------------------------------------------------------------------
def run_server_and_load(engine_config, cluster, port: int, metrics_port: int,
                        workloads, stream_interval: int = 1,
                        connections_per_proc: int = 1) -> list[dict]:
    """Start a server (cluster None: one engine, no Ray), run each (prompts, rate, concurrency,
    max_new_tokens, client_procs) load against it, stop it. With a cluster, each row carries
    the front's profile. With several front processes the server process supervises them (its
    multiprocessing children), /metrics is front 0's (its step counters and histograms are
    every engine's: each front hears every step; its TTFT stages, its own calls') and the
    row's server CPU is the fronts' together."""
    server = multiprocessing.get_context("spawn").Process(
        target=serve_launched, args=(engine_config, port, None, cluster),
        kwargs=dict(metrics_port=metrics_port, stream_interval=stream_interval))
    server.start()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    rows = []
    try:
        wait_serving(f"http://127.0.0.1:{metrics_port}/health")  # SERVING: every front is up
        several = cluster is not None and cluster.front_processes > 1
        fronts = worker_pids(server.pid, b"multiprocessing.spawn") if several else [server.pid]
        assert len(fronts) == (cluster.front_processes if several else 1), fronts

        def workers() -> list[int]:
            return [p for front in fronts for p in worker_pids(front)]

        fronts_metrics = [f"http://127.0.0.1:{metrics_port + i}/metrics" for i in range(len(fronts))]
        for prompts, rate, concurrency, max_new_tokens, client_procs in workloads:
            before = replica_counters(metrics_url) if cluster is not None else {}
            calls_before = [calls_answered(url) for url in fronts_metrics]
            fronts_before = [process_cpu_seconds(p) for p in fronts]
            # Workers may start during the row (the tokenizer pool's, on demand): from 0 then.
            workers_before = {p: process_cpu_seconds(p) for p in workers()}
            row = asyncio.run(run_load(f"127.0.0.1:{port}", prompts, rate, concurrency,
                                       max_new_tokens, seed=0, client_procs=client_procs,
                                       server_pid=server.pid, metrics_url=metrics_url,
                                       connections_per_proc=connections_per_proc))
            fronts_cpu = [process_cpu_seconds(p) - cpu for p, cpu in zip(fronts, fronts_before)]
            workers_cpu = sum(process_cpu_seconds(p) - workers_before.get(p, 0.0)
                              for p in workers())
            if several:  # the supervisor's own CPU is next to nothing
                tokens = row["output_tokens_per_s"] * row["requests"] / row["requests_per_s"]
                row["server_cpu_us_per_token"] = 1e6 * sum(fronts_cpu) / max(tokens, 1)
            if cluster is not None:
                seconds = row["requests"] / row["requests_per_s"]
                calls = [calls_answered(url) - n for url, n in zip(fronts_metrics, calls_before)]
                row["front"] = front_profile(before, replica_counters(metrics_url), seconds,
                                             fronts_cpu, workers_cpu, calls)
            rows.append(row)
    finally:
        server.terminate()  # SIGTERM: drains, stops the engines (and its local Ray), exits
        server.join(180)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launch", choices=["demo", "llama-1b", "llama-8b"], default="demo")
    ap.add_argument("--spec", choices=["plain", "chain", "tree"], default="chain")
    ap.add_argument("--accept-len", type=int, default=3, help="shapes: forced accept length")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--setups", default="2x1@0.5", type=lambda s: [parse_setup(x) for x in s.split(",")],
                    help="comma-separated NxT[@G]: N replicas of tp T, G GPUs per rank "
                         "(default 2x1@0.5: two replicas sharing one GPU)")
    ap.add_argument("--ray-address", default=None, help="join this Ray cluster (default: local)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="each engine's share of a GPU (a replica on G < 1 GPU takes G x this)")
    ap.add_argument("--max-context-len", type=int, default=4096)
    ap.add_argument("--concurrency", default="64,256", help="throughput part: the replicas' loads")
    ap.add_argument("--baseline-concurrency", default=None,
                    help="throughput part: the one engine's loads (default: --concurrency); the "
                         "replicas at N x a baseline load see that load each")
    ap.add_argument("--requests-per-stream", type=int, default=4,
                    help="throughput part: requests a stream sends, one after another (enough "
                         "that the ramp and the tail are a small part of the run)")
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--pressure-kv-tokens", type=int, default=65536,
                    help="affinity part: each replica's KV pool (--max-total-tokens)")
    ap.add_argument("--tenants", type=int, default=None,
                    help="affinity part: system prompts (default: they fill (N + 1) / 2 pools)")
    ap.add_argument("--system-prompt-tokens", type=int, default=2048)
    ap.add_argument("--ttft-requests", type=int, default=512)
    ap.add_argument("--rate-per-replica", type=float, default=8.0,
                    help="affinity part: requests/s (Poisson) per replica")
    ap.add_argument("--ttft-concurrency", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the servers' --stream-interval (one engine's and the replicas' alike)")
    ap.add_argument("--front-processes", type=int, default=1,
                    help="the replicas' server: front processes sharing its port (the one "
                         "engine's server has one)")
    ap.add_argument("--connections", type=int, default=None,
                    help="gRPC connections each client process opens (default: 4 per front "
                         "process with --front-processes, else 1): the kernel spreads "
                         "connections, not calls, over the fronts")
    ap.add_argument("--port", type=int, default=50071)
    ap.add_argument("--metrics-port", type=int, default=50081)
    ap.add_argument("--parts", default="throughput,affinity")
    ap.add_argument("--out", default="bench_data_parallel.json")
    args = ap.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    baseline_concurrencies = [int(c) for c in (args.baseline_concurrency or args.concurrency).split(",")]
    parts = args.parts.split(",")

    def engine_config(tp: int, max_running: int, **overrides):
        return launched_engine_config(
            args.launch, args.spec, args.accept_len, max_running,
            args.max_context_len, args.device, tp_size=tp, cuda_graph_sampled=False,
            gpu_memory_utilization=args.gpu_memory_utilization, **overrides)

    def cluster(setup: Setup, policy: RoutingPolicy) -> ClusterConfig:
        return ClusterConfig(data_parallel=setup.replicas, ray_address=args.ray_address,
                             gpus_per_rank=setup.gpus_per_rank,
                             routing=RoutingConfig(policy=policy),
                             front_processes=args.front_processes)

    rows = []

    def record(part: str, label: str, results: list[dict], **extra) -> None:
        for result in results:
            rows.append(dict(part=part, label=label, **extra, **result))
            print(json.dumps(rows[-1]), flush=True)

    connections = args.connections or (4 * args.front_processes if args.front_processes > 1 else 1)

    def serve(config, cluster_config, workloads):
        return run_server_and_load(config, cluster_config, args.port, args.metrics_port, workloads,
                                   args.stream_interval, connections)

    fronts_label = f" {args.front_processes} fronts" if args.front_processes > 1 else ""
    baselines_done = set()
    for setup in args.setups:
        if "throughput" in parts:
            def workloads(loads):
                return [(make_prompts(args.requests_per_stream * c, 0, args.prompt_words, args.vocab,
                                      token_ids=args.launch != "demo"), float("inf"), c,
                         args.max_new_tokens, args.client_procs) for c in loads]

            if setup.tp not in baselines_done:
                baselines_done.add(setup.tp)
                record("throughput", f"1x tp{setup.tp} (one engine)",
                       serve(engine_config(setup.tp, max(baseline_concurrencies)), None,
                             workloads(baseline_concurrencies)))
            # A replica's batch: its share of the largest load (more queue at the replica).
            per_replica = -(-max(concurrencies) // setup.replicas)
            record("throughput", setup.label + fronts_label,
                   serve(engine_config(setup.tp, per_replica), cluster(setup, RoutingPolicy.PREFIX),
                         workloads(concurrencies)))
        if "affinity" in parts:
            tenants = args.tenants or pressure_tenants(setup.replicas, args.pressure_kv_tokens,
                                                       args.system_prompt_tokens)
            prompts = tenants_workload(args.ttft_requests, tenants, args.system_prompt_tokens,
                                       args.prompt_words, args.vocab, seed=1)
            workload = [(prompts, args.rate_per_replica * setup.replicas, args.ttft_concurrency,
                         32, args.client_procs)]
            config = engine_config(setup.tp, max(concurrencies), max_total_tokens=args.pressure_kv_tokens)
            for policy in RoutingPolicy:
                record("affinity", f"{setup.label}{fronts_label} {policy.value}",
                       serve(config, cluster(setup, policy), workload), tenants=tenants,
                       kv_tokens_per_replica=args.pressure_kv_tokens)
    json.dump({"launch": args.launch, "spec": args.spec,
               "setups": [s._asdict() for s in args.setups],
               "gpu_memory_utilization": args.gpu_memory_utilization,
               "stream_interval": args.stream_interval,
               "front_processes": args.front_processes, "connections_per_client": connections,
               "date": time.strftime("%Y-%m-%d"), "rows": rows}, open(args.out, "w"), indent=1)
    print_tables(rows)


def print_tables(rows: list[dict]) -> None:
    print(f"\n{'part':>10} {'label':>28} {'conc':>4} {'rate':>5} {'tok/s':>8} {'TTFT p50':>9} "
          f"{'p99':>7} {'TPOT p50':>9} {'cached':>7}")
    for r in rows:
        print(f"{r['part']:>10} {r['label']:>28} {r['concurrency']:>4} {r['rate']:>5} "
              f"{r['output_tokens_per_s']:8.1f} {r['ttft_ms_p50']:9.1f} {r['ttft_ms_p99']:7.1f} "
              f"{r['tpot_ms_p50']:9.2f} {r['cached_tokens_mean']:7.1f}")
    fronts = [r for r in rows if "front" in r]
    if fronts:
        print(f"\n{'front profile':>28} {'conc':>4} {'front CPU% (each front)':>24} "
              f"{'calls (each front)':>20} {'workers%':>8}  per replica: steps/s | busy %")
        for r in fronts:
            f = r["front"]
            each = " ".join(f"{pct:.0f}" for pct in f.get("fronts_cpu_pct", [f["front_cpu_pct"]]))
            calls = " ".join(str(n) for n in f.get("fronts_calls", []))
            print(f"{r['label']:>28} {r['concurrency']:>4} {each:>24} {calls:>20} "
                  f"{f['front_workers_cpu_pct']:8.1f}  {f['replica_steps_per_s']} | "
                  f"{f['replica_busy_pct']}")


if __name__ == "__main__":
    main()
