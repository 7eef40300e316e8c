"""Run by tests/test_weights.py under TRITON_INTERPRET=1: the Triton kernels on block-FP8 and mxfp4 weights
(moecg.models.weights) on CPU tensors (fp32 activations). Each quantized kernel must give exactly what the same kernel gives on the
reference-dequantized weights (it dequantizes in registers as the reference does, then runs the same tl.dot), and
match the PyTorch dequantize-then-matmul reference within 1e-4: the GEMV (any T, bias, scale groups of 128 and of
fewer rows), the dropless MoE kernels (expert and slot grids, split-K down, pad rows, counters) and the capacity
kernels; the same MoE and capacity kernels on mxfp4 experts (K steps of one and of several 32-column scale groups,
a ragged last one), the products of both on the CUDA cores (fewer than 16 rows a program) in every format, GPT-OSS's
experts arithmetic on bf16 activations at several output tilings (the same bits; one row a program on the CUDA cores
within bf16 rounding) and GPT-OSS's transposed, biased, interleaved experts in mxfp4 through the whole fused step.
Prints ALL OK when every check passes; any mismatch raises.
Dims: T tokens, K top-k, E experts, D hidden, I expert intermediate, N/K a projection's.
"""
import math
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from moecg.dispatch.state import DispatchState  # noqa: E402
from moecg.dispatch.base import Dispatcher  # noqa: E402
from moecg.kernels import ref  # noqa: E402
from moecg.kernels import triton_ops as tri  # noqa: E402
from moecg.kernels.tiles import GemvTiles, MoeTiles, capacity_tiles  # noqa: E402
from moecg.moe_math import capacity  # noqa: E402
from moecg.models.adapter import ExpertSpec  # noqa: E402
from moecg.models.formats import BLOCK, Mxfp4, mx_quantize, quantize_stacked  # noqa: E402

from moecg.models import build_model  # noqa: E402

from interp_common import close, fused_backends_agree  # noqa: E402 (tests/, this script's directory)

torch.manual_seed(0)


# GEMV: N/K spanning several 128-blocks with ragged tails, one row group of 64 (two fused parts of 64 rows)
for T, N, K, parts, bias in ((1, 300, 200, 1, False), (5, 384, 256, 1, True), (21, 128, 160, 2, False),
                             (3, 96, 64, 1, True)):
    wq = quantize_stacked(torch.randn(N, K), parts)
    x = torch.randn(T, K)
    b = torch.randn(N) if bias else None
    got = tri.linear(x, wq, b)
    close(got, ref.linear(x, wq, b), 1e-4)
    # K steps inside one scale column and across two and four of them
    # 32 and 64 rows a program (block-FP8 only: one pass over the weights up to 64 rows)
    for tiles in (GemvTiles(64, 128, 4, 3), GemvTiles(32, 64, 4, 2), GemvTiles(16, 512),
                  GemvTiles(32, 256, 4, 3, rows=32), GemvTiles(16, 128, 4, 3, rows=64)):
        out = tri.linear(x, wq, b, tiles=tiles)
        if T <= 16 and tiles.rows == 16:  # the same tiles on the dequantized weight: the same bits
            assert torch.equal(out, tri.linear(x, wq.dense(), b, tiles=tiles)), (T, N, K, tiles)
        close(out, got, 1e-4)
    # split-K partial rows (ranges of whole 128-column scale blocks): the same products as the unsplit GEMV, summed
    # in another order; on the dequantized weight the same bits
    for tiles in (GemvTiles(32, 128, 4, 3, split_k=2), GemvTiles(16, 64, 4, 2, split_k=4)):
        parts = tri.linear_partials(x, wq, b, tiles=tiles)
        kper = math.ceil(math.ceil(K / tiles.split_k) / tiles.block_k) * tiles.block_k  # a split's columns
        assert parts.shape[1] == math.ceil(K / kper), (parts.shape, tiles)
        close(parts.sum(1), got, 1e-4)
        if T <= 16:
            assert torch.equal(parts, tri.linear_partials(x, wq.dense(), b, tiles=tiles)), (T, N, K, tiles)


class _Counting(Dispatcher):
    drops = True


def counters(E):
    st = DispatchState(_Counting(), [0], E, 8, torch.device("cpu"))
    return st, st.layer(0)


# dropless MoE: I = 96 (fused gate|up groups of 32 rows), D = 320 (ragged last K block), split-K down, pad rows
E, D, I = 6, 320, 96
gate_up = quantize_stacked(torch.randn(E, 2 * I, D) * 0.1, 2)
down = quantize_stacked(torch.randn(E, D, I) * 0.1)
assert gate_up.rows == 32 and down.rows == BLOCK
for T, K, grid, split, valid in ((1, 2, "slot", 2, None), (4, 2, "expert", 1, torch.tensor([1, 1, 0, 1]) != 0),
                                 (9, 3, "auto", 3, None)):
    x = torch.randn(T, D)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    tiles = MoeTiles(block_m=16, up_n=32, up_k=256, down_n=64, down_k=64, down_split=split)
    st1, c1 = counters(E)
    st2, c2 = counters(E)
    got = tri.moe_experts(x, idx, w, gate_up, down, valid, c1, tiles=tiles, grid=grid)
    same = tri.moe_experts(x, idx, w, gate_up.dense(), down.dense(), valid, c2, tiles=tiles, grid=grid)
    assert torch.equal(got, same), (T, K, grid)
    close(got, ref.moe_experts(x, idx, w, gate_up, down, valid), 1e-4)
    assert st1.snapshot()["routed"] == st2.snapshot()["routed"]

# capacity kernels: a drop-heavy factor and the same kernels on the dequantized weights
for T, K, cf in ((6, 2, 0.5), (3, 2, 1.0)):
    x = torch.randn(T, D)
    idx = torch.randint(0, 2, (T, K)) if cf < 1 else torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    idx[:, 1] = (idx[:, 0] + 1) % E
    w = torch.rand(T, K)
    tiles = MoeTiles(block_m=16, up_n=32, up_k=64, down_n=64, down_k=256)
    got = tri.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf, tiles=tiles)
    same = tri.capacity_experts(x, idx, w, gate_up.dense(), down.dense(), capacity_factor=cf, tiles=tiles)
    assert torch.equal(got, same), (T, K, cf)
    close(got, ref.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf), 1e-4)

# the products on the CUDA cores (MoeTiles.block_m < 16, GemvTiles.rows < 16: fp32 products, no tl.dot), every format:
# the reference's values within fp32 rounding (the sums in another order than the MMA's), pad rows and counters as on
# tl.dot; the GEMV unsplit and split over K
mgu, mdn = (Mxfp4(*mx_quantize(t), torch.float32) for t in (torch.randn(E, 2 * I, D) * 0.1, torch.randn(E, D, I) * 0.1))


def _core_moe_checks(x, idx, w, valid, grid, tiles):
    for gu, dn in ((gate_up, down), (gate_up.dense(), down.dense()), (mgu, mdn)):
        st1, c1 = counters(E)
        st2, c2 = counters(E)
        got = tri.moe_experts(x, idx, w, gu, dn, valid, c1, tiles=tiles, grid=grid)
        close(got, ref.moe_experts(x, idx, w, gu, dn, valid, c2), 1e-4)
        assert st1.snapshot()["routed"] == st2.snapshot()["routed"]  # the reference's counts
    close(tri.capacity_experts(x, idx, w, gate_up, down, capacity_factor=1.0, tiles=tiles),
          ref.capacity_experts(x, idx, w, gate_up, down, capacity_factor=1.0), 1e-4)


for T, K, grid, bm, valid in ((1, 2, "slot", 1, None), (4, 2, "expert", 2, torch.tensor([1, 1, 0, 1]) != 0)):
    x = torch.randn(T, D)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    # block_m 1: block-FP8 tiles inside one scale row (up_n 32 of gate_up's 32-row groups) take the scale on x
    # (quant.fp8_row_mac); up_n 64 spans two scale rows and dequantizes each weight instead
    for tiles in (MoeTiles(block_m=bm, up_n=32, up_k=128, down_n=16, down_k=64, down_split=2),
                  MoeTiles(block_m=bm, up_n=64, up_k=256, down_n=16, down_k=256)):
        _core_moe_checks(x, idx, w, valid, grid, tiles)
# the row grid (one-row tiles, which grid "auto" runs on it: a program per assignment, each its own row): the slot
# grid's bits (the same products per row), pad rows zero, the same counters; block-FP8 (split-K down) and mxfp4
g = torch.Generator().manual_seed(1)  # its own: the checks below keep the random draws they were written with
x = torch.randn(4, D, generator=g)
idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(4)])
idx[1] = idx[0]  # experts with two rows
w = torch.rand(4, 2, generator=g)
valid = torch.tensor([1, 1, 0, 1]) != 0
for gu, dn, tiles in ((gate_up, down, MoeTiles(block_m=1, up_n=32, up_k=128, down_n=16, down_k=64, down_split=2)),
                      (mgu, mdn, MoeTiles(block_m=1, up_n=64, up_k=256, down_n=64, down_k=512))):
    (st1, c1), (st2, c2) = counters(E), counters(E)
    got = tri.moe_experts(x, idx, w, gu, dn, valid, c1, tiles=tiles, grid="row")
    assert torch.equal(got, tri.moe_experts(x, idx, w, gu, dn, valid, c2, tiles=tiles, grid="slot")), tiles
    assert torch.equal(got, tri.moe_experts(x, idx, w, gu, dn, valid, tiles=tiles)), tiles  # auto: the row grid
    assert st1.snapshot()["routed"] == st2.snapshot()["routed"]
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))
# the GEMV: one row with 128-row scale groups takes the scale on x, also with K steps over two scale columns and a
# ragged K; 96-row groups (two fused parts) under 64-row tiles dequantize each weight
for T in (1, 3):
    wq = quantize_stacked(torch.randn(300, 200), 1)
    x = torch.randn(T, 200)
    for wi in (wq, wq.dense()):
        for tiles in (GemvTiles(16, 128, rows=1), GemvTiles(4, 256, rows=1), GemvTiles(32, 256, rows=2)):
            close(tri.linear(x, wi, tiles=tiles), ref.linear(x, wi), 1e-4)
    w2 = quantize_stacked(torch.randn(192, 200), 2)
    assert w2.rows == 32
    for tiles in (GemvTiles(64, 128, rows=1), GemvTiles(32, 256, rows=1)):
        close(tri.linear(x, w2, tiles=tiles), ref.linear(x, w2), 1e-4)
        close(tri.linear_partials(x, wi, tiles=GemvTiles(16, 128, rows=1, split_k=2)).sum(1), ref.linear(x, wi), 1e-4)

# the same kernels on mxfp4 experts: D = 320 (K steps of 32 and 64 end inside it, 256 with a ragged last block),
# I = 96 (three scale groups), every e2m1 code and a spread of scales
def mx(w):
    return Mxfp4(*mx_quantize(w), torch.float32)


gate_up = mx(torch.randn(E, 2 * I, D) * torch.logspace(-2, 0, D))
down = mx(torch.randn(E, D, I) * 0.1)
for T, K, grid, split, up_k, down_k in ((1, 2, "slot", 2, 16, 32), (4, 2, "expert", 1, 64, 128),
                                        (9, 3, "auto", 3, 256, 64)):
    x = torch.randn(T, D)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    valid = torch.tensor([1, 1, 0, 1]) != 0 if T == 4 else None
    got = tri.moe_experts(x, idx, w, gate_up, down, valid, grid=grid, tiles=MoeTiles(
        block_m=16, up_n=32, up_k=up_k, down_n=64, down_k=down_k, down_split=split))
    same = tri.moe_experts(x, idx, w, gate_up.dense(), down.dense(), valid, grid=grid, tiles=MoeTiles(
        block_m=16, up_n=32, up_k=max(up_k, 32), down_n=64, down_k=down_k, down_split=split))  # K steps of 32 at least
    assert torch.equal(got, same), (T, K, grid)
    close(got, ref.moe_experts(x, idx, w, gate_up, down, valid), 1e-4)
for T, K, cf in ((6, 2, 0.5), (3, 2, 1.0)):
    x = torch.randn(T, D)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    tiles = MoeTiles(block_m=16, up_n=32, up_k=64, down_n=64, down_k=256)
    got = tri.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf, tiles=tiles)
    assert torch.equal(got, tri.capacity_experts(x, idx, w, gate_up.dense(), down.dense(), capacity_factor=cf,
                                                 tiles=tiles)), (T, K, cf)
    close(got, ref.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf), 1e-4)
# the capacity kernels at the table's tiles for C rows in the weights' format (what they pick when not told): C 1 at
# these sizes, one row a program on the CUDA cores (mx_row_mac), K steps past D's and I's ends; drops at cf 0.5
for T, K, cf in ((3, 2, 1.0), (8, 2, 0.5)):
    x = torch.randn(T, D)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    C = capacity(T, K, E, cf)
    assert C <= 2 and capacity_tiles(C, D, I, E, "mxfp4").block_m == 1, C
    close(tri.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf),
          ref.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf), 1e-4)
# GPT-OSS's experts arithmetic (interleaved clamped SwiGLU, biases) on bf16 activations: the output-column tiles
# (up_n, down_n) and the K steps change no value beyond the interpreter's own rounding: its tl.dot is numpy's matmul,
# whose fp32 sums depend on the operands' shapes (another column count or K step, another BLAS blocking), so a
# bf16-rounded GEMM output may land one ulp apart, rarely (seen: 1 element of 3 x 2 x 320 under other random draws)


def within_an_ulp(got, want):
    d = (got - want).abs()
    assert bool((d <= want.abs() * 2**-7 + 1e-30).all()), float(d.max())  # one bf16 ulp of the output, relative
    assert float((d > 0).float().mean()) < 0.01, float((d > 0).float().mean())


spec = ExpertSpec("swiglu_clamp", True, False, True, 1.702, 7.0)
BF = torch.bfloat16
gate_up16, down16 = (Mxfp4(t.q, t.scale, BF) for t in (gate_up, down))
kw = {"spec": spec, "gate_up_bias": (torch.randn(E, 2 * I) * 0.1).to(BF), "down_bias": (torch.randn(E, D) * 0.1).to(BF)}
for T in (1, 3):
    x = torch.randn(T, D).to(BF)
    idx = torch.stack([torch.randperm(E)[:2] for _ in range(T)]).int()
    w = torch.rand(T, 2).to(BF)
    base = tri.moe_experts(x, idx, w, gate_up16, down16, tiles=MoeTiles(), **kw)
    want = ref.moe_experts(x, idx, w, gate_up16, down16, **kw)
    # bf16 rounding of each GEMM's output, through the clamped SwiGLU: 1.7-2.5% of the largest output over seeds 0-5
    close(base, want, 4e-2 * float(want.float().abs().max()))
    for tiles in (MoeTiles(down_n=32), MoeTiles(up_n=32, down_n=32), MoeTiles(up_n=128),
                  MoeTiles(up_k=256, down_k=256, stages=3)):
        within_an_ulp(tri.moe_experts(x, idx, w, gate_up16, down16, tiles=tiles, **kw), base)
    # one row a program on the CUDA cores (int32 words of 8 codes, each scale group's sum scaled once: the sums in
    # another order), K steps of one and of eight scale groups, the down GEMM split over I
    for tiles in (MoeTiles(block_m=1, up_n=16, up_k=256, down_n=16, down_k=256, warps=2),
                  MoeTiles(block_m=1, up_n=32, up_k=32, down_n=64, down_k=64, down_split=3)):
        close(tri.moe_experts(x, idx, w, gate_up16, down16, tiles=tiles, **kw), base,
              1e-2 * float(base.float().abs().max()))
model = build_model("gpt_oss_tiny", dtype="fp32", device="cpu", seed=4, weights="mxfp4").model
fused_backends_agree(model, torch.randint(0, 100, (2, 5)), 16, 3, "gpt_oss_tiny mxfp4")

# whole models on block-FP8 weights: the fused step on the Triton ops against the same step on the torch ops
# (shared experts as their own FP8 GEMV, MLA's fused projections, dense first layers; standard attention's fused
# qkv is the GEMV above, and every family's fused step on the torch ops is bit for bit the dequantized model's in
# tests/test_weights.py)
for preset in ("deepseek_v3_tiny",):  # MLA's fused projections, shared experts, a dense first layer
    model = build_model(preset, dtype="fp32", device="cpu", seed=4, weights="fp8_block").model
    fused_backends_agree(model, torch.randint(0, 100, (2, 5)), 16, 3, preset)
print("ALL OK")
