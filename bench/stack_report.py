"""Where the stack sampler (bench/stack_sampler) saw processes' main threads stop: its events
grouped by their innermost frames, per process, most CPU time first.

    python bench/stack_report.py /tmp/stacks [--frames 5] [--from-frame process.py:_step] [--top 12]

`--from-frame` keeps a process's events from the first one whose stack holds that frame on
(e.g. the engine's steps, leaving its start-up's compiles out); `--skip` drops events whose
stack holds any of the given frames. A "held" group with CPU near its time spun in C (a device
wait, a kernel launch the driver held, or a Python loop sampled at one instruction); one with
CPU near 0 slept (a poll, a lock); a "gap" held the GIL or was stopped.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
from typing import NamedTuple, Optional


class Group(NamedTuple):
    kind: str
    frames: tuple[str, ...]
    count: int
    total_ms: float
    max_ms: float
    cpu_ms: float


def read_events(path: str) -> dict[int, list[dict]]:
    """Each process's events (PATH.<pid> files; a line cut short by a killed process is
    dropped)."""
    out = {}
    for name in glob.glob(f"{glob.escape(path)}.*"):
        suffix = name.rsplit(".", 1)[-1]
        if not suffix.isdigit():
            continue
        events = []
        with open(name) as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        out[int(suffix)] = events
    return out


def groups(events: list[dict], frames: int, from_frame: Optional[str] = None,
           skip: tuple[str, ...] = ()) -> list[Group]:
    """`events` grouped by (kind, innermost `frames` frames), most CPU time first."""
    if from_frame:
        starts = [i for i, e in enumerate(events) if any(from_frame in s for s in e["stack"])]
        events = events[starts[0]:] if starts else []
    by_key = collections.defaultdict(list)
    for e in events:
        if not any(frame in s for s in e["stack"] for frame in skip):
            by_key[(e["kind"], tuple(e["stack"][:frames]))].append(e)
    out = [Group(kind, key, len(es), sum(e["ms"] for e in es), max(e["ms"] for e in es),
                 sum(e["cpu_ms"] for e in es)) for (kind, key), es in by_key.items()]
    return sorted(out, key=lambda g: (-g.cpu_ms, -g.total_ms))


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="the sampler's STACK_SAMPLER path (PATH.<pid> files)")
    ap.add_argument("--frames", type=int, default=5, help="innermost frames that name a group")
    ap.add_argument("--from-frame", default=None, help="keep a process's events from this frame's first")
    ap.add_argument("--skip", default="", help="comma list: drop events whose stack holds one")
    ap.add_argument("--top", type=int, default=12, help="groups listed per process")
    ap.add_argument("--out", default=None, help="write the groups as JSON here too")
    args = ap.parse_args(argv)
    skip = tuple(s for s in args.skip.split(",") if s)
    report = {}
    for pid, events in sorted(read_events(args.path).items()):
        found = groups(events, args.frames, args.from_frame, skip)
        if not found:
            continue
        report[pid] = [g._asdict() for g in found]
        allocator = f"{args.path}.{pid}.allocator.json"
        counters = json.load(open(allocator)) if os.path.exists(allocator) else None
        print(f"# process {pid}: {len(events)} events" + (f"; allocator {counters}" if counters else ""))
        print(f"  {'kind':>5} {'n':>5} {'total ms':>9} {'max ms':>7} {'cpu/wall':>8}  frames")
        for g in found[:args.top]:
            print(f"  {g.kind:>5} {g.count:5d} {g.total_ms:9.1f} {g.max_ms:7.1f} "
                  f"{g.cpu_ms / g.total_ms if g.total_ms else 0.0:8.2f}  {' < '.join(g.frames)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
