"""Expert-parallel ranks: torch.distributed from torchrun's environment, the expert-parallel group from megatron-core.

R = ranks in the expert-parallel group. `init_group` starts the default process group (NCCL on GPUs, gloo on CPU)
and megatron-core's `parallel_state.initialize_model_parallel(expert_model_parallel_size=R)`, whose expert-model-
parallel group carries moecg's all-to-alls. megatron-core builds its groups on gloo as on NCCL (moecg's CPU tests run
it with 2 and 4 gloo processes); only its token dispatchers need CUDA (moecg.parallel.megatron).

One rank (parallel.ep=1 without torchrun) needs no process group: `EPGroup()` is that rank, and every collective below
is the identity there, so the single-process run goes through the same calls.
"""
from __future__ import annotations

import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch

# what torchrun (torch.distributed.run) exports to every worker
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env() -> dict | None:
    """{rank, world_size, local_rank} from torchrun's environment, or None when this process was not launched by it."""
    if not all(k in os.environ for k in TORCHRUN_ENV):
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "local_rank": int(os.environ["LOCAL_RANK"])}


@dataclass
class EPGroup:
    """This process's place among the expert-parallel ranks, and the collectives moecg runs over them."""

    size: int = 1
    rank: int = 0
    backend: str | None = None  # nccl | gloo; None: one rank, no process group
    group: object = None  # the torch.distributed group of the R ranks (megatron-core's expert-model-parallel group)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where collective tensors live

    def experts(self, num_experts: int) -> tuple[int, int]:
        """[lo, hi): the experts this rank holds, E/R consecutive ones (megatron-core's local_expert_indices)."""
        n = num_experts // self.size
        return self.rank * n, (self.rank + 1) * n

    # -- collectives (identity on one rank) ----------------------------------------------------------------
    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, ...]: block i goes to rank i; returns [R, ...] whose block j came from rank j.

        Equal splits only: every shape is fixed by the (padded) token count, so no sizes are read on the host and the
        exchange can be captured in a CUDA graph (NCCL) or replayed by the emulated backend (gloo)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.group)
        return out

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks (counters: each rank counts its own tokens' assignments, so the sum counts each
        assignment once)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)
        return t

    def _reduce(self, values: list[float], op: str) -> list[float]:
        """op: max | mean, over ranks, elementwise (float64 on the collective's device)."""
        if self.size == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        out = t.cpu().tolist()
        return out if op == "max" else [v / self.size for v in out]

    def max_each(self, values: list[float]) -> list[float]:
        """Elementwise max over ranks (a step ends when its slowest rank does); every rank passes as many values."""
        return self._reduce(list(values), "max") if values else list(values)

    def max(self, value: float | None) -> float | None:
        return value if value is None or self.size == 1 else self._reduce([value], "max")[0]

    def mean(self, value: float | None) -> float | None:
        """Mean over ranks: a global rate when every rank contributes the same number of rows and steps."""
        return value if value is None or self.size == 1 else self._reduce([value], "mean")[0]

    def broadcast(self, obj, src: int = 0):
        """rank src's Python object on every rank (e.g. rank 0's job directory)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group, device=self.device)
        return box[0]

    def barrier(self) -> None:
        """Every rank got here (an all-reduce, not dist.barrier: that guesses a device on NCCL)."""
        self.max(0.0)

    def close(self) -> None:
        if self.backend is None:
            return
        import torch.distributed as dist

        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.backend, self.group = None, None


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """This rank's GPU: set_device and NCCL's device_id need an index, which a one-rank job's plan (device "cuda",
    parallel.ep=1 under torchrun) does not give (the H200 run of h200_ep1_stdlib.sh failed there)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", local_rank)
    return device


def init_group(ep: int, backend: str, device: torch.device, timeout_s: float) -> EPGroup:
    """Join the torchrun job (if any) and build the expert-parallel group; the run plan checked every value first.

    Without torchrun's environment this is the single process of parallel.ep=1: no process group."""
    env = torchrun_env()
    if env is None:
        return EPGroup(device=device)
    import torch.distributed as dist

    device = rank_device(device, env["local_rank"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    # megatron-core's import says at length that Transformer Engine, Apex and its FSDP extras are absent: not used here
    logging.getLogger("megatron").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

    # megatron-core's own groups (tp = pp = cp = 1): its expert-model-parallel group is the all-to-all group
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=ep, distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
        create_gloo_process_groups=backend == "gloo")
    group = parallel_state.get_expert_model_parallel_group()
    return EPGroup(size=ep, rank=dist.get_rank(group), backend=backend, group=group, device=device)
