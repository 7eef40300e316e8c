"""Run by tests/test_act_kernels.py under TRITON_INTERPRET=1: the Triton GEMMs on block-FP8 weights with fp8_dynamic
activations (moecg.models.formats.act_quant: each row's 128-column blocks quantized to e4m3) on CPU tensors. Every
kernel must match the PyTorch reference (act_fake_quant, then the dequantize-then-matmul) within fp32 rounding on fp32
activations, and differ from the same kernel without activation quantization (the flag reaches the kernel): the GEMV
(any T, tensor-core and CUDA-core tiles, K steps of one and of several 128-column blocks, ragged K, split-K
partials), the dropless MoE kernels (expert and slot grids, split-K down, pad rows, counters) and the capacity kernels,
on the tensor cores and on the CUDA cores; bf16 activations within bf16 rounding.
Prints ALL OK when every check passes; any mismatch raises.
Dims: T tokens, K top-k, E experts, D hidden, I expert intermediate, N/K a projection's.
"""
import dataclasses
import os
import time

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from moecg.dispatch.state import DispatchState  # noqa: E402
from moecg.dispatch.base import Dispatcher  # noqa: E402
from moecg.kernels import ref  # noqa: E402
from moecg.kernels import triton_ops as tri  # noqa: E402
from moecg.kernels.tiles import GemvTiles, MoeTiles  # noqa: E402
from moecg.models.formats import quantize_stacked  # noqa: E402

from moecg.models import build_model  # noqa: E402

from interp_common import close, fused_backends_agree, same_quant  # noqa: E402 (tests/, this script's directory)

torch.manual_seed(0)
T0 = time.time()


def a8(w):
    return dataclasses.replace(w, act="fp8_dynamic")


def differs(a, b, tol=1e-3):
    assert float((a.float() - b.float()).abs().max()) > tol, "fp8_dynamic changed nothing"


# GEMV: ragged N and K, one and two fused parts, tensor-core (rows 16) and CUDA-core tiles, K steps 64 (made 128),
# 128 and 512 (whole blocks on the CUDA cores, 128 on the tensor cores), split-K partials
for T, N, K, parts, bias in ((1, 300, 200, 1, False), (21, 128, 160, 2, False), (16, 96, 384, 1, True)):
    w8 = quantize_stacked(torch.randn(N, K), parts)
    wa = a8(w8)
    x = torch.randn(T, K) * torch.logspace(-2, 1, K)  # blocks of different magnitudes
    x[0, :128] = 0  # an all-zero block: scale 1
    b = torch.randn(N) if bias else None
    want = ref.linear(x, wa, b)
    close(tri.linear(x, wa, b), want, 1e-4)
    differs(want, ref.linear(x, w8, b))
    # 32 and 64 rows a program (block-FP8 up to 64: one pass over the weights)
    for tiles in (GemvTiles(32, 64, 4, 2), GemvTiles(16, 512), GemvTiles(4, 256, rows=1), GemvTiles(32, 256, rows=2),
                  GemvTiles(32, 128, 4, 3, rows=32), GemvTiles(16, 128, 4, 3, rows=64)):
        close(tri.linear(x, wa, b, tiles=tiles), want, 1e-4)
    for tiles in (GemvTiles(16, 64, 4, 2, split_k=4), GemvTiles(16, 128, rows=1, split_k=2),
                  GemvTiles(32, 128, 4, 3, split_k=2, rows=32)):
        close(tri.linear_partials(x, wa, b, tiles=tiles).sum(1), want, 1e-4)


class _Counting(Dispatcher):
    drops = True


def counters(E):
    st = DispatchState(_Counting(), [0], E, 8, torch.device("cpu"))
    return st, st.layer(0)


print("gemv", round(time.time() - T0, 1), "s")
# dropless MoE: I = 96 (fused gate|up groups of 32 rows), D = 320 (ragged last K block), split-K down, pad rows;
# tensor-core tiles (block_m 16) and CUDA-core ones (block_m 1 with the scale on x, 2)
E, D, I = 6, 320, 96
gate_up = a8(quantize_stacked(torch.randn(E, 2 * I, D) * 0.1, 2))
down = a8(quantize_stacked(torch.randn(E, D, I) * 0.1))
for T, K, grid, split, valid in ((1, 2, "slot", 2, None), (4, 2, "expert", 3, torch.tensor([1, 1, 0, 1]) != 0)):
    x = torch.randn(T, D)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    want = ref.moe_experts(x, idx, w, gate_up, down, valid)
    differs(want, ref.moe_experts(x, idx, w, dataclasses.replace(gate_up, act="full"),
                                  dataclasses.replace(down, act="full"), valid))
    for tiles in (MoeTiles(block_m=16, up_n=32, up_k=256, down_n=64, down_k=64, down_split=split),
                  MoeTiles(block_m=1, up_n=32, up_k=128, down_n=16, down_k=128, down_split=2),
                  MoeTiles(block_m=2, up_n=64, up_k=256, down_n=16, down_k=256)):
        st1, c1 = counters(E)
        st2, c2 = counters(E)
        got = tri.moe_experts(x, idx, w, gate_up, down, valid, c1, tiles=tiles, grid=grid)
        close(got, want, 1e-4)
        tri.moe_experts(x, idx, w, dataclasses.replace(gate_up, act="full"), dataclasses.replace(down, act="full"),
                        valid, c2, tiles=tiles, grid=grid)
        assert st1.snapshot()["routed"] == st2.snapshot()["routed"]
        if valid is not None:
            assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))

# capacity kernels: a drop-heavy factor and a dropless one
for T, K, cf in ((6, 2, 0.5), (3, 2, 1.0)):
    x = torch.randn(T, D)
    idx = torch.randint(0, 2, (T, K)) if cf < 1 else torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    idx[:, 1] = (idx[:, 0] + 1) % E
    w = torch.rand(T, K)
    want = ref.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf)
    for tiles in (MoeTiles(block_m=16, up_n=32, up_k=64, down_n=64, down_k=256),
                  MoeTiles(block_m=1, up_n=32, up_k=128, down_n=16, down_k=128)):
        close(tri.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf, tiles=tiles), want, 1e-4)

print("moe + capacity", round(time.time() - T0, 1), "s")
# inputs quantized by their producer (the norms' `quant`): the norm kernels' act_quant is the reference's, bit for bit
# (ragged D, D under one 128-column block); the GEMMs reading it (xq) give the bits of quantizing x themselves, on the
# tensor cores and the CUDA cores, in the GEMV, the MoE and the capacity kernels


for T, Dn in ((3, 320), (2, 64), (1, 256)):
    y, res, nw = torch.randn(T, 2, Dn), torch.randn(T, Dn), torch.rand(Dn) + 0.5
    y[0, :, :min(Dn, 128)] = 0  # an all-zero block of the normed row (with res zero there too): scale 1
    res[0, :min(Dn, 128)] = 0
    got, want = tri.add_rmsnorm(y, res, nw, 1e-6, quant=True), ref.add_rmsnorm(y, res, nw, 1e-6, quant=True)
    close(got[1], want[1], 1e-5)
    assert len(got) == len(want) == 3
    same_quant(got[2], got[1])  # the kernel's rows quantized as act_quant does
    rw = torch.randn(8, Dn)
    y, res = torch.randn(T, 2, Dn), torch.randn(T, Dn)  # no all-zero row: its router logits would all tie
    gr = tri.norm_route(y, res, nw, 1e-6, rw, 2, True, torch.float32, quant=True)
    wr = ref.norm_route(y, res, nw, 1e-6, rw, 2, True, torch.float32, quant=True)
    assert len(gr) == len(wr) == 5 and torch.equal(gr[2], wr[2])
    same_quant(gr[4], gr[1])
# the attention output per head of 128 (the o projection's input): the direct split, the in-kernel merge and the
# merge kernel (splits 1, 4 in the kernel, 4 by the kernel after it), grouped query heads, per-row positions
Hq, Hkv, Dh, Lc = 4, 2, 128, 256
qh = torch.randn(3, Hq, Dh)
kc, vc = torch.randn(3, Hkv, Lc, Dh), torch.randn(3, Hkv, Lc, Dh)
pos = torch.tensor([5, 200, 130])
want = ref.attn_decode(qh, kc, vc, pos, 0.1, quant=True)
for splits, merge in ((1, None), (4, 1), (4, 2)):
    o, oq = tri.attn_decode(qh, kc, vc, pos, 0.1, splits=splits, merge=merge, quant=True)
    close(o, want[0], 1e-5)
    same_quant(oq, o)
# silu_mul (a shared expert's or dense MLP's down projection's input): ragged I over two 1024-column programs
gu = torch.randn(3, 2 * 1100 + 5)
h, hq8 = tri.silu_mul(gu, 1100, quant=True)
close(h, ref.silu_mul(gu, 1100), 1e-5)
same_quant(hq8, h)
for T, N, K in ((1, 96, 320), (5, 64, 256)):
    wa = a8(quantize_stacked(torch.randn(N, K), 1))
    x = torch.randn(T, K)
    xq = ref.act_quant(x)
    for tiles in (GemvTiles(32, 128, 4, 3), GemvTiles(4, 256, rows=1), GemvTiles(16, 128, rows=1)):
        assert torch.equal(tri.linear(x, wa, tiles=tiles, xq=xq), tri.linear(x, wa, tiles=tiles)), tiles
    # a K step past K reads no scale column past it: the scales as a view whose next columns hold NaN
    sp = torch.full((T, xq[1].shape[1] + 2), float("nan"))
    sp[:, :xq[1].shape[1]] = xq[1]
    got = tri.linear(x, wa, tiles=GemvTiles(4, 512, rows=1), xq=(xq[0], sp[:, :xq[1].shape[1]]))
    assert torch.equal(got, tri.linear(x, wa, tiles=GemvTiles(4, 512, rows=1)))
for T, K in ((1, 2), (4, 2)):
    x = torch.randn(T, D)
    xq = ref.act_quant(x)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    for tiles in (MoeTiles(block_m=16, up_n=32, up_k=128, down_n=64, down_k=128),
                  MoeTiles(block_m=1, up_n=32, up_k=128, down_n=16, down_k=128, down_split=2)):
        assert torch.equal(tri.moe_experts(x, idx, w, gate_up, down, tiles=tiles, xq=xq),
                           tri.moe_experts(x, idx, w, gate_up, down, tiles=tiles)), tiles
        assert torch.equal(tri.capacity_experts(x, idx, w, gate_up, down, capacity_factor=1.0, tiles=tiles, xq=xq),
                           tri.capacity_experts(x, idx, w, gate_up, down, capacity_factor=1.0, tiles=tiles)), tiles
print("producer quantization", round(time.time() - T0, 1), "s")
# bf16 activations: within bf16 rounding of the reference (the kernel multiplies the e4m3 values exactly where the
# reference rounds q * scale and the dequantized weight to bf16)
xb = torch.randn(3, D, dtype=torch.bfloat16)
wb = a8(quantize_stacked(torch.randn(200, D), 1, dtype=torch.bfloat16))
want = ref.linear(xb, wb).float()
for tiles in (GemvTiles(64, 128, 4, 3), GemvTiles(16, 128, rows=1)):
    got = tri.linear(xb, wb, tiles=tiles).float()
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max()), tiles

# whole models: the fused step on the Triton ops against the same step on the torch ops (the reference ops), with
# every block-FP8 GEMM's input quantized (standard attention's fused qkv, o, shared experts, dense first layers, MLA's
# fused projections; MLA's kv_b_proj takes its input as it is)
# (and Qwen3-MoE with 128-wide heads: the o projection's input quantized by the attention kernel, the experts' and
# qkv's by the norms)
for preset, over in (("qwen2_moe_tiny", None), ("qwen3_moe_tiny", None), ("qwen3_moe_tiny", {"head_dim": 128}),
                     ("deepseek_v3_tiny", None)):
    t0 = time.time()
    model = build_model(preset, dtype="fp32", device="cpu", seed=4, weights="fp8_block", activations="fp8_dynamic",
                        config_overrides=over).model
    steps = fused_backends_agree(model, torch.randint(0, 100, (2, 5)), 16, 3, preset)
    if over:
        assert all(steps[1]._o_q) and all(steps[1]._post_q) and all(steps[1]._in_q[:-1]), "producers quantize"
    print(preset, over, round(time.time() - t0, 1), "s")

print("ALL OK")
