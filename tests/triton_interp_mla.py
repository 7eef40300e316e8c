"""Run by tests/test_latent.py under TRITON_INTERPRET=1: the multi-head latent attention kernels (moecg.kernels.mla)
on CPU tensors against their references (every rotary layout, fp32 and model-dtype tables, one position for every
row and each row's own, one split and split contexts, padded head blocks and latent dims), then DeepSeek-V2's and
-V3's whole fused decode with the Triton ops against the torch ops.

Dims: T tokens, H heads, Dn / R non-rotary / rotary dims, C latent dims, L cache slots. Prints ALL OK when every
check passes; any mismatch raises. Not collected by pytest (no test_ prefix): TRITON_INTERPRET must be set before
triton is imported.
"""
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from moecg.kernels import ref  # noqa: E402
from moecg.kernels import triton_ops as tri  # noqa: E402
from moecg.kernels.tiles import GemvTiles, MlaTiles  # noqa: E402
from moecg.models import build_model  # noqa: E402

from interp_common import close, fused_backends_agree  # noqa: E402 (tests/, this script's directory)

torch.manual_seed(0)
T, Dn, L = 3, 16, 130
for H, C, R in ((4, 32, 8), (20, 48, 16)):  # 20 heads: two head blocks, the second padded; C 48: padded to 64
    kv, q = torch.randn(T, C + R + 5)[:, : C + R], torch.randn(T, H * (Dn + R))  # kv: a row-strided slice
    w = torch.randn(C)
    for layout in ref.ROPE_LAYOUTS:
        for tdt in (torch.float32,):  # bf16 tables (per-op rounding) on the GPU: the interpreter's bf16 casts truncate
            cos, sin = torch.randn(L, R // 2).to(tdt), torch.randn(L, R // 2).to(tdt)
            for pos in (torch.tensor(7), torch.tensor([3, 120, 0])):
                lat1, kr1 = torch.zeros(T, 1, L, C), torch.zeros(T, 1, L, R)
                lat2, kr2 = lat1.clone(), kr1.clone()
                a = ref.mla_rope_cache(kv, q, pos, cos, sin, lat1, kr1, w, 1e-6, H, Dn, layout)
                b = tri.mla_rope_cache(kv, q, pos, cos, sin, lat2, kr2, w, 1e-6, H, Dn, layout)
                close(a, b)
                close(lat1, lat2)
                close(kr1, kr2)
    lat, kr = torch.randn(T, 1, L, C), torch.randn(T, 1, L, R)
    q_lat = torch.randn(H, T, C).transpose(0, 1)  # [T, H, C] strided, as the fused step passes it
    q_pe = torch.randn(T, H, R)
    wide = MlaTiles(heads=32, block_l=16, warps=4, stages=2, merge_tile=64)  # one padded block of 32 heads
    for pos in (torch.tensor(0), torch.tensor(63), torch.tensor(129), torch.tensor([5, 70, 129])):
        want = ref.mla_attn_decode(q_lat, q_pe, lat, kr, pos, 0.3)
        for splits, tiles, merge in ((None, None, None), (1, None, None), (3, None, None), (3, None, 2),
                                     (2, wide, 2), (3, wide, 1)):
            close(want, tri.mla_attn_decode(q_lat, q_pe, lat, kr, pos, 0.3, splits=splits, tiles=tiles, merge=merge))
    # the per-head projections (W_UK's strided view: N stride 1; W_UV's rows), T up to the GEMV's 16 rows and past
    wkv = torch.randn(H, Dn + 24, C)  # as kv_b_proj's weight viewed [H, Dn + Dv, C]
    core_uk, core_uv = GemvTiles(8, 64, 4, 2, rows=1), GemvTiles(4, 32, 4, 2, rows=1)  # CUDA-core rows, K masked
    for Tq in (1, 3, 17):
        x = torch.randn(Tq, H, Dn + R)[..., :Dn]  # q_nope: a slice of q, K contiguous
        o_lat = torch.randn(Tq, H, C)
        for uk, uv in ((None, None), (core_uk, core_uv)):
            close(ref.head_linear(x, wkv[:, :Dn].transpose(1, 2)), tri.head_linear(x, wkv[:, :Dn].transpose(1, 2), uk))
            close(ref.head_linear(o_lat, wkv[:, Dn:]), tri.head_linear(o_lat, wkv[:, Dn:], uv))
# the fp32 router's logits (DeepSeek's, GLM's): bf16 or fp32 rows, fp32 or bf16 weights; E and D not a tile's
# multiple; 17 rows: F.linear on the table's choice, the kernel on given tiles
for hdt, wdt in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)):
    wr = torch.randn(5, 48).to(wdt)
    for Tq in (1, 3, 17):
        hr = torch.randn(Tq, 48).to(hdt)
        for t in (None, GemvTiles(2, 32, 4, 2, rows=1)):
            got = tri.router_logits(hr, wr, t)
            assert got.dtype == torch.float32
            close(ref.router_logits(hr, wr), got, 1e-5)
print("kernels ok")

prompts = torch.randint(0, 512, (3, 7), generator=torch.Generator().manual_seed(0))
# DeepSeek-V3 with biases (q LoRA, its norm, interleaved rotary); DeepSeek-V2's layout is checked op by op above
for preset, overrides in (("deepseek_v3_tiny", {"attention_bias": True}),):
    model = build_model(preset, dtype="fp32", device="cpu", seed=0, config_overrides=overrides).model
    fused_backends_agree(model, prompts, 32, 4, preset)
    print(preset, "ok")
print("ALL OK")
