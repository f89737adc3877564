"""Front-end benchmark: what the server costs per token, with a synthetic engine (no model, no GPU).

    python bench/frontend.py --step-ms 0,0.5 --tokens-per-step 1,3 --concurrency 1,64,256 --out frontend.json

The real server runs (`run_server`: gRPC on uvloop, the real ZeroMQ link, the engine process
loop of engine/process.py, the demo pair's tokenizer), but the engine process drives a
`SyntheticEngine`: every step it waits until `--step-ms` has passed since the previous step
(0: as fast as it can) and then emits `--tokens-per-step` tokens for every running request
(3 looks like a chain speculation accepting 2 drafts a step). The tokens are the held-out code
of the demo pair, so detokenising sees real text.

For each concurrency, that many requests arrive at once (bench/serving.py's load generator,
in this process) and the server process's CPU time (all its threads, from /proc) is divided
over the (stream, engine step) pairs served: the front-end's cost per stream per engine step.
With the engine faster than that cost times the concurrency, the front-end is the bottleneck,
and served TPOT p50 / engine time per token shows by how much. `--profile` runs the server
under cProfile and prints its top functions by own time.

`--replicas 4` serves the same load through the server's data-parallel ReplicaSet (its router,
one EngineClient per replica: an output-reader thread and a detokenizer worker each), with the
replicas as local engine processes instead of Ray actors (the front's cost is what is measured;
0, the default: one EngineClient, no set). Each row also splits the server's CPU per output
token over its event-loop thread, its output-reader threads and its other threads (gRPC's,
ZeroMQ's, the prepare threads), and gives the detokenizer workers' CPU per token:

    python bench/frontend.py --step-ms 4 --tokens-per-step 3 --replicas 1,4 --concurrency 64,256

`--reader` times only the detokenizer worker's work (`TextSteps.step`: the per-token
detokenising, stop strings and chunk building of each step's batch) on the synthetic engine's
steps, without a server: its cost per token, and the part of it that holds the GIL (all but
the Rust tokenizer's `decode_batch`), which the event loop then cannot have:

    python bench/frontend.py --reader --tokens-per-step 1,3 --concurrency 64,256
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import functools
import json
import logging
import os
import pstats
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from serving import make_prompts, run_load  # bench/ is this script's folder

from specserve.clients import AsyncClient
from specserve.engine.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.outputs import EngineInfo, EngineLoad, StepOutput
from specserve.engine.tokenizer import Tokenizer

MODELS = Path(__file__).resolve().parents[1] / "models"
HELDOUT = MODELS / "demo-heldout.txt"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class SyntheticShape:
    step_s: float         # engine time per step
    tokens_per_step: int  # tokens a running request gets per step (after its first)
    max_running: int


@dataclass
class _Request:
    first_token: int       # offset into the token text
    max_new_tokens: int
    logprobs: bool
    generated: int = 0
    steps: int = 0


class SyntheticEngine:
    """Stands in for `Engine` in the engine process (the methods engine/process.py calls)."""

    def __init__(self, shape: SyntheticShape):
        self.shape = shape
        self.tokenizer = Tokenizer(str(MODELS / "demo-target"), [1])
        self.text = self.tokenizer.encode(HELDOUT.read_text(), add_special_tokens=False)
        k = shape.tokens_per_step
        spec = (SpecConfig(algorithm="eagle3", draft_model="synthetic", num_steps=k - 1, topk=1,
                           num_draft_tokens=k) if k > 1 else None)
        self.info = EngineInfo(model="synthetic", architecture="synthetic",
                               vocab_size=self.tokenizer.vocab_size, max_context_len=1 << 16,
                               dtype="float32", device="cpu", eos_token_ids=(1,), spec=spec)
        self.running: dict[str, _Request] = {}
        self._next_step = time.perf_counter()

    def add_request(self, rid: str, prompt_token_ids, sampling: SamplingParams) -> None:
        self.running[rid] = _Request(hash(rid) % len(self.text), sampling.max_new_tokens,
                                     sampling.logprobs)

    def abort(self, rid: str, index: Optional[int] = None) -> None:
        self.running.pop(rid, None)  # one sequence per request (the bench asks for n = 1)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[StepOutput]:
        now = time.perf_counter()
        if self._next_step > now:
            time.sleep(self._next_step - now)
        self._next_step = max(self._next_step, now) + self.shape.step_s
        outputs = []
        for rid, req in list(self.running.items()):
            n = min(1 if req.steps == 0 else self.shape.tokens_per_step,
                    req.max_new_tokens - req.generated)
            ids = [self.text[(req.first_token + req.generated + i) % len(self.text)]
                   for i in range(n)]
            req.generated += n
            req.steps += 1
            finished = req.generated >= req.max_new_tokens
            if finished:
                del self.running[rid]
            verify_steps = req.steps - 1 if self.info.spec is not None else 0
            outputs.append(StepOutput(
                rid=rid, new_token_ids=ids, new_logprobs=[-0.5] * n if req.logprobs else None,
                finished=finished, finish_reason="length" if finished else None,
                completion_tokens=req.generated, num_verify_steps=verify_steps,
                num_accepted_drafts=max(0, req.generated - 1 - verify_steps)))
        return outputs

    def take_step_stats(self) -> list:
        return []  # it times no steps

    def flush_prefix_cache(self) -> None:
        pass  # it caches nothing (bench/serving.py's load generator asks before each run)

    def grammar_health(self) -> None:
        return None  # no grammar service

    def rank_failure(self) -> None:
        return None  # one rank

    def check_ranks(self) -> None:
        pass

    def load(self) -> EngineLoad:
        return EngineLoad(num_running=len(self.running), num_waiting=0, kv_used_tokens=0,
                          kv_total_tokens=1, mean_accept_length=float(self.shape.tokens_per_step),
                          num_retractions=0)

    def shutdown(self) -> None:
        pass


def start_synthetic(shape: SyntheticShape, config: EngineConfig) -> SyntheticEngine:
    return SyntheticEngine(shape)


def serve(args) -> None:
    """The server process (this script with --serve)."""
    from specserve.server.app import run_server
    from specserve.server.config import ServerConfig

    # As `specserve serve` logs (one access-log line per request is part of the cost).
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    shape = SyntheticShape(args.step_ms / 1000, args.tokens_per_step, args.max_running)
    # No prefix cache: the synthetic engine caches nothing (so a replica set's router reads no
    # KV-cache events from it; a real engine's would add the router's work per step).
    engine_config = EngineConfig(device="cpu", max_running_requests=args.max_running, spec=None,
                                 enable_prefix_cache=False)
    server_config = ServerConfig(port=args.port, stats_log_interval_s=3600.0,
                                 stream_interval=args.stream_interval,
                                 **({} if args.tokenizer_workers is None
                                    else {"tokenizer_workers": args.tokenizer_workers}))
    start = functools.partial(start_synthetic, shape)
    cluster = local_replicas(args.replicas) if args.replicas else None
    record_workers(args.workers_out, args.profile_out)
    if args.profile_out is None:
        raise SystemExit(run_server(engine_config, server_config, start, cluster))
    profile = cProfile.Profile()
    profile.enable()
    code = run_server(engine_config, server_config, start, cluster)
    profile.disable()
    profile.dump_stats(args.profile_out)
    raise SystemExit(code)


def local_replicas(n: int):
    """A ClusterConfig of n replicas whose engines are local processes: a stand-in for the
    one module that imports Ray (ray_replicas), placing each replica with the EngineClient's
    LocalLauncher."""
    import types

    from specserve.server.cluster.config import ClusterConfig
    from specserve.server.engine_client import LocalLauncher

    sys.modules["specserve.server.cluster.ray_replicas"] = types.SimpleNamespace(
        place_replicas=lambda cluster, config: [LocalLauncher() for _ in range(cluster.data_parallel)],
        disconnect=lambda: None)
    return ClusterConfig(data_parallel=n)


def record_workers(path: str, profile_out: Optional[str]) -> None:
    """Append "reader TID" for every output-reader thread and "detokenizer PID" for every
    detokenizer worker to `path` (the parent splits the server's CPU by them); with
    `profile_out`, cProfile each reader thread into profile_out.reader-TID (cProfile sees one
    thread: the event loop's is profiled by serve())."""
    from specserve.server.engine_client import EngineClient
    from specserve.server.output_router import OutputReader

    def note(line: str) -> None:
        with open(path, "a") as f:
            f.write(line + "\n")

    read, start_text_worker = OutputReader.run, EngineClient._start_text_worker

    def recorded_read(reader: OutputReader) -> None:
        tid = threading.get_native_id()
        note(f"reader {tid}")
        if profile_out is None:
            return read(reader)
        reader_profile = cProfile.Profile()
        reader_profile.enable()
        try:
            read(reader)
        finally:
            reader_profile.disable()
            reader_profile.dump_stats(f"{profile_out}.reader-{tid}")

    def recorded_text_worker(client: EngineClient, loop) -> None:
        start_text_worker(client, loop)
        note(f"detokenizer {client.text_worker_pid}")

    OutputReader.run = recorded_read
    EngineClient._start_text_worker = recorded_text_worker


def cpu_seconds(pid: int, tid: Optional[int] = None) -> float:
    """utime + stime of a process (all its threads), or of its thread `tid`; 0 once gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@dataclass(frozen=True)
class ServerCpu:
    """CPU seconds so far of the server process, split by thread, and of its detokenizers."""

    total: float
    event_loop: float  # the main thread
    readers: float     # the output-reader threads
    detokenizers: float

    @classmethod
    def read(cls, pid: int, workers_file: str) -> "ServerCpu":
        readers, detokenizers = [], []
        if os.path.exists(workers_file):
            for line in Path(workers_file).read_text().split("\n"):
                kind, _, ident = line.partition(" ")
                (readers if kind == "reader" else detokenizers if kind else []).append(int(ident or 0))
        return cls(cpu_seconds(pid), cpu_seconds(pid, pid),
                   sum(cpu_seconds(pid, tid) for tid in readers),
                   sum(cpu_seconds(p) for p in detokenizers))

    def __sub__(self, other: "ServerCpu") -> "ServerCpu":
        return ServerCpu(*(a - b for a, b in zip(dataclasses.astuple(self),
                                                 dataclasses.astuple(other))))


class ServerProcess:
    def __init__(self, step_ms: float, tokens_per_step: int, max_running: int, port: int,
                 profile: Optional[str], replicas: int, workers_file: str,
                 tokenizer_workers: Optional[int], stream_interval: int):
        command = [sys.executable, __file__, "--serve", "--step-ms", str(step_ms),
                   "--tokens-per-step", str(tokens_per_step), "--max-running", str(max_running),
                   "--port", str(port), "--replicas", str(replicas),
                   "--workers-out", workers_file] + (["--profile-out", profile] if profile else [])
        if tokenizer_workers is not None:
            command += ["--tokenizer-workers", str(tokenizer_workers)]
        command += ["--stream-interval", str(stream_interval)]
        self.process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)


async def wait_serving(address: str) -> None:
    async with AsyncClient(address) as client:
        await client.wait_until_serving()


def run_shape(args, step_ms: float, k: int, replicas: int) -> list[dict]:
    name = f"{args.out}.{step_ms}ms.k{k}.dp{replicas}"
    profile = f"{name}.prof" if args.profile else None
    workers_file = f"{name}.workers"
    if os.path.exists(workers_file):  # an earlier run's
        os.remove(workers_file)
    # Each engine (replica) takes up to max_running requests.
    max_running = -(-max(args.concurrency_list) // max(replicas, 1))
    server = ServerProcess(step_ms, k, max_running, args.port, profile, replicas, workers_file,
                           args.tokenizer_workers, args.stream_interval)
    rows = []
    try:
        asyncio.run(wait_serving(server.address))  # the CPU of its start-up is not counted
        for concurrency in args.concurrency_list:
            prompts = make_prompts(concurrency * args.rounds, args.seed, args.prompt_words, 8192,
                                   token_ids=args.token_ids)
            cpu_before = ServerCpu.read(server.process.pid, workers_file)
            row = asyncio.run(run_load(server.address, prompts, float("inf"), concurrency,
                                       args.max_new_tokens, args.seed, args.client_procs))
            used = ServerCpu.read(server.process.pid, workers_file) - cpu_before
            cpu = used.total
            tokens = row["output_tokens_per_s"] * row["requests"] / row["requests_per_s"]
            per_token = lambda seconds: round(1e6 * seconds / tokens, 2)  # noqa: E731
            # (stream, step) pairs: a request's first step brings one token, later ones k.
            stream_steps = row["requests"] * (1 + (args.max_new_tokens - 1) / k)
            engine_ms_per_token = step_ms / k
            row.update(step_ms=step_ms, tokens_per_step=k, replicas=replicas,
                       stream_interval=args.stream_interval,
                       engine_ms_per_token=engine_ms_per_token, output_tokens=tokens,
                       server_cpu_s=cpu, server_cpu_us_per_stream_step=1e6 * cpu / stream_steps,
                       server_cpu_us_per_token=per_token(cpu),
                       event_loop_us_per_token=per_token(used.event_loop),
                       readers_us_per_token=per_token(used.readers),
                       other_threads_us_per_token=per_token(
                           used.total - used.event_loop - used.readers),
                       detokenizers_us_per_token=per_token(used.detokenizers),
                       served_over_engine=(row["tpot_ms_p50"] / engine_ms_per_token
                                           if step_ms else None))
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.stop()
        if os.path.exists(workers_file):  # (a server that failed to start wrote none)
            os.remove(workers_file)
    if profile:
        readers = sorted(str(p) for p in Path(profile).parent.glob(Path(profile).name + ".reader-*"))
        for thread, paths in (("event loop", [profile]), ("output readers'", readers)):
            print(f"\nprofile of the server's {thread} thread (step {step_ms} ms, {k} tokens/step, "
                  f"{replicas} replicas), top {args.profile_top} by own time:")
            pstats.Stats(*paths).sort_stats("tottime").print_stats(args.profile_top)
            for path in paths:
                os.remove(path)
    return rows


def time_reader(concurrency: int, k: int, max_new_tokens: int, stops: tuple[str, ...],
                repeats: int) -> dict:
    """The reader's routing of every step of `concurrency` requests of `max_new_tokens`
    tokens, `k` a step (the engine process's messages, parsed as the reader does); best of
    `repeats`, with a shared warm TokenTexts as in the server."""
    from specserve.engine.wire import encode_batch
    from specserve.proto import engine_ipc_pb2 as ipc
    import pickle

    from specserve.engine.wire import decode_batch as decode_step
    from specserve.server.text.validation import ValidatedRequest
    from specserve.server.workers.detokenizer import TextSteps

    engine = SyntheticEngine(SyntheticShape(0.0, k, concurrency))
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    for i in range(concurrency):
        engine.add_request(f"r{i}", [], sampling)
    messages, stream_steps = [], 0
    while engine.has_unfinished():
        batch = encode_batch(engine.step())
        messages.append(ipc.EngineToServer(batch=batch).SerializeToString())
        stream_steps += len(batch.rids)
    tokenizer, outside_gil = engine.tokenizer, [0.0]
    decode_batch = tokenizer.decode_batch

    def timed_decode_batch(sequences):  # runs in Rust without the GIL
        start = time.perf_counter()
        try:
            return decode_batch(sequences)
        finally:
            outside_gil[0] += time.perf_counter() - start

    tokenizer.decode_batch = timed_decode_batch
    request = ValidatedRequest([1], sampling, stops)
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        # The detokenizer worker's work per step (server/workers/detokenizer.py): decode the
        # columnar step, the per-token work, the answer pickled.
        steps = TextSteps(tokenizer)
        for i in range(concurrency):
            steps.open(f"r{i}", request, True)
        outside_gil[0] = 0.0
        start = time.perf_counter()
        for message in messages:
            pickle.dumps(steps.step(decode_step(ipc.EngineToServer.FromString(message).batch)))
        best = min(best, (time.perf_counter() - start, outside_gil[0]))
    tokens = concurrency * max_new_tokens
    return dict(concurrency=concurrency, tokens_per_step=k, stop_strings=len(stops),
                reader_us_per_token=1e6 * best[0] / tokens,
                gil_us_per_token=1e6 * (best[0] - best[1]) / tokens,
                reader_us_per_stream_step=1e6 * best[0] / stream_steps)


def reader_main(args) -> None:
    rows = []
    for k in (int(t) for t in args.tokens_per_step.split(",")):
        for concurrency in args.concurrency_list:
            for stops in ((), ("\n\n\n", "</s>")):
                row = time_reader(concurrency, k, args.max_new_tokens, stops, args.repeats)
                rows.append(row)
                print(json.dumps(row), flush=True)
    json.dump({"date": time.strftime("%Y-%m-%d"), "reader_rows": rows}, open(args.out, "w"),
              indent=1)
    print(f"\n{'tok/step':>8} {'conc':>4} {'stops':>5} {'us/token':>8} {'GIL us/token':>12}")
    for r in rows:
        print(f"{r['tokens_per_step']:8d} {r['concurrency']:4d} {r['stop_strings']:5d} "
              f"{r['reader_us_per_token']:8.2f} {r['gil_us_per_token']:12.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ms", default="0,0.5", help="synthetic engine step times (ms), a list")
    ap.add_argument("--tokens-per-step", default="1,3", help="tokens per request per step, a list")
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--rounds", type=int, default=1, help="requests per stream slot")
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-procs", type=int, default=1, help="load-generator processes")
    ap.add_argument("--port", type=int, default=50091)
    ap.add_argument("--replicas", default="0",
                    help="data-parallel replicas behind the server's ReplicaSet, a list (0: one "
                         "engine, no set)")
    ap.add_argument("--tokenizer-workers", type=int,
                    help="the server's --tokenizer-workers (default: its default)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the server's --stream-interval (tokens a chunk after the first holds)")
    ap.add_argument("--token-ids", action="store_true",
                    help="prompts as token ids (as bench/data_parallel.py sends them)")
    ap.add_argument("--profile", action="store_true", help="cProfile the server process")
    ap.add_argument("--profile-top", type=int, default=30)
    ap.add_argument("--out", default="bench_frontend.json")
    ap.add_argument("--reader", action="store_true",
                    help="time the output reader's work alone (no server)")
    ap.add_argument("--repeats", type=int, default=5, help="--reader: best of this many")
    # The server process (started by this script).
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--max-running", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", help=argparse.SUPPRESS)
    ap.add_argument("--workers-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        args.step_ms, args.tokens_per_step = float(args.step_ms), int(args.tokens_per_step)
        args.replicas = int(args.replicas)
        return serve(args)
    args.concurrency_list = [int(c) for c in args.concurrency.split(",")]
    if args.reader:
        return reader_main(args)
    rows = []
    for step_ms in (float(s) for s in args.step_ms.split(",")):
        for k in (int(t) for t in args.tokens_per_step.split(",")):
            for replicas in (int(r) for r in args.replicas.split(",")):
                rows.extend(run_shape(args, step_ms, k, replicas))
    json.dump({"date": time.strftime("%Y-%m-%d"), "rows": rows}, open(args.out, "w"), indent=1)
    print(f"\n{'step ms':>7} {'tok/step':>8} {'dp':>2} {'conc':>4} {'tok/s':>8} {'TTFT p50':>9} "
          f"{'TPOT p50':>9} {'p99':>7} {'engine/tok':>10} {'served/eng':>10} {'us/stream-step':>14} "
          f"{'us/tok':>6} {'loop':>5} {'readers':>7} {'other':>5} {'detok':>5}")
    for r in rows:
        ratio = f"{r['served_over_engine']:.2f}" if r["served_over_engine"] else "-"
        print(f"{r['step_ms']:7.2f} {r['tokens_per_step']:8d} {r['replicas']:2d} {r['concurrency']:4d} "
              f"{r['output_tokens_per_s']:8.0f} {r['ttft_ms_p50']:9.1f} {r['tpot_ms_p50']:9.3f} "
              f"{r['tpot_ms_p99']:7.3f} {r['engine_ms_per_token']:10.3f} {ratio:>10} "
              f"{r['server_cpu_us_per_stream_step']:14.1f} {r['server_cpu_us_per_token']:6.1f} "
              f"{r['event_loop_us_per_token']:5.1f} {r['readers_us_per_token']:7.1f} "
              f"{r['other_threads_us_per_token']:5.1f} {r['detokenizers_us_per_token']:5.1f}")


if __name__ == "__main__":
    main()
