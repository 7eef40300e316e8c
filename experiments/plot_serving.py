"""Latency vs throughput per strategy from bench_serving.py's JSON (one point per max batch):
  python experiments/plot_serving.py experiments/results/serving/serving.json experiments/results/serving/serving.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    d = json.load(open(src))
    pts = {}
    for pair in d["rows"]["pairs"]:
        for r in pair["rows"]:
            pts.setdefault(r["variant"], []).append((pair["max_batch"], r["output_tokens_per_s"], r["tpot_ms_p90"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, p in pts.items():
        p.sort()
        ax.plot([x[1] for x in p], [x[2] for x in p], "o-", label=name)
        for mb, x, y in p:
            ax.annotate(f"max {mb}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("output tokens/s (end to end)")
    ax.set_ylabel("p90 time per output token (ms)")
    ax.set_xscale("log")
    ax.set_title("Qwen1.5-MoE shape, 24 layers, H200: serving 64 (max 64) and 16 (max 8) requests", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=130)


if __name__ == "__main__":
    main(*sys.argv[1:3])
