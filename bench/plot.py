"""Plots for docs/benchmarks.md from the JSON that bench/one_batch.py and peers_hf.py write.

    python bench/plot.py docs/bench/one_batch_h200.json docs/bench/peers_hf_h200.json --out docs/bench
"""
from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("one_batch")
    ap.add_argument("peers", nargs="?")
    ap.add_argument("--out", default="docs/bench")
    args = ap.parse_args()
    data = json.load(open(args.one_batch))
    rows = data["rows"]
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4))
    for ax, model in zip(axes, models):
        for mode in ("plain", "chain", "tree"):
            pts = sorted((r["batch_size"], r["decode_tokens_per_s"]) for r in rows
                         if r["model"] == model and r["mode"] == mode and r.get("variant", "default") == "default")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(model)
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens/s")
        ax.legend()
    fig.suptitle(f"specserve decode throughput, {data['device']} ({data['date']})")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "throughput.png"), dpi=100)

    bs1 = [r for r in rows if r["batch_size"] == 1 and r["model"] != "demo" and r.get("variant", "default") == "default"]
    labels = [f"{r['model']}\n{r['mode']}" for r in bs1]
    values = [100 * r["fraction_of_limit"] for r in bs1]
    if args.peers:
        for r in json.load(open(args.peers))["rows"]:
            limit = next(x["bs1_limit_tokens_per_s"] for x in bs1 if x["model"] == r["model"])
            labels.append(f"{r['model']}\n{r['mode']}")
            values.append(100 * r["decode_tokens_per_s"] / limit)
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 4))
    ax.bar(range(len(values)), values, color=["C0" if "hf" not in lab else "C7" for lab in labels])
    ax.axhline(100, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("% of the bs=1 bandwidth limit")
    ax.set_title(f"bs=1 tokens/s vs weight bytes / copy bandwidth ({data['device']})")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bs1_vs_limit.png"), dpi=100)


if __name__ == "__main__":
    main()
