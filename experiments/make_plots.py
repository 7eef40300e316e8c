"""README figures from the committed results (CPU, seconds).

  python experiments/make_plots.py
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from moecg.analysis import load_results, plot_drop_rate, plot_quality, plot_speedup  # noqa: E402

ROOT = Path(__file__).resolve().parent / "results"


def main() -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    plot_speedup(load_results(ROOT / "strategy_matrix" / "qwen1_5_moe_a2_7b_L4", ROOT / "strategy_matrix" / "mixtral_8x7b_L2"),
                 ax=axes[0])
    axes[0].set_title("H200: speedup vs eager (Qwen1.5-MoE 4 layers, Mixtral-8x7B 2 layers)")
    plot_drop_rate(load_results(ROOT / "capacity_sweep" / "qwen1_5_moe_a2_7b_L4", ROOT / "capacity_sweep" / "mixtral_8x7b_L2"),
                   ax=axes[1])
    axes[1].set_title("H200 random weights: decode drop rate (dashed: uniform routing)")
    fig.tight_layout()
    fig.savefig(ROOT / "strategy_matrix" / "strategies_and_drops.png", dpi=110)

    stdlib = ROOT / "stdlib_capacity_sweep"
    fig = plot_quality(load_results(stdlib))
    fig.set_size_inches(12, 4.5)
    fig.suptitle("trained stdlib models (CPU): held-out bits/byte cost and drop rate vs capacity factor, bs 8")
    fig.tight_layout()
    fig.savefig(stdlib / "quality_vs_capacity.png", dpi=110)
    print("wrote", ROOT / "strategy_matrix" / "strategies_and_drops.png", stdlib / "quality_vs_capacity.png")


if __name__ == "__main__":
    main()
