"""Serving benchmark: a gRPC load generator against a running `specserve serve`, or one it starts.

    specserve serve --port 50051 &
    python bench/serving.py --server 127.0.0.1:50051 --rates 2,8,inf --concurrency 1,16 --out serving.json

    # on a GPU: a server of its own, the demo pair or a Llama shape with random weights
    python bench/serving.py --launch llama-1b --spec chain --rates inf --concurrency 1,64,256 --out s.json

`--launch` starts the server (`run_server`, as `specserve serve --device cuda` runs it) in a
child process with the engine `bench/one_batch.py` measures: the demo pair, or the llama-1b /
llama-8b shape with random bf16 weights and an EAGLE-3 head whose accept length is forced to
`--accept-len` (random weights accept nothing). The shapes have no tokenizer of their own: their
prompts are random token ids and the server streams ids only, unless `--text` gives them the
demo pair's tokenizer (and its 8192-token vocabulary), so that requests carry held-out text in
and detokenised text out, as users send them.

`--api openai` drives the OpenAI front (`--launch` starts it on `--http-port`) with streamed
`/v1/completions` (SSE, usage in the last chunk); the token count of a chunk is not on the wire
there, so its ITL spreads a request's completion tokens evenly over its chunks.
With `--launch`, each row also reports the server process's CPU time per output token (user +
system, from /proc; the engine process not included).

Requests arrive as a Poisson process at each rate (`inf`: all at once), with at most
`concurrency` in flight. Prompts are held-out code from the demo pair's sample
(`models/demo-heldout.txt`) or random token ids. Reports TTFT, TPOT (per request: decode time /
(tokens - 1)) and ITL (gaps between streamed chunks, divided over the tokens each chunk
carries) percentiles, output throughput, the mean accept length and the mean prompt tokens
served from the prefix cache.

`--launch tiny --device cpu --text` is a 4-layer random Llama with the demo tokenizer: fast
enough on a CPU for the server's and the scheduler's costs to show at ratios nearer a GPU's.

Before the rows, an untimed wave of requests (`--warmup-requests`, default the largest
concurrency) takes the first-time costs (kernel compiles of new shapes, lazy starts). With the
server's /metrics (`--metrics-url`; `--launch` serves it on `--metrics-port`) each row also
reports where TTFT went: the p50, p99 and mean of every stage of
`specserve_ttft_stage_seconds` (prepare, submit, to_engine, engine_queue, prefill, to_server,
to_consumer, write; docs/grpc-api.md), the server's own TTFT and chunk gaps, and the engine's
decode and extend step times and the stalls extends caused (histogram differences over the
row, percentiles interpolated in their buckets).

Workloads that share prefixes (random token ids):
  --workload system-prompt  every request = one shared system prompt (--system-prompt-tokens)
                            + its own question (--prompt-words tokens)
  --workload multi-turn     conversations of --turns turns; each turn resends the conversation
                            so far (questions and answers) + a new question; conversations
                            arrive at the rate, their turns one after another
The cache is flushed before each run (FlushCache), so every run starts cold. For TTFT with the
cache off, run the same command against a server started with --disable-prefix-cache (or with
--launch ... --disable-prefix-cache) and a different --label.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import random
import statistics
import tempfile
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Optional

from specserve.clients import AsyncClient

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "demo-heldout.txt"


def make_prompts(n: int, seed: int, words: int, vocab: int, token_ids: bool = False) -> list[dict]:
    rng = random.Random(seed)
    if HELDOUT.exists() and not token_ids:
        text = HELDOUT.read_text().split()
        starts = [rng.randrange(0, len(text) - words) for _ in range(n)]
        return [{"prompt": " ".join(text[s:s + words])} for s in starts]
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(words)]} for _ in range(n)]


async def one_request_openai(http, base_url: str, model: str, request: dict, max_new_tokens: int) -> dict:
    """One streamed /v1/completions request (the same measurements as one_request)."""
    body = {"model": model, "prompt": request.get("prompt", request.get("prompt_token_ids")),
            "max_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, usage = [], None
    async with http.stream("POST", base_url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", ())):
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else len(stamps)
    per_chunk = tokens / max(len(stamps), 1)
    itl = [(b - a) / per_chunk for a, b in zip(stamps, stamps[1:])]
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft": stamps[0] - start if stamps else end - start, "tpot": (end - stamps[0]) / max(tokens - 1, 1)
            if stamps else 0.0, "itl": itl, "tokens": tokens, "latency": end - start, "cached": cached,
            "token_ids": [], "accept": 1.0}


async def one_request(client: AsyncClient, request: dict, max_new_tokens: int) -> dict:
    start = time.perf_counter()
    stamps, tokens, spec, cached, ids = [], 0, None, 0, []
    async with client.generate_stream(**request, max_new_tokens=max_new_tokens, temperature=0.0,
                                      ignore_eos=True) as stream:
        async for chunk in stream:
            if chunk.token_ids:
                stamps.append((time.perf_counter(), len(chunk.token_ids)))
                tokens += len(chunk.token_ids)
                ids += chunk.token_ids
            spec = chunk.spec or spec
            if chunk.usage is not None:
                cached = chunk.usage.cached_tokens
    end = time.perf_counter()
    itl = [(b[0] - a[0]) / b[1] for a, b in zip(stamps, stamps[1:])]
    return {"ttft": stamps[0][0] - start, "tpot": (end - stamps[0][0]) / max(tokens - 1, 1), "itl": itl,
            "tokens": tokens, "latency": end - start, "cached": cached, "token_ids": ids,
            "accept": spec.accept_length if spec is not None else 1.0}


def shared_prefix_workload(kind: str, n: int, seed: int, words: int, vocab: int, system_tokens: int,
                           turns: int) -> list[list[list[int]]]:
    """Conversations, each a list of new-token segments: one segment per request for
    system-prompt (the system prompt is its first tokens), one per turn for multi-turn."""
    rng = random.Random(seed)
    new = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    if kind == "system-prompt":
        system = new(system_tokens)
        return [[system + new(words)] for _ in range(n)]
    return [[new(words) for _ in range(turns)] for _ in range(max(1, n // turns))]


async def conversation(client: AsyncClient, limit: asyncio.Semaphore, segments: list[list[int]],
                       max_new_tokens: int) -> list[dict]:
    """Turns in order: each resends the history (earlier segments and answers) + its segment."""
    history, results = [], []
    for segment in segments:
        history = history + segment
        async with limit:
            result = await one_request(client, {"prompt_token_ids": history}, max_new_tokens)
        history = history + result["token_ids"]
        results.append(result)
    return results


async def run_requests(server: str, prompts: list, rate: float, concurrency: int, max_new_tokens: int,
                       seed: int, start_at: float = 0.0,
                       http_url: Optional[str] = None,
                       connections: int = 1) -> tuple[list[dict], float, float]:
    """The per-request results, and the wall-clock (time.time) start and end of the run; the run
    starts at `start_at` if that is later (client processes start together). `prompts`: request
    dicts, or conversations (lists of token segments, see above). With `http_url` the requests
    go to the OpenAI front there (the gRPC server still flushes the cache and names the model).
    `connections` > 1: the gRPC requests take turns over that many TCP connections (a server of
    several front processes spreads connections, not calls, over its fronts)."""
    import contextlib

    import httpx

    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    async with contextlib.AsyncExitStack() as stack:
        own = [("grpc.use_local_subchannel_pool", 1)] if connections > 1 else []
        clients = [await stack.enter_async_context(AsyncClient(server, options=own))
                   for _ in range(connections)]
        client = clients[0]
        http = await stack.enter_async_context(httpx.AsyncClient(
            timeout=None, limits=httpx.Limits(max_connections=concurrency + 4)))
        await client.wait_until_serving()
        await client.flush_cache()  # every run starts with a cold prefix cache
        model = (await client.model_info()).model
        await asyncio.sleep(max(0.0, start_at - time.time()))

        async def bounded(request, client):
            if isinstance(request, list):
                return await conversation(client, limit, request, max_new_tokens)
            async with limit:
                if http_url is not None:
                    return [await one_request_openai(http, http_url, model, request, max_new_tokens)]
                return [await one_request(client, request, max_new_tokens)]

        tasks, start = [], time.time()
        for i, request in enumerate(prompts):
            tasks.append(asyncio.create_task(bounded(request, clients[i % len(clients)])))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
    return results, start, time.time()


def _client_process(server: str, prompts: list, rate: float, concurrency: int, max_new_tokens: int,
                    seed: int, start_at: float, http_url: Optional[str],
                    connections: int = 1) -> tuple[list[dict], float, float]:
    return asyncio.run(run_requests(server, prompts, rate, concurrency, max_new_tokens, seed, start_at,
                                    http_url, connections))


def process_cpu_seconds(pid: Optional[int]) -> float:
    """User + system CPU time of a process so far (Linux /proc); 0 when unknown."""
    if pid is None or not os.path.exists(f"/proc/{pid}/stat"):
        return 0.0
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_load(server: str, prompts: list, rate: float, concurrency: int, max_new_tokens: int,
                   seed: int, client_procs: int = 1, http_url: Optional[str] = None,
                   server_pid: Optional[int] = None, metrics_url: Optional[str] = None,
                   connections_per_proc: int = 1) -> dict:
    """One load run. `client_procs` > 1 splits the requests, the concurrency and the rate over
    that many client processes, so that a Python client's per-chunk cost does not cap the
    measurement at high concurrency; each opens `connections_per_proc` gRPC connections."""
    cpu0 = process_cpu_seconds(server_pid)
    scraped = scrape_histograms(metrics_url)
    if client_procs <= 1:
        results, start, end = await run_requests(server, prompts, rate, concurrency, max_new_tokens, seed,
                                                 http_url=http_url, connections=connections_per_proc)
    else:
        loop = asyncio.get_running_loop()
        start_at = time.time() + 5.0  # spawned clients import grpc and connect meanwhile
        with ProcessPoolExecutor(client_procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = await asyncio.gather(*(
                loop.run_in_executor(pool, _client_process, server, prompts[i::client_procs],
                                     rate / client_procs, concurrency // client_procs + (i < concurrency % client_procs),
                                     max_new_tokens, seed + i, start_at, http_url,
                                     connections_per_proc)
                for i in range(min(client_procs, concurrency, len(prompts)))))
        results = [r for part in parts for r in part[0]]
        start, end = min(p[1] for p in parts), max(p[2] for p in parts)
    elapsed = end - start
    server_cpu = process_cpu_seconds(server_pid) - cpu0
    stages = breakdown(scraped, scrape_histograms(metrics_url))

    def pct(values, q):
        values = sorted(values)
        return 1000 * values[min(len(values) - 1, int(q / 100 * len(values)))] if values else 0.0

    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {"rate": rate, "concurrency": concurrency, "requests": len(results), "client_procs": client_procs,
            "output_tokens_per_s": tokens / elapsed, "requests_per_s": len(results) / elapsed,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
            "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
            "accept_length": statistics.mean(r["accept"] for r in results),
            "cached_tokens_mean": statistics.mean(r["cached"] for r in results),
            "server_cpu_us_per_token": 1e6 * server_cpu / max(tokens, 1) if server_pid else None,
            **stages}


# /metrics histograms a row reports (scraped before and after it; the differences are the row's).
STAGE_HISTOGRAM = "specserve_ttft_stage_seconds"
STEP_HISTOGRAMS = {"step": "specserve_engine_step_seconds",
                   "decode_stall": "specserve_engine_decode_stall_seconds",
                   "extend_tokens": "specserve_engine_extend_tokens"}
# The server's own view, to set against the client's (a busy client adds to its TTFT and ITL).
SERVER_HISTOGRAMS = {"server_ttft_ms": "specserve_time_to_first_token_seconds",
                     "server_chunk_gap_ms": "specserve_inter_token_latency_seconds"}


def scrape_histograms(url: Optional[str]) -> dict:
    """{(histogram, label value): (sorted [(le, cumulative count)], sum, count)} from /metrics;
    {} without a url or when it cannot be read."""
    if not url:
        return {}
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        body = urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError as e:
        logging.warning("cannot scrape %s: %s", url, e)
        return {}
    wanted = {STAGE_HISTOGRAM, *STEP_HISTOGRAMS.values(), *SERVER_HISTOGRAMS.values()}
    out: dict = {}
    for family in text_string_to_metric_families(body):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            label = sample.labels.get("stage") or sample.labels.get("mode") or ""
            buckets, total, count = out.get((family.name, label), ([], 0.0, 0.0))
            if sample.name.endswith("_bucket"):
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_count"):
                count = sample.value
            out[(family.name, label)] = (buckets, total, count)
    return {k: (sorted(b), t, c) for k, (b, t, c) in out.items()}


def histogram_delta(before: dict, after: dict) -> dict:
    """{key: {"count", "mean", "p50", "p99"}} of the observations between two scrapes; the
    percentiles interpolated linearly inside their bucket (as Prometheus' histogram_quantile)."""
    out = {}
    for key, (buckets, total, count) in after.items():
        b0, t0, c0 = before.get(key, ([], 0.0, 0.0))
        old = dict(b0)
        cum = [(le, n - old.get(le, 0.0)) for le, n in buckets]
        n = count - c0
        if n <= 0:
            continue

        def quantile(q):
            rank, prev_le, prev_n = q * n, 0.0, 0.0
            for le, c in cum:
                if c >= rank:
                    if le == float("inf"):
                        return prev_le
                    return prev_le + (le - prev_le) * (rank - prev_n) / max(c - prev_n, 1e-12)
                prev_le, prev_n = le, c
            return prev_le

        out[key] = {"count": int(n), "mean": (total - t0) / n, "p50": quantile(0.5), "p99": quantile(0.99)}
    return out


def breakdown(before: dict, after: dict) -> dict:
    """A row's TTFT decomposition (p50 and mean of each stage, ms) and engine step times."""
    delta = histogram_delta(before, after)
    if not delta:
        return {}
    ms = lambda d: {k: round(1000 * d[k], 3) if k != "count" else d[k] for k in d}  # noqa: E731
    stages = {label: d for (name, label), d in delta.items() if name == STAGE_HISTOGRAM}
    steps = {f"{label}" if name == STEP_HISTOGRAMS["step"] else what:
             (ms(d) if what != "extend_tokens" else d)
             for what, name in STEP_HISTOGRAMS.items() for (n, label), d in delta.items() if n == name}
    server = {what: ms(delta[(name, "")]) for what, name in SERVER_HISTOGRAMS.items() if (name, "") in delta}
    return {**server,
            "ttft_stages_ms_p50": {k: round(1000 * d["p50"], 3) for k, d in stages.items()},
            "ttft_stages_ms_p99": {k: round(1000 * d["p99"], 3) for k, d in stages.items()},
            "ttft_stages_ms_mean": {k: round(1000 * d["mean"], 3) for k, d in stages.items()},
            "engine_steps": steps}


def launched_engine_config(model: str, spec: str, accept_len: int, max_running: int,
                           max_context_len: int, device: str = "cuda", prefix_cache: bool = True,
                           text: bool = False, **engine_overrides):
    """The engine bench/one_batch.py measures, for --launch (imports torch: only then)."""
    from one_batch import SPEC_MODES, write_shape  # bench/ is this script's folder

    from specserve.engine.builder import demo_models_dir
    from specserve.engine.config import EngineConfig, SpecConfig

    if model == "demo":
        target, draft, load_format, force = None, str(demo_models_dir() / "demo-draft"), "auto", None
    else:
        tokenizer = str(demo_models_dir() / "demo-target") if text else None
        (target, draft), load_format, force = write_shape(tempfile.mkdtemp(), model, tokenizer), "dummy", accept_len
    spec_config = None if spec == "plain" else SpecConfig(
        algorithm="eagle3", draft_model=draft, bench_force_accept_len=force, **SPEC_MODES[spec])
    return EngineConfig(model=target, device=device, dtype="bfloat16" if device == "cuda" else "float32",
                        load_format=load_format,
                        spec=spec_config, max_running_requests=max_running,
                        max_context_len=max_context_len, enable_prefix_cache=prefix_cache,
                        **engine_overrides)


def serve_launched(engine_config, port: int, http_port: Optional[int], cluster=None,
                   tokenizer_workers: int = 2, metrics_port: Optional[int] = None,
                   stream_interval: int = 1) -> None:
    """The --launch server process (cluster: a ClusterConfig, for bench/data_parallel.py);
    tokenizer_workers and stream_interval as `specserve serve --tokenizer-workers` and
    `--stream-interval`."""
    from specserve.server.app import run_server
    from specserve.server.config import ServerConfig

    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    raise SystemExit(run_server(engine_config, ServerConfig(host="127.0.0.1", port=port, http_port=http_port,
                                                            tokenizer_workers=tokenizer_workers,
                                                            metrics_port=metrics_port,
                                                            stream_interval=stream_interval),
                                cluster=cluster))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="127.0.0.1:50051")
    ap.add_argument("--rates", default="1,4,inf", help="requests/s (Poisson); inf: all at once")
    ap.add_argument("--concurrency", default="1,16", help="comma-separated rows, e.g. 64,256")
    ap.add_argument("--tokenizer-workers", type=int, default=2,
                    help="with --launch: the server's tokenizer worker processes (0: threads)")
    ap.add_argument("--num-requests", type=int, default=32, help="0: one wave of `concurrency` requests")
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=8192, help="for random prompts (no held-out text)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workload", default="random", choices=["random", "system-prompt", "multi-turn"])
    ap.add_argument("--system-prompt-tokens", type=int, default=2048)
    ap.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    ap.add_argument("--label", default="", help="tags the rows (e.g. cache-on / cache-off)")
    ap.add_argument("--out", default="bench_serving.json")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="load-generator processes (the requests and the concurrency are split over them)")
    ap.add_argument("--launch", choices=["demo", "tiny", "llama-1b", "llama-8b"], default=None,
                    help="start a server on the GPU for the run (on --server's port)")
    ap.add_argument("--spec", choices=["plain", "chain", "tree"], default="chain", help="with --launch")
    ap.add_argument("--accept-len", type=int, default=3, help="with --launch of a shape: forced accept length")
    ap.add_argument("--max-context-len", type=int, default=4096, help="with --launch")
    ap.add_argument("--device", default="cuda", help="with --launch (cpu: a smoke test of the demo pair)")
    ap.add_argument("--disable-prefix-cache", action="store_true", help="with --launch: the cache off")
    ap.add_argument("--chunked-prefill-size", type=int, default=None, help="with --launch (engine default if unset)")
    ap.add_argument("--prefill-interleave-tokens", type=int, default=None,
                    help="with --launch: the decode-fairness extend budget (engine default if unset; 0: off)")
    ap.add_argument("--mixed-steps", action="store_true",
                    help="with --launch: prompts ride in decode steps (E30's mixed step; else extends of their own)")
    ap.add_argument("--mixed-step-time-ratio", type=float, default=None,
                    help="with --launch --mixed-steps: the adaptive prompt budget's step-time ratio "
                         "(engine default if unset; 0: no cost model, up to --prefill-interleave-tokens)")
    ap.add_argument("--step-log", default=None, metavar="PATH",
                    help="with --launch: the engine writes a JSON line per step to PATH (one log for "
                         "every row; bench/step_log_report.py reads it)")
    ap.add_argument("--text", action="store_true",
                    help="with --launch of a shape: the demo tokenizer, text prompts in and text out")
    ap.add_argument("--metrics-url", default=None,
                    help="the server's /metrics (its --metrics-port): each row then reports its TTFT "
                         "by stage and the engine's step times (with --launch: --metrics-port's)")
    ap.add_argument("--metrics-port", type=int, default=8072, help="with --launch: the server's metrics port")
    ap.add_argument("--warmup-requests", type=int, default=-1,
                    help="untimed requests (all at once, at the largest concurrency) before the rows, "
                         "so that first-time costs (kernel compiles of new shapes, lazy inits) stay "
                         "out of them; -1: the largest concurrency, 0: none")
    ap.add_argument("--api", choices=["grpc", "openai"], default="grpc")
    ap.add_argument("--http-port", type=int, default=8071, help="the OpenAI front's port (--api openai)")
    args = ap.parse_args()
    http_url = f"http://127.0.0.1:{args.http_port}" if args.api == "openai" else None
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    server = None
    if args.launch is not None:
        engine_config = launched_engine_config(args.launch, args.spec, args.accept_len, max(concurrencies),
                                               args.max_context_len, args.device,
                                               prefix_cache=not args.disable_prefix_cache, text=args.text,
                                               mixed_steps=args.mixed_steps,
                                               **{name: getattr(args, name) for name in
                                                  ("chunked_prefill_size", "prefill_interleave_tokens",
                                                   "mixed_step_time_ratio", "step_log")
                                                  if getattr(args, name) is not None})
        # Not a daemon: the server spawns the engine process.
        server = multiprocessing.get_context("spawn").Process(
            target=serve_launched, args=(engine_config, int(args.server.rpartition(":")[2]),
                                         args.http_port if args.api == "openai" else None,
                                         None, args.tokenizer_workers, args.metrics_port))
        server.start()
        args.metrics_url = args.metrics_url or f"http://127.0.0.1:{args.metrics_port}/metrics"
    rows = []
    try:
        warmup = max(concurrencies) if args.warmup_requests < 0 else args.warmup_requests
        if warmup:
            prompts = make_prompts(warmup, args.seed + 1, args.prompt_words, args.vocab,
                                   token_ids=args.launch not in (None, "demo") and not args.text)
            row = asyncio.run(run_load(args.server, prompts, float("inf"), warmup, args.max_new_tokens,
                                       args.seed + 1, 1, http_url))
            print(f"warm-up ({warmup} requests, untimed): TTFT p50 {row['ttft_ms_p50']:.1f} ms, "
                  f"p99 {row['ttft_ms_p99']:.1f} ms", flush=True)
        for concurrency in concurrencies:
            num_requests = args.num_requests or concurrency
            if args.workload == "random":
                prompts = make_prompts(num_requests, args.seed, args.prompt_words, args.vocab,
                                       token_ids=args.launch not in (None, "demo") and not args.text)
            else:
                prompts = shared_prefix_workload(args.workload, num_requests, args.seed, args.prompt_words,
                                                 args.vocab, args.system_prompt_tokens, args.turns)
            for rate in (float(r) for r in args.rates.split(",")):
                rows.append(dict(workload=args.workload, label=args.label, api=args.api,
                                 text=args.launch in (None, "demo") or args.text,
                                 **asyncio.run(run_load(args.server, prompts, rate, concurrency,
                                                        args.max_new_tokens, args.seed, args.client_procs,
                                                        http_url, server.pid if server is not None else None,
                                                        args.metrics_url))))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if server is not None:
            server.terminate()  # SIGTERM: the server drains, stops its engine and exits
            server.join(120)
    json.dump({"server": args.server, "launch": args.launch, "spec": args.spec if args.launch else None,
               "date": time.strftime("%Y-%m-%d"), "rows": rows}, open(args.out, "w"), indent=1)
    print(f"\n{'label':>10} {'conc':>4} {'rate':>5} {'tok/s':>8} {'req/s':>6} {'TTFT p50':>9} {'p99':>7} "
          f"{'TPOT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'accept':>6} {'cached':>7} {'api':>6} "
          f"{'cpu us/tok':>10}")
    for r in rows:
        print(f"{r['label']:>10} {r['concurrency']:>4} {r['rate']:>5} {r['output_tokens_per_s']:8.1f} "
              f"{r['requests_per_s']:6.2f} {r['ttft_ms_p50']:9.1f} {r['ttft_ms_p99']:7.1f} "
              f"{r['tpot_ms_p50']:9.2f} {r['tpot_ms_p99']:7.2f} {r['itl_ms_p50']:8.2f} {r['itl_ms_p99']:7.2f} "
              f"{r['accept_length']:6.2f} {r['cached_tokens_mean']:7.1f} {r['api']:>6} "
              f"{r['server_cpu_us_per_token'] or 0:10.1f}")
    for r in rows:  # the TTFT decomposition (needs --metrics-url or --launch)
        if not r.get("ttft_stages_ms_p50"):
            continue
        stages = " ".join(f"{k} {v:.2f}" for k, v in r["ttft_stages_ms_p50"].items())
        print(f"{r['label']:>10} {r['concurrency']:>4} {r['rate']:>5}  TTFT p50 by stage (ms): {stages}")
        if "server_ttft_ms" in r and "server_chunk_gap_ms" in r:
            t, g = r["server_ttft_ms"], r["server_chunk_gap_ms"]
            print(f"{'':>10} {'':>4} {'':>5}  server-side (ms): TTFT p50 {t['p50']:.1f} p99 {t['p99']:.1f}; "
                  f"chunk gap p50 {g['p50']:.2f} p99 {g['p99']:.2f}")
        steps = r["engine_steps"]
        parts = [f"{mode} n={d['count']} p50 {d['p50']:.2f} p99 {d['p99']:.2f} mean {d['mean']:.2f}"
                 for mode, d in steps.items() if mode in ("decode", "extend", "decode_stall")]
        if "extend_tokens" in steps:
            parts.append(f"extend tokens mean {steps['extend_tokens']['mean']:.0f}")
        print(f"{'':>10} {'':>4} {'':>5}  engine steps (ms): " + "; ".join(parts))


if __name__ == "__main__":
    main()
