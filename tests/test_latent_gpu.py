"""Multi-head latent attention on the fused step on a real GPU (bf16): the Triton kernels against their references at
real shapes (DeepSeek-V3's 128 heads, 512 latent + 64 rotary dims; V2-Lite's 16 heads), then whole tiny models
captured against HF's modules.

Dims: T tokens, H heads, Dn / R non-rotary / rotary dims, C latent dims, L cache slots.
Skipped without CUDA. Run on the H200: `pytest -m gpu -s tests/test_latent_gpu.py`.
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytestmark = pytest.mark.gpu

from moecg.kernels import ref, triton_ops as tri  # noqa: E402
from moecg.kernels.tiles import GemvTiles, MlaTiles  # noqa: E402
from moecg.models import build_model  # noqa: E402
from model_terms import randomise_terms  # noqa: E402 (tests/)
from forced_runs import captured_run, hf_reference, prompts_for  # noqa: E402 (tests/)

BF = torch.bfloat16


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("H", [128, 16])
def test_latent_ops_match_references(T, H):
    g = torch.Generator(device="cuda").manual_seed(T * H)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(BF)  # noqa: E731
    C, R, Dn, L = 512, 64, 128, 640
    kv, q, w = r(T, 1536 + C + R + 8)[:, 1536: 1536 + C + R], r(T, H * (Dn + R)), r(C)
    for layout, tdt in (("pairs_to_halves", BF), ("halves", BF), ("pairs", torch.float32)):
        cos, sin = torch.randn(L, R // 2, device="cuda", generator=g).to(tdt), \
            torch.randn(L, R // 2, device="cuda", generator=g).to(tdt)
        for pos in (torch.tensor(300, device="cuda"), torch.randint(0, L, (T,), device="cuda", generator=g)):
            lat1, kr1 = torch.zeros(T, 1, L, C, device="cuda", dtype=BF), torch.zeros(T, 1, L, R, device="cuda", dtype=BF)
            lat2, kr2 = lat1.clone(), kr1.clone()
            a = ref.mla_rope_cache(kv, q, pos, cos, sin, lat1, kr1, w, 1e-6, H, Dn, layout)
            b = tri.mla_rope_cache(kv, q, pos, cos, sin, lat2, kr2, w, 1e-6, H, Dn, layout)
            # HF's per-op rotary, up to one bf16 rounding of a product (0.016 at |x| ~ 3; bit equality not claimed)
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(kr1.float(), kr2.float(), rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(lat1.float(), lat2.float(), rtol=1e-2, atol=1e-2)
    lat, kr = r(T, 1, L, C), r(T, 1, L, R)
    q_lat = r(H, T, C).transpose(0, 1)  # [T, H, C] strided, as the fused step passes it
    q_pe = r(T, H, R)
    scale = 192 ** -0.5
    for pos in (torch.tensor(0, device="cuda"), torch.tensor(255, device="cuda"), torch.tensor(639, device="cuda"),
                torch.randint(0, L, (T,), device="cuda", generator=g)):
        want = ref.mla_attn_decode(q_lat, q_pe, lat, kr, pos, scale)
        for splits, tiles, merge in ((None, None, None), (1, None, None), (4, None, None), (10, None, None),
                                     (10, None, 2), (10, MlaTiles(64, 32, 8, 2), 2), (4, MlaTiles(32, 32, 8, 2), 1)):
            got = tri.mla_attn_decode(q_lat, q_pe, lat, kr, pos, scale, splits=splits, tiles=tiles, merge=merge)
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    # the per-head projections W_UK (a strided view of kv_b_proj: N stride 1) and W_UV at V3's / V2-Lite's dims
    wkv = (r(H, 256, C) * 0.05)  # [H, Dn + Dv, C]
    # at T rows on the table's tiles, and one row on CUDA-core tiles (rows=1: the products on the CUDA cores)
    for Tq, uk, uv in ((T, None, None), (1, GemvTiles(32, 128, 4, 2, rows=1), GemvTiles(4, 512, 4, 2, rows=1))):
        x = r(Tq, H, Dn + R)[..., :Dn]
        torch.testing.assert_close(tri.head_linear(x, wkv[:, :Dn].transpose(1, 2), uk).float(),
                                   ref.head_linear(x, wkv[:, :Dn].transpose(1, 2)).float(), rtol=2e-2, atol=2e-2)
        o_lat = r(Tq, H, C)
        torch.testing.assert_close(tri.head_linear(o_lat, wkv[:, Dn:], uv).float(),
                                   ref.head_linear(o_lat, wkv[:, Dn:]).float(), rtol=2e-2, atol=2e-2)
    # the fp32 router's logits at V3's (256 experts, D 7168) and V2-Lite's (64, 2048) dims: fp32 sums in another
    # order than cuBLAS's fp32 GEMM, so equal within fp32 rounding of a D-term sum
    for E, D in ((256, 7168), (64, 2048)):
        for wdt in (torch.float32, BF):
            hr, wr = r(T, D), (r(E, D) / D ** 0.5).to(wdt)
            got = tri.router_logits(hr, wr)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, ref.router_logits(hr, wr), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["deepseek_v3_tiny", "deepseek_v2_tiny"])
def test_latent_fused_full_capture_matches_hf(preset):
    """bf16, random biases and correction biases: the fused step captured per bucket (3 real rows in bucket 4),
    teacher-forced against HF's modules eagerly; every real token routed K times per layer."""
    m = build_model(preset, dtype="bf16", device="cuda", seed=1, config_overrides={"attention_bias": True}).model
    randomise_terms(m, 0)
    prompts = prompts_for(m)
    r_ref, s_ref = hf_reference(m, prompts)
    caps = []
    for strategy, disp in (("full", "fused"), ("capacity", "capacity")):
        f = captured_run(m, prompts, r_ref, strategy, disp)
        print(f"{preset} {strategy}: forced agreement {f.agreement:.3f}, max logit diff {f.max_logit_diff:.4f}")
        assert f.state["tokens"] == s_ref["tokens"]
        if strategy == "full":
            assert f.agreement >= 0.95 and f.state["routed_assignments"] == s_ref["routed_assignments"]
        else:
            caps.append((f.run, f.state))
    # capacity on HF's modules, captured the same way and teacher-forced alike: the group-limited router and the
    # Triton capacity kernel drop what the HF-module path drops (the first MoE layer sees the same inputs: exactly)
    hf = captured_run(m, prompts, r_ref, "capacity", "capacity", kernels="hf")
    r_hf, s_hf = hf.run, hf.state
    (r, s), = caps
    agree = float((r.tokens == r_hf.tokens).float().mean())
    print(f"{preset} capacity fused vs HF modules: agreement {agree:.3f}, dropped {s['dropped_assignments']} vs "
          f"{s_hf['dropped_assignments']} of {s_hf['routed_assignments']}")
    assert s_hf["dropped_assignments"] > 0 and s["dropped"][0] == s_hf["dropped"][0]
    assert s["routed_assignments"] == s_hf["routed_assignments"] and s["capacity_used"] == s_hf["capacity_used"]
    assert agree >= 0.95


@pytest.mark.parametrize("preset", ["deepseek_v2_tiny", "deepseek_v3_tiny"])
def test_shared_gemm_on_the_side_stream_gives_the_same_bits(preset, monkeypatch):
    """moecg.fast.step.SHARED_GEMM_ON_SIDE moves the shared expert's gate/up GEMM beside the fp32 router (the same
    kernels on the same inputs, another stream): captured and teacher-forced, every step's logits the same bits."""
    from moecg.fast import step as fast_step

    m = build_model(preset, dtype="bf16", device="cuda", seed=1).model
    randomise_terms(m, 0)
    prompts = prompts_for(m)
    r_ref, _ = hf_reference(m, prompts)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(fast_step, "SHARED_GEMM_ON_SIDE", on)
        runs.append(captured_run(m, prompts, r_ref, "full", "fused").run)
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert all(torch.equal(a, b) for a, b in zip(runs[0].logits, runs[1].logits))
