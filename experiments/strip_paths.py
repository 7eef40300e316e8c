"""Remove this machine's paths from committed results (Hydra's .hydra/ files record the working directory; benchmark
JSONs record their --out/--json arguments).

    python experiments/strip_paths.py experiments/results      # rewrites files in place, prints what changed

The repository root becomes `.`; any other absolute path under /root, /tmp, /work, /home or /opt keeps only its last
component (`<abs>/name`), so a reader still sees which file was meant.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
OTHER = re.compile(r"/(?:root|tmp|work|home|opt)(?:/[^\s\"',:\]\}]+)+")
TEXT = {".json", ".yaml", ".yml", ".md", ".log", ".txt", ".csv"}


def strip(text: str) -> str:
    text = text.replace(ROOT, ".")
    return OTHER.sub(lambda m: "<abs>/" + m.group(0).rstrip("/").rsplit("/", 1)[-1], text)


def main(paths) -> int:
    changed = 0
    for top in paths:
        for f in sorted(Path(top).rglob("*")):
            if not f.is_file() or f.suffix not in TEXT:
                continue
            old = f.read_text(errors="surrogateescape")
            new = strip(old)
            if new != old:
                f.write_text(new, errors="surrogateescape")
                changed += 1
                print(f"stripped {f}")
    print(f"{changed} files changed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["experiments/results"]))
