"""moecg.data: byte-level text from the Python standard library's own source, split by file path.

Every machine that runs moecg has a stdlib, so training needs no download: `train_bytes()` reads the local
interpreter's `*.py` files (vocab 256, one token per byte). The split is a hash of each file's path relative
to the stdlib root, so a path falls on the same side on every Python version, and files that exist on only
one version cannot leak a held-out path into training.

The stdlib's text still differs between versions, so evaluation never reads the local held-out files: it reads
`heldout.txt`, a fixed 300 KB subset of held-out files shipped with the package (written once from CPython
3.11.7 by `python -c 'import moecg.data as d; d.write_heldout()'`; `heldout.json` lists its 33 files), so every
machine scores the same bytes.
"""
from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from pathlib import Path

import torch

__all__ = ["HELDOUT_PATH", "HELDOUT_PERCENT", "split_of", "stdlib_root", "stdlib_files", "train_bytes",
           "heldout_bytes", "heldout_tensor", "split_sizes", "write_heldout"]

DATA_DIR = Path(__file__).resolve().parent
HELDOUT_PATH = DATA_DIR / "heldout.txt"
MANIFEST_PATH = DATA_DIR / "heldout.json"
HELDOUT_PERCENT = 10
# Third-party packages are not the stdlib, and the regression suite `test/` (17 MB on 3.11) is mostly
# fixtures: bad encodings, deliberately broken syntax, generated tables.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
EXCLUDED_TOP = frozenset({"test"})


def _path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")


def split_of(rel: str) -> str:
    """'heldout' or 'train' for a path relative to the stdlib root, in POSIX form (e.g. 'json/decoder.py')."""
    return "heldout" if _path_hash(rel) % 100 < HELDOUT_PERCENT else "train"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(split: str, root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative POSIX path, file) for the local stdlib's `*.py` files of `split`, sorted by path."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r}: choose 'train' or 'heldout'")
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for f in root.rglob("*.py"):
        parts = f.relative_to(root).parts
        if EXCLUDED_DIRS.intersection(parts) or (len(parts) > 1 and parts[0] in EXCLUDED_TOP):
            continue
        rel = "/".join(parts)
        if split_of(rel) == split and f.is_file():
            out.append((rel, f))
    return sorted(out)


def _join(files) -> bytes:
    # Files back to back, each ending in one newline: the model sees file boundaries as in a `cat`.
    chunks = []
    for _, f in files:
        b = f.read_bytes()
        chunks.append(b if b.endswith(b"\n") else b + b"\n")
    return b"".join(chunks)


def train_bytes(root: Path | None = None) -> bytes:
    """The local stdlib's training split, concatenated (~13 MB on Python 3.11)."""
    data = _join(stdlib_files("train", root))
    if len(data) < 1_000_000:
        raise RuntimeError(f"only {len(data)} bytes of stdlib source under {root or stdlib_root()}: this "
                           "interpreter ships without its *.py sources; use a full CPython install")
    return data


def heldout_bytes() -> bytes:
    """The shipped held-out text (identical on every machine)."""
    if not HELDOUT_PATH.exists():
        raise FileNotFoundError(f"{HELDOUT_PATH} is missing: reinstall moecg (it is package data)")
    return HELDOUT_PATH.read_bytes()


def heldout_tensor(max_bytes: int | None = None) -> torch.Tensor:
    """[N] uint8 tensor of the shipped held-out text (first `max_bytes` bytes if given)."""
    data = heldout_bytes()[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split_sizes(root: Path | None = None) -> dict:
    """Bytes and files in each set: the local train / held-out splits and the shipped held-out text."""
    train, held = stdlib_files("train", root), stdlib_files("heldout", root)
    size = lambda files: sum(f.stat().st_size for _, f in files)  # noqa: E731
    manifest = json.loads(MANIFEST_PATH.read_text()) if MANIFEST_PATH.exists() else {}
    return {
        "python": platform.python_version(),
        "train_bytes": size(train), "train_files": len(train),
        "heldout_local_bytes": size(held), "heldout_local_files": len(held),
        "heldout_shipped_bytes": HELDOUT_PATH.stat().st_size if HELDOUT_PATH.exists() else 0,
        "heldout_shipped_files": len(manifest.get("files", [])),
    }


def write_heldout(max_total: int = 300_000, max_file: int = 40_000) -> dict:
    """Write `heldout.txt` + `heldout.json` from the local held-out split. Done once; rerun only on purpose.

    Files are taken in order of their path hash (a fixed pseudo-random order, not alphabetical, so the text
    spans many packages), skipping files over `max_file` bytes (one large module would dominate) and files
    that are not UTF-8, until `max_total` bytes.
    """
    picked, total = [], 0
    for rel, f in sorted(stdlib_files("heldout"), key=lambda rf: _path_hash(rf[0])):
        b = f.read_bytes()
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            continue
        n = len(b) + (not b.endswith(b"\n"))
        if n > max_file or total + n > max_total:
            continue
        picked.append((rel, f))
        total += n
    data = _join(picked)
    HELDOUT_PATH.write_bytes(data)
    manifest = {
        "source": f"CPython {platform.python_version()} stdlib, held-out split (sha256(path) % 100 < "
                  f"{HELDOUT_PERCENT})",
        "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
        "files": [rel for rel, _ in picked],
    }
    MANIFEST_PATH.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest

