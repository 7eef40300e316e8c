"""`measure.*`: how a run is timed, what it is compared with, and the bandwidths its floors use."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moecg.config.model import ModelPlan
from moecg.config.readers import PlanError, as_bool, as_float, as_int
from moecg.floor import device_bandwidth_gbps, device_nvlink_gbps


@dataclass
class MeasureConfig:
    """`measure.*` (values typed by resolve(), see moecg.config.readers)."""

    repeats: Any = 3  # int >= 1: timed generate() calls after one untimed warm call
    skip_steps: Any = 2  # int >= 0: first decode steps of each repeat left out of the latency stats
    eager_baseline: Any = True  # time strategy=eager with the same dispatch in the same run -> speedup_vs_eager
    fidelity: Any = True  # greedy agreement and logit diff vs dropless eager
    # int >= 0: rows whose logits are kept for max_logit_diff_vs_eager (serving: requests decoded alone)
    fidelity_rows: Any = 8
    # auto: the measured value for this device (moecg.floor), null where unknown (CPU); or GB/s
    hbm_bandwidth_gbps: Any = "auto"
    # parallel.ep > 1: per direction, for the all-to-all floor; auto: moecg.floor's table
    nvlink_bandwidth_gbps: Any = "auto"
    heldout_bpb: Any = "auto"  # auto: on models with a shipped held-out set (byte-level) | true | false
    heldout_bytes: Any = 16384  # int >= 2: bytes of held-out text scored

    def resolve(self, device: torch.device, model: ModelPlan, new_tokens: int | None, ep: int = 1) -> MeasurePlan:
        """new_tokens: the fixed batch's (None when serving: skip_steps does not apply)."""
        bw = self.hbm_bandwidth_gbps
        if bw in (None, "auto"):
            bw, source = device_bandwidth_gbps(device)
        else:
            bw, source = as_float(bw, "measure.hbm_bandwidth_gbps", 0.0, strict=True, example=4300), "config"
        nvl = self.nvlink_bandwidth_gbps
        if nvl in (None, "auto"):
            nvl, nvl_source = device_nvlink_gbps(device) if ep > 1 else (None, "unknown")
        elif ep == 1:
            raise PlanError(f"measure.nvlink_bandwidth_gbps={nvl} prices the all-to-all of parallel.ep > 1, and this run "
                            "has parallel.ep=1 (no exchange): drop it")
        else:
            nvl, nvl_source = as_float(nvl, "measure.nvlink_bandwidth_gbps", 0.0, strict=True, example=450), "config"
        want = self.heldout_bpb
        byte_level = model.config.vocab_size == 256
        if want == "auto":
            heldout = byte_level
        else:
            heldout = as_bool(want, "measure.heldout_bpb")
            if heldout and not byte_level:
                raise PlanError(f"measure.heldout_bpb=true needs a byte-level model (vocab_size 256; this one has "
                                f"{model.config.vocab_size}): use a *_stdlib model or measure.heldout_bpb=auto")
        repeats = as_int(self.repeats, "measure.repeats", 1, 3)
        skip = as_int(self.skip_steps, "measure.skip_steps", 0, 2)
        if new_tokens is not None and skip >= new_tokens - 1:
            # the prefill makes the first token: new_tokens - 1 decode steps, the first skip_steps of them untimed
            raise PlanError(f"measure.skip_steps={skip} leaves none of the {new_tokens - 1} decode steps to time "
                            f"(new_tokens={new_tokens}, the first token by the prefill): raise new_tokens to at least "
                            f"{skip + 2} or lower measure.skip_steps")
        return MeasurePlan(
            repeats=repeats, skip_steps=skip, eager_baseline=as_bool(self.eager_baseline, "measure.eager_baseline"),
            fidelity=as_bool(self.fidelity, "measure.fidelity"),
            fidelity_rows=as_int(self.fidelity_rows, "measure.fidelity_rows", 0, 8),
            hbm_bandwidth_gbps=bw, bandwidth_source=source, nvlink_bandwidth_gbps=nvl, nvlink_source=nvl_source,
            heldout_bpb=heldout, heldout_bytes=as_int(self.heldout_bytes, "measure.heldout_bytes", 2, 16384))


@dataclass(frozen=True)
class MeasurePlan:
    repeats: int
    skip_steps: int
    eager_baseline: bool
    fidelity: bool
    fidelity_rows: int
    hbm_bandwidth_gbps: float | None  # None: unknown for this device (no floor)
    bandwidth_source: str  # "config" | "device table" | "unknown"
    nvlink_bandwidth_gbps: float | None  # per direction, for the all-to-all floor (parallel.ep > 1); None: unknown
    nvlink_source: str  # "config" | "device table" | "unknown"
    heldout_bpb: bool
    heldout_bytes: int
