"""Results -> a DataFrame, the analytic uniform-routing drop rate, and the plots the notebook shows.

  python -m moecg.analysis DIR [DIR...] [--csv out.csv] [--serving-plot out.png [--latency e2e_ms_p90]]

Dims: T tokens per MoE layer call (= batch rows during decode), K top-k, E experts, C capacity per expert.
A results file is `run.py`'s results.json (one job, ok or failed), or any JSON file holding one such dict or a
list of them (committed results, e.g. experiments/results/). Plot helpers return a matplotlib Figure and
never call show(), so they work under the Agg backend.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import pandas as pd

from moecg import schema
from moecg.dispatch.capacity import capacity

TABLE = list(schema.ANALYSIS)  # the table's columns and the sweep axes come from the one results schema
AXES = list(schema.AXES)  # always columns
SKIP_DIRS = {"wandb", ".hydra", ".git"}  # wandb-summary.json repeats a run's fields: never read it as a result


# -- loading ---------------------------------------------------------------------------------------------------
def _is_result(d) -> bool:
    return isinstance(d, dict) and ("status" in d or {"strategy", "dispatch"} <= d.keys())


def _natural(p: Path):
    # multirun job dirs are 0, 1, ..., 10: sort them as numbers, not strings
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", str(p))]


def _json_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such results file or directory")
    found = [p for p in path.rglob("*.json")
             if not any(part in SKIP_DIRS or part.startswith(".") for part in p.relative_to(path).parts[:-1])]
    return sorted(found, key=_natural)


def _from_config(row: dict) -> None:
    """A row without some sweep axis (older failed records) gets it from its config, as the schema says."""
    for name, value in schema.axes_from_config(row.get("config") or {}).items():
        row.setdefault(name, value)


def load_results(*paths) -> pd.DataFrame:
    """One row per job from results.json files, run dirs, multirun dirs or dirs of committed JSON results.

    List-valued fields stay Python lists; `path` says where each row came from and `status` is 'ok' or 'failed'
    (failed jobs keep their `error`).
    """
    rows = []
    for path in paths:
        for f in _json_files(Path(path)):
            try:
                data = json.loads(f.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # a stray non-results file in a committed directory
            items = data if isinstance(data, list) else [data]
            for i, d in enumerate(x for x in items if _is_result(x)):
                row = dict(d)
                row.setdefault("status", "ok")
                _from_config(row)
                row["path"] = str(f) if not isinstance(data, list) else f"{f}[{i}]"
                rows.append(row)
    df = pd.DataFrame(rows)
    for col in (*AXES, "path", "status"):
        if col not in df:
            df[col] = pd.Series(dtype=object)
    return df


def ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"] if "status" in df else df


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    # serving columns only where some row served (a sweep of fixed batches keeps today's table)
    return df[[c for c in TABLE if c in df and not (c in schema.SERVING and df[c].isna().all())]]


# -- analytic drop rate -----------------------------------------------------------------------------------------
def _log_binom_pmf(k: int, n: int, p: float) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)


def uniform_drop_rate(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float,
                      min_capacity: int = 1) -> float:
    """Expected fraction of the T*K assignments dropped when every token picks K distinct experts uniformly.

    Each expert's load X ~ Binomial(T, K/E) (a token includes a given expert with probability K/E, tokens
    independent), so expected dropped = E * E[max(X - C, 0)] and the rate divides by the fixed T*K.
    Exact sum over the pmf in log space: (1 - K/E)^T underflows a float long before T = 4096.
    """
    T, K, E = num_tokens, top_k, num_experts  # T: the real tokens (the threshold ignores bucket padding)
    if not 0 < K <= E or T < 1:
        raise ValueError(f"need 1 <= top_k <= num_experts and num_tokens >= 1, got T={T}, K={K}, E={E}")
    C = capacity(T, K, E, capacity_factor, min_capacity)
    p = K / E
    if p == 1.0:
        return (T - C) / T  # every token routes to every expert
    excess = sum((k - C) * math.exp(_log_binom_pmf(k, T, p)) for k in range(C + 1, T + 1))
    return E * excess / (T * K)


def _analytic_for(row) -> float:
    cfg = row.get("config") if isinstance(row.get("config"), dict) else {}
    min_cap = int((cfg.get("dispatch") or {}).get("min_capacity") or 1)
    return uniform_drop_rate(int(row["batch_size"]), int(row["top_k"]), int(row["num_experts"]),
                             float(row["capacity_factor"]), min_cap)


# -- plots -------------------------------------------------------------------------------------------------------
def _axes(ax, ncols=1, width=5.5):
    import matplotlib.pyplot as plt

    if ax is not None:
        return (ax[0] if ncols > 1 else ax).figure, ax
    fig, ax = plt.subplots(1, ncols, figsize=(width * ncols, 4), squeeze=True)
    return fig, ax


def _has(df, *cols) -> bool:
    return all(c in df and df[c].notna().any() for c in cols)


def _empty(ax, msg: str):
    ax.text(0.5, 0.5, msg, ha="center", va="center", transform=ax.transAxes, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def _capacity_rows(df):
    df = ok_rows(df)
    if not _has(df, "dispatch", "capacity_factor", "batch_size"):
        return df.iloc[0:0]
    return df[(df["dispatch"] == "capacity") & df["capacity_factor"].notna()]


def _lines(df, keys, vary=("model", "drop_policy")):
    """One line per value of `keys`, split further by any `vary` column that takes several values -> (label, rows)."""
    keys = list(keys) + [k for k in vary if k not in keys and k in df and df[k].nunique(dropna=False) > 1]
    for key, g in df.groupby(keys, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        yield " ".join(f"bs={v}" if k == "batch_size" else str(v) for k, v in zip(keys, key)), g


def plot_speedup(df: pd.DataFrame, ax=None):
    """speedup_vs_eager against batch size, one line per strategy."""
    fig, ax = _axes(ax)
    df = ok_rows(df)
    if not _has(df, "speedup_vs_eager", "batch_size"):
        _empty(ax, "no speedup_vs_eager in these results")
        return fig
    for label, g in _lines(df[df["speedup_vs_eager"].notna()], ["strategy"], vary=("model", "dispatch")):
        s = g.groupby("batch_size")["speedup_vs_eager"].median()
        ax.plot(s.index, s.values, marker="o", label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size", ylabel="speedup vs eager (p50)", title="speedup vs batch size")
    ax.legend(fontsize=8)
    return fig


def plot_drop_rate(df: pd.DataFrame, ax=None):
    """Measured drop rate against capacity factor per batch size, dashed: the uniform-routing expectation."""
    fig, ax = _axes(ax)
    df = _capacity_rows(df)
    if df.empty or not _has(df, "drop_rate"):
        _empty(ax, "no dispatch=capacity results")
        return fig
    for label, g in _lines(df, ["model", "batch_size"]):
        g = g.groupby("capacity_factor", as_index=False).first().sort_values("capacity_factor")
        line, = ax.plot(g["capacity_factor"], g["drop_rate"], marker="o", label=label)
        if _has(g, "top_k", "num_experts"):
            ax.plot(g["capacity_factor"], [_analytic_for(r) for _, r in g.iterrows()], ls="--",
                    color=line.get_color(), alpha=0.7)
    ax.set(xlabel="capacity factor", ylabel="drop rate", title="drop rate (dashed: uniform routing)")
    ax.legend(fontsize=8)
    return fig


def plot_latency_vs_drop(df: pd.DataFrame, ax=None):
    """ms per token against drop rate for capacity runs: what each point of dropped tokens buys."""
    fig, ax = _axes(ax)
    df = _capacity_rows(df)
    if df.empty or not _has(df, "drop_rate", "ms_per_token_p50"):
        _empty(ax, "no dispatch=capacity results")
        return fig
    for label, g in _lines(df, ["model", "batch_size"]):
        g = g.sort_values("capacity_factor")
        ax.plot(g["drop_rate"], g["ms_per_token_p50"], marker="o", label=label)
        for _, r in g.iterrows():
            ax.annotate(f"{r['capacity_factor']:g}", (r["drop_rate"], r["ms_per_token_p50"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="drop rate", ylabel="ms / token (p50)", title="latency vs drop rate (labels: capacity factor)")
    ax.legend(fontsize=8)
    return fig


def plot_quality(df: pd.DataFrame, axes=None):
    """Held-out bpb delta vs dropless and drop rate against capacity factor, one line per drop policy."""
    fig, axes = _axes(axes, ncols=2)
    df = _capacity_rows(df)
    for ax, col, label in [(axes[0], "heldout_bpb_delta_vs_dropless", "bpb delta vs dropless"),
                           (axes[1], "drop_rate", "drop rate")]:
        ax.set_title(f"{label} by drop policy")
        d = df[df[col].notna()] if col in df else df.iloc[0:0]
        if d.empty:
            _empty(ax, f"no {col}\n(random-weight models have no held-out quality)")
            continue
        for name, g in _lines(d, ["model", "drop_policy", "batch_size"]):
            g = g.groupby("capacity_factor", as_index=False)[col].median()
            ax.plot(g["capacity_factor"], g[col], marker="o", label=name)
        ax.set(xlabel="capacity factor", ylabel=label)
        ax.legend(fontsize=8)
    return fig


def serving_rows(df: pd.DataFrame) -> pd.DataFrame:
    df = ok_rows(df)
    if not _has(df, "output_tokens_per_s"):
        return df.iloc[0:0]
    return df[df["output_tokens_per_s"].notna()]


def plot_serving(df: pd.DataFrame, ax=None, latency: str = "tpot_ms_p90"):
    """Serving runs: `latency` (tpot_ms_p90, e2e_ms_p90, ttft_ms_p90...) against output tokens/s, one line per
    strategy x dispatch through its arrival rates (labels: workload.rate), transformers' continuous batching dashed
    where the runs measured it (workload.anchor=true)."""
    fig, ax = _axes(ax)
    df = serving_rows(df)
    if df.empty or not _has(df, latency):
        _empty(ax, "no serving results (workload=poisson or trace)")
        return fig
    for label, g in _lines(df, ["strategy", "dispatch"], vary=("model", "max_batch", "kernels")):
        g = g.sort_values("workload_rate" if _has(g, "workload_rate") else "output_tokens_per_s")
        ax.plot(g["output_tokens_per_s"], g[latency], marker="o", label=label)
        if _has(g, "workload_rate"):
            for _, r in g.iterrows():
                ax.annotate(f"{r['workload_rate']:g}", (r["output_tokens_per_s"], r[latency]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
    anchor = f"anchor_{latency}"
    if _has(df, "anchor_output_tokens_per_s", anchor):
        a = df[df["anchor_output_tokens_per_s"].notna()]
        for label, g in _lines(a, ["model"], vary=("max_batch",)):
            g = g.groupby("workload_rate" if _has(g, "workload_rate") else "max_batch", as_index=False)[
                ["anchor_output_tokens_per_s", anchor]].median()
            ax.plot(g["anchor_output_tokens_per_s"], g[anchor], ls="--", marker="x", color="grey",
                    label=f"transformers CB {label}")
    ax.set(xlabel="output tokens / s", ylabel=latency.replace("_", " "),
           title=f"serving: {latency} vs throughput (labels: req/s)")
    ax.legend(fontsize=8)
    return fig


# -- CLI -----------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moecg.analysis", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="results.json files, run/multirun dirs, or dirs of committed results")
    ap.add_argument("--csv", help="also write every row (lists as JSON) to this CSV file")
    ap.add_argument("--serving-plot", metavar="PNG", help="also plot serving runs' latency against output tokens/s")
    ap.add_argument("--latency", default="tpot_ms_p90", help="the serving plot's latency field (default tpot_ms_p90)")
    args = ap.parse_args(argv)
    try:
        df = load_results(*args.paths)
    except FileNotFoundError as e:
        print(f"moecg.analysis: {e}", file=sys.stderr)
        return 2
    if df.empty:
        print(f"moecg.analysis: no results found under {' '.join(args.paths)}", file=sys.stderr)
        return 1
    with pd.option_context("display.width", 200, "display.max_columns", None, "display.float_format", "{:.4g}".format):
        print(summary_table(df).to_string(index=False))
    for _, r in df[df["status"] != "ok"].iterrows():
        print(f"failed: {r['path']}: {r.get('error')}")
    if args.csv:
        flat = df.drop(columns=[c for c in ("config", "traceback") if c in df])
        flat = flat.apply(lambda s: s.map(lambda v: json.dumps(v) if isinstance(v, (list, dict)) else v))
        flat.to_csv(args.csv, index=False)
        print(f"csv: {args.csv} ({len(flat)} rows)")
    if args.serving_plot:
        import matplotlib

        matplotlib.use("Agg")
        fig = plot_serving(df, latency=args.latency)
        fig.savefig(args.serving_plot, dpi=120, bbox_inches="tight")
        print(f"plot: {args.serving_plot} ({len(serving_rows(df))} serving runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
