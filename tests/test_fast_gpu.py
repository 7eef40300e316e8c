"""The fused decode path on a real GPU (bf16): each Triton op against its PyTorch reference, then whole models.

Dims: T tokens (= rows), D hidden, E experts, K top-k.
Skipped without CUDA. Run on the H200: `pytest -m gpu -s tests/test_fast_gpu.py`.
"""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytestmark = pytest.mark.gpu

from moecg.capture import Capture  # noqa: E402
from moecg.dispatch import attach, detach, make_dispatcher  # noqa: E402
from moecg.dispatch.state import LayerCounters  # noqa: E402
from moecg.engine import DecodeEngine  # noqa: E402
from moecg.kernels import launch, ref, triton_ops as tri  # noqa: E402
from moecg.kernels.tiles import MoeTiles, moe_tiles  # noqa: E402
from moecg.models import build_model  # noqa: E402
from model_terms import randomise_terms  # noqa: E402 (tests/)
from forced_runs import captured_run, hf_reference, prompts_for  # noqa: E402 (tests/)

BF = torch.bfloat16


def _close(a, b, rtol=2e-2, atol=2e-2):
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


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
        c1 = LayerCounters.zeros(E, "cuda")
        want = ref.moe_experts(x, idx, w, gate_up, down, v, c1)
        # the default grid and tiles, both grids, and the split-K down and up GEMMs (partials added once, in order)
        for grid, split, usplit in (("auto", None, 1), ("expert", 1, 1), ("slot", 1, 1), ("auto", 2, 1),
                                    ("slot", 4, 1), ("auto", 1, 2), ("expert", 2, 4)):
            c2 = LayerCounters.zeros(E, "cuda")
            tiles = None if split is None else replace(moe_tiles(T, D, inter, E), down_split=split, up_split=usplit)
            got = tri.moe_experts(x, idx, w, gate_up, down, v, c2, grid=grid, tiles=tiles)
            _close(got, want, 2e-2, 5e-3)
            assert torch.equal(c1.routed, c2.routed) and torch.equal(c1.tokens, c2.tokens), (grid, split)
            _close(c1.routed_mass, c2.routed_mass, 1e-5, 1e-5)
            if split and max(split, usplit) > 1:  # deterministic: the same bits again, the counters back at zero
                assert torch.equal(got, tri.moe_experts(x, idx, w, gate_up, down, v, None, grid=grid, tiles=tiles))
                assert all(int(s.abs().sum()) == 0 for s in launch._SEMS.values())


@pytest.mark.parametrize("shape", [(128, 8, 2048, None), (8, 2, 4096, None), (64, 8, 2048, None),
                                   (32, 4, 2880, "topk_softmax"), (128, 4, 2880, "topk_softmax")],
                         ids=["qwen3", "mixtral", "olmoe", "gpt_oss_20b", "gpt_oss_120b"])
@pytest.mark.parametrize("T", [1, 8, 64])
@pytest.mark.parametrize("warp_topk", [False, True])
def test_norm_route_matches_reference(shape, T, warp_topk, monkeypatch):
    """residual + norm + router GEMV + top-k in one kernel against add_rmsnorm, F.linear and the router reference:
    residual bit-equal, normed row close, the chosen experts equal on all but near-tie rows, weights close; twice
    the same bits; the arrival counters back at zero. GPT-OSS's router: its own bias, top-k then softmax. warp_topk:
    NormRouteTiles' top-k a warp a row (64-128 experts)."""
    from moecg.kernels import tiles as tiles_mod

    tiles_of = tiles_mod.norm_route_tiles
    monkeypatch.setattr(tiles_mod, "norm_route_tiles", lambda *a: replace(tiles_of(*a), warp_topk=warp_topk))
    E, K, D, kind = shape
    g = torch.Generator(device="cuda").manual_seed(T)
    r = lambda *sh: torch.randn(*sh, device="cuda", generator=g).to(BF)  # noqa: E731
    a, res, nw, rw, skew = r(T, D), r(T, D), r(D), (r(E, D) / D ** 0.5).to(BF), r(E) * 0.1
    kw = {"router_b": r(E) * 0.5, "kind": kind} if kind else {}
    for bias in (None, skew):
        want = ref.norm_route(a, res, nw, 1e-6, rw, K, True, BF, logit_bias=bias, **kw)
        got = tri.norm_route(a, res, nw, 1e-6, rw, K, True, BF, logit_bias=bias, **kw)
        assert torch.equal(got[0], want[0])  # the residual add: elementwise, the same roundings
        _close(got[1], want[1], 1e-2, 1e-2)  # the norm's statistics are summed in another order
        # the GEMV sums in another order than cuBLAS: a logit may move by one bf16 ulp, which reorders (near-)tied
        # experts within a row's top k (seen at T=64: 81-89% of rows in the same order) and rarely swaps the k-th;
        # the chosen sets must agree on 90% of the rows and their weights wherever the order agrees
        ids_g, ids_w = got[2].sort(-1).values, want[2].sort(-1).values
        assert float((ids_g == ids_w).all(-1).float().mean()) >= 0.9
        same = (got[2] == want[2]).all(-1)
        assert float(same.float().mean()) >= 0.75, float(same.float().mean())
        _close(got[3][same], want[3][same], 1e-2, 1e-2)
        again = tri.norm_route(a, res, nw, 1e-6, rw, K, True, BF, logit_bias=bias, **kw)
        assert all(torch.equal(x, y) for x, y in zip(got, again))
    assert all(int(s.abs().sum()) == 0 for s in launch._SEMS.values())


@pytest.mark.parametrize("T", [1, 8])
def test_attention_split_merge_in_kernel_long_context(T):
    """Long contexts split the keys over many programs; only the splits holding keys at the position run, and the last
    of them to finish merges in the kernel (one alone writes the output), or a merge kernel after it: every split
    count and merge gives the reference's values, the same bits on a second call, and the counters go back to 0."""
    g = torch.Generator(device="cuda").manual_seed(T)
    Hq, Hkv, Dh, L = 32, 4, 128, 8192
    q = torch.randn(T, Hq, Dh, device="cuda", generator=g).to(BF)
    keys = torch.randn(T, Hkv, L, Dh, device="cuda", generator=g).to(BF)
    vals = torch.randn(T, Hkv, L, Dh, device="cuda", generator=g).to(BF)
    sinks = torch.randn(Hq, device="cuda", generator=g).to(BF)
    # positions near the end (every split holds keys), short spans in the long cache (one split or a few hold keys:
    # the rest exit, one writes the output itself or the active ones merge), and one position per row (ragged)
    per_row = torch.tensor([40, 300, 5000, 8191, 130, 64, 65, 2000][:T], device="cuda")
    for p, window, sk in ((L - 1, 0, None), (5000, 0, sinks), (7000, 1024, None), (100, 0, sinks), (300, 0, None),
                          (per_row, 0, sinks), (per_row, 256, None)):
        p_t = p if isinstance(p, torch.Tensor) else torch.tensor(p, device="cuda")
        want = ref.attn_decode(q, keys, vals, p_t, Dh ** -0.5, window, sinks=sk)
        for splits in (None, 1, 7, 64, 128):
            for merge in (1, 2):  # in the kernel, or the merge kernel one program a query head
                got = tri.attn_decode(q, keys, vals, p_t, Dh ** -0.5, window, sinks=sk, splits=splits, merge=merge)
                _close(got, want)
                assert torch.equal(got, tri.attn_decode(q, keys, vals, p_t, Dh ** -0.5, window, sinks=sk,
                                                        splits=splits, merge=merge))
    assert all(int(s.abs().sum()) == 0 for s in launch._SEMS.values())


@pytest.mark.parametrize("preset", ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny"])
def test_fused_full_capture_matches_hf_eager(preset):
    """Whole models, bf16: the fused step captured per bucket (3 real rows in bucket 4) gives HF's greedy tokens."""
    m = build_model(preset, dtype="bf16", device="cuda", seed=1).model
    prompts = prompts_for(m)
    r_ref, s_ref = hf_reference(m, prompts)
    f = captured_run(m, prompts, r_ref, forced=False)
    s = f.state
    print(f"{preset}: agreement {f.agreement:.3f}, max logit diff {f.max_logit_diff:.4f}, replays {f.stats['buckets']}")
    assert f.agreement == 1.0
    # dropless both: every real token routed K times per layer (per-expert counts may differ at router near-ties)
    assert s["routed_assignments"] == s_ref["routed_assignments"] and s["tokens"] == s_ref["tokens"]
    assert s["dropped_assignments"] == 0


# -- the ops the GLM-4-MoE, OLMoE and GPT-OSS fused steps add, at their real shapes ------------------------------
@pytest.mark.parametrize("T", [1, 3, 8, 64])
def test_family_norm_rope_attn_ops(T):
    """GLM-4.5-Air (96 q / 8 kv heads of 128, rotary on 64, optional per-head q/k norm), OLMoE-1B-7B (q/k norm over
    the 2048-wide projection, clip), GPT-OSS-20B (sinks, window 128, hidden 2880 with its cast-last RMSNorm)."""
    g = torch.Generator(device="cuda").manual_seed(T)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(BF)  # noqa: E731
    pos = torch.tensor(300, device="cuda")
    L = 512
    for Hq, Hkv, Dh, R, norm, clip in ((96, 8, 128, 64, None, None), (96, 8, 128, 64, "head", None),
                                       (16, 16, 128, 128, "full", 4.0)):
        qkv, cos, sin = r(T, (Hq + 2 * Hkv) * Dh) * 3, r(L, R), r(L, R)
        qn = None if norm is None else r(Dh if norm == "head" else Hq * Dh)
        kn = None if norm is None else r(Dh if norm == "head" else Hkv * Dh)
        k1 = torch.zeros(T, Hkv, L, Dh, device="cuda", dtype=BF)
        v1, k2, v2 = k1.clone(), k1.clone(), k1.clone()
        q1 = ref.rope_cache(qkv, pos, cos, sin, k1, v1, Hq, Hkv, Dh, qn, kn, clip=clip)
        q2 = tri.rope_cache(qkv, pos, cos, sin, k2, v2, Hq, Hkv, Dh, qn, kn, clip=clip)
        # Full rotary (R = Dh) is bit-exact on the H200. Partial rotary (R < Dh, GLM-4-MoE's shape) is not: about 25%
        # of the rotated elements are one bf16 ulp off in a product, carried through the near-cancelling rotary sum
        # (experiments/diag_rope_gpu.py: ~12% of q, with and without a norm; the PyTorch reference is the same bits
        # on CPU and GPU, and the Triton interpreter matches it). Not yet explained; end-to-end agreement is in the
        # capture tests and bench_vs_compile.
        for a, b in ((q1, q2), (k1, k2)):
            _close(a, b, 2e-2, 6.25e-2)
            if R == Dh:
                assert torch.equal(a, b)
        assert torch.equal(v1, v2)
    Hq, Hkv, Dh = 64, 8, 64
    keys, vals, q, sinks = r(T, Hkv, L, Dh), r(T, Hkv, L, Dh), r(T, Hq, Dh), r(Hq)
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, Hq // Hkv, False
    for p, window in ((0, 0), (300, 0), (511, 0), (300, 128)):
        p_t = torch.tensor(p, device="cuda")
        for eager in (False, True):
            _close(ref.attn_decode(q, keys, vals, p_t, Dh ** -0.5, window, sinks, eager),
                   tri.attn_decode(q, keys, vals, p_t, Dh ** -0.5, window, sinks, eager))
        kv = torch.arange(L, device="cuda")
        ok = (kv <= p) & ((kv > p - window) if window else True)
        mask = torch.where(ok, 0.0, torch.finfo(BF).min).to(BF)[None, None, None, :]
        want, _ = eager_attention_forward(module, q[:, :, None], keys, vals, mask, Dh ** -0.5)  # HF's, GPT-OSS
        assert torch.equal(ref.attn_decode(q, keys, vals, p_t, Dh ** -0.5, window, sinks, True),
                           want.reshape(T, Hq * Dh))
    D = 2880
    y, res, w32 = r(T, 4, D).float(), r(T, D), torch.randn(D, device="cuda", generator=g)
    for weight in (w32, w32.to(BF)):
        for a, b in zip(ref.add_rmsnorm(y, res, weight, 1e-5, cast_last=True),
                        tri.add_rmsnorm(y, res, weight, 1e-5, cast_last=True)):
            _close(a, b)
        for a, b in zip(ref.add_rmsnorm(y, None, weight, 1e-5, cast_last=True, out_dtype=BF),
                        tri.add_rmsnorm(y, None, weight, 1e-5, cast_last=True, out_dtype=BF)):
            assert a.dtype == b.dtype == BF
            _close(a, b)


@pytest.mark.parametrize("T", [1, 5, 64])
def test_family_routers(T):
    """sigmoid_group at DeepSeek-V3's (256 experts, 8 groups, 4 kept, top-8, x2.5) and GLM-4.5-Air's (128, flat)
    shapes; topk_softmax at GPT-OSS-20B's (32 experts, top-4, bf16 logits). Same chosen experts, weights to rounding."""
    g = torch.Generator(device="cuda").manual_seed(T)
    for E, K, G, TG, norm, scaling in ((256, 8, 8, 4, True, 2.5), (128, 8, 1, 1, True, 1.0), (64, 6, 4, 2, False, 1.0)):
        logits = torch.randn(T, E, device="cuda", generator=g)
        bias = torch.rand(E, device="cuda", generator=g) * 0.1
        i1, w1 = ref.route_sigmoid_group(logits, bias, K, G, TG, norm, scaling)
        i2, w2 = tri.route_sigmoid_group(logits, bias, K, G, TG, norm, scaling)
        s1, p1 = i1.sort(1)
        s2, p2 = i2.sort(1)
        assert torch.equal(s1, s2)
        _close(w1.gather(1, p1), w2.gather(1, p2), 1e-5, 1e-6)
    # softmax_group at DeepSeek-V2-Lite's (64 experts, greedy top-6, x1.0) and DeepSeek-V2's (160, 8 groups, 3 kept,
    # top-6, x16) shapes
    for E, K, G, TG, scaling in ((64, 6, 1, 1, 1.0), (160, 6, 8, 3, 16.0)):
        logits = torch.randn(T, E, device="cuda", generator=g)
        i1, w1 = ref.route_softmax_group(logits, K, G, TG, scaling)
        i2, w2 = tri.route_softmax_group(logits, K, G, TG, scaling)
        s1, p1 = i1.sort(1)
        s2, p2 = i2.sort(1)
        assert torch.equal(s1, s2)
        _close(w1.gather(1, p1), w2.gather(1, p2), 1e-5, 1e-6)
    logits = torch.randn(T, 32, device="cuda", generator=g).to(BF)
    i1, w1 = ref.route_topk_softmax(logits, 4)
    i2, w2 = tri.route_topk_softmax(logits, 4)
    # bf16 logits tie now and then: the chosen logits must be the top 4, whichever tied index was taken
    assert torch.equal(logits.gather(1, i2), logits.gather(1, i1))
    _close(w1, w2, 0, 1e-2)


@pytest.mark.parametrize("T", [1, 5, 16, 17, 64])
def test_moe_kernel_gpt_oss_experts(T):
    """GPT-OSS-20B's experts: [E, D, 2I] / [E, I, D], interleaved gate/up, biases, clamped SwiGLU (limit 7)."""
    from moecg.models.adapter import ExpertSpec

    E, K, D, inter = 32, 4, 2880, 2880
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, D, device="cuda", generator=g).to(BF)
    gate_up = (torch.randn(E, D, 2 * inter, device="cuda", generator=g) * 3 / D ** 0.5).to(BF)
    down = (torch.randn(E, inter, D, device="cuda", generator=g) / inter ** 0.5).to(BF)
    b_gu = torch.randn(E, 2 * inter, device="cuda", generator=g).to(BF)
    b_d = torch.randn(E, D, device="cuda", generator=g).to(BF)
    spec = ExpertSpec("swiglu_clamp", interleaved=True, transposed=True, has_bias=True, alpha=1.702, limit=7.0)
    idx, w = ref.route_topk_softmax(torch.randn(T, E, device="cuda", generator=g).to(BF), K)
    valid = torch.ones(T, dtype=torch.bool, device="cuda")
    valid[T // 2:] = T == 1
    for v in (None, valid):
        c1, c2 = LayerCounters.zeros(E, "cuda"), LayerCounters.zeros(E, "cuda")
        kw = dict(spec=spec, gate_up_bias=b_gu, down_bias=b_d)
        want = ref.moe_experts(x, idx, w, gate_up, down, v, c1, **kw)
        got = tri.moe_experts(x, idx, w, gate_up, down, v, c2, **kw)
        _close(got, want, 2e-2, 2e-2)
        assert torch.equal(c1.routed, c2.routed) and torch.equal(c1.tokens, c2.tokens)
        # gate/up as two stride-2 loads (the paired tile off), and paired on the CUDA cores (one row a program)
        for t in (MoeTiles(paired=False), MoeTiles(block_m=1, up_n=16, up_k=256, down_n=16, down_k=256)):
            _close(tri.moe_experts(x, idx, w, gate_up, down, v, tiles=t, **kw), want, 2e-2, 2e-2)


@pytest.mark.parametrize("preset", ["glm4_moe_tiny", "olmoe_tiny", "gpt_oss_tiny"])
def test_family_fused_full_capture_matches_hf_eager(preset):
    """Whole models, bf16, random biases / correction biases / sinks: the fused step captured per bucket (3 real
    rows in bucket 4), teacher-forced against HF's modules eagerly; every real token routed K times per layer."""
    overrides = {"n_group": 4, "topk_group": 2, "use_qk_norm": True} if preset == "glm4_moe_tiny" else {}
    m = build_model(preset, dtype="bf16", device="cuda", seed=1, config_overrides=overrides).model
    randomise_terms(m, 0)
    prompts = prompts_for(m)
    r_ref, s_ref = hf_reference(m, prompts)
    f = captured_run(m, prompts, r_ref)
    print(f"{preset}: forced agreement {f.agreement:.3f}, max logit diff {f.max_logit_diff:.4f}")
    assert f.agreement >= 0.95
    assert f.state["routed_assignments"] == s_ref["routed_assignments"] and f.state["tokens"] == s_ref["tokens"]


def _n_compiled() -> int | None:
    """Compiled specialisations held in memory by the Triton kernels of the fused step (None: Triton's layout
    unknown)."""
    n = 0
    for mod in tri.MODULES:
        for fn in vars(mod).values():
            caches = getattr(fn, "device_caches", None)
            if caches is None:
                continue
            try:
                n += sum(len(c[0]) for c in caches.values())
            except (TypeError, IndexError, KeyError):
                return None
    return n


def test_capture_precompile_leaves_nothing_to_compile_and_same_bits(monkeypatch):
    """Capture(precompile=True): after the dry pass and the pool, the warmups and captures compile no kernel; the
    replayed logits are bit-equal to a capture without the pass (precompile=False), whose warmup=auto runs 3 eager
    steps before each capture where the precompiled one runs none."""
    b = build_model("qwen2_moe_tiny", dtype="bf16", device="cuda", seed=4)
    m = b.model
    prompts = torch.randint(0, m.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    outs, after_pre = [], {}
    real = Capture._precompile

    def spy(self, order):
        real(self, order)
        after_pre["n"] = _n_compiled()
    monkeypatch.setattr(Capture, "_precompile", spy)
    for pre in (True, False):
        attach(m, make_dispatcher("fused"), max_rows=8)
        eng = DecodeEngine(m, 64, 8)
        cap = Capture(eng, "full", buckets=(1, 2, 4, 8), kernels="fused", precompile=pre).apply()
        assert cap.stats()["warmup"] == (0 if pre else 3)  # capture.warmup=auto: no eager run after the dry pass
        if pre:
            st = cap.stats()["precompiled"]
            assert st["specialisations"] > 0 and st["launches"] > st["specialisations"]
            if after_pre["n"] is not None:
                assert _n_compiled() == after_pre["n"], "a capture compiled a kernel the dry pass missed"
        else:
            assert cap.stats()["precompiled"] is None
        outs.append(eng.generate(prompts, 8, keep_logits=True, timing=False))
        cap.unwrap()
        detach(m)
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert all(torch.equal(a, c) for a, c in zip(outs[0].logits, outs[1].logits))


@pytest.mark.parametrize("T", [1, 3, 8, 16])
def test_small_batch_gemv_matches_cublas(T):
    """triton_ops.linear (the Triton GEMV) at the qkv / o shapes of the families (Qwen1.5's and GPT-OSS's qkv with
    bias; GPT-OSS's K 2880, V2-Lite's latent projection, shared-expert and dense-MLP shapes whose K no tile divides),
    at the table's tiles and at others: within bf16 rounding of F.linear; above 16 rows it is F.linear."""
    from moecg.kernels.tiles import GemvTiles, gemv_tiles

    g = torch.Generator(device="cuda").manual_seed(T)
    for N, K, bias in ((6144, 2048, True), (2048, 2048, False), (5120, 2048, False), (2048, 4096, False),
                       (6144, 4096, False), (4096, 4096, False), (100, 200, True), (5120, 2880, True),
                       (2880, 4096, True), (3648, 2048, False), (2048, 5632, False), (4096, 1408, False),
                       (21888, 2048, False)):
        x = torch.randn(T, K, device="cuda", generator=g).to(BF)
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(BF)
        b = torch.randn(N, device="cuda", generator=g).to(BF) if bias else None
        want = F.linear(x.float(), w.float(), b.float() if b is not None else None)
        for tiles in (gemv_tiles(T, N, K) or GemvTiles(), GemvTiles(32, 128, 4, 4), GemvTiles(16, 512, 8, 3)):
            got = tri.linear(x, w, b, tiles=tiles)
            assert got.shape == (T, N) and got.dtype == BF
            _close(got, want, rtol=1e-2, atol=1e-2)
    x = torch.randn(17, 64, device="cuda", dtype=BF)
    w = torch.randn(32, 64, device="cuda", dtype=BF)
    assert torch.equal(tri.linear(x, w, tiles=GemvTiles()), F.linear(x, w))


@pytest.mark.parametrize("preset,weights", [("qwen3_moe_tiny", "full"), ("qwen2_moe_tiny", "full"),
                                            ("qwen3_moe_tiny", "fp8_block")])
def test_weights_loaded_before_the_pdl_wait_change_no_bit(preset, weights):
    """capture.preload (the GEMVs' first weight tile, norm_route's router rows, the norms' weights and the MoE down
    kernel's first tile loaded before the PDL wait) against loads after it: the captured fused step's tokens and logits
    are the same bits, at buckets 1 (the one-row tiles) and 8 (tl.dot rows), PDL at its default; the step sets
    launch.PRELOAD only while it runs."""
    m = build_model(preset, dtype="bf16", device="cuda", seed=6, weights=weights).model
    prompts = torch.randint(0, m.config.vocab_size, (8, 9), generator=torch.Generator().manual_seed(0))
    outs = []
    for pre in (True, False):
        attach(m, make_dispatcher("fused"), max_rows=8)
        eng = DecodeEngine(m, 64, 8)
        cap = Capture(eng, "full", buckets=(1, 8), kernels="fused", preload=pre).apply()
        assert cap.describe()["preload"] is pre
        outs.append([eng.generate(p, 6, keep_logits=True, timing=False) for p in (prompts[:1], prompts)])
        cap.unwrap()
        detach(m)
        assert launch.PRELOAD is True  # the module default, untouched outside the step
    for a, b in zip(*outs):
        assert torch.equal(a.tokens, b.tokens)
        assert all(torch.equal(u, v) for u, v in zip(a.logits, b.logits))
