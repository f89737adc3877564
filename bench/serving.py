"""Serving benchmark: a gRPC load generator against a running `specserve serve`.

    specserve serve --port 50051 &
    python bench/serving.py --server 127.0.0.1:50051 --rates 2,8,inf --concurrency 1,16 --out serving.json

Requests arrive as a Poisson process at each rate (`inf`: all at once), with at most
`concurrency` in flight. Prompts are held-out code from the demo pair's sample
(`models/demo-heldout.txt`) or random token ids. Reports TTFT, TPOT (per request: decode time /
(tokens - 1)) and ITL (gaps between streamed chunks, divided over the tokens each chunk
carries) percentiles, output throughput, the mean accept length and the mean prompt tokens
served from the prefix cache.

Workloads that share prefixes (random token ids):
  --workload system-prompt  every request = one shared system prompt (--system-prompt-tokens)
                            + its own question (--prompt-words tokens)
  --workload multi-turn     conversations of --turns turns; each turn resends the conversation
                            so far (questions and answers) + a new question; conversations
                            arrive at the rate, their turns one after another
The cache is flushed before each run (FlushCache), so every run starts cold. For TTFT with the
cache off, run the same command against a server started with --disable-prefix-cache and a
different --label.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from specserve.clients import AsyncClient

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "demo-heldout.txt"


def make_prompts(n: int, seed: int, words: int, vocab: int) -> list[dict]:
    rng = random.Random(seed)
    if HELDOUT.exists():
        text = HELDOUT.read_text().split()
        starts = [rng.randrange(0, len(text) - words) for _ in range(n)]
        return [{"prompt": " ".join(text[s:s + words])} for s in starts]
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(words)]} for _ in range(n)]


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


async def run_load(server: str, prompts: list, rate: float, concurrency: int, max_new_tokens: int,
                   seed: int) -> dict:
    """`prompts`: request dicts, or conversations (lists of token segments, see above)."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    async with AsyncClient(server) as client:
        await client.wait_until_serving()
        await client.flush_cache()

        async def bounded(request):
            if isinstance(request, list):
                return await conversation(client, limit, request, max_new_tokens)
            async with limit:
                return [await one_request(client, request, max_new_tokens)]

        tasks, start = [], time.perf_counter()
        for request in prompts:
            tasks.append(asyncio.create_task(bounded(request)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
        elapsed = time.perf_counter() - start

    def pct(values, q):
        values = sorted(values)
        return 1000 * values[min(len(values) - 1, int(q / 100 * len(values)))] if values else 0.0

    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {"rate": rate, "concurrency": concurrency, "requests": len(results),
            "output_tokens_per_s": tokens / elapsed, "requests_per_s": len(results) / elapsed,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
            "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
            "accept_length": statistics.mean(r["accept"] for r in results),
            "cached_tokens_mean": statistics.mean(r["cached"] for r in results)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="127.0.0.1:50051")
    ap.add_argument("--rates", default="1,4,inf", help="requests/s (Poisson); inf: all at once")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=8192, help="for random prompts (no held-out text)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workload", default="random", choices=["random", "system-prompt", "multi-turn"])
    ap.add_argument("--system-prompt-tokens", type=int, default=2048)
    ap.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    ap.add_argument("--label", default="", help="tags the rows (e.g. cache-on / cache-off)")
    ap.add_argument("--out", default="bench_serving.json")
    args = ap.parse_args()
    if args.workload == "random":
        prompts = make_prompts(args.num_requests, args.seed, args.prompt_words, args.vocab)
    else:
        prompts = shared_prefix_workload(args.workload, args.num_requests, args.seed, args.prompt_words,
                                         args.vocab, args.system_prompt_tokens, args.turns)
    rows = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for rate in (float(r) for r in args.rates.split(",")):
            rows.append(dict(workload=args.workload, label=args.label,
                             **asyncio.run(run_load(args.server, prompts, rate, concurrency,
                                                    args.max_new_tokens, args.seed))))
            print(json.dumps(rows[-1]), flush=True)
    json.dump({"server": args.server, "date": time.strftime("%Y-%m-%d"), "rows": rows}, open(args.out, "w"),
              indent=1)
    print(f"\n{'label':>10} {'conc':>4} {'rate':>5} {'tok/s':>8} {'req/s':>6} {'TTFT p50':>9} {'p99':>7} "
          f"{'TPOT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'accept':>6} {'cached':>7}")
    for r in rows:
        print(f"{r['label']:>10} {r['concurrency']:>4} {r['rate']:>5} {r['output_tokens_per_s']:8.1f} "
              f"{r['requests_per_s']:6.2f} {r['ttft_ms_p50']:9.1f} {r['ttft_ms_p99']:7.1f} "
              f"{r['tpot_ms_p50']:9.2f} {r['tpot_ms_p99']:7.2f} {r['itl_ms_p50']:8.2f} {r['itl_ms_p99']:7.2f} "
              f"{r['accept_length']:6.2f} {r['cached_tokens_mean']:7.1f}")


if __name__ == "__main__":
    main()
