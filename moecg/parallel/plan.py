"""The `parallel.*` part of the run plan: expert-parallel size, backend and this rank, checked before any CUDA work.

Each message names the key and the fix (`ParallelError`, turned into a PlanError by moecg.plan).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moecg.parallel.dispatch import EP_VARIANTS
from moecg.parallel.groups import torchrun_env

BACKENDS = ("auto", "nccl", "gloo")


class ParallelError(ValueError):
    pass


@dataclass(frozen=True)
class ParallelPlan:
    ep: int = 1  # expert-parallel ranks; every rank decodes batch_size rows of its own
    backend: str | None = None  # nccl | gloo; None: one process, no process group
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    timeout_s: float = 300.0  # a collective that waits longer fails the job


def _int(value, key: str, lo: int, example) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ParallelError(f"{key}={value!r}: must be an integer >= {lo} (e.g. {key}={example})")
    return value


def resolve_parallel(p, device: torch.device, num_experts: int, dispatchers, compile_: bool) -> ParallelPlan:
    """p: the `parallel` config node; dispatchers: the run's dispatcher and prefill dispatcher (None: same)."""
    ep = _int(p.ep, "parallel.ep", 1, 2)
    backend = p.backend
    if backend not in BACKENDS:
        raise ParallelError(f"parallel.backend={backend!r}: choose one of {', '.join(BACKENDS)}")
    timeout = p.timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ParallelError(f"parallel.timeout_s={timeout!r}: must be a number of seconds > 0 (e.g. 300)")
    env = torchrun_env()
    launch = f"torchrun --nproc-per-node {ep} -m moecg.run parallel.ep={ep} ..."
    if env is None:
        if ep > 1:
            raise ParallelError(f"parallel.ep={ep} needs {ep} processes, one per rank: launch with `{launch}` "
                                "(no torchrun environment here: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
        if backend != "auto":
            raise ParallelError(f"parallel.backend={backend} only applies under torchrun (parallel.ep > 1): drop it")
        return ParallelPlan(timeout_s=float(timeout))
    world = env["world_size"]
    if world != ep:
        raise ParallelError(f"parallel.ep={ep} but torchrun started {world} processes: every process is one "
                            f"expert-parallel rank, so set parallel.ep={world} or launch `{launch}`")
    if num_experts % ep:
        fits = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
        raise ParallelError(f"parallel.ep={ep} does not divide the model's {num_experts} experts: choose parallel.ep "
                            f"in {fits} (and as many torchrun processes)")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ParallelError("parallel.backend=nccl needs CUDA devices: use parallel.backend=gloo (or auto) on CPU")
    if device.type == "cuda":
        n = torch.cuda.device_count()  # NVML: no CUDA context is created
        if env["local_rank"] >= n:
            raise ParallelError(f"rank {env['rank']} has LOCAL_RANK={env['local_rank']} but only {n} GPUs are visible: "
                                f"launch at most {n} processes per node (torchrun --nproc-per-node {n})")
    if ep > 1:
        for d in dispatchers:
            if d is not None and d.name not in EP_VARIANTS:
                key = "dispatch" if d is dispatchers[0] else "dispatch.prefill"
                use = " or ".join(f"{key}={n}" for n in EP_VARIANTS)
                raise ParallelError(f"{key}={d.name} has no expert-parallel variant: use {use} with parallel.ep={ep}")
        if compile_:
            raise ParallelError(f"capture.compile=true with parallel.ep={ep}: Inductor around the all-to-alls is "
                                "untested; drop capture.compile")
    return ParallelPlan(ep=ep, backend=backend, rank=env["rank"], world_size=world, local_rank=env["local_rank"],
                        timeout_s=float(timeout))
