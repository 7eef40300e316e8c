"""`capture.*`: how decode steps are captured and which kernels run them, checked against the strategy and device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moecg.capture.buckets import DEFAULT_BUCKETS, validate_buckets
from moecg.capture.plan import COMPILE_MODES, KERNELS, StrategyError, StrategySpec, validate_capture
from moecg.config.readers import PlanError, as_bool, as_choice, as_int

BACKENDS = ("auto", "cuda", "emulate", "none")
KERNEL_BACKENDS = ("auto", "triton", "torch")


@dataclass
class CaptureConfig:
    """`capture.*` (values typed by resolve(), see moecg.config.readers)."""

    buckets: Any = field(default_factory=lambda: list(DEFAULT_BUCKETS))  # ascending batch sizes a graph is captured for
    backend: Any = "auto"  # auto (cuda on a GPU, none on CPU) | cuda | emulate (CPU stand-in for tests) | none
    warmup: Any = 3  # int >= 1: eager runs before each capture
    compile: Any = False  # experimental: Inductor-compile the captured pieces (fused kernels) before capture
    compile_mode: Any = "default"  # default | max-autotune-no-cudagraphs (never reduce-overhead: moecg owns the graphs)
    # hf: decode runs HF's modules | fused: moecg.fast's fused decode step (strategy full/capacity/eager)
    kernels: Any = "hf"
    kernel_backend: Any = "auto"  # kernels=fused: auto (Triton on CUDA, PyTorch elsewhere) | triton | torch

    def resolve(self, spec: StrategySpec, device: torch.device) -> CapturePlan:
        try:
            buckets = validate_buckets(self.buckets)
        except (ValueError, TypeError) as e:
            raise PlanError(str(e)) from None
        backend = as_choice(self.backend, "capture.backend", BACKENDS)
        if backend == "cuda" and device.type != "cuda":
            raise PlanError("capture.backend=cuda needs a CUDA device: use capture.backend=auto (or emulate on CPU)")
        warmup = as_int(self.warmup, "capture.warmup", 1, 3)
        compile_ = as_bool(self.compile, "capture.compile")
        compile_mode = as_choice(self.compile_mode, "capture.compile_mode", COMPILE_MODES)
        if not compile_ and compile_mode != "default":
            raise PlanError(f"capture.compile_mode={compile_mode} only applies with capture.compile=true")
        kernels = as_choice(self.kernels, "capture.kernels", KERNELS)
        kernel_backend = as_choice(self.kernel_backend, "capture.kernel_backend", KERNEL_BACKENDS)
        if kernels == "hf" and kernel_backend != "auto":
            raise PlanError(f"capture.kernel_backend={kernel_backend} only applies with capture.kernels=fused")
        try:
            validate_capture(spec, kernels, compile_, compile_mode)  # the same check Capture makes
        except StrategyError as e:
            raise PlanError(str(e)) from None
        if kernels == "fused" and kernel_backend == "triton" and device.type != "cuda":
            raise PlanError("capture.kernel_backend=triton needs CUDA: use capture.kernel_backend=auto on CPU")
        if spec.scope == "eager" and compile_:
            raise PlanError("capture.compile=true compiles the captured pieces, and strategy=eager captures none: "
                            "pick a graph strategy or drop capture.compile")
        return CapturePlan(buckets, backend, warmup, compile_, compile_mode, kernels, kernel_backend)


@dataclass(frozen=True)
class CapturePlan:
    buckets: tuple[int, ...]
    backend: str  # as configured; RunPlan.captures says whether graphs will be made
    warmup: int
    compile: bool
    compile_mode: str
    kernels: str  # hf | fused
    kernel_backend: str
