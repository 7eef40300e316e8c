"""capture.kernels=fused for GLM-4-MoE, OLMoE and GPT-OSS on CPU: the new routers equal HF's router modules bit for
bit, the new reference ops round as HF's modules, the fused step (PyTorch reference ops) agrees with HF's modules
teacher-forced (also captured with emulated graphs, padded, at a batch that is not a bucket), and the new Triton kernels match their references under Triton's interpreter.

Dims: T tokens, B rows, D hidden, Hq/Hkv heads, Dh head dim, R rotary dims, E experts, K top-k, V vocab.
Tiny models get random biases, correction biases and sinks (HF initialises them to zero, which would hide a dropped
term) and a small swiglu_limit, so GPT-OSS's clamps bite.
"""
import sys

import pytest
import torch
import torch.nn.functional as F

from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.engine import DecodeEngine
from moecg.fast import FastDecode
from moecg.kernels import ref
from moecg.models import build_model
from model_terms import randomise_terms  # tests/
from interp_runner import needs_triton, run_marked  # tests/

S, NEW, LEN = 7, 10, 48
LOGIT_TOL = 1e-4  # fp32: different GEMM shapes and accumulation orders than HF's modules
# (preset, config overrides): every preset's features, plus the variants its tiny preset leaves out
CASES = {
    "glm4": ("glm4_moe_tiny", {}),
    # group-limited choice that matters (4 groups, best 2 kept), per-head q/k norm, scaled weights
    "glm4_groups_qknorm": ("glm4_moe_tiny", {"n_group": 4, "topk_group": 2, "use_qk_norm": True,
                                             "routed_scaling_factor": 2.5, "first_k_dense_replace": 2}),
    "olmoe": ("olmoe_tiny", {}),
    "olmoe_clip_bias": ("olmoe_tiny", {"clip_qkv": 0.5, "attention_bias": True, "norm_topk_prob": True}),
    "gpt_oss": ("gpt_oss_tiny", {"swiglu_limit": 0.3}),
}


def _build(preset, overrides, seed=0, dtype="fp32"):
    b = build_model(preset, dtype=dtype, device="cpu", seed=seed, config_overrides=overrides)
    randomise_terms(b.model, seed)
    return b


def _prompts(n=3, seed=0):
    return torch.randint(0, 512, (n, S), generator=torch.Generator().manual_seed(seed))


def _agreement(got, want):
    agree = float((got.tokens == want.tokens).float().mean())
    diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits))
    return agree, diff


# -- routers: the references are HF's routers --------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [(1, 1, True, 1.0), (4, 2, True, 2.5), (8, 3, False, 1.5)],
                         ids=["flat", "grouped", "grouped_unnormalised"])
def test_sigmoid_group_reference_is_hfs_router(groups, dtype):
    """GLM-4-MoE's and DeepSeek-V3's router (fp32 weight, fp32 GEMM on a bf16 model): identical ids and weights."""
    from transformers import DeepseekV3Config, Glm4MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    n_group, topk_group, norm, scaling = groups
    kw = dict(hidden_size=64, n_routed_experts=32, num_experts_per_tok=6, n_group=n_group, topk_group=topk_group,
              norm_topk_prob=norm, routed_scaling_factor=scaling)
    g = torch.Generator().manual_seed(n_group)
    for router in (Glm4MoeTopkRouter(Glm4MoeConfig(**kw)), DeepseekV3TopkRouter(DeepseekV3Config(**kw))):
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
            router.e_score_correction_bias.copy_(torch.rand(32, generator=g) * 0.3)
        h = torch.randn(64, 64, generator=g).to(dtype)
        with torch.no_grad():
            logits, w, idx = router(h)
            mine = F.linear(h.float(), router.weight.float())  # FastDecode's fp32 router GEMM
            idx2, w2 = ref.route_sigmoid_group(mine, router.e_score_correction_bias, 6, n_group, topk_group, norm,
                                               scaling)
        assert torch.equal(mine, logits) and torch.equal(idx2, idx) and torch.equal(w2, w) and w2.dtype == w.dtype
        if n_group > 1:  # the group limit changed some choice: the test has teeth
            idx_flat, _ = ref.route_sigmoid_group(mine, router.e_score_correction_bias, 6, 1, 1, norm, scaling)
            assert not torch.equal(idx_flat.sort(1).values, idx.sort(1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_softmax_reference_is_hfs_router(dtype):
    """GPT-OSS's router: logits with its bias (FastDecode's concatenated GEMM adds it), top-k, softmax in bf16."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    router = GptOssTopKRouter(GptOssConfig(hidden_size=64, num_local_experts=32, num_experts_per_tok=4)).to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.bias.copy_(torch.randn(32, generator=g))
        h = torch.randn(64, 64, generator=g).to(dtype)
        logits, w, idx = router(h)
        idx2, w2 = ref.route_topk_softmax(F.linear(h, router.weight, router.bias), 4)
    assert torch.equal(idx2, idx) and torch.equal(w2, w) and w2.dtype == dtype


# -- the other reference ops round as HF's modules -----------------------------------------------------------
@pytest.mark.parametrize("preset", ["glm4_moe_tiny", "olmoe_tiny", "gpt_oss_tiny"])
def test_rope_cache_reference_is_hfs_attention_prologue(preset):
    """bf16: q and k as each family's attention computes them before the softmax (q/k norm per head or over the
    projection, partial rotary, GPT-OSS's half tables), bit for bit; v written as is."""
    overrides = {"use_qk_norm": True} if preset == "glm4_moe_tiny" else {}
    b = _build(preset, overrides, dtype="bf16")
    m, ad = b.model, b.adapter
    at = ad.layers(m)[0].self_attn
    torch.manual_seed(0)
    with torch.no_grad():
        for norm in ("q_norm", "k_norm"):
            if hasattr(at, norm):
                getattr(at, norm).weight.normal_()
    mod = sys.modules[type(at).__module__]
    fast = FastDecode(m, "torch")
    cos, sin = fast._rope_tables(_FakeCache(LEN).layers)  # [LEN, R]
    T, Hq, Hkv, Dh, pos = 3, fast.layers[0].n_q, fast.layers[0].n_kv, at.head_dim, 9
    h = torch.randn(T, 1, m.config.hidden_size).to(torch.bfloat16)
    with torch.no_grad():
        q, k = at.q_proj(h), at.k_proj(h)  # [T, 1, H*Dh]
        if preset == "olmoe_tiny":  # OlmoeAttention: norms over the whole projection, before the head split
            q, k = at.q_norm(q), at.k_norm(k)
        q, k = q.view(T, 1, Hq, Dh), k.view(T, 1, Hkv, Dh)
        if getattr(at, "use_qk_norm", False):  # Glm4MoeAttention: per head
            q, k = at.q_norm(q), at.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [T, H, 1, Dh]
        hf_cos, hf_sin = m.model.rotary_emb(h, torch.tensor([[pos]]))
        want_q, want_k = mod.apply_rotary_pos_emb(q, k, hf_cos, hf_sin)  # [T, H, 1, Dh]
        qkv = F.linear(h[:, 0], fast.layers[0].wqkv, fast.layers[0].bqkv)
        keys, values = torch.zeros(T, Hkv, LEN, Dh, dtype=torch.bfloat16), torch.zeros(T, Hkv, LEN, Dh,
                                                                                     dtype=torch.bfloat16)
        got_q = ref.rope_cache(qkv, torch.tensor(pos), cos, sin, keys, values, Hq, Hkv, Dh, fast.layers[0].q_norm,
                               fast.layers[0].k_norm, fast.layers[0].qk_eps)
    assert torch.equal(got_q, want_q[:, :, 0]) and torch.equal(keys[:, :, pos], want_k[:, :, 0])
    assert torch.equal(values[:, :, pos], at.v_proj(h).view(T, Hkv, Dh))


class _FakeCache:
    """Just what FastDecode._rope_tables reads: every layer's key length."""

    def __init__(self, length):
        self.layers = [type("C", (), {"keys": torch.zeros(1, 1, length, 1), "is_sliding": False})()]


def test_sink_attention_reference_is_hfs_eager():
    """GPT-OSS's eager attention (sinks join the softmax, then dropped) == ref.attn_decode, full and sliding: to fp32
    rounding with fp32 softmax (eager=False), bit for bit in bf16 with eager=True."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    T, Hq, Hkv, Dh, L, pos = 2, 4, 2, 16, 24, 20
    q, keys, values = torch.randn(T, Hq, Dh), torch.randn(T, Hkv, L, Dh), torch.randn(T, Hkv, L, Dh)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = torch.randn(Hq) * 2, Hq // Hkv, False
    for window in (0, 6):
        kv = torch.arange(L)
        ok = (kv <= pos) & ((kv > pos - window) if window else True)
        mask = torch.where(ok, 0.0, float("-inf"))[None, None, None, :]
        want, _ = eager_attention_forward(module, q[:, :, None], keys, values, mask, 0.25)  # [T, 1, Hq, Dh]
        got = ref.attn_decode(q, keys, values, torch.tensor(pos), 0.25, window, module.sinks)
        torch.testing.assert_close(got, want.reshape(T, Hq * Dh), atol=1e-6, rtol=1e-5)
        no_sink = ref.attn_decode(q, keys, values, torch.tensor(pos), 0.25, window)
        assert float((no_sink - got).abs().max()) > 1e-2  # the sinks matter at this scale
        # bf16: eager=True rounds where HF's eager attention rounds, bit for bit
        bf = [t.to(torch.bfloat16) for t in (q, keys, values, module.sinks)]
        module.sinks = bf[3]
        want, _ = eager_attention_forward(module, bf[0][:, :, None], bf[1], bf[2], mask.to(torch.bfloat16), 0.25)
        got = ref.attn_decode(*bf[:3], torch.tensor(pos), 0.25, window, bf[3], eager=True)
        assert torch.equal(got, want.reshape(T, Hq * Dh))
        module.sinks = module.sinks.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_norm_and_experts_references(dtype):
    """GPT-OSS's RMSNorm (fp32 product, then cast; fp32 or bf16 weight) and experts ([E, D, 2I] interleaved, biases,
    clamped SwiGLU) as HF computes them: bit for bit in bf16 (one expert per token, weight 1), to rounding in fp32."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    b = _build("gpt_oss_tiny", {"swiglu_limit": 0.3}, dtype="bf16" if dtype == torch.bfloat16 else "fp32")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(dtype)
    for wdt in (dtype, torch.float32):
        norm = GptOssRMSNorm(64, eps=1e-5).to(wdt)
        with torch.no_grad():
            norm.weight.normal_(generator=g)
        assert torch.equal(ref.rmsnorm(x, norm.weight, 1e-5, cast_last=True), norm(x))
        _, normed = ref.add_rmsnorm(x[:, None], None, norm.weight, 1e-5, cast_last=True, out_dtype=dtype)
        assert torch.equal(normed, norm(x))
    experts = b.adapter.experts_of(b.adapter.layers(b.model)[0])
    spec = b.adapter.expert_spec(experts)
    assert (spec.act, spec.interleaved, spec.transposed, spec.has_bias) == ("swiglu_clamp", True, True, True)
    gu = torch.randn(6, 2 * 32, generator=g).to(dtype)
    assert torch.equal(ref.expert_act(gu, spec), experts._apply_gate(gu))
    h = torch.randn(20, 64, generator=g).to(dtype)
    idx, w = torch.randint(0, 8, (20, 1), generator=g), torch.ones(20, 1, dtype=dtype)
    with torch.no_grad():
        want = type(experts).forward.__wrapped__(experts, h, idx, w)  # HF's own loop
        got = ref.moe_experts(h, idx, w, experts.gate_up_proj, experts.down_proj, spec=spec,
                              gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias)[:, 0]
    if dtype == torch.bfloat16:
        assert torch.equal(got.to(dtype), want)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- whole models: the fused step against HF's modules ------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_fused_step_matches_hf_modules(case):
    """Teacher-forced: fused-step tokens agree with HF's modules, logits to fp32 rounding, same routing counts."""
    preset, overrides = CASES[case]
    model = _build(preset, overrides).model
    prompts = _prompts()
    attach(model, make_dispatcher("dropless"), max_rows=4)
    want = DecodeEngine(model, LEN, 4).generate(prompts, NEW, keep_logits=True, timing=False)
    want_counts = state_of(model).snapshot()
    detach(model)
    attach(model, make_dispatcher("fused"), max_rows=4)
    eng = DecodeEngine(model, LEN, 4)
    eng.decode_forward = FastDecode(model, "torch")
    got = eng.generate(prompts, NEW, keep_logits=True, timing=False, force_tokens=want.tokens)
    counts = state_of(model).snapshot()
    detach(model)
    agree, diff = _agreement(got, want)
    assert agree >= 0.99 and diff < LOGIT_TOL, (agree, diff)
    assert counts["tokens"] == want_counts["tokens"] and counts["routed"] == want_counts["routed"]


@pytest.mark.parametrize("case", ["glm4_groups_qknorm", "olmoe_clip_bias", "gpt_oss"])
def test_fused_capture_emulated_padding(case):
    """Emulated graphs per bucket, kernels=fused with the torch ops, 3 real rows in bucket 4: teacher-forced against
    HF's modules; then rows leaving mid-decode (buckets 4, 2, 1), free-running, same tokens."""
    preset, overrides = CASES[case]
    model = _build(preset, overrides, seed=1).model
    prompts, lengths = _prompts(3, seed=1), [NEW, 4, 7]
    attach(model, make_dispatcher("dropless"), max_rows=4)
    eng = DecodeEngine(model, LEN, 4)
    want = eng.generate(prompts, NEW, keep_logits=True, timing=False)
    want_short = eng.generate(prompts, NEW, lengths=lengths, timing=False)
    detach(model)
    attach(model, make_dispatcher("fused"), max_rows=4)
    eng = DecodeEngine(model, LEN, 4)
    cap = Capture(eng, "full", buckets=(1, 2, 4), backend="emulate", kernels="fused", kernel_backend="torch").apply()
    got = eng.generate(prompts, NEW, keep_logits=True, timing=False, force_tokens=want.tokens)
    assert set(got.step_rows) == {4}  # 3 rows padded to bucket 4
    agree, diff = _agreement(got, want)
    assert agree >= 0.99 and diff < LOGIT_TOL, (agree, diff)
    short = eng.generate(prompts, NEW, lengths=lengths, timing=False)
    st = cap.stats()
    cap.unwrap()
    detach(model)
    assert st["kernels"] == "fused" and st["kernel_backend"] == "torch" and st["graphs"] == 3
    assert set(short.step_rows) == {4, 2, 1}
    assert float((short.tokens == want_short.tokens).float().mean()) >= 0.99


def test_dropped_terms_show():
    """The comparisons have teeth: leaving out the sinks, the router bias or the clamp changes GPT-OSS's logits by
    far more than LOGIT_TOL (20x or more)."""
    model = _build("gpt_oss_tiny", {"swiglu_limit": 0.3}).model
    prompts = _prompts(2)
    attach(model, make_dispatcher("dropless"), max_rows=2)
    eng = DecodeEngine(model, LEN, 2)
    want = eng.generate(prompts, 4, keep_logits=True, timing=False)
    fast = FastDecode(model, "torch")
    for drop in ("sinks", "bcat", "window"):
        saved = [getattr(L, drop) for L in fast.layers]
        for L in fast.layers:
            setattr(L, drop, 0 if drop == "window" else None)
        eng.decode_forward = fast
        got = eng.generate(prompts, 4, keep_logits=True, timing=False, force_tokens=want.tokens)
        assert _agreement(got, want)[1] > 20 * LOGIT_TOL, drop
        for L, v in zip(fast.layers, saved):
            setattr(L, drop, v)
    detach(model)


@needs_triton
@pytest.mark.interp("triton_interp_families.py")
def test_triton_kernels_under_interpreter(request):
    """The new Triton kernels (rope variants, sinks, both routers, biased interleaved experts, cast-last norm) on CPU
    through TRITON_INTERPRET=1 against their references, and each family's fused decode, Triton ops == torch ops."""
    run_marked(request)
