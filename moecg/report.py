"""What every result carries about where it ran (environment fields), how benchmark scripts write reports, and the
one JSON writer of results and records (`write_json`: strict JSON, atomic)."""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
import transformers

import moecg


_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: mkstemp makes 0600 files, a written record gets the mode open() would give it


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


def strict(obj):
    """obj with every non-finite float (NaN, +-Infinity) as None, through dicts, lists and tuples: what strict JSON
    can hold (json.dumps would write bare NaN, which no JSON parser but Python's reads)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def dumps(obj, **kw) -> str:
    """Strict JSON (null, never NaN/Infinity); objects JSON has no type for (paths, dtypes) as their str."""
    return json.dumps(strict(obj), allow_nan=False, default=str, **kw)


def write_json(path, obj, indent: int | None = 2) -> Path:
    """Write obj as strict JSON, atomically: a temp file in the same directory, then os.replace, so a job killed
    mid-write leaves the old file or the new one, never half of one."""
    path = Path(path)
    text = dumps(obj, indent=indent) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
