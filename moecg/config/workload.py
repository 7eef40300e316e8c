"""`workload=fixed | poisson | trace`: the requests a run decodes (resolved by moecg.workload.resolve_workload).

`fixed` reads the root's batch_size, prompt_len and new_tokens; the serving workloads are served on
moecg.ragged.RaggedEngine (moecg.serving) in real time, after one warm request. batch_size, prompt_len, new_tokens
and measure.repeats, skip_steps, eager_baseline belong to workload=fixed; measure.fidelity compares the first
measure.fidelity_rows requests with each decoded alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the keys every serving workload shares, one default each
MAX_BATCH = 8  # requests decoded at once at most; admission first come, first served
PREFILL_TOKENS = 8192  # admissions prefill together, right-padded, up to this many tokens per forward (0: one by one)
SEED = 0  # arrivals, lengths and prompt ids
ANCHOR = False  # also serve the same requests with transformers' continuous batching (anchor_* fields)


@dataclass
class FixedWorkload:
    """Today's batch (the default): batch_size rows of prompt_len tokens, new_tokens each, started together."""

    name: Any = "fixed"


@dataclass
class PoissonWorkload:
    """Requests arrive as a seeded Poisson process: `python -m moecg.run workload=poisson workload.rate=8`.
    Lengths: an integer, [low, high] (uniform, inclusive) or {choices: [16, 64, 256]}."""

    name: Any = "poisson"
    rate: Any = 4.0  # mean arrivals per second
    n_requests: Any = 32
    prompt_len: Any = field(default_factory=lambda: [16, 64])  # tokens per prompt
    output_len: Any = field(default_factory=lambda: [16, 64])  # tokens generated per request (the first by its prefill)
    max_batch: Any = MAX_BATCH
    prefill_tokens: Any = PREFILL_TOKENS
    seed: Any = SEED
    anchor: Any = ANCHOR


@dataclass
class TraceWorkload:
    """Requests from a file: a .jsonl with one object per line, {"arrival_s": 0.25, "prompt_len": 32,
    "output_len": 16}, or a .csv with the header arrival_s,prompt_len,output_len; arrival_s: seconds from the
    start of serving, ascending."""

    name: Any = "trace"
    file: Any = None  # null: the sample shipped with moecg (moecg/data/sample_trace.jsonl)
    max_batch: Any = MAX_BATCH
    prefill_tokens: Any = PREFILL_TOKENS
    seed: Any = SEED  # prompt ids
    anchor: Any = ANCHOR


WORKLOADS = {"fixed": FixedWorkload, "poisson": PoissonWorkload, "trace": TraceWorkload}
