"""The Triton ops of moecg's fused decode path: the op functions of `moecg.kernels.ref` (OPS), same signatures.

What `get_ops` returns on Triton. The kernels live in one file per job (norm_rope, attention, mla, routers, gemv,
moe, capacity: MODULES) and launch through `moecg.kernels.launch`; this module gathers their ops, with the launch
knobs its callers read (pdl_mode, dry_run, Precompiler) and the attention split rules.
"""
from __future__ import annotations

import sys
import types

from moecg.kernels import attention, capacity, gemv, launch, mla, moe, norm_rope, routers
from moecg.kernels.attention import LONG_SPAN, attn_decode, attn_merge_block, attn_splits
from moecg.kernels.capacity import capacity_experts
from moecg.kernels.gemv import GEMV_MAX_T, head_linear, linear, linear_partials, router_logits, silu_mul
from moecg.kernels.launch import Precompiler, dry_run, pdl_mode
from moecg.kernels.mla import mla_attn_decode, mla_rope_cache, mla_splits
from moecg.kernels.moe import moe_experts
from moecg.kernels.moe_gemm import ExpertArgs
from moecg.kernels.norm_rope import add_rmsnorm, rope_cache
from moecg.kernels.routers import norm_route, route, route_sigmoid_group, route_softmax_group, route_topk_softmax

__all__ = ["add_rmsnorm", "rope_cache", "attn_decode", "route", "norm_route", "route_sigmoid_group",
           "route_topk_softmax", "route_softmax_group", "mla_rope_cache", "mla_attn_decode", "mla_splits", "linear", "linear_partials", "head_linear", "router_logits", "silu_mul", "moe_experts", "capacity_experts",
           "ExpertArgs", "GEMV_MAX_T", "LONG_SPAN", "attn_splits", "attn_merge_block",
           "PDL", "pdl_mode", "dry_run", "Precompiler", "MODULES"]

# the modules that hold the kernels, each launching through moecg.kernels.launch (tests walk them)
MODULES = (norm_rope, attention, mla, routers, gemv, moe, capacity)


class _Ops(types.ModuleType):
    """`triton_ops.PDL` reads and sets `launch.PDL`, the programmatic-dependent-launch mode `pdl_mode` reads (the
    benchmarks set it here)."""

    @property
    def PDL(self) -> int | None:  # noqa: N802 - the module attribute's name
        return launch.PDL

    @PDL.setter
    def PDL(self, mode: int | None) -> None:  # noqa: N802
        launch.PDL = mode


sys.modules[__name__].__class__ = _Ops
