"""moecg.parallel: expert-parallel decode over torch.distributed (NCCL on GPUs, gloo on CPU).

`init_group` joins the torchrun job and builds megatron-core's expert-parallel group; `shard_experts` keeps each rank's
E/R experts; `parallelize` turns `dropless` / `capacity` into their graph-safe all-to-all variants; `moecg.parallel.job`
runs one job on R ranks (rank 0 writes the results; the first rank that fails writes its error and ends the job).
"""
from moecg.parallel.dispatch import EP_VARIANTS, EPCapacity, EPDropless, parallelize
from moecg.parallel.groups import TORCHRUN_ENV, EPGroup, init_group, torchrun_env
from moecg.parallel.shard import shard_experts

__all__ = ["EP_VARIANTS", "EPCapacity", "EPDropless", "EPGroup", "TORCHRUN_ENV", "init_group", "parallelize",
           "shard_experts", "torchrun_env"]
