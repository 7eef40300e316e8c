"""Block-FP8 and mxfp4 weights on a real GPU (bf16 activations): each quantized Triton kernel against the same kernel on the
reference-dequantized weights (the same operands; on the GPU the MMAs may sum them in another order, so within bf16
rounding, where the interpreter test asserts the bits) and against the PyTorch dequantize-then-matmul reference;
whole models captured on the fused step against HF's modules on the same quantized model.

Dims: T tokens, D hidden, E experts, K top-k, I expert intermediate, N/K a projection's.
Skipped without CUDA. Run on the H200: `pytest -m gpu -s tests/test_weights_gpu.py`.
"""
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytestmark = pytest.mark.gpu

from moecg.kernels import ref, triton_ops as tri  # noqa: E402
from moecg.kernels.tiles import CORE_GEMV, CORE_GEMV_FP8, CORE_MOE, GemvTiles, MoeTiles, moe_tiles  # noqa: E402
from moecg.models import build_model  # noqa: E402
from moecg.models.adapter import ExpertSpec  # noqa: E402
from forced_runs import captured_run, hf_reference, prompts_for  # noqa: E402 (tests/)
from moecg.models.formats import Mxfp4, mx_quantize, quantize_stacked  # noqa: E402

BF = torch.bfloat16


def _close(a, b, tol=2e-2):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("T", [1, 8, 33])
@pytest.mark.parametrize("N,K,parts", [(4096 + 2 * 512, 2048, 1), (2048, 4096, 1), (1536, 2048, 2)])
def test_fp8_gemv_is_the_dequantized_gemv(T, N, K, parts):
    g = torch.Generator(device="cuda").manual_seed(T)
    w = quantize_stacked(torch.randn(N, K, device="cuda", generator=g) * 0.02, parts, BF)
    x = torch.randn(T, K, device="cuda", generator=g).to(BF)
    got = tri.linear(x, w)
    _close(got, ref.linear(x, w))
    if T <= 16:  # the same tiles on the dequantized weight: the same operands, the MMAs may sum in another order
        for tiles in (GemvTiles(64, 128, 4, 3), GemvTiles(16, 512, 4, 3)):
            _close(tri.linear(x, w, tiles=tiles), tri.linear(x, w.dense(), tiles=tiles), 1e-2)


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("N,K", [(2048, 4096), (4096, 4096 + 320)])  # Qwen3-30B-A3B's o projection; a ragged K
@pytest.mark.parametrize("fp8", [True, False])
def test_split_k_partial_rows_sum_to_the_projection(T, N, K, fp8):
    # linear_partials: S fp32 partial rows over whole K steps whose sum is the unsplit GEMV (another order of sums)
    g = torch.Generator(device="cuda").manual_seed(T + K)
    wf = torch.randn(N, K, device="cuda", generator=g) * 0.02
    w = quantize_stacked(wf, 1, BF) if fp8 else wf.to(BF)
    x = torch.randn(T, K, device="cuda", generator=g).to(BF)
    whole = ref.linear(x, w).float()
    for tiles in (GemvTiles(16, 256, 4, 3, split_k=2), GemvTiles(16, 256, 4, 3, split_k=4),
                  GemvTiles(32, 128, 4, 3, split_k=8)):
        parts = tri.linear_partials(x, w, tiles=tiles)
        assert parts.dtype == torch.float32 and parts.shape[0] == T and parts.shape[2] == N, (parts.shape, tiles)
        assert 1 < parts.shape[1] <= tiles.split_k, (parts.shape, tiles)
        _close(parts.sum(1), whole)
        if fp8:  # the same splits on the dequantized weight: the same operands
            _close(parts, tri.linear_partials(x, w.dense(), tiles=tiles), 1e-2)


@pytest.mark.parametrize("T", [1, 8, 32])
@pytest.mark.parametrize("shape", [(2048, 768, 128, 8), (4096, 1408, 64, 6)])  # Qwen3-30B-A3B, DeepSeek-V2-Lite-ish
def test_fp8_moe_kernels_are_the_dequantized_kernels(shape, T):
    D, I, E, K = shape
    g = torch.Generator(device="cuda").manual_seed(T)
    gate_up = quantize_stacked(torch.randn(E, 2 * I, D, device="cuda", generator=g) * 0.02, 2, BF)
    down = quantize_stacked(torch.randn(E, D, I, device="cuda", generator=g) * 0.02, 1, BF)
    x = torch.randn(T, D, device="cuda", generator=g).to(BF)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, device="cuda", generator=g).to(BF)
    t = moe_tiles(T, D, I, E)
    for tiles in (t, replace(t, up_k=256, down_k=256, stages=3)):
        _moe_checks(x, idx, w, gate_up, down, tiles)


@pytest.mark.parametrize("T", [1, 8, 32])
@pytest.mark.parametrize("shape", [(2048, 768, 128, 8), (2880, 2880, 32, 4)])  # Qwen3-30B-A3B, GPT-OSS-20B's dims
def test_mxfp4_moe_kernels_are_the_dequantized_kernels(shape, T):
    D, I, E, K = shape
    g = torch.Generator(device="cuda").manual_seed(T)
    gate_up = Mxfp4(*mx_quantize(torch.randn(E, 2 * I, D, device="cuda", generator=g) * 0.02), BF)
    down = Mxfp4(*mx_quantize(torch.randn(E, D, I, device="cuda", generator=g) * 0.02), BF)
    x = torch.randn(T, D, device="cuda", generator=g).to(BF)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, device="cuda", generator=g).to(BF)
    t = moe_tiles(T, D, I, E)
    for tiles in (t, replace(t, up_k=256, down_k=256, stages=3), replace(t, up_k=32, down_k=32)):
        _moe_checks(x, idx, w, gate_up, down, tiles)


@pytest.mark.parametrize("T", [1, 8])
def test_mxfp4_moe_output_tiles_change_no_value(T):
    """GPT-OSS-120B's layer dims with its experts' arithmetic (interleaved clamped SwiGLU, biases), 16 of its experts:
    the output-column tiles (up_n, down_n) change which program computes a column, the K steps how many columns a
    step takes, one row a program (block_m 1) moves the products to the CUDA cores; every tiling within bf16 rounding
    of the reference and of the table's tiles."""
    D, I, E, K = 2880, 2880, 16, 4
    g = torch.Generator(device="cuda").manual_seed(T)
    gate_up = Mxfp4(*mx_quantize(torch.randn(E, 2 * I, D, device="cuda", generator=g) * 0.02), BF)
    down = Mxfp4(*mx_quantize(torch.randn(E, D, I, device="cuda", generator=g) * 0.02), BF)
    spec = ExpertSpec("swiglu_clamp", True, False, True, 1.702, 7.0)
    bu = (torch.randn(E, 2 * I, device="cuda", generator=g) * 0.1).to(BF)
    bd = (torch.randn(E, D, device="cuda", generator=g) * 0.1).to(BF)
    x = torch.randn(T, D, device="cuda", generator=g).to(BF)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, device="cuda", generator=g).to(BF)
    kw = {"spec": spec, "gate_up_bias": bu, "down_bias": bd}
    want = ref.moe_experts(x, idx, w, gate_up, down, **kw)
    t = moe_tiles(T, D, I, E)
    base = tri.moe_experts(x, idx, w, gate_up, down, tiles=t, **kw)
    _close(base, want)
    for tiles in (replace(t, down_n=32), replace(t, up_n=32, down_n=32), replace(t, up_n=128),
                  replace(t, up_k=256, down_k=256, stages=3), replace(t, down_n=32, up_k=256, down_k=256, stages=3),
                  moe_tiles(1, D, I, E, "mxfp4"), replace(CORE_MOE, stages=3),  # one row a program (quant.mx_row_mac)
                  MoeTiles(block_m=1, up_n=32, up_k=128, down_n=32, down_k=512, down_split=2)):
        got = tri.moe_experts(x, idx, w, gate_up, down, tiles=tiles, **kw)
        diff = float((got.float() - base.float()).abs().max())
        print(f"mxfp4 T {T} {tiles}: max |diff| against the table's tiles {diff:.3e}")
        _close(got, want)
        _close(got, base, 1e-2)
        if tiles.block_m == 1:  # the row grid (auto on one-row tiles) against the slot grid: the same bits
            assert torch.equal(got, tri.moe_experts(x, idx, w, gate_up, down, tiles=tiles, grid="slot", **kw))


CORE_MOE_TILES = (CORE_MOE, MoeTiles(block_m=1, up_n=16, up_k=256, down_n=16, down_k=256, stages=3),
                  MoeTiles(block_m=2, up_n=32, up_k=128, down_n=32, down_k=128, warps=8, stages=4))


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("weights", ["full", "fp8_block", "mxfp4"])
def test_moe_kernels_on_the_cuda_cores_are_the_reference(weights, T):
    """block_m < 16: the MoE and capacity kernels' products on the CUDA cores (fp32, no tl.dot) in every format,
    Qwen3-30B-A3B's layer dims: within bf16 rounding of the reference and of the tensor-core tiles; the capacity
    kernels at their own tiles too."""
    D, I, E, K = 2048, 768, 128, 8
    g = torch.Generator(device="cuda").manual_seed(T)
    gu, dn = (torch.randn(E, 2 * I, D, device="cuda", generator=g) * 0.02,
              torch.randn(E, D, I, device="cuda", generator=g) * 0.02)
    if weights == "fp8_block":
        gate_up, down = quantize_stacked(gu, 2, BF), quantize_stacked(dn, 1, BF)
    elif weights == "mxfp4":
        gate_up, down = Mxfp4(*mx_quantize(gu), BF), Mxfp4(*mx_quantize(dn), BF)
    else:
        gate_up, down = gu.to(BF), dn.to(BF)
    x = torch.randn(T, D, device="cuda", generator=g).to(BF)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, device="cuda", generator=g).to(BF)
    on_mma = tri.moe_experts(x, idx, w, gate_up, down, tiles=moe_tiles(T, D, I, E))  # the bf16 rules: tl.dot
    for tiles in CORE_MOE_TILES:
        got = tri.moe_experts(x, idx, w, gate_up, down, tiles=tiles)
        _close(got, ref.moe_experts(x, idx, w, gate_up, down))
        _close(got, on_mma, 1e-2)
        for cf in (0.5, 1.25):
            _close(tri.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf, tiles=tiles),
                   ref.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf))
    for cf in (0.5, 1.25):  # the capacity kernels' own choice: the format's table at C rows (1 here)
        _close(tri.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf),
               ref.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf))


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("fp8", [True, False])
def test_gemv_on_the_cuda_cores_is_the_reference(fp8, T):
    """GemvTiles.rows < 16: the GEMV's products on the CUDA cores, unsplit and split over K (Qwen3-30B-A3B's qkv and
    o shapes; GLM-4.5-Air's shared-expert down, whose K no tile divides), against the reference and the tensor-core
    GEMV."""
    g = torch.Generator(device="cuda").manual_seed(T)
    for N, K in ((5120, 2048), (2048, 4096), (4096, 1408)):
        wf = torch.randn(N, K, device="cuda", generator=g) * 0.02
        w = quantize_stacked(wf, 1, BF) if fp8 else wf.to(BF)
        x = torch.randn(T, K, device="cuda", generator=g).to(BF)
        want = ref.linear(x, w)
        on_mma = tri.linear(x, w, tiles=GemvTiles(16, 512, 4, 3))
        for tiles in (CORE_GEMV, CORE_GEMV_FP8, GemvTiles(16, 256, 4, 3, rows=1), GemvTiles(8, 512, 8, 4, rows=1),
                      GemvTiles(32, 128, rows=2)):
            got = tri.linear(x, w, tiles=tiles)
            _close(got, want)
            _close(got, on_mma, 1e-2)
            _close(tri.linear_partials(x, w, tiles=replace(tiles, split_k=4)).sum(1), want.float())


def _moe_checks(x, idx, w, gate_up, down, tiles):
    got = tri.moe_experts(x, idx, w, gate_up, down, tiles=tiles)
    _close(got, tri.moe_experts(x, idx, w, gate_up.dense(), down.dense(), tiles=tiles), 1e-2)
    _close(got, ref.moe_experts(x, idx, w, gate_up, down))
    for cf in (0.5, 1.25):
        got = tri.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf, tiles=tiles)
        _close(got, tri.capacity_experts(x, idx, w, gate_up.dense(), down.dense(), capacity_factor=cf, tiles=tiles),
               1e-2)
        _close(got, ref.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf))


@pytest.mark.parametrize("preset,weights", [(p, "fp8_block") for p in ("qwen3_moe_tiny", "qwen2_moe_tiny",
                                                                         "deepseek_v3_tiny", "glm4_moe_tiny")] +
                         [(p, "mxfp4") for p in ("gpt_oss_tiny", "qwen3_moe_tiny", "deepseek_v3_tiny")])
def test_quantized_fused_full_capture_matches_hf_on_the_same_weights(preset, weights):
    """The quantized model captured on the fused step (its kernels reading e4m3 + scales), teacher-forced against
    HF's modules on the same model (dequantizing experts and linears): the same greedy tokens nearly everywhere,
    every real token routed K times per layer."""
    m = build_model(preset, dtype="bf16", device="cuda", seed=1, weights=weights).model
    prompts = prompts_for(m)
    r_ref, s_ref = hf_reference(m, prompts)
    for disp in ("fused", "capacity"):
        f = captured_run(m, prompts, r_ref, dispatch=disp)
        print(f"{preset} {weights} {disp}: forced agreement {f.agreement:.3f}, max logit diff {f.max_logit_diff:.4f}")
        assert f.state["tokens"] == s_ref["tokens"]
        if disp == "fused":
            assert f.agreement >= 0.95 and f.state["routed_assignments"] == s_ref["routed_assignments"]
