"""How a test file runs its Triton-interpreter script (tests/triton_interp_*.py, capacity_interp_check.py): in a
subprocess under TRITON_INTERPRET=1 (Triton reads it at import, so never in pytest's own process), from this folder,
with it on PYTHONPATH (the scripts import interp_common and model_terms); passing when the script exits 0 and printed
its marker. The assertion shows the ends of its output.

A test names its script on its `interp` marker (`@pytest.mark.interp(script, *args, timeout=...)`) and calls
`run_marked(request)`. When collection ends, tests/conftest.py starts the collected tests' scripts, one after
another in a background thread, and moves those tests to the end: the scripts run on a second core while the
rest of the suite runs, and each test then waits for its script's result."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

HERE = Path(__file__).parent
HAS_TRITON = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode == 0
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
TIMEOUT = 600  # s, a script's run unless its marker says otherwise


class _Job:
    """One script run: started by the background thread, waited for by its test."""

    def __init__(self, script: str, args: tuple, timeout: int):
        self.script, self.args, self.timeout = script, args, timeout
        self.done = threading.Event()
        self.proc = self.result = None

    def run(self, threads: int | None = None) -> None:
        """threads: the script's torch threads (OMP_NUM_THREADS); None: torch's default."""
        env = {**os.environ, "TRITON_INTERPRET": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p),
               **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        try:
            self.proc = subprocess.Popen([sys.executable, str(HERE / self.script), *self.args], env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(HERE))
            try:
                out, err = self.proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, err = self.proc.communicate()
                err += f"\n{self.script}: timed out after {self.timeout} s"
            self.result = (self.proc.returncode, out, err)
        except Exception as e:  # noqa: BLE001 - reported by the test that waits for it
            self.result = (None, "", repr(e))
        finally:
            self.done.set()


_JOBS: dict[tuple, _Job] = {}


def _key(script: str, args: tuple) -> tuple:
    return (script, tuple(args))


def prestart(specs) -> None:
    """Start the scripts of `specs` ((script, args, timeout) each, in order) one after another in a daemon thread."""
    if not HAS_TRITON:
        return
    jobs = []
    for script, args, timeout in specs:
        key = _key(script, args)
        if key not in _JOBS:  # once per script and arguments
            _JOBS[key] = _Job(script, tuple(args), timeout)
            jobs.append(_JOBS[key])
    if jobs:
        # one torch thread: the suite's own process keeps its threads on the cores beside it
        threading.Thread(target=lambda: [j.run(threads=1) for j in jobs], daemon=True, name="interp").start()


def stop() -> None:
    """Kill a script still running when the test run ends (an interrupted or -x run)."""
    for j in _JOBS.values():
        if j.proc is not None and j.proc.poll() is None:
            j.proc.kill()


def run_interp(script: str, *args: str, timeout: int = TIMEOUT, marker: str = "ALL OK") -> str:
    """Run tests/<script> with `args` under the interpreter (or wait for its run started by prestart); returns its
    stdout."""
    job = _JOBS.get(_key(script, args))
    if job is None:
        job = _Job(script, args, timeout)
        job.run()
    job.done.wait()
    code, out, err = job.result
    assert code == 0 and marker in out, out[-3000:] + err[-4000:]
    return out


def marked(item) -> tuple | None:
    """(script, args, timeout) of a test item's interp marker, or None."""
    m = item.get_closest_marker("interp")
    return None if m is None else (m.args[0], tuple(m.args[1:]), m.kwargs.get("timeout", TIMEOUT))


def run_marked(request) -> str:
    """Run (or wait for) the script the test's interp marker names."""
    script, args, timeout = marked(request.node)
    return run_interp(script, *args, timeout=timeout)
