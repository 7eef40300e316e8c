"""One `python -m moecg.run` job on R ranks (torchrun): who writes what, and how a failure on any rank ends the job.

Rank 0 writes results.json, the summary and the logger; the others stay quiet. A rank that raises cannot wait for
the others (they may be blocked in an all-to-all that it will never join), so it ends the job itself:
  1. it claims `.moecg_failed` in rank 0's job directory (O_EXCL: the first failing rank wins) and writes the failed
     results.json with its own error, phase and traceback, the error prefixed `rank r of R:`;
  2. it prints that one line to stderr and leaves at once with exit code 1 (os._exit: no interpreter teardown that
     could wait on a collective).
The others then fail too: gloo raises in the pending collective as soon as the peer is gone, and torchrun stops
every worker once one exits non-zero (NCCL waits would otherwise last until parallel.timeout_s). A rank that fails
after the first one finds the claim taken and only says so. So the job exits non-zero with the first failure's
error in results.json, and rank 0 never writes `ok` unless every rank reached the final barrier.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from moecg.parallel.groups import EPGroup, init_group, torchrun_env

CLAIM = ".moecg_failed"


class RankJob:
    def __init__(self, out_dir: Path, rank: int = 0, world: int = 1):
        self.out_dir, self.rank, self.world = Path(out_dir), rank, world
        self.group: EPGroup | None = None

    @classmethod
    def from_env(cls, out_dir) -> "RankJob":
        env = torchrun_env()
        return cls(out_dir) if env is None else cls(out_dir, env["rank"], env["world_size"])

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def start(self, plan, phases) -> EPGroup:
        """This rank's expert-parallel group (the identity group without torchrun), rank 0's job dir shared."""
        if torchrun_env() is None:
            self.group = EPGroup(device=plan.device)
            return self.group
        p = plan.parallel
        with phases("parallel", f"{p.backend} process group of {p.world_size}, megatron-core expert-parallel group "
                                f"of {p.ep}"):
            self.group = init_group(p.ep, p.backend, plan.device, p.timeout_s)
            shared = Path(self.group.broadcast(str(self.out_dir)))
        if shared != self.out_dir:
            _drop_stray(self.out_dir)  # Hydra's clock gave this rank another second: rank 0's directory is the job's
            self.out_dir = shared
        return self.group

    def barrier(self) -> None:
        if self.group is not None:
            self.group.barrier()

    def fail(self, write_failure, e: BaseException, results_name: str) -> None:
        """End the job from this rank (module docstring); write_failure(e, path, prefix) writes the failed record."""
        try:
            fd = os.open(self.out_dir / CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            first = (self.out_dir / CLAIM).read_text().strip() or "another rank"
            print(f"moecg: rank {self.rank} of {self.world} stopped ({type(e).__name__}); {first} failed first: see "
                  f"{self.out_dir / results_name}", file=sys.stderr)
        else:
            with os.fdopen(fd, "w") as f:
                f.write(f"rank {self.rank}")
            write_failure(e, self.out_dir / results_name, f"rank {self.rank} of {self.world}: ")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def _drop_stray(path: Path) -> None:
    """Remove a job dir Hydra made for this rank alone, if it holds nothing but Hydra's own files."""
    if path.is_dir() and all(c.name == ".hydra" or c.suffix == ".log" for c in path.iterdir()):
        shutil.rmtree(path, ignore_errors=True)
