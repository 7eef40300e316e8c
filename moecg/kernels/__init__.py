"""moecg.kernels: the fused decode ops, as Triton kernels (CUDA) or their pure-PyTorch references (anywhere).

`get_ops("auto", device)` gives the Triton ops on a CUDA device with Triton installed, else the references;
both modules expose the same functions (OPS; see ref.py for what each computes and how it rounds).
Set TRITON_INTERPRET=1 before importing to run the Triton ops on CPU tensors (slow; used by the tests).

Files, by job: ref.py (the references), triton_ops.py (the Triton ops, gathered from norm_rope, attention, mla,
routers, gemv, moe and capacity), launch.py (PDL, dry run, precompile), tiles.py (tile tables), backend.py (which one runs).
"""
from __future__ import annotations

from moecg.kernels import ref
from moecg.kernels.backend import OPS_BACKENDS, interpreting, triton_ok

__all__ = ["get_ops", "triton_ok", "interpreting", "ref", "OPS", "OPS_BACKENDS"]

# The op functions both backends expose, with the same signatures (a backend may take extra tuning keywords)
OPS = ("add_rmsnorm", "rope_cache", "attn_decode", "mla_rope_cache", "mla_attn_decode", "route", "norm_route",
       "route_sigmoid_group", "route_topk_softmax", "route_softmax_group", "linear", "head_linear", "router_logits",
       "silu_mul",
       "moe_experts",
       "capacity_experts")


def get_ops(backend: str, device):
    if backend not in OPS_BACKENDS:
        raise ValueError(f"kernel backend {backend!r}: choose one of {OPS_BACKENDS}")
    if backend == "torch" or (backend == "auto" and not triton_ok(device)):
        return ref
    if not triton_ok(device):
        raise RuntimeError(f"Triton kernels requested on {device} but Triton cannot run there: install triton "
                           "(CUDA), set TRITON_INTERPRET=1 (CPU, slow), or use the torch backend")
    from moecg.kernels import triton_ops  # Triton: optional, imported only where it can run

    return triton_ops
