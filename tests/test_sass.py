"""The fused step's weight-streaming kernels keep their pipelined, 16-byte weight loads in sm_90 machine code, at real
hidden and expert shapes and through real launches (moecg.kernels.sass: the launches a dry pass records, specialised
by Triton's own binder, compiled with its bundled ptxas, read with its cuobjdump). A layout that loses them still
gives the right bits, so only the machine code shows it: before, a split kernel whose start the compiler could not
prove aligned had no cp.async (down) or 2-byte loads (GEMV), and GPT-OSS's transposed experts went through registers.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

from moecg.capture import Capture  # noqa: E402
from moecg.dispatch import attach, detach, make_dispatcher  # noqa: E402
from moecg.engine import DecodeEngine  # noqa: E402
from moecg.kernels import gemv, sass, tiles, triton_ops  # noqa: E402
from moecg.kernels.moe_gemm import ExpertArgs  # noqa: E402
from moecg.models import build_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")]
STREAMING = ("gemv_kernel", "moe_up_kernel", "moe_down_kernel", "cap_up_kernel", "cap_down_kernel")


def _audit(records, seen=None):
    try:
        return sass.audit(records, seen)
    except FileNotFoundError as e:  # a Triton build without ptxas / cuobjdump
        pytest.skip(str(e))


def _step_rows(preset, overrides, batches=(1, 8), dispatch="fused", layers=1):
    built = build_model(preset, num_layers=layers, device="cpu", dtype="bfloat16", config_overrides=overrides)
    rows, seen = [], set()
    for bs in batches:
        attach(built.model, make_dispatcher(dispatch), max_rows=bs)
        try:
            with sass.sm90_dry_run() as rec:
                eng = DecodeEngine(built.model, 128, bs)
                cap = Capture(eng, "eager", buckets=(bs,), kernels="fused").apply()
                with torch.no_grad():
                    eng.eager_step(eng.ids, bs)
                cap.unwrap()
        finally:
            detach(built.model)
        rows += _audit(rec, seen)
    return rows


def _check_streaming(rows):
    """Spills (stack) are the audit's to report, not asserted: they move with the compiler (Triton 3.9 gives the
    Qwen3 up kernel 8 bytes of stack where 3.6, the GPU's, gives none)."""
    for r in rows:
        if r["kernel"] not in STREAMING:
            continue
        t = r["tiles"]
        if max(t.get("BLOCK_M", 1), t.get("BLOCK_T", 1)) >= 16:  # tensor-core tiles: weights through cp.async
            assert r["async_loads"] >= 8, r
        else:  # CUDA-core rows: 16-byte weight loads, not element by element
            assert r["wide_loads"] > r["narrow_loads"], r


@pytest.mark.parametrize("preset,overrides,dispatch", [
    ("qwen3_30b_a3b", {"vocab_size": 512, "num_experts": 16}, "fused"),  # D 2048, I 768: n-contiguous experts
    ("gpt_oss_20b", {"vocab_size": 512, "num_local_experts": 8}, "fused"),  # D 2880: HF's transposed experts
    ("gpt_oss_20b", {"vocab_size": 512, "num_local_experts": 8}, "capacity"),  # (k-major tiles), capacity kernels
])
def test_step_kernels_keep_wide_pipelined_loads(preset, overrides, dispatch):
    rows = _step_rows(preset, overrides, dispatch=dispatch)
    kernels = {r["kernel"] for r in rows}
    moe = ("moe_up_kernel", "moe_down_kernel") if dispatch == "fused" else ("cap_up_kernel", "cap_down_kernel")
    assert {*moe, "gemv_kernel"} <= kernels, kernels
    assert any(r["tiles"].get("KN") for r in rows) == (preset == "gpt_oss_20b")
    _check_streaming(rows)


def test_latent_attention_step_keeps_wide_pipelined_loads():
    """DeepSeek-V2-Lite's shapes (a dense layer, then an MoE one): the per-head W_UK GEMV on k-major tiles (the
    n-contiguous view of kv_b_proj) and W_UV's, the MLA attention, the MoE kernels."""
    rows = _step_rows("deepseek_v2_lite", {"vocab_size": 512, "n_routed_experts": 8}, layers=2)
    kernels = {r["kernel"] for r in rows}
    assert {"mla_attn_kernel", "mla_rope_cache_kernel", "moe_up_kernel", "moe_down_kernel"} <= kernels, kernels
    assert any(r["kernel"] == "gemv_kernel" and r["tiles"].get("KN") for r in rows)  # W_UK
    assert all(r["async_loads"] >= 8 for r in rows if r["kernel"] == "mla_attn_kernel")
    _check_streaming(rows)


def test_split_kernels_compile_like_unsplit():
    """The split-K MoE up / down and GEMV launches (real shapes, launched by their ops) keep the unsplit kernels'
    shared memory and loads: each split starts at a multiple of BLOCK_K the compiler sees."""
    D, inter, E, T = 2048, 768, 16, 1
    x = torch.zeros(T, D, dtype=torch.bfloat16)
    idx = torch.arange(8, dtype=torch.int64)[None].repeat(T, 1)
    w = torch.full((T, 8), 0.125)
    gate_up = torch.zeros(E, 2 * inter, D, dtype=torch.bfloat16)
    down = torch.zeros(E, D, inter, dtype=torch.bfloat16)
    wo = torch.zeros(D, 4096, dtype=torch.bfloat16)
    xo = torch.zeros(T, 4096, dtype=torch.bfloat16)
    base = tiles.moe_tiles(T, D, inter, E, ExpertArgs(gate_up, down).weights)
    by = {}
    for split in (1, 2):
        with sass.sm90_dry_run() as rec:
            triton_ops.moe_experts(x, idx, w, gate_up, down,
                                   tiles=dataclasses.replace(base, up_split=split, down_split=split))
            triton_ops.linear_partials(xo, wo, tiles=dataclasses.replace(tiles.GemvTiles(16, 256, 4, 3),
                                                                         split_k=split))
        for r in _audit(rec):
            by[(r["kernel"], r["tiles"].get("SPLIT", 1))] = r
    _check_streaming(by.values())
    for kernel in ("gemv_kernel", "moe_up_kernel", "moe_down_kernel"):  # the kernels that split
        one, two = by[(kernel, 1)], by[(kernel, 2)]
        assert two["shared"] == one["shared"] and two["async_loads"] == one["async_loads"], (one, two)
    assert gemv.GEMV_MAX_T >= T
