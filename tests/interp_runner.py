"""How a test file runs its Triton-interpreter script (tests/triton_interp_*.py, capacity_interp_check.py): in a
subprocess under TRITON_INTERPRET=1 (Triton reads it at import, so never in pytest's own process), from this folder,
with it on PYTHONPATH (the scripts import interp_common and model_terms); passing when the script exits 0 and printed
its marker. The assertion shows the ends of its output."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
HAS_TRITON = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode == 0
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def run_interp(script: str, *args: str, timeout: int = 600, marker: str = "ALL OK") -> str:
    """Run tests/<script> with `args` under the interpreter; returns its stdout."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)}
    r = subprocess.run([sys.executable, str(HERE / script), *args], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=str(HERE))
    assert r.returncode == 0 and marker in r.stdout, r.stdout[-3000:] + r.stderr[-4000:]
    return r.stdout
