"""`torchrun ... tests/ep_failing_rank.py RANK CALLS [moecg.run overrides]`: moecg.run in which rank RANK raises inside
its expert-parallel dispatch at call CALLS (so the other ranks are waiting in an all-to-all), for test_parallel."""
import os
import runpy
import sys

from moecg.parallel.dispatch import EPCapacity, EPDropless

rank, calls = int(sys.argv[1]), int(sys.argv[2])
sys.argv = [sys.argv[0], *sys.argv[3:]]
if int(os.environ["RANK"]) == rank:
    seen = [0]

    def failing(orig):
        def forward(self, *a, **k):
            seen[0] += 1
            if seen[0] == calls:
                raise RuntimeError(f"injected failure on rank {rank} at expert-parallel call {calls}")
            return orig(self, *a, **k)
        return forward

    EPDropless.forward = failing(EPDropless.forward)
    EPCapacity.forward = failing(EPCapacity.forward)

runpy.run_module("moecg.run", run_name="__main__", alter_sys=True)  # as `python -m moecg.run` (Hydra finds conf/)
