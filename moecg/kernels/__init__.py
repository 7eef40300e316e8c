"""moecg.kernels: the fused decode ops, as Triton kernels (CUDA) or their pure-PyTorch references (anywhere).

`get_ops("auto", device)` gives the Triton ops on a CUDA device with Triton installed, else the references;
both modules expose the same functions (see ref.py for what each computes and how it rounds).
Set TRITON_INTERPRET=1 before importing to run the Triton ops on CPU tensors (slow; used by the tests).
"""
from __future__ import annotations

import importlib
import os

from moecg.kernels import ref

__all__ = ["get_ops", "triton_ok", "ref", "OPS_BACKENDS"]

OPS_BACKENDS = ("auto", "triton", "torch")


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_ok(device) -> bool:
    """Triton kernels can run on `device` (CUDA with Triton importable, or any device under TRITON_INTERPRET=1)."""
    if device.type != "cuda" and not _interpret():
        return False
    try:
        importlib.import_module("triton")
    except Exception:  # noqa: BLE001 - a missing or broken Triton simply means the reference path
        return False
    return True


def get_ops(backend: str, device):
    if backend not in OPS_BACKENDS:
        raise ValueError(f"kernel backend {backend!r}: choose one of {OPS_BACKENDS}")
    if backend == "torch" or (backend == "auto" and not triton_ok(device)):
        return ref
    if not triton_ok(device):
        raise RuntimeError(f"Triton kernels requested on {device} but Triton cannot run there: install triton "
                           "(CUDA), set TRITON_INTERPRET=1 (CPU, slow), or use the torch backend")
    from moecg.kernels import triton_ops
    return triton_ops
