"""Run by tests/test_fast_families.py under TRITON_INTERPRET=1: the Triton kernels the GLM-4-MoE, OLMoE and GPT-OSS
fused steps add, on CPU tensors (fp32), against their references; then each family's whole fused decode with the
Triton ops against the torch ops.

Dims: T tokens, D hidden, Hq/Hkv heads, Dh head dim, R rotary dims, L cache slots, E experts, G groups, K top-k,
I expert intermediate. Prints ALL OK when every check passes; any mismatch raises. Kept out of pytest collection
(no test_ prefix) because TRITON_INTERPRET must be set before triton is imported.
"""
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from moecg.dispatch.state import LayerCounters  # noqa: E402
from moecg.kernels import ref  # noqa: E402
from moecg.kernels import triton_ops as tri  # noqa: E402
from moecg.kernels.tiles import MoeTiles  # noqa: E402
from moecg.models import build_model  # noqa: E402
from moecg.models.adapter import ExpertSpec  # noqa: E402

from interp_common import close, fused_backends_agree  # noqa: E402 (tests/, this script's directory)


torch.manual_seed(0)
T, D = 3, 64
# residual + RMSNorm that casts last (GPT-OSS), with an fp32 weight on the first call (residual None)
y, res, w = torch.randn(T, 2, D), torch.randn(T, D), torch.randn(D)
for kw in ({"cast_last": True}, {"cast_last": True, "shared": torch.randn(T, D)}):
    for a, b in zip(ref.add_rmsnorm(y, res, w, 1e-6, **kw), tri.add_rmsnorm(y, res, w, 1e-6, **kw)):
        close(a, b)
    for a, b in zip(ref.add_rmsnorm(y, None, w, 1e-6, **kw), tri.add_rmsnorm(y, None, w, 1e-6, **kw)):
        close(a, b)

# rope_cache: partial rotary (R < Dh), per-head and whole-projection q/k norms, clip
Hq, Hkv, Dh, L = 4, 2, 16, 40
qkv = torch.randn(T, (Hq + 2 * Hkv) * Dh) * 2
for R, full, clip in ((16, None, None), (8, False, None), (16, True, 0.7), (4, True, None), (8, None, 0.5)):
    qn = None if full is None else torch.randn(Hq * Dh if full else Dh)
    kn = None if full is None else torch.randn(Hkv * Dh if full else Dh)
    cos, sin = torch.randn(L, R), torch.randn(L, R)
    k1, v1 = torch.zeros(T, Hkv, L, Dh), torch.zeros(T, Hkv, L, Dh)
    k2, v2 = k1.clone(), v1.clone()
    close(ref.rope_cache(qkv, torch.tensor(7), cos, sin, k1, v1, Hq, Hkv, Dh, qn, kn, clip=clip),
          tri.rope_cache(qkv, torch.tensor(7), cos, sin, k2, v2, Hq, Hkv, Dh, qn, kn, clip=clip))
    close(k1, k2)
    close(v1, v2, 0)

# decode attention with sinks: one split and split contexts (the sink joins in the merge kernel), windows, and HF
# eager's rounding (a no-op in fp32: this checks the two-pass kernel's arithmetic; the bf16 rounding is checked on GPU)
for Tq, Lc, cases in ((3, 80, ((0, 0), (33, 0), (79, 0), (70, 20))), (1, 192, ((191, 0), (150, 64)))):
    keys, vals, q = torch.randn(Tq, Hkv, Lc, Dh), torch.randn(Tq, Hkv, Lc, Dh), torch.randn(Tq, Hq, Dh)
    sinks = torch.randn(Hq) * 2
    for p, window in cases:
        for sk in (sinks, None):
            for eager in (False, True):  # eager with sinks: the two-pass kernel
                close(ref.attn_decode(q, keys, vals, torch.tensor(p), 0.25, window, sk, eager),
                      tri.attn_decode(q, keys, vals, torch.tensor(p), 0.25, window, sk, eager))

# routers: sigmoid_group (flat, grouped, unnormalised, k not a power of two), topk_softmax
E = 32
logits = torch.randn(T + 5, E + 3)[:, :E]
bias = torch.rand(E) * 0.3
for K, ng, tg, norm in ((6, 1, 1, True), (4, 4, 2, True), (3, 8, 3, False), (8, 2, 1, True)):
    i1, w1 = ref.route_sigmoid_group(logits, bias, K, ng, tg, norm, 2.5)
    i2, w2 = tri.route_sigmoid_group(logits, bias, K, ng, tg, norm, 2.5)
    s1, p1 = i1.sort(1)
    s2, p2 = i2.sort(1)  # HF's top-ks are unsorted: compare the chosen sets
    assert torch.equal(s1, s2), (K, ng, tg)
    close(w1.gather(1, p1), w2.gather(1, p2), 1e-6)
for K, ng, tg, sc in ((6, 1, 1, 1.0), (4, 4, 2, 16.0), (3, 8, 3, 1.0), (8, 4, 1, 2.0)):  # softmax_group (V2)
    i1, w1 = ref.route_softmax_group(logits, K, ng, tg, sc)
    i2, w2 = tri.route_softmax_group(logits, K, ng, tg, sc)
    s1, p1 = i1.sort(1)
    s2, p2 = i2.sort(1)
    assert torch.equal(s1, s2), (K, ng, tg)
    close(w1.gather(1, p1), w2.gather(1, p2), 1e-6)
i1, _ = tri.route_softmax_group(logits, 8, 4, 1, 1.0)  # 8 picks from one kept group of 8: none masked
assert torch.equal(i1.sort(1).values, ref.route_softmax_group(logits, 8, 4, 1, 1.0)[0].sort(1).values)
i1, _ = tri.route_sigmoid_group(logits, None, 4, 1, 1, True, 1.0)
assert torch.equal(i1.sort(1).values, ref.route_sigmoid_group(logits, None, 4, 1, 1, True, 1.0)[0].sort(1).values)
for K in (4, 3):
    i1, w1 = ref.route_topk_softmax(logits, K)
    i2, w2 = tri.route_topk_softmax(logits, K)
    assert torch.equal(i1, i2)
    close(w1, w2, 1e-6)
# the routers' shared top-k (one packed max per pick): largest first, exact ties to the lower expert, any sign,
# -0.0 equal to +0.0, -inf last; checked against a stable sort
tied = torch.tensor([[-1.0, 3.0, -7.5, 3.0, -0.0, 0.0, float("-inf"), -1.0, 2.5, -0.0, 3.0, -7.5],
                     [0.0, -0.0, -2.0, -2.0, -2.0, float("-inf"), -3.0, 0.0, -1e-30, 1e-30, -2.0, -0.0]])


def stable_top(v, K):  # per row: the K largest, ties to the lower index (Python's sort is stable; -0.0 == 0.0)
    return torch.tensor([sorted(range(v.shape[1]), key=lambda i, r=r: (-float(r[i]), i))[:K] for r in v])


for K in (1, 2, 3, 5, 8):
    assert torch.equal(tri.route_topk_softmax(tied, K)[0], stable_top(tied, K)), K
    assert torch.equal(tri.route_sigmoid_group(tied, None, K, 1, 1, True, 1.0)[0], stable_top(tied.sigmoid(), K)), K
for K in (1, 2, 4, 8):  # softmax_topk: ranks the probabilities (1e-30 and 0 give the same one)
    assert torch.equal(tri.route(tied, K, True, torch.float32)[0], stable_top(tied.softmax(-1), K)), K


# GPT-OSS experts: [E, D, 2I] / [E, I, D], interleaved gate/up, biases, clamped SwiGLU; pad rows and counters
E, K, inter = 8, 2, 32
spec = ExpertSpec("swiglu_clamp", interleaved=True, transposed=True, has_bias=True, alpha=1.702, limit=1.5)
for Tm in (3, 20):  # 20 tokens: two row blocks per expert
    x = torch.randn(Tm, D)
    gate_up, down = torch.randn(E, D, 2 * inter) / 4, torch.randn(E, inter, D) / 3
    b_gu, b_d = torch.randn(E, 2 * inter), torch.randn(E, D)
    idx = torch.stack([torch.randperm(E - 1)[:K] for _ in range(Tm)])  # K distinct experts a token, as a router's
    idx[:, 0] = E - 1  # every token on one expert
    wts = torch.rand(Tm, K)
    for v in (None, torch.rand(Tm) > 0.3):
        c1, c2 = LayerCounters.zeros(E), LayerCounters.zeros(E)
        a = ref.moe_experts(x, idx, wts, gate_up, down, v, c1, spec=spec, gate_up_bias=b_gu, down_bias=b_d)
        b = tri.moe_experts(x, idx, wts, gate_up, down, v, c2, spec=spec, gate_up_bias=b_gu, down_bias=b_d)
        close(a, b, 1e-4)
        assert torch.equal(c1.routed, c2.routed) and torch.equal(c1.tokens, c2.tokens)
        # gate/up as two stride-2 loads (paired False), paired on the CUDA cores (block_m 1) and on narrower tiles
        # (the default 64-wide tiles above: half of each pair block masked, I = 32); the up GEMM split over D (its
        # bias and clamp after the split sums are added), paired and not
        for t in (MoeTiles(paired=False), MoeTiles(block_m=1, up_n=16, up_k=32), MoeTiles(up_n=16, up_k=16),
                  MoeTiles(up_n=16, up_k=16, up_split=3), MoeTiles(paired=False, up_k=32, up_split=2)):
            close(a, tri.moe_experts(x, idx, wts, gate_up, down, v, spec=spec, gate_up_bias=b_gu, down_bias=b_d,
                                     tiles=t), 1e-4)
clamped = ((x @ gate_up[E - 1] + b_gu[E - 1])[:, ::2] > spec.limit).float().mean()
assert clamped > 0.05, "the clamp never bites: the check has no teeth"

# whole models: the fused decode with the Triton ops == with the torch ops (fp32), incl. the fused dispatcher
for preset, overrides in (("glm4_moe_tiny", {"n_group": 4, "topk_group": 2, "use_qk_norm": True}),
                          ("olmoe_tiny", {"clip_qkv": 0.5}), ("gpt_oss_tiny", {"swiglu_limit": 0.3})):
    model = build_model(preset, dtype="fp32", device="cpu", seed=0, config_overrides=overrides).model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape, generator=g) * 0.3)
    prompts = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    steps = fused_backends_agree(model, prompts, 16, 5, preset)
    if preset == "gpt_oss_tiny":  # its router (a bias, top-k then softmax) in norm_route
        assert all(L.norm_route for s in steps for L in s.layers)
print("ALL OK")
