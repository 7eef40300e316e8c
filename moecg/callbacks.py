"""Hydra callbacks (configured under `hydra.callbacks` in conf/config.yaml).

`FailedJobsReport`: after every job of a multirun has finished (any launcher: basic, submitit local or SLURM),
list the jobs whose results.json says `status: failed`, with their overrides and one-line error, and exit 1.
Each job already records its failure and returns normally, so one failed job never stops the others.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def one_line(error: str) -> str:
    """The first non-empty line of an error message (multi-line messages: the rest is in results.json)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return lines[0] if lines else "unknown error"


class FailedJobsReport(Callback):
    def __init__(self, results_file: str = "results.json") -> None:
        self.results_file = results_file
        self._start = time.time()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._start = time.time()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            jobs = sweep_jobs(sweep_dir, config.get("results_file", self.results_file), self._start)
        except Exception as e:  # noqa: BLE001 - the report must never hide the jobs' own results
            print(f"moecg: could not check the sweep's results under {sweep_dir}: {type(e).__name__}: {e}",
                  file=sys.stderr)
            return
        failed = [j for j in jobs if j["status"] != "ok"]
        if not failed:
            return
        print(format_failures(jobs, sweep_dir), file=sys.stderr)
        sys.exit(1)


def sweep_jobs(sweep_dir: Path, results_file: str = "results.json", since: float = 0.0) -> list[dict]:
    """This multirun's jobs under `sweep_dir`: num, overrides, status and one-line error, in job order.

    A job dir is one with Hydra's `.hydra/overrides.yaml`; dirs older than this multirun (a reused
    `hydra.sweep.dir`) are left out. Times are compared on the sweep dir's own filesystem where possible
    (Hydra rewrites `multirun.yaml` when a sweep starts), so a cluster node's clock cannot skew them.
    """
    marker = sweep_dir / "multirun.yaml"
    start = marker.stat().st_mtime if marker.exists() else since
    start -= 2.0  # filesystem timestamp granularity
    jobs = []
    for ov_file in sweep_dir.rglob(".hydra/overrides.yaml"):
        job_dir = ov_file.parent.parent
        if ".submitit" in job_dir.parts or ov_file.stat().st_mtime < start:
            continue
        overrides = [str(o) for o in (OmegaConf.load(ov_file) or [])]
        num = _job_num(job_dir)
        res_path = job_dir / results_file
        if res_path.exists():
            try:
                res = json.loads(res_path.read_text())
                status, error = res.get("status", "ok"), res.get("error")
            except (OSError, ValueError) as e:
                status, error = "failed", f"unreadable {results_file}: {type(e).__name__}: {e}"
        else:
            status, error = "failed", f"no {results_file} (the job was killed or crashed before writing it)"
        jobs.append({"num": num, "dir": job_dir, "overrides": overrides, "status": status,
                     "error": one_line(error) if error else None, "results": res_path})
    jobs.sort(key=lambda j: (j["num"] is None, j["num"] if j["num"] is not None else 0, str(j["dir"])))
    return jobs


def format_failures(jobs: list[dict], sweep_dir: Path) -> str:
    """`moecg: 1 of 2 jobs failed (sweep dir):` then one line per failed job: `#num overrides: error`.

    Overrides every job of the sweep shares are left out, so each line shows what was swept.
    """
    failed = [j for j in jobs if j["status"] != "ok"]
    common = set.intersection(*(set(j["overrides"]) for j in jobs)) if len(jobs) > 1 else set()
    lines = [f"moecg: {len(failed)} of {len(jobs)} jobs failed ({sweep_dir}):"]
    for j in failed:
        ov = " ".join(o for o in j["overrides"] if o not in common) or "(no overrides)"
        num = f"#{j['num']}" if j["num"] is not None else str(j["dir"].name)
        lines.append(f"  {num} {ov}: {j['error']}")
    lines.append(f"full errors and tracebacks: {failed[0]['results'].name} in each failed job's dir")
    return "\n".join(lines)


def _job_num(job_dir: Path) -> int | None:
    try:
        return int(OmegaConf.load(job_dir / ".hydra" / "hydra.yaml").hydra.job.num)
    except Exception:  # noqa: BLE001
        try:
            return int(job_dir.name)
        except ValueError:
            return None
