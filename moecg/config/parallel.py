"""`parallel.*`: expert parallelism (one process per rank under torchrun); resolved by moecg.parallel.plan."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ParallelConfig:
    """Read by moecg.parallel.plan.resolve_parallel, which types each value and names the fix."""

    ep: Any = 1  # expert-parallel ranks, one process each: torchrun --nproc-per-node N -m moecg.run parallel.ep=N
    backend: Any = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    timeout_s: Any = 300  # a collective waiting longer fails the job (a rank that died without a word)
