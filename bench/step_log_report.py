"""What an engine's step log says about its step times (`--step-log PATH`, engine/scheduler/
step_log.py: one JSON line per step).

    python bench/step_log_report.py steps.jsonl [--out report.json] [--burst-s 2] [--gap-s 0.25]

The log is cut into segments where the engine went idle (no launch for --gap-s: a bench's
rows, its warm-up); in each, the first --burst-s seconds (the opening burst of simultaneous
prompts) are reported apart from the steady state. Per part:
- step time percentiles per kind (decode / mixed / extend), and the decode gap: the time from
  one decode-side step's result to the next's (about the streams' chunk gap: what separate
  extends in between add shows there);
- the decode-side steps (decode and mixed) above their p95 and p99: what they carry (kind, rows,
  prompt tokens, the budget's binding term, predicted against measured, graph or eager) against
  the steps below the p95, and the slowest ones line by line ("queued": requests waiting;
  "gpu wait": the host's wait for the step's result, a GPU-bound step's; "cpu": the scheduler
  thread's CPU time, which includes that wait, since a CUDA wait spins; "launch": the host's
  time launching the step, including any kernel launch the driver held);
- the measured over predicted time per kind (steps priced by a fitted model only: fit_steps >=
  --min-fit), and a mixed step's measured time over its decode rows' predicted time alone (the
  budget bounds the predicted one at DRAIN_TIME_RATIO, 2x).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from typing import Optional

KINDS = ("decode", "mixed", "extend")
PERCENTILES = (50, 90, 95, 99)


def read_log(path: str) -> list[dict]:
    """The rows of a step log, in launch order (a last line cut short by a killed engine is
    skipped)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return sorted(rows, key=lambda r: r["step"])


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (nan for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summary(values: list[float], scale: float = 1.0) -> dict:
    return {"n": len(values), "mean": sum(values) * scale / len(values) if values else math.nan,
            **{f"p{q}": percentile(values, q) * scale for q in PERCENTILES},
            "max": max(values) * scale if values else math.nan}


def segments(rows: list[dict], gap_s: float) -> list[list[dict]]:
    """Runs of steps with no idle stretch longer than `gap_s` between one step's result and the
    next launch."""
    out: list[list[dict]] = []
    for row in rows:
        if not out or row["t"] - (out[-1][-1]["t"] + out[-1][-1]["seconds"]) > gap_s:
            out.append([])
        out[-1].append(row)
    return out


def decode_side(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["kind"] in ("decode", "mixed")]


def decode_gaps(rows: list[dict]) -> list[float]:
    """Seconds between consecutive decode-side steps' results (launch + measured time)."""
    ends = [r["t"] + r["seconds"] for r in decode_side(rows)]
    return [b - a for a, b in zip(ends, ends[1:])]


def carried(rows: list[dict]) -> dict:
    """What a set of steps carries, summed up."""
    n = len(rows)
    if not n:
        return {"n": 0}
    count = lambda key: dict(collections.Counter(str(r[key]) for r in rows).most_common())  # noqa: E731
    mean = lambda key: sum(r[key] for r in rows) / n  # noqa: E731
    return {"n": n, "kinds": count("kind"), "bounds": count("bound"),
            "graphed": sum(r["graph"] > 0 for r in rows) / n,
            "mean_ms": 1e3 * mean("seconds"), "mean_decode_rows": mean("decode_rows"),
            "mean_prompt_tokens": mean("prompt_tokens"), "mean_prompt_reqs": mean("prompt_reqs"),
            "mean_waiting": mean("waiting"), "with_retractions": sum(r["retracted"] > 0 for r in rows),
            "with_others": sum(r["others"] > 0 for r in rows), "mean_host_wait_ms": 1e3 * mean("wait_s"),
            # the host's pauses (engine/host_pauses.py; absent from logs before them)
            "mean_gc_ms": 1e3 * sum(r.get("gc_s", 0.0) for r in rows) / n,
            "with_full_gc": sum(r.get("gc_full", 0) > 0 for r in rows),
            "mean_compile_ms": 1e3 * sum(r.get("compile_s", 0.0) for r in rows) / n,
            "with_compiles": sum(bool(r.get("compiled")) for r in rows),
            "mean_cpu_ms": 1e3 * sum(r.get("cpu_s", 0.0) for r in rows) / n,
            # the host's launch of the step (absent from logs before it)
            "mean_launch_ms": 1e3 * sum(r.get("launch_s", 0.0) for r in rows) / n,
            "mean_preempted": sum(r.get("preempted", 0) for r in rows) / n}


def line(r: dict, burst_until: float) -> dict:
    """One step, for the listing of the slowest."""
    predicted, alone = r["predicted_s"], r["decode_alone_s"]
    priced = predicted is not None and r["fit_steps"] > 0
    return {"step": r["step"], "t": r["t"], "burst": r["t"] < burst_until, "kind": r["kind"],
            "rows": r["decode_rows"], "verify": r["verify_tokens"], "prompt": r["prompt_tokens"],
            "prompt_reqs": r["prompt_reqs"], "waiting": r["waiting"], "backlog": r["backlog"],
            "budget": r["budget"], "bound": r["bound"], "graph": r["graph"],
            "predicted_ms": 1e3 * predicted if priced else None,
            "alone_ms": 1e3 * alone if priced else None, "measured_ms": 1e3 * r["seconds"],
            "x_predicted": r["seconds"] / predicted if priced and predicted else None,
            "x_alone": r["seconds"] / alone if priced and alone else None,
            "others": r["others"], "retracted": r["retracted"], "host_wait_ms": 1e3 * r["wait_s"],
            "gc_ms": 1e3 * r.get("gc_s", 0.0), "compile_ms": 1e3 * r.get("compile_s", 0.0),
            "compiled": r.get("compiled", []), "cpu_ms": 1e3 * r.get("cpu_s", 0.0),
            "preempted": r.get("preempted", 0), "launch_ms": 1e3 * r.get("launch_s", 0.0)}


def ratios(rows: list[dict], min_fit: int) -> dict:
    """Measured over predicted time per kind, and a mixed step's measured time over its decode
    rows' predicted time alone, for the steps a model fitted from >= min_fit steps priced."""
    priced = [r for r in rows if r["predicted_s"] and r["fit_steps"] >= min_fit]
    out = {kind: summary([r["seconds"] / r["predicted_s"] for r in priced if r["kind"] == kind])
           for kind in ("decode", "mixed")}
    mixed = [r for r in priced if r["kind"] == "mixed" and r["decode_alone_s"]]
    stretch = [r["seconds"] / r["decode_alone_s"] for r in mixed]
    predicted = [r["predicted_s"] / r["decode_alone_s"] for r in mixed]
    out["mixed_over_alone"] = {**summary(stretch), "over_2x": sum(x > 2.0 for x in stretch),
                               "predicted_over_2x": sum(x > 2.0 + 1e-9 for x in predicted)}
    return out


def by_graph(rows: list[dict], min_fit: int) -> dict:
    """The mixed steps per graph bucket they replayed (0: eager): their measured time, and
    measured over predicted where a fitted model priced them (a cost the linear model misses
    shows as a bucket whose ratio departs from the others')."""
    groups = collections.defaultdict(list)
    for r in rows:
        if r["kind"] == "mixed":
            groups[r["graph"]].append(r)
    return {str(graph): {"ms": summary([r["seconds"] for r in group], 1e3),
                         "x_predicted": summary([r["seconds"] / r["predicted_s"] for r in group
                                                 if r["predicted_s"] and r["fit_steps"] >= min_fit]),
                         "mean_prompt_tokens": sum(r["prompt_tokens"] for r in group) / len(group),
                         "mean_prompt_reqs": sum(r["prompt_reqs"] for r in group) / len(group)}
            for graph, group in sorted(groups.items())}


def part_report(rows: list[dict], burst_until: float, min_fit: int, top: int) -> dict:
    side = decode_side(rows)
    times = [r["seconds"] for r in side]
    p95, p99 = percentile(times, 95), percentile(times, 99)
    above99 = sorted((r for r in side if r["seconds"] > p99), key=lambda r: -r["seconds"])
    return {"steps": len(rows),
            "kinds_ms": {kind: summary([r["seconds"] for r in rows if r["kind"] == kind], 1e3) for kind in KINDS},
            "decode_gap_ms": summary(decode_gaps(rows), 1e3),
            "decode_side_p95_ms": 1e3 * p95, "decode_side_p99_ms": 1e3 * p99,
            "below_p95": carried([r for r in side if r["seconds"] <= p95]),
            "above_p95": carried([r for r in side if r["seconds"] > p95]),
            "above_p99": carried(above99),
            "slowest": [line(r, burst_until) for r in above99[:top]],
            "ratios": ratios(rows, min_fit), "mixed_by_graph": by_graph(rows, min_fit)}


def report(rows: list[dict], burst_s: float = 2.0, gap_s: float = 0.25, min_fit: int = 32, top: int = 12) -> dict:
    out = []
    for index, seg in enumerate(segments(rows, gap_s)):
        start = seg[0]["t"]
        burst_until = start + burst_s
        parts = {"all": seg, "burst": [r for r in seg if r["t"] < burst_until],
                 "steady": [r for r in seg if r["t"] >= burst_until]}
        out.append({"index": index, "first_step": seg[0]["step"], "start_s": start,
                    "duration_s": seg[-1]["t"] + seg[-1]["seconds"] - start,
                    "peak_running": max(r["running"] for r in seg),
                    "parts": {name: part_report(part, burst_until, min_fit, top) for name, part in parts.items()}})
    return {"steps": len(rows), "burst_s": burst_s, "gap_s": gap_s, "min_fit": min_fit, "segments": out}


def _fmt(x: Optional[float], width: int = 7, digits: int = 2) -> str:
    return f"{'-':>{width}}" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{width}.{digits}f}"


def print_report(rep: dict, min_steps: int = 20) -> None:
    for seg in rep["segments"]:
        if seg["parts"]["all"]["steps"] < min_steps:
            print(f"\n# segment {seg['index']}: {seg['parts']['all']['steps']} steps (too few, skipped)")
            continue
        print(f"\n# segment {seg['index']}: from step {seg['first_step']}, {seg['duration_s']:.1f} s, "
              f"peak running {seg['peak_running']}")
        for name in ("burst", "steady"):
            part = seg["parts"][name]
            if not part["steps"]:
                continue
            print(f"## {name} ({part['steps']} steps)")
            print(f"{'kind':>10} {'n':>6} {'p50 ms':>7} {'p90':>7} {'p95':>7} {'p99':>7} {'max':>7}")
            for kind, s in [*part["kinds_ms"].items(), ("gap", part["decode_gap_ms"])]:
                if s["n"]:
                    print(f"{kind:>10} {s['n']:6d} {_fmt(s['p50'])} {_fmt(s['p90'])} {_fmt(s['p95'])} "
                          f"{_fmt(s['p99'])} {_fmt(s['max'])}")
            print(f"decode-side p95 {part['decode_side_p95_ms']:.2f} ms, p99 {part['decode_side_p99_ms']:.2f} ms; "
                  f"what the steps carry:")
            for label in ("below_p95", "above_p95", "above_p99"):
                c = part[label]
                if c["n"]:
                    print(f"  {label:>9}: n {c['n']}, {c['mean_ms']:.2f} ms, kinds {c['kinds']}, bounds {c['bounds']}, "
                          f"graphed {100 * c['graphed']:.0f}%, rows {c['mean_decode_rows']:.1f}, "
                          f"prompt {c['mean_prompt_tokens']:.0f} tok / {c['mean_prompt_reqs']:.1f} req, "
                          f"waiting {c['mean_waiting']:.1f}, retractions {c['with_retractions']}, "
                          f"host wait {c['mean_host_wait_ms']:.2f} ms, gc {c['mean_gc_ms']:.2f} ms "
                          f"({c['with_full_gc']} full), compiles {c['mean_compile_ms']:.2f} ms "
                          f"({c['with_compiles']} steps), scheduler CPU {c['mean_cpu_ms']:.2f} ms, "
                          f"launch {c['mean_launch_ms']:.2f} ms, preempted {c['mean_preempted']:.2f}")
            r = part["ratios"]
            for kind in ("decode", "mixed"):
                s = r[kind]
                if s["n"]:
                    print(f"  measured/predicted {kind:>6}: n {s['n']}, p50 {_fmt(s['p50'])} p90 {_fmt(s['p90'])} "
                          f"p99 {_fmt(s['p99'])} max {_fmt(s['max'])}")
            s = r["mixed_over_alone"]
            if s["n"]:
                print(f"  mixed measured/decode-alone predicted: p50 {_fmt(s['p50'])} p99 {_fmt(s['p99'])} "
                      f"max {_fmt(s['max'])}; over 2x: {s['over_2x']} measured, {s['predicted_over_2x']} predicted")
            if part["mixed_by_graph"]:
                print(f"  mixed steps by graph bucket: {'bucket':>6} {'n':>5} {'p50 ms':>7} {'p99':>7} "
                      f"{'x pred p50':>10} {'p99':>6} {'prompt':>6} {'reqs':>5}")
                for graph, g in part["mixed_by_graph"].items():
                    print(f"  {'':>28} {graph if graph != '0' else 'eager':>6} {g['ms']['n']:5d} {_fmt(g['ms']['p50'])} "
                          f"{_fmt(g['ms']['p99'])} {_fmt(g['x_predicted']['p50'], 10)} {_fmt(g['x_predicted']['p99'], 6)} "
                          f"{g['mean_prompt_tokens']:6.0f} {g['mean_prompt_reqs']:5.1f}")
            if part["slowest"]:
                print(f"  slowest above p99: {'step':>7} {'kind':>6} {'rows':>4} {'prompt':>6} {'reqs':>4} "
                      f"{'bound':>14} {'graph':>5} {'pred':>7} {'alone':>7} {'meas':>7} {'x pred':>6} "
                      f"{'queued':>6} {'retr':>4} {'gpu wait':>8} {'gc':>6} {'compile':>7} {'cpu':>6} "
                      f"{'launch':>6} {'preempt':>7}")
                for s in part["slowest"]:
                    print(f"  {'':>17} {s['step']:7d} {s['kind']:>6} {s['rows']:4d} {s['prompt']:6d} "
                          f"{s['prompt_reqs']:4d} {str(s['bound']):>14} {s['graph']:5d} {_fmt(s['predicted_ms'])} "
                          f"{_fmt(s['alone_ms'])} {_fmt(s['measured_ms'])} {_fmt(s['x_predicted'], 6)} "
                          f"{s['waiting']:6d} {s['retracted']:4d} {_fmt(s['host_wait_ms'], 8, 1)} "
                          f"{_fmt(s['gc_ms'], 6, 1)} "
                          f"{_fmt(s['compile_ms'], 7, 1)} {_fmt(s['cpu_ms'], 6, 1)} {_fmt(s['launch_ms'], 6, 1)} "
                          f"{s['preempted']:7d} "
                          f"{' '.join(s['compiled'])}")


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", help="a step log (--step-log PATH)")
    ap.add_argument("--burst-s", type=float, default=2.0, help="a segment's opening burst, reported apart")
    ap.add_argument("--gap-s", type=float, default=0.25, help="an idle stretch this long starts a segment")
    ap.add_argument("--min-fit", type=int, default=32,
                    help="predicted times count once the cost model was fitted from this many steps")
    ap.add_argument("--top", type=int, default=12, help="the slowest steps listed per part")
    ap.add_argument("--out", default=None, help="write the report as JSON here too")
    args = ap.parse_args(argv)
    rows = read_log(args.log)
    if not rows:
        sys.exit(f"{args.log}: no steps")
    rep = report(rows, args.burst_s, args.gap_s, args.min_fit, args.top)
    rep["log"] = args.log
    print_report(rep)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)
    return rep


if __name__ == "__main__":
    main()
