"""Rotary + KV write inside the decode attention (ops.rope_attn_decode, moecg.fast.step.ROPE_IN_ATTENTION) on a real
GPU (bf16): against rope_cache then attn_decode at the families' real shapes, and whole models captured with it on
and off. Skipped without CUDA. Run on the H200: `pytest -m gpu -s tests/test_rope_attn_gpu.py`.
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytestmark = pytest.mark.gpu

from moecg.kernels import ref, triton_ops as tri  # noqa: E402
from moecg.models import build_model  # noqa: E402
from model_terms import randomise_terms  # noqa: E402 (tests/)
from forced_runs import captured_run, hf_reference, prompts_for  # noqa: E402 (tests/)

BF = torch.bfloat16
# (Hq, Hkv, Dh, R, per-head q/k norm, sinks, window, eager): Qwen3-30B-A3B, GLM-4.5-Air (partial rotary), Mixtral
# (8 kv heads of 128), GPT-OSS-20B (sinks, window 128, HF eager's rounding)
SHAPES = ((32, 4, 128, 128, True, False, 0, False), (96, 8, 128, 64, False, False, 0, False),
          (32, 8, 128, 128, False, False, 0, False), (64, 8, 64, 64, False, True, 128, True))


@pytest.mark.parametrize("T", [1, 3, 8, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=("qwen3", "glm", "mixtral", "gpt_oss"))
def test_rope_attn_decode_matches_rope_cache_then_attention(shape, T):
    """The same cache writes and outputs as the two kernels it replaces (full rotary without a norm: the same bits; a
    per-head norm's sum of squares and partial rotary: to a bf16 ulp), at one position and per-row positions, one
    split and several."""
    Hq, Hkv, Dh, R, norm, sink, window, eager = shape
    g = torch.Generator(device="cuda").manual_seed(T)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(BF)  # noqa: E731
    L = 512
    qkv, cos, sin = r(T, (Hq + 2 * Hkv) * Dh) * 3, r(L, R), r(L, R)
    qn, kn = (r(Dh), r(Dh)) if norm else (None, None)
    sinks = r(Hq) if sink else None
    keys, vals = r(T, Hkv, L, Dh), r(T, Hkv, L, Dh)
    for pos in (torch.tensor(300, device="cuda"), torch.tensor(40, device="cuda"),
                torch.randint(0, L, (T,), device="cuda", generator=g)):
        k1, v1, k2, v2 = keys.clone(), vals.clone(), keys.clone(), vals.clone()
        q = tri.rope_cache(qkv, pos, cos, sin, k1, v1, Hq, Hkv, Dh, qn, kn)
        want = tri.attn_decode(q, k1, v1, pos, Dh ** -0.5, window, sinks, eager)
        got = tri.rope_attn_decode(qkv, pos, cos, sin, k2, v2, Hq, Hkv, Dh, Dh ** -0.5, window, sinks, eager,
                                   q_norm=qn, k_norm=kn)
        assert torch.equal(v1, v2)
        if R == Dh and not norm:
            assert torch.equal(k1, k2) and torch.equal(got, want)
        torch.testing.assert_close(k2.float(), k1.float(), rtol=2e-2, atol=6.25e-2)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        k3, v3 = keys.clone(), vals.clone()
        torch.testing.assert_close(
            got.float(), ref.rope_attn_decode(qkv, pos, cos, sin, k3, v3, Hq, Hkv, Dh, Dh ** -0.5, window, sinks,
                                              eager, q_norm=qn, k_norm=kn).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("preset", ["qwen3_moe_tiny", "glm4_moe_tiny", "mixtral_tiny", "gpt_oss_tiny", "olmoe_tiny"])
def test_rope_in_attention_whole_models(preset, monkeypatch):
    """Captured per bucket, teacher-forced against HF eager with ROPE_IN_ATTENTION on and off: both agree with HF as
    the fused step does, the same routing, and (nearly) the same tokens as each other (OLMoE's whole-projection norm
    keeps rope_cache: the same bits)."""
    from moecg.fast import step as fast_step

    overrides = {"use_qk_norm": True} if preset == "glm4_moe_tiny" else {}
    m = build_model(preset, dtype="bf16", device="cuda", seed=1, config_overrides=overrides).model
    randomise_terms(m, 0)
    prompts = prompts_for(m)
    r_ref, s_ref = hf_reference(m, prompts)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(fast_step, "ROPE_IN_ATTENTION", on)
        f = captured_run(m, prompts, r_ref)
        assert f.agreement >= 0.95
        assert f.state["routed_assignments"] == s_ref["routed_assignments"]
        runs.append(f.run)
    assert float((runs[0].tokens == runs[1].tokens).float().mean()) >= 0.95
    if preset == "olmoe_tiny":
        assert all(torch.equal(a, b) for a, b in zip(runs[0].logits, runs[1].logits))
    else:
        assert max(float((a - b).abs().max()) for a, b in zip(runs[0].logits, runs[1].logits)) < 0.5
