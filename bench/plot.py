#!/usr/bin/env python3
"""Draws kvroute-bench's PNG plots from a run's results.json.

Usage: python3 bench/plot.py {compare|lifecycle|overhead} OUT_DIR
Prints the names of the PNGs it wrote (relative to OUT_DIR), one per line;
kvroute-bench links them from report.md.
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(r):
    s = r["policy"]
    if r.get("routers", 1) > 1:
        s += f" ×{r['routers']}"
    if not r.get("sidecars", True):
        s += " (no sc)"
    return s


def compare(out, records):
    written = []
    groups = {}
    for r in records:
        groups.setdefault((r["workload"], r["workers"]), []).append(r)
    for (workload, workers), rs in sorted(groups.items()):
        labels = [label(r) for r in rs]
        x = range(len(rs))
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
        ax = axes[0]
        ax.bar(x, [r["hit_rate"] for r in rs], color="tab:blue")
        ax.axhline(rs[0]["ceiling"], color="black", linestyle="--", label="infinite-cache ceiling")
        ax.set_ylim(0, 1)
        ax.set_title("prefix hit rate (tokens)")
        ax.legend(loc="upper right", fontsize=8)
        ax = axes[1]
        w = 0.27
        for k, (key, name) in enumerate([("ttft_p50_ms", "p50"), ("ttft_p90_ms", "p90"), ("ttft_p99_ms", "p99")]):
            ax.bar([i + (k - 1) * w for i in x], [r[key] for r in rs], width=w, label=name)
        ax.set_yscale("log")
        ax.set_title("TTFT (ms, client-side)")
        ax.legend(fontsize=8)
        ax = axes[2]
        ax.bar(x, [r["max_mean_load"] for r in rs], color="tab:orange")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.3, color="red", linestyle=":", label="1.3")
        ax.set_title("load spread (max/mean requests per worker)")
        ax.legend(fontsize=8)
        for ax in axes:
            ax.set_xticks(list(x))
            ax.set_xticklabels(labels, rotation=40, ha="right", fontsize=8)
        fig.suptitle(f"{workload}, {workers} workers")
        fig.tight_layout()
        name = f"compare_{workload}_w{workers}.png"
        fig.savefig(os.path.join(out, name), dpi=110)
        plt.close(fig)
        written.append(name)
    return written


def lifecycle(out, steps):
    rs = [s for s in steps if s.get("latency_ms") is not None]
    fig, ax = plt.subplots(figsize=(9, 4))
    colors = ["tab:green" if s["pass"] else "tab:red" for s in rs]
    ax.barh([f"{s['state']}\n({s['latency_what']})" for s in rs], [s["latency_ms"] for s in rs], color=colors)
    ax.set_xlabel("ms")
    ax.set_title("lifecycle latencies (green = PASS)")
    fig.tight_layout()
    name = "lifecycle_latencies.png"
    fig.savefig(os.path.join(out, name), dpi=110)
    plt.close(fig)
    return [name]


def overhead(out, res):
    paths = res["paths"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [p["path"] for p in paths]
    w = 0.35
    axes[0].bar([i - w / 2 for i in range(len(paths))], [p["c1_p50_ms"] for p in paths], width=w, label="p50")
    axes[0].bar([i + w / 2 for i in range(len(paths))], [p["c1_p99_ms"] for p in paths], width=w, label="p99")
    axes[0].set_xticks(range(len(paths)))
    axes[0].set_xticklabels(names)
    axes[0].set_title("latency at concurrency 1 (ms)")
    axes[0].legend()
    axes[1].bar(names, [p["c64_throughput_rps"] for p in paths], color="tab:purple")
    axes[1].set_title("throughput at concurrency 64 (req/s)")
    fig.tight_layout()
    name = "overhead.png"
    fig.savefig(os.path.join(out, name), dpi=110)
    plt.close(fig)
    return [name]


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("compare", "lifecycle", "overhead"):
        sys.exit(__doc__)
    kind, out = sys.argv[1], sys.argv[2]
    with open(os.path.join(out, "results.json")) as f:
        data = json.load(f)
    written = {"compare": compare, "lifecycle": lifecycle, "overhead": overhead}[kind](out, data)
    print("\n".join(written))


if __name__ == "__main__":
    main()
