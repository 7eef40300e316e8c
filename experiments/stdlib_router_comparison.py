"""Two (or more) trained routers under capacity: drop rate and held-out bpb cost against capacity factor.

    python experiments/stdlib_router_comparison.py [SWEEP_DIR ...] [--out DIR]

Each SWEEP_DIR is one model's Hydra multirun of the stdlib capacity sweep (experiments/README.md, "Trained routing:
quality cost of capacity"), e.g. for the DeepSeek-V3-style model:

    python -m moecg.run -m model=deepseek_v3_stdlib strategy=capacity dispatch.capacity_factor=0.5,1.0,1.25,1.5,2.0 \\
        dispatch.drop_policy=probs,position prompts=heldout batch_size=8 prompt_len=64 new_tokens=32 \\
        measure.heldout_bytes=32768 hydra.sweep.dir=experiments/results/stdlib_capacity_sweep/deepseek_v3_stdlib

Default dirs: results/stdlib_capacity_sweep/{mixtral_stdlib,deepseek_v3_stdlib} (HF's aux loss vs DeepSeek-V3's
aux-loss-free bias). Writes <out>/router_comparison.md (tables) and <out>/router_comparison.png (left: bpb delta vs
dropless, middle: decode drop rate with the uniform-routing expectation dashed, right: bpb delta against drop rate),
<out> defaulting to results/stdlib_capacity_sweep. How each model was balanced comes from its card.json when the
checkpoint is in moecg/checkpoints.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from moecg.analysis import load_results, ok_rows, uniform_drop_rate  # noqa: E402

ROOT = Path(__file__).resolve().parent / "results" / "stdlib_capacity_sweep"
CHECKPOINTS = Path(__file__).resolve().parents[1] / "moecg" / "checkpoints"
DEFAULT_DIRS = [ROOT / "mixtral_stdlib", ROOT / "deepseek_v3_stdlib"]
POLICIES = ("probs", "position")
COLS = ["model", "drop_policy", "capacity_factor", "batch_size", "top_k", "num_experts", "drop_rate", "heldout_bpb",
        "heldout_bpb_delta_vs_dropless", "token_agreement_vs_eager", "expert_load_imbalance", "git_sha"]


def load_sweeps(dirs) -> tuple:
    """(ok capacity rows with COLS + `card`, one row per model x policy x cf, models in the order of `dirs`;
    failed rows) from the sweep dirs."""
    df = load_results(*dirs)
    failed = df[df["status"] != "ok"]
    df = ok_rows(df)
    df = df[(df["dispatch"] == "capacity") & df["capacity_factor"].notna()] if "dispatch" in df else df.iloc[0:0]
    if df.empty:
        raise SystemExit(f"no ok dispatch=capacity results under {' '.join(map(str, dirs))}")
    df = df.copy()
    for c in COLS:
        if c not in df:
            df[c] = None
    df["card"] = [_card_path(r) for _, r in df.iterrows()]
    order = {m: i for i, m in enumerate(dict.fromkeys(df["model"]))}  # load_results reads the dirs in order
    df = df[[*COLS, "card"]].sort_values(["model", "drop_policy", "capacity_factor"], key=lambda c: c.map(order)
                                         if c.name == "model" else c)
    return df.groupby(["model", "drop_policy", "capacity_factor"], as_index=False, sort=False).first(), failed


def _card_path(row) -> str | None:
    """The model's card.json: next to model.pretrained_path (model=local) or in moecg/checkpoints/<model>."""
    cfg = row.get("config") if isinstance(row.get("config"), dict) else {}
    path = (cfg.get("model") or {}).get("pretrained_path")
    for card in ([Path(path) / "card.json"] if path else []) + [CHECKPOINTS / str(row["model"]) / "card.json"]:
        if card.exists():
            return str(card)
    return None


def router_of(card: str | None) -> str:
    """How the model's router was trained to balance, from its card.json (blank without one)."""
    if not card:
        return ""
    c = json.loads(Path(card).read_text())
    lb = c.get("load_balancing")
    if lb:
        seq = f", seq-wise loss alpha {lb['seq_aux_alpha']}" if lb.get("seq_aux_alpha") else ""
        return f"aux-loss-free bias, gamma {lb['bias_update_speed']}{seq}"
    return f"aux loss, coef {c.get('router_aux_loss_coef')}"


def _f(x, fmt):
    return "-" if x is None or x != x else format(x, fmt)


def markdown(df) -> str:
    models = list(dict.fromkeys(df["model"]))
    lines = ["| model | router balancing | dropless held-out bpb | load imbalance (decode, median) | commit |",
             "|---|---|---|---|---|"]
    for m in models:
        g = df[df["model"] == m]
        dropless = (g["heldout_bpb"] - g["heldout_bpb_delta_vs_dropless"]).median()
        shas = ", ".join(sorted({str(s) for s in g["git_sha"] if s}))
        lines.append(f"| {m} | {router_of(g['card'].iloc[0]) or '-'} | {_f(dropless, '.3f')} | "
                     f"{_f(g['expert_load_imbalance'].median(), '.2f')} | {shas or '-'} |")
    lines += ["", "| drop policy | cf | " + " | ".join(f"{m} drop rate" for m in models) + " | "
              + " | ".join(f"{m} bpb delta" for m in models) + " | "
              + " | ".join(f"{m} greedy agreement" for m in models) + " |",
              "|---|---|" + "---|" * (3 * len(models))]
    keyed = df.set_index(["model", "drop_policy", "capacity_factor"])

    def cell(m, p, cf, col, fmt):
        return _f(keyed[col].get((m, p, cf)), fmt)

    for p in [p for p in POLICIES if p in set(df["drop_policy"])] + sorted(set(df["drop_policy"]) - set(POLICIES)):
        for cf in sorted(set(df.loc[df["drop_policy"] == p, "capacity_factor"])):
            lines.append(f"| {p} | {cf:g} | " + " | ".join(cell(m, p, cf, "drop_rate", ".3f") for m in models) + " | "
                         + " | ".join(cell(m, p, cf, "heldout_bpb_delta_vs_dropless", "+.3f") for m in models) + " | "
                         + " | ".join(cell(m, p, cf, "token_agreement_vs_eager", ".3f") for m in models) + " |")
    return "\n".join(lines) + "\n"


def plot(df):
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(df["model"]))}
    styles = {"probs": ("-", "o"), "position": (":", "s")}
    for (m, p), g in df.groupby(["model", "drop_policy"], sort=False):
        ls, mk = styles.get(p, ("--", "^"))
        kw = dict(color=colors[m], ls=ls, marker=mk, label=f"{m} {p}")
        axes[0].plot(g["capacity_factor"], g["heldout_bpb_delta_vs_dropless"], **kw)
        axes[1].plot(g["capacity_factor"], g["drop_rate"], **kw)
        axes[2].plot(g["drop_rate"], g["heldout_bpb_delta_vs_dropless"], **kw)
    # uniform routing at the decode batch (T = batch rows), per (T, K, E) the sweeps share
    for (T, K, E), g in df.groupby(["batch_size", "top_k", "num_experts"]):
        cfs = sorted(set(g["capacity_factor"]))
        axes[1].plot(cfs, [uniform_drop_rate(int(T), int(K), int(E), float(cf)) for cf in cfs], color="grey",
                     ls="--", lw=1, label=f"uniform routing (T={T}, K={K}, E={E})")
    axes[0].set(xlabel="capacity factor", ylabel="held-out bpb delta vs dropless",
                title="quality cost (teacher-forced, T = 4096 per forward)")
    axes[1].set(xlabel="capacity factor", ylabel="decode drop rate", title="decode drop rate (bs 8)")
    axes[2].set(xlabel="decode drop rate", ylabel="held-out bpb delta vs dropless", title="cost per dropped assignment")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("trained stdlib routers under capacity (CPU): " + " vs ".join(colors))
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="*", type=Path, help="one sweep dir per model (default: mixtral vs deepseek_v3)")
    ap.add_argument("--out", type=Path, default=ROOT, help="where router_comparison.{md,png} go")
    args = ap.parse_args(argv)
    dirs = args.dirs or DEFAULT_DIRS
    missing = [d for d in dirs if not d.is_dir()]
    if missing:
        print(f"stdlib_router_comparison: no sweep dir {' '.join(map(str, missing))} (run the sweep in this file's "
              "docstring first)", file=sys.stderr)
        return 2
    df, failed = load_sweeps(dirs)
    args.out.mkdir(parents=True, exist_ok=True)
    md = markdown(df)
    if not failed.empty:
        md += "\nFailed jobs: " + "; ".join(f"{r['path']}: {r.get('error')}" for _, r in failed.iterrows()) + "\n"
    (args.out / "router_comparison.md").write_text(md)
    fig = plot(df)
    fig.savefig(args.out / "router_comparison.png", dpi=110)
    print(md, end="")
    print("wrote", args.out / "router_comparison.md", args.out / "router_comparison.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
