"""The fused decode path on a real GPU (bf16): each Triton op against its PyTorch reference, then whole models.

Dims: T tokens (= rows), D hidden, E experts, K top-k.
Skipped without CUDA. Run on the H200: `pytest -m gpu -s tests/test_fast_gpu.py`.
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytestmark = pytest.mark.gpu

from moecg.capture import Capture  # noqa: E402
from moecg.dispatch import attach, detach, make_dispatcher, state_of  # noqa: E402
from moecg.dispatch.state import LayerCounters  # noqa: E402
from moecg.engine import DecodeEngine  # noqa: E402
from moecg.kernels import ref, triton_ops as tri  # noqa: E402
from moecg.models import build_model  # noqa: E402

BF = torch.bfloat16


def _close(a, b, rtol=2e-2, atol=2e-2):
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


def _counters(E):
    z = lambda dt=torch.int64: torch.zeros(E, dtype=dt, device="cuda")  # noqa: E731
    return LayerCounters(z(), z(), z(torch.float32), z(torch.float32), torch.zeros((), dtype=torch.int64,
                         device="cuda"), torch.zeros((), dtype=torch.int64, device="cuda"))


@pytest.mark.parametrize("T", [1, 3, 8, 64])
def test_norm_rope_attn_route_ops(T):
    g = torch.Generator(device="cuda").manual_seed(T)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(BF)  # noqa: E731
    D, Hq, Hkv, Dh, L, E, K = 2048, 32, 4, 128, 256, 60, 4
    y, res, w = r(T, K, D).float(), r(T, D), r(D)
    sh, sg = r(T, D), r(T, 3)[:, 1]
    for kw in ({}, {"shared": sh, "shared_gate": sg}):
        for a, b in zip(ref.add_rmsnorm(y, res, w, 1e-6, **kw), tri.add_rmsnorm(y, res, w, 1e-6, **kw)):
            _close(a, b)
    qkv, cos, sin = r(T, (Hq + 2 * Hkv) * Dh), r(L, Dh), r(L, Dh)
    pos = torch.tensor(100, device="cuda")
    qn, kn = r(Dh), r(Dh)
    k1, v1 = torch.zeros(T, Hkv, L, Dh, device="cuda", dtype=BF), torch.zeros(T, Hkv, L, Dh, device="cuda", dtype=BF)
    k2, v2 = k1.clone(), v1.clone()
    _close(ref.rope_cache(qkv, pos, cos, sin, k1, v1, Hq, Hkv, Dh, qn, kn),
           tri.rope_cache(qkv, pos, cos, sin, k2, v2, Hq, Hkv, Dh, qn, kn))
    _close(k1, k2)
    assert torch.equal(v1, v2)
    keys, vals, q = r(T, Hkv, L, Dh), r(T, Hkv, L, Dh), r(T, Hq, Dh)
    for p, window in ((0, 0), (100, 0), (255, 0), (200, 64)):
        p_t = torch.tensor(p, device="cuda")
        _close(ref.attn_decode(q, keys, vals, p_t, Dh ** -0.5, window),
               tri.attn_decode(q, keys, vals, p_t, Dh ** -0.5, window))
    logits = r(T, E + 5)[:, 5:]
    for norm in (True, False):
        i1, w1 = ref.route(logits, K, norm, BF)
        i2, w2 = tri.route(logits, K, norm, BF)
        assert torch.equal(i1, i2)
        _close(w1, w2, 0, 1e-2)
    gu = r(T, 2 * 5632 + 1)
    _close(ref.silu_mul(gu, 5632), tri.silu_mul(gu, 5632))


@pytest.mark.parametrize("shape", [(60, 4, 2048, 1408), (8, 2, 4096, 14336), (128, 8, 2048, 768)],
                         ids=["qwen1.5", "mixtral", "qwen3"])
@pytest.mark.parametrize("T", [1, 5, 16, 17, 64])
def test_moe_kernel_matches_reference_and_counts(shape, T):
    E, K, D, inter = shape
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, D, device="cuda", generator=g).to(BF)
    gate_up = (torch.randn(E, 2 * inter, D, device="cuda", generator=g) / D ** 0.5).to(BF)
    down = (torch.randn(E, D, inter, device="cuda", generator=g) / inter ** 0.5).to(BF)
    idx, w = ref.route(torch.randn(T, E, device="cuda", generator=g), K, True, BF)
    valid = torch.ones(T, dtype=torch.bool, device="cuda")
    valid[T // 2:] = T == 1
    for v in (None, valid):
        c1, c2 = _counters(E), _counters(E)
        want = ref.moe_experts(x, idx, w, gate_up, down, v, c1)
        got = tri.moe_experts(x, idx, w, gate_up, down, v, c2)
        _close(got, want, 2e-2, 5e-3)
        assert torch.equal(c1.routed, c2.routed) and torch.equal(c1.tokens, c2.tokens)
        _close(c1.routed_mass, c2.routed_mass, 1e-5, 1e-5)


@pytest.mark.parametrize("preset", ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny"])
def test_fused_full_capture_matches_hf_eager(preset):
    """Whole models, bf16: the fused step captured per bucket (3 real rows in bucket 4) gives HF's greedy tokens."""
    b = build_model(preset, dtype="bf16", device="cuda", seed=1)
    m = b.model
    prompts = torch.randint(0, m.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    attach(m, make_dispatcher("dropless"), max_rows=8)
    r_ref = DecodeEngine(m, 64, 8).generate(prompts, 16, keep_logits=True, timing=False)
    s_ref = state_of(m).snapshot()
    detach(m)
    attach(m, make_dispatcher("fused"), max_rows=8)
    eng = DecodeEngine(m, 64, 8)
    cap = Capture(eng, "full", buckets=(1, 2, 4, 8), kernels="fused").apply()
    assert cap.stats()["kernel_backend"] == "triton" and cap.captured
    r = eng.generate(prompts, 16, keep_logits=True, timing=False)
    s = state_of(m).snapshot()
    agree = float((r.tokens == r_ref.tokens).float().mean())
    diff = max(float((a - c).abs().max()) for a, c in zip(r.logits, r_ref.logits))
    print(f"{preset}: agreement {agree:.3f}, max logit diff {diff:.4f}, replays {cap.stats()['buckets']}")
    assert agree == 1.0
    # dropless both: every real token routed K times per layer (per-expert counts may differ at router near-ties)
    assert s["routed_assignments"] == s_ref["routed_assignments"] and s["tokens"] == s_ref["tokens"]
    assert s["dropped_assignments"] == 0
    cap.unwrap()
    detach(m)
