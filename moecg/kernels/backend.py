"""Which backend runs the fused decode ops: the Triton kernels (CUDA, or any device under Triton's CPU interpreter) or
their PyTorch references. Nothing here imports Triton, so moecg imports on a machine without it.
"""
from __future__ import annotations

import importlib
import os

OPS_BACKENDS = ("auto", "triton", "torch")
# True inside moecg.kernels.sass.sm90_dry_run(): the Triton ops are chosen on any device and launched as on a Hopper GPU
# (PDL on), every launch recorded by launch.dry_run and none run, so a CPU machine sees what a step compiles to.
SM90_DRY = False


def interpreting() -> bool:
    """TRITON_INTERPRET=1 (set before importing Triton): the Triton ops run on CPU tensors in its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_ok(device) -> bool:
    """Triton kernels can run on `device` (CUDA with Triton importable, or any device under TRITON_INTERPRET=1)."""
    if device.type != "cuda" and not interpreting() and not SM90_DRY:
        return False
    try:
        importlib.import_module("triton")
    except Exception:  # noqa: BLE001 - a missing or broken Triton simply means the reference path
        return False
    return True
