"""Sweeps through Hydra launchers (basic, submitit_local; submitit_slurm's config), the failed-jobs report and exit
code, one-line errors of a failed single run, per-job process isolation, and the documented quoting examples (docs/running.md)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from moecg import callbacks, run

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "moecg" / "conf")
QUICK = ["new_tokens=3", "prompt_len=4", "measure.repeats=1", "measure.skip_steps=0", "measure.eager_baseline=false",
         "measure.fidelity=false"]


def moecg(cwd, *overrides, timeout=120):
    return subprocess.run([sys.executable, "-m", "moecg.run", *overrides], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "MPLBACKEND": "Agg", "HYDRA_FULL_ERROR": "0"}, timeout=timeout)


def results(sweep) -> dict[int, dict]:
    return {int(f.parent.name): json.loads(f.read_text()) for f in Path(sweep).glob("*/results.json")}


# -- submitit launcher -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_submitit_local_sweep_runs_every_job(tmp_path):
    p = moecg(tmp_path, "-m", "hydra/launcher=submitit_local", "batch_size=1,2", *QUICK,
              f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert p.returncode == 0, p.stderr[-3000:]
    res = results(tmp_path / "sweep")
    assert sorted(res) == [0, 1] and all(r["status"] == "ok" for r in res.values()), res
    assert (res[0]["batch_size"], res[1]["batch_size"]) == (1, 2)
    assert list((tmp_path / "sweep" / ".submitit").glob("*/*_log.out"))  # really ran through submitit


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["basic", "submitit_local"])
def test_multirun_with_a_failed_job_finishes_lists_it_and_exits_nonzero(tmp_path, launcher):
    p = moecg(tmp_path, "-m", f"hydra/launcher={launcher}", "batch_size=1,0", *QUICK,
              f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert p.returncode == 1, p.stderr[-3000:]
    res = results(tmp_path / "sweep")
    assert res[0]["status"] == "ok" and res[0]["batch_size"] == 1
    assert res[1]["status"] == "failed" and "batch_size" in res[1]["error"] and "Traceback" in res[1]["traceback"]
    assert f"moecg: 1 of 2 jobs failed ({tmp_path / 'sweep'}):" in p.stderr
    assert f"  #1 batch_size=0: {callbacks.one_line(res[1]['error'])}\n" in p.stderr
    assert "#0" not in p.stderr.split("jobs failed")[1]


def test_submitit_slurm_gets_one_gpu_per_job(tmp_path):
    p = moecg(tmp_path, "hydra/launcher=submitit_slurm", "--cfg", "hydra", "-p", "hydra.launcher")
    assert p.returncode == 0, p.stderr
    conf = yaml.safe_load(p.stdout)
    assert conf["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert (conf["gpus_per_node"], conf["tasks_per_node"], conf["nodes"]) == (1, 1, 1)
    assert conf["timeout_min"] == run.SLURM_DEFAULTS["timeout_min"] and conf["signal_delay_s"] == 120  # plugin's own
    p = moecg(tmp_path, "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=90", "hydra.launcher.partition=gpu",
              "--cfg", "hydra", "-p", "hydra.launcher")
    conf = yaml.safe_load(p.stdout)
    assert (conf["timeout_min"], conf["partition"], conf["gpus_per_node"]) == (90, "gpu", 1)


@pytest.mark.parametrize("launcher,isolated", [("basic", True), ("submitit_local", False), ("submitit_slurm", False)])
def test_isolation_only_where_the_launcher_shares_a_process(monkeypatch, launcher, isolated):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.mode = "MULTIRUN"
    hc = HydraConfig.instance()
    try:
        hc.set_config(cfg)
        assert run._isolate(cfg) is isolated
        with open_dict(cfg):
            cfg.isolate = True
        assert run._isolate(cfg) is True  # an explicit isolate=true always isolates
    finally:
        hc.cfg = None
    assert run._isolate(compose_plain()) is False  # a single run (no Hydra) never isolates


@pytest.mark.slow
def test_isolated_jobs_record_the_childs_error_and_traceback(tmp_path):
    p = moecg(tmp_path, "-m", "isolate=true", "batch_size=1,0", *QUICK, f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert p.returncode == 1, p.stderr[-3000:]
    res = results(tmp_path / "sweep")
    assert res[0]["status"] == "ok" and res[0]["batch_size"] == 1
    err, tb = res[1]["error"], res[1]["traceback"]
    assert "batch_size" in err and not err.startswith("JobProcessError") and "_child" in tb and "Traceback" in tb
    assert f"#1 batch_size=0: {callbacks.one_line(err)}" in p.stderr and "Traceback" not in p.stderr


def compose_plain():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config")


# -- failed single run --------------------------------------------------------------------------------------------
def test_failed_single_run_exits_1_with_one_readable_line(tmp_path):
    p = moecg(tmp_path, "batch_size=0", *QUICK, f"hydra.run.dir={tmp_path / 'x'}")
    assert p.returncode == 1
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("moecg: job failed")]
    assert "Traceback" not in p.stderr and len(lines) == 1, p.stderr
    line = lines[0]
    r = json.loads((tmp_path / "x" / "results.json").read_text())
    assert r["status"] == "failed" and "Traceback" in r["traceback"] and "batch_size" in r["error"]
    assert line.startswith(f"moecg: job failed: {callbacks.one_line(r['error'])}")
    assert re.match(r"moecg: job failed: \w+: .*batch_size", line) and str(tmp_path / "x" / "results.json") in line
    assert "jobs failed" not in p.stderr  # the multirun report is for multiruns only


def test_one_line_keeps_the_first_line_of_a_long_error():
    assert callbacks.one_line("CaptureError: capture failed at bucket 8\nWays to fix it:\n  1. ...") == \
        "CaptureError: capture failed at bucket 8"
    assert callbacks.one_line("\n  \nValueError: x\n") == "ValueError: x"


def test_sweep_jobs_reads_this_sweeps_dirs_only(tmp_path):
    def job(num, overrides, res, age=0.0):
        d = tmp_path / str(num)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        (d / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"job": {"num": num}}}))
        if res is not None:
            (d / "results.json").write_text(json.dumps(res))
        if age:
            t = time.time() - age
            os.utime(d / ".hydra" / "overrides.yaml", (t, t))

    job(0, ["batch_size=1", "new_tokens=3"], {"status": "ok"})
    job(1, ["batch_size=0", "new_tokens=3"], {"status": "failed", "error": "ValueError: bad\nmore detail"})
    job(2, ["batch_size=4", "new_tokens=3"], None)
    job(3, ["batch_size=9", "new_tokens=3"], {"status": "failed", "error": "old"}, age=3600)  # an earlier sweep's
    (tmp_path / "multirun.yaml").write_text("{}")
    os.utime(tmp_path / "multirun.yaml", (time.time() - 60, time.time() - 60))
    jobs = callbacks.sweep_jobs(tmp_path)
    assert [(j["num"], j["status"]) for j in jobs] == [(0, "ok"), (1, "failed"), (2, "failed")]
    text = callbacks.format_failures(jobs, tmp_path)
    assert text.splitlines()[:3] == [f"moecg: 2 of 3 jobs failed ({tmp_path}):", "  #1 batch_size=0: ValueError: bad",
                                     "  #2 batch_size=4: no results.json (the job was killed or crashed before "
                                     "writing it)"]


# -- the documented examples (docs/running.md) ------------------------------------------------------------------------
def docs_command(*needles) -> list[str]:
    """docs/running.md's example line holding every needle, as bash would split it, minus `python -m moecg.run`."""
    lines = [ln for ln in (ROOT / "docs" / "running.md").read_text().splitlines()
             if ln.startswith("python -m moecg.run") and all(n in ln for n in needles)]
    assert len(lines) == 1, lines
    argv = shlex.split(lines[0], comments=True)
    assert argv[:3] == ["python", "-m", "moecg.run"]
    return argv[3:]


def test_docs_mixed_example_keeps_the_layer_ranges_whole():
    overrides = docs_command("strategy=mixed")
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
        assert cfg.strategy.name == "mixed" and cfg.model.preset == "qwen1_5_moe_a2_7b"
        assert cfg.strategy.layers == "0-11:layer,12-23:attn"
        # what the old line gave Hydra after bash removed its quotes: a sweep, not a string
        with pytest.raises(Exception, match="Ambiguous value"):
            compose(config_name="config", overrides=shlex.split("strategy=mixed strategy.layers='0-11:layer,12-23:attn'"))


def test_docs_launcher_and_wandb_examples_compose():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=docs_command("logger=wandb"))
        assert (cfg.logger.name, cfg.logger.mode) == ("wandb", "offline")
        overrides = [o for o in docs_command("hydra/launcher=submitit_slurm") if o != "-m"]
        cfg = compose(config_name="config", overrides=[o.replace("1,8,32", "8") for o in overrides],
                      return_hydra_config=True)
        assert cfg.hydra.launcher.partition == "gpu" and cfg.hydra.launcher._target_.endswith("SlurmLauncher")
