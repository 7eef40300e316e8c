"""Experiments end to end on CPU: Hydra sweeps -> results.json, drop rates against the uniform-routing formula,
failed jobs, the wandb logger, moecg.analysis and the notebook.

Hydra jobs run as `python -m moecg.run ...` subprocesses in tmp dirs, exactly as a user runs them.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moecg import analysis
from moecg.dispatch import DispatchState, make_dispatcher
from moecg.dispatch.capacity import capacity

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["model", "family", "num_layers", "dtype", "device", "strategy", "dispatch", "capacity_factor",
          "drop_policy", "batch_size", "bucket", "prompt_len", "new_tokens", "captured", "ms_per_token_p50",
          "ms_per_token_p90", "tokens_per_s", "eager_ms_per_token_p50", "speedup_vs_eager", "capture_s",
          "graph_mem_mib", "peak_mem_mib", "floor_ms", "floor_ratio", "drop_rate", "dropped_prob_mass",
          "per_layer_drop_rate", "expert_load_imbalance", "token_agreement_vs_eager", "max_logit_diff_vs_eager",
          "device_name", "torch_version", "transformers_version", "moecg_version", "git_sha", "timestamp"]
FAST = ["model=mixtral_tiny", "measure.repeats=1", "new_tokens=8", "prompt_len=8"]
BATCHES, FACTORS = [2, 8], [0.25, 0.5, 1.0, 2.0, 4.0]  # mixtral_tiny: E=8, K=2, so cf=4.0 gives C = T


def moecg_run(cwd, *overrides, env=None, ok=True):
    p = subprocess.run([sys.executable, "-m", "moecg.run", *overrides], cwd=cwd, capture_output=True, text=True,
                       env={**os.environ, "MPLBACKEND": "Agg", **(env or {})}, timeout=300)
    if ok:
        assert p.returncode == 0, p.stderr[-4000:]
    return p


def job_results(sweep_dir) -> list[dict]:
    """The sweep's results.json files in job order."""
    files = sorted(Path(sweep_dir).glob("*/results.json"), key=lambda f: int(f.parent.name))
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("capacity_sweep")
    moecg_run(tmp, "experiment=capacity_sweep", *FAST, f"batch_size={','.join(map(str, BATCHES))}",
              f"dispatch.capacity_factor={','.join(map(str, FACTORS))}", f"hydra.sweep.dir={tmp / 'sweep'}")
    return tmp / "sweep"


# -- sweeps through Hydra ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_capacity_sweep_writes_one_full_result_per_job(sweep):
    res = job_results(sweep)
    assert len(res) == len(BATCHES) * len(FACTORS)
    for r in res:
        assert r["status"] == "ok", r.get("error")
        assert not [f for f in FIELDS if f not in r], "missing results fields"
        assert (r["model"], r["strategy"], r["dispatch"], r["device"]) == ("mixtral_tiny", "capacity", "capacity", "cpu")
        assert len(r["per_layer_drop_rate"]) == r["num_layers"]
        assert r["ms_per_token_p50"] > 0 and r["tokens_per_s"] > 0
    assert {(r["batch_size"], r["capacity_factor"]) for r in res} == {(b, f) for b in BATCHES for f in FACTORS}


@pytest.mark.slow
def test_drops_vanish_at_full_capacity(sweep):
    res = job_results(sweep)
    for bs in BATCHES:
        rows = sorted((r for r in res if r["batch_size"] == bs), key=lambda r: r["capacity_factor"])
        E, K = rows[0]["num_experts"], rows[0]["top_k"]
        rates = [r["drop_rate"] for r in rows]
        assert rows[-1]["capacity_factor"] >= E / K and capacity(bs, K, E, rows[-1]["capacity_factor"]) == bs
        assert rates[-1] == 0.0 and rows[-1]["dropped_prob_mass"] == 0.0
        assert rows[0]["capacity_factor"] == 0.25 and rates[0] > 0
        # Not monotone in the factor in general: a drop changes the next layers' inputs (and the prompt's drops at
        # prefill, whose C the factor sets too, the cache), so the routing and the generated tokens differ between
        # factors even where the decode C is the same. What holds: a decode C of bs drops nothing.
        for r in rows:
            if capacity(bs, K, E, r["capacity_factor"]) == bs:
                assert r["drop_rate"] == 0.0, (bs, r["capacity_factor"])
        assert rows[-1]["token_agreement_vs_eager"] == 1.0


@pytest.mark.slow
def test_dropless_runs_drop_nothing_and_agree_with_eager(tmp_path):
    # capture.backend=emulate: the full strategy really captures and replays on CPU
    moecg_run(tmp_path, "-m", "strategy=full,eager", "dispatch=dropless", "capture.backend=emulate", *FAST,
              f"hydra.sweep.dir={tmp_path / 'sweep'}")
    full, eager = job_results(tmp_path / "sweep")
    assert (full["strategy"], full["captured"], eager["strategy"]) == ("full", True, "eager")
    for r in (full, eager):
        assert r["status"] == "ok" and r["dispatch"] == "dropless"
        assert r["drop_rate"] == 0.0 and r["dropped_assignments"] == 0 and r["routed_assignments"] > 0
        assert r["token_agreement_vs_eager"] == 1.0


@pytest.mark.slow
def test_failed_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    p = moecg_run(tmp_path, "-m", "strategy=full,eager", "dispatch=dynamic", *FAST,
                  f"hydra.sweep.dir={tmp_path / 'sweep'}", ok=False)
    assert p.returncode == 1  # every job ran, then the failed ones are listed (tests/test_launcher.py)
    assert "1 of 2 jobs failed" in p.stderr and "#0 strategy=full: " in p.stderr
    full, eager = job_results(tmp_path / "sweep")
    assert full["status"] == "failed" and "not graph-safe" in full["error"] and full["strategy"] == "full"
    assert eager["status"] == "ok" and eager["ms_per_token_p50"] > 0
    assert "job failed" in p.stderr and "not graph-safe" in p.stderr
    df = analysis.load_results(tmp_path / "sweep")
    assert list(df["status"]) == ["failed", "ok"] and "not graph-safe" in df["error"].iloc[0]


@pytest.mark.slow
def test_wandb_logger_writes_offline_run_and_results(tmp_path):
    job = tmp_path / "job"
    p = moecg_run(tmp_path, "logger=wandb", *FAST, f"hydra.run.dir={job}",
                  env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb_dir"), "WANDB_SILENT": "true"})
    runs = list(job.glob("**/offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), p.stderr[-2000:]
    assert "wandb logging failed" not in p.stderr and "wandb unavailable" not in p.stderr
    assert json.loads((job / "results.json").read_text())["status"] == "ok"
    assert len(analysis.load_results(job)) == 1  # the wandb dir's JSON files are not read as results


def test_refused_run_leaves_no_wandb_run(tmp_path):
    """The wandb logger is made only once a run has results: a run the plan refuses writes its failed results.json
    and no offline wandb run (it used to leave one behind, made before the plan was checked)."""
    job = tmp_path / "job"
    p = moecg_run(tmp_path, "logger=wandb", "strategy=full", "dispatch=dynamic", *FAST, f"hydra.run.dir={job}",
                  env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb_dir"), "WANDB_SILENT": "true"},
                  ok=False)
    assert p.returncode == 1 and "not graph-safe" in p.stderr
    assert json.loads((job / "results.json").read_text())["status"] == "failed"
    assert not list(tmp_path.glob("**/offline-run-*")) and not list(tmp_path.glob("**/wandb/"))


@pytest.mark.slow
def test_single_run_qwen2_moe_tiny(tmp_path):
    moecg_run(tmp_path, "model=qwen2_moe_tiny", "batch_size=4", "new_tokens=16", f"hydra.run.dir={tmp_path / 'x'}")
    r = json.loads((tmp_path / "x" / "results.json").read_text())
    assert (r["status"], r["model"], r["family"], r["batch_size"], r["new_tokens"]) == \
        ("ok", "qwen2_moe_tiny", "qwen2_moe", 4, 16)


@pytest.mark.parametrize("group,choice", [("strategy", "partial"), ("dispatch", "dropless")])
def test_unknown_config_value_lists_the_choices(tmp_path, group, choice):
    p = moecg_run(tmp_path, f"{group}=nope", f"hydra.run.dir={tmp_path / 'x'}", ok=False)
    assert p.returncode != 0
    assert f"Could not find '{group}/nope'" in p.stderr and choice in p.stderr
    assert not (tmp_path / "x" / "results.json").exists()


# -- drop accounting against the analytic rate -------------------------------------------------------------------
def _uniform_routing_drop_rate(T, E, K, cf, trials, seed=0, pad_to=None) -> float:
    """Capacity.forward on random uniform routings, counted by a DispatchState summed over `trials` calls.

    pad_to: run T real rows padded up to a bucket of pad_to rows (pad rows masked), as a captured step does."""
    g = torch.Generator().manual_seed(seed)
    disp = make_dispatcher("capacity", capacity_factor=cf)
    rows = pad_to or T
    state = DispatchState(disp, [0], E, max_rows=rows, device="cpu")
    state.set_rows(T, rows)
    D = I = 4  # the expert MLP's output does not matter here, only which assignments keep a slot
    experts = SimpleNamespace(num_experts=E, gate_up_proj=torch.zeros(E, 2 * I, D), down_proj=torch.zeros(E, D, I),
                              _apply_gate=lambda gu: gu[..., :I] * gu[..., I:])
    valid = state.token_valid(rows) if pad_to else None
    for _ in range(trials):
        idx = torch.rand(rows, E, generator=g).argsort(1)[:, :K]  # [B, K] K distinct experts, uniform
        w = torch.rand(rows, K, generator=g).softmax(1)  # [B, K]
        disp.forward(experts, torch.zeros(rows, D), idx, w, valid, state.layer(0))
    snap = state.snapshot()
    assert snap["routed_assignments"] == T * K * trials
    return snap["drop_rate"]


@pytest.mark.parametrize("T,E,cf", [(4096, 8, 1.0), (4096, 8, 1.25), (4096, 16, 1.0), (4096, 16, 1.25),
                                    (4096, 8, 0.5), (64, 8, 1.0), (64, 16, 1.25)])
def test_uniform_routing_drop_rate_matches_analytic(T, E, cf):
    K = 2
    expected = analysis.uniform_drop_rate(T, K, E, cf)
    measured = _uniform_routing_drop_rate(T, E, K, cf, trials=max(4, 16384 // T))  # same token count per case
    assert abs(measured - expected) < 0.01, (measured, expected)


@pytest.mark.parametrize("T,bucket,cf", [(5, 8, 1.25), (40, 64, 1.0), (3, 4, 2.0)])
def test_analytic_rate_holds_for_a_batch_padded_to_its_bucket(T, bucket, cf):
    """The overlay is priced on the real batch; a padded (captured) step must drop at that rate, not the bucket's."""
    E, K = 8, 2
    expected = analysis.uniform_drop_rate(T, K, E, cf)
    measured = _uniform_routing_drop_rate(T, E, K, cf, trials=min(4096 // T, 500), pad_to=bucket)  # seeded
    assert abs(measured - expected) < 0.01, (measured, expected, analysis.uniform_drop_rate(bucket, K, E, cf))


def test_uniform_drop_rate_edges():
    assert analysis.uniform_drop_rate(8, 2, 8, 4.0) == 0.0  # C = T: nothing can overflow
    assert analysis.uniform_drop_rate(16, 4, 4, 0.5) == pytest.approx(0.5)  # K = E: every expert gets all T
    assert analysis.uniform_drop_rate(1, 2, 8, 0.01) == 0.0  # min capacity 1 holds a single token
    rates = [analysis.uniform_drop_rate(256, 2, 8, cf) for cf in (0.5, 1.0, 1.25, 2.0)]
    assert rates == sorted(rates, reverse=True) and 0.4 < rates[0] < 0.6
    with pytest.raises(ValueError, match="top_k"):
        analysis.uniform_drop_rate(8, 9, 8, 1.0)


# -- analysis ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_load_results_one_row_per_job(sweep):
    df = analysis.load_results(sweep)
    assert len(df) == len(BATCHES) * len(FACTORS) and set(df["status"]) == {"ok"}
    assert all(isinstance(v, list) for v in df["per_layer_drop_rate"])
    assert df["path"].str.endswith("results.json").all()
    assert len(analysis.load_results(sweep / "0" / "results.json", sweep / "1")) == 2


def test_load_results_reads_committed_json_of_any_name(tmp_path):
    row = {"model": "m", "strategy": "capacity", "dispatch": "capacity", "batch_size": 1, "drop_rate": 0.1,
           "per_layer_drop_rate": [0.1, 0.2]}
    (tmp_path / "sweep_h200.json").write_text(json.dumps(row))
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "matrix.json").write_text(json.dumps([row, {**row, "batch_size": 8}]))
    (tmp_path / "notes.json").write_text(json.dumps({"comment": "not a result"}))
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "strategies.md").write_text("| table |")
    df = analysis.load_results(tmp_path)
    assert len(df) == 3 and set(df["status"]) == {"ok"} and df["per_layer_drop_rate"].iloc[0] == [0.1, 0.2]
    assert sorted(df["batch_size"]) == [1, 1, 8]
    assert analysis.load_results(tmp_path / "more").shape[0] == 2
    with pytest.raises(FileNotFoundError, match="no such results"):
        analysis.load_results(tmp_path / "missing")


@pytest.mark.slow
def test_plots_draw_and_tolerate_missing_data(sweep):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = analysis.load_results(sweep)
    empty = analysis.load_results()
    for plot in (analysis.plot_speedup, analysis.plot_drop_rate, analysis.plot_latency_vs_drop, analysis.plot_quality):
        for frame in (df, empty):
            fig = plot(frame)
            fig.canvas.draw()
            plt.close(fig)
    fig = analysis.plot_drop_rate(df)
    assert len(fig.axes[0].lines) == 2 * len(BATCHES)  # measured + analytic per batch size
    plt.close(fig)


@pytest.mark.slow
def test_cli_prints_table_and_writes_csv(sweep, tmp_path):
    out = tmp_path / "out.csv"
    p = subprocess.run([sys.executable, "-m", "moecg.analysis", str(sweep), "--csv", str(out)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "capacity_factor" in p.stdout and "mixtral_tiny" in p.stdout
    import pandas as pd

    assert len(pd.read_csv(out)) == len(BATCHES) * len(FACTORS)


# -- notebook ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("which", ["sweep", "none"])
def test_notebook_runs_top_to_bottom(sweep, tmp_path, monkeypatch, which):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("MOECG_RESULTS", str(sweep if which == "sweep" else tmp_path / "nothing_here"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend, so plots become outputs
    nb = nbformat.read(ROOT / "notebooks" / "analysis.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    if which == "sweep":
        assert f"{len(BATCHES) * len(FACTORS)} jobs" in text and len(images) == 4
    else:
        assert "No results" in text and not images


# -- experiments/ as named benchmarks ----------------------------------------------------------------------------
EXP = ROOT / "experiments"
RUNNER = EXP / "gpu.sh"
RUNNER_FILES = (RUNNER, EXP / "gpu_step.sh")  # gpu.sh sources the fused step's suites from gpu_step.sh


def _runner_text() -> str:
    return "\n".join(f.read_text() for f in RUNNER_FILES)


DIARY = re.compile(r"issue_?\d|session|(^|[_./-])(s\d+[a-z]?|r\d|run\d|round|step\d|final_[a-z])($|[_./-])")


def _suites() -> dict[str, str]:
    """The runner's suites, name -> body (bash functions `suite_NAME() {` ... `}` at column 0)."""
    return dict(re.findall(r"^suite_(\w+)\(\) \{(.*?)^\}", _runner_text(), re.S | re.M))


def test_runner_suites_name_existing_scripts_and_folders():
    suites = _suites()
    assert {"tests", "floor", "long_context", "capture", "fidelity", "vs_compile", "serving", "ep"} <= set(suites)
    listed = subprocess.run(["bash", str(RUNNER), "list"], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[0] for line in listed.stdout.splitlines()] == sorted(suites)
    for name, body in suites.items():
        first = next(line.strip() for line in body.splitlines() if line.strip() and not line.strip().startswith("#"))
        assert re.fullmatch(r"bench [a-z0-9_]+", first), f"suite {name} must start with `bench FOLDER`, not {first!r}"
    # every script the runner names (suites and their helpers) exists, and so does every pytest path
    scripts = set(re.findall(r"experiments/[\w/]+\.py", _runner_text()))
    assert scripts and not [s for s in scripts if not (ROOT / s).is_file()]
    assert not [p for p in re.findall(r"\btests/[\w/.]+", _runner_text()) if not (ROOT / p).exists()]


def test_shell_scripts_parse():
    scripts = sorted(EXP.rglob("*.sh"))
    assert set(RUNNER_FILES) <= set(scripts)
    for s in scripts:
        p = subprocess.run(["bash", "-n", str(s)], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, (s, p.stderr)


def test_experiments_paths_name_benchmarks_not_rounds():
    paths = [p.relative_to(EXP).as_posix() for p in EXP.rglob("*") if "__pycache__" not in p.parts]
    assert len(paths) > 100
    assert not [p for p in paths if DIARY.search(p.lower())]
    current = [p for p in (EXP / "results").rglob("*.md") if "history" not in p.parts]  # what the docs cite now
    for text in (EXP / "README.md", *RUNNER_FILES, *current):
        assert not re.search(r"issue \d|issue-\d|session|this round", text.read_text(), re.I), text
    # every results folder says which command, commit and machine produced it
    results = EXP / "results"
    assert not [d.name for d in results.iterdir() if d.is_dir() and not (d / "README.md").is_file()]
