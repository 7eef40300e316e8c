"""`capture.*`: how decode steps are captured and which kernels run them, checked against the strategy and device.

The last five keys change measured numbers and are written to results.json: `pdl` (programmatic dependent launch
of every Triton kernel moecg launches: the fused step's and the Triton MoE dispatchers'), and four switches of the
fused step (capture.kernels=fused, refused without it): `preload` (its kernels' constant weights loaded before their
PDL wait), `overlap_shared` (the shared expert on a second CUDA stream), `fuse_router` (residual add + norm + router
as one kernel), `precompile` (its Triton kernels compiled on a thread pool before the first warmup).
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
PDL_MODES = ("auto", 0, 1, 2)
FUSED_ONLY = ("preload", "overlap_shared", "fuse_router", "precompile")  # switches of the fused step: refused off it


@dataclass
class CaptureConfig:
    """`capture.*` (values typed by resolve(), see moecg.config.readers)."""

    buckets: Any = field(default_factory=lambda: list(DEFAULT_BUCKETS))  # ascending batch sizes a graph is captured for
    backend: Any = "auto"  # auto (cuda on a GPU, none on CPU) | cuda | emulate (CPU stand-in for tests) | none
    warmup: Any = "auto"  # auto (0 after the fused step's dry pass, else 3) | int 1-3: eager runs before each capture
    compile: Any = False  # experimental: Inductor-compile the captured pieces (fused kernels) before capture
    compile_mode: Any = "default"  # default | max-autotune-no-cudagraphs (never reduce-overhead: moecg owns the graphs)
    # hf: decode runs HF's modules | fused: moecg.fast's fused decode step (strategy full/capacity/eager)
    kernels: Any = "hf"
    kernel_backend: Any = "auto"  # kernels=fused: auto (Triton on CUDA, PyTorch elsewhere) | triton | torch
    # programmatic dependent launch of the Triton kernels: auto (2 on sm90+ where Triton has it, else 0) | 0 off |
    # 1 wait only (the next kernel launches as this one's blocks exit) | 2 also trigger the next launch at once
    pdl: Any = "auto"
    # kernels=fused on Triton: constant weights (GEMVs' first K step, router rows, norms, the MoE down kernel's first
    # tile at batch 1) loaded before each kernel's PDL wait, beside the kernel before it; the same bits either way
    preload: Any = True
    overlap_shared: Any = True  # kernels=fused on CUDA: the shared expert on a second stream beside the routed experts
    # kernels=fused: a router that is its own linear (with or without a bias) runs with the residual add and norm as
    # one kernel
    fuse_router: Any = True
    # kernels=fused on Triton: compile every bucket's kernels on a thread pool before the first warmup
    precompile: Any = True

    def resolve(self, spec: StrategySpec, device: torch.device) -> CapturePlan:
        try:
            buckets = validate_buckets(self.buckets)
        except (ValueError, TypeError) as e:
            raise PlanError(str(e)) from None
        backend = as_choice(self.backend, "capture.backend", BACKENDS)
        if backend == "cuda" and device.type != "cuda":
            raise PlanError("capture.backend=cuda needs a CUDA device: use capture.backend=auto (or emulate on CPU)")
        try:
            warmup = "auto" if self.warmup == "auto" else as_int(self.warmup, "capture.warmup", 1, 3)
        except PlanError as e:
            raise PlanError(f"{e}, or capture.warmup=auto") from None
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
        if isinstance(self.pdl, bool) or self.pdl not in PDL_MODES:
            raise PlanError(f"capture.pdl={self.pdl!r}: choose one of {', '.join(map(str, PDL_MODES))}")
        switches = {k: as_bool(getattr(self, k), f"capture.{k}") for k in FUSED_ONLY}
        for k, v in switches.items():
            if kernels != "fused" and v != getattr(CaptureConfig, k):
                raise PlanError(f"capture.{k}={str(v).lower()} only applies with capture.kernels=fused (the fused "
                                f"step's switch): drop it or add capture.kernels=fused")
        return CapturePlan(buckets, backend, warmup, compile_, compile_mode, kernels, kernel_backend,
                           None if self.pdl == "auto" else int(self.pdl), **switches)


@dataclass(frozen=True)
class CapturePlan:
    buckets: tuple[int, ...]
    backend: str  # as configured; RunPlan.captures says whether graphs will be made
    warmup: int | str  # "auto": Capture decides (WARMUP_DRY after the dry pass, else WARMUP_HF)
    compile: bool
    compile_mode: str
    kernels: str  # hf | fused
    kernel_backend: str
    pdl: int | None  # None: auto
    preload: bool
    overlap_shared: bool
    fuse_router: bool
    precompile: bool

    def record(self) -> dict:
        """The knobs results.json records (the other capture fields come from Capture.stats(): what took effect)."""
        return {"pdl": "auto" if self.pdl is None else self.pdl, "preload": self.preload,
                "overlap_shared": self.overlap_shared, "fuse_router": self.fuse_router, "precompile": self.precompile}
