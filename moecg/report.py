"""What every result carries about where it ran (environment fields), and how benchmark scripts write reports."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch
import transformers

import moecg
from moecg.schema import write_json


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def env_fields() -> dict:
    # MOECG_GIT_SHA names the commit where the tree has no .git (e.g. a copy shipped to a GPU machine)
    sha = os.environ.get("MOECG_GIT_SHA")
    if not sha:
        try:
            sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
        except Exception:  # noqa: BLE001 - no git is fine
            sha = None
    return {
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "moecg_version": moecg.__version__, "git_sha": sha,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_report(table: str, rows, args, out: str | None, json_path: str | None) -> None:
    """Print a benchmark's markdown table; optionally write it and the raw rows (with the environment)."""
    print(table)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(table + "\n")
    if json_path:
        write_json(json_path, {"env": env_fields(), "args": vars(args), "rows": rows})
