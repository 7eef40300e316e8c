"""The root of moecg's config: the run's own keys and its groups. conf/config.yaml lists the groups' defaults in
override order (this schema first); an experiment file (`# @package _global_`) may override any of them."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import MISSING

from moecg.config.capture import CaptureConfig
from moecg.config.measure import MeasureConfig
from moecg.config.model import ModelConfig
from moecg.config.parallel import ParallelConfig
from moecg.config.readers import unknown_key
from moecg.config.strategy import StrategyConfig


@dataclass
class RunConfig:
    """The root's own keys (values typed by moecg.plan, see moecg.config.readers)."""

    # real rows (on each rank with parallel.ep > 1); padded up to the next capture bucket with graphs (workload=fixed)
    batch_size: Any = 4
    prompt_len: Any = 16  # workload=fixed
    new_tokens: Any = 32  # workload=fixed: tokens generated per row, the first by the prefill
    seed: Any = 0  # weights, router skew and random prompts
    prompts: Any = "random"  # random | heldout (byte-level stdlib models) | file (prompt_file: one line of ids per row)
    prompt_file: Any = None  # prompts=file: a text file of token ids, one line per row
    max_cache_len: Any = None  # null: prompt_len + new_tokens (serving: the longest request's prompt_len + output_len)
    # null = one forward; N: the prompt in forwards of N tokens on the same cache (workload=fixed, dropless prefill)
    prefill_chunk: Any = None
    device: Any = "auto"  # auto | cpu | cuda
    results_file: Any = "results.json"  # in the job's directory
    # auto: each sweep job in its own process on a GPU (a failed capture poisons CUDA) | true | false
    isolate: Any = "auto"


@dataclass
class RootConfig(RunConfig):
    """The whole config: the run's keys and one node per group."""

    model: ModelConfig = field(default_factory=ModelConfig)  # model=<preset> | local (moecg.config.model)
    dispatch: Any = MISSING  # dispatch=<name>: a dispatcher's own options (moecg.config.dispatch)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)  # strategy=<name> (moecg.config.strategy)
    workload: Any = MISSING  # workload=fixed | poisson | trace (moecg.config.workload)
    logger: Any = MISSING  # logger=none | wandb (conf/logger/, read by moecg.logger)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)


GROUPS = tuple(f.name for f in fields(RootConfig) if f.name not in {g.name for g in fields(RunConfig)})
HYDRA_KEYS = ("hydra",)  # present when a caller composes with return_hydra_config=True


def read_run(cfg) -> RunConfig:
    """The run's own keys from the whole config; a root key the schema does not declare (`+batchsize=4`, which
    Hydra lets through) is refused with the nearest one it does."""
    known = [f.name for f in fields(RootConfig)]
    for k in cfg.keys():
        if k not in known and k not in HYDRA_KEYS:
            raise unknown_key(str(k), None, known)
    return RunConfig(**{f.name: cfg[f.name] for f in fields(RunConfig) if f.name in cfg})
