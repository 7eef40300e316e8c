"""Run by tests/test_fast.py under TRITON_INTERPRET=1: the Triton ops on CPU tensors (fp32) against the references.

Prints ALL OK when every check passes; any mismatch raises. Kept out of pytest collection (no test_ prefix)
because TRITON_INTERPRET must be set before triton is imported.
"""
import itertools
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from moecg.dispatch.state import LayerCounters  # noqa: E402
from moecg.kernels import ref  # noqa: E402
from moecg.kernels import launch, triton_ops as tri  # noqa: E402
from moecg.kernels.tiles import MoeTiles  # noqa: E402
from moecg.models import build_model  # noqa: E402

from interp_common import close, fused_backends_agree  # noqa: E402 (tests/, this script's directory)


torch.manual_seed(0)
T, D, E, K, inter = 3, 64, 8, 2, 32
valid = torch.tensor([True, False, True])
y, res, w = torch.randn(T, K, D), torch.randn(T, D), torch.randn(D)
sh, sg = torch.randn(T, D), torch.randn(T, 5)[:, 2]
for kw in ({}, {"shared": sh, "shared_gate": sg}, {"valid": valid}):
    for a, b in zip(ref.add_rmsnorm(y, res, w, 1e-6, **kw), tri.add_rmsnorm(y, res, w, 1e-6, **kw)):
        close(a, b)
Hq, Hkv, Dh, L = 4, 2, 16, 80
qkv, cos, sin = torch.randn(T, (Hq + 2 * Hkv) * Dh), torch.randn(L, Dh), torch.randn(L, Dh)
for qn in (None, torch.randn(Dh)):
    kn = None if qn is None else torch.randn(Dh)
    k1, v1 = torch.zeros(T, Hkv, L, Dh), torch.zeros(T, Hkv, L, Dh)
    k2, v2 = k1.clone(), v1.clone()
    close(ref.rope_cache(qkv, torch.tensor(7), cos, sin, k1, v1, Hq, Hkv, Dh, qn, kn),
          tri.rope_cache(qkv, torch.tensor(7), cos, sin, k2, v2, Hq, Hkv, Dh, qn, kn))
    close(k1, k2)
    close(v1, v2, 0)
keys, vals, q = torch.randn(T, Hkv, L, Dh), torch.randn(T, Hkv, L, Dh), torch.randn(T, Hq, Dh)
for p, window in ((0, 0), (33, 0), (79, 0), (70, 20)):
    close(ref.attn_decode(q, keys, vals, torch.tensor(p), 0.25, window),
          tri.attn_decode(q, keys, vals, torch.tensor(p), 0.25, window))
# split contexts: the last split of each (row, kv head) merges the partials in the kernel; with sinks too
L2 = 200
keys2, vals2 = torch.randn(T, Hkv, L2, Dh), torch.randn(T, Hkv, L2, Dh)
sinks = torch.randn(Hq)
for p, window, sk in ((150, 0, None), (199, 0, sinks), (180, 100, None), (60, 0, sinks)):
    for splits in (2, 3):
        close(ref.attn_decode(q, keys2, vals2, torch.tensor(p), 0.25, window, sinks=sk),
              tri.attn_decode(q, keys2, vals2, torch.tensor(p), 0.25, window, sinks=sk, splits=splits))
    # the merge unrolling 1, 2 or 4 splits' loads (past the active splits masked); p = 60 has one active split (the
    # direct path, no merge), the others two
    for mb in (1, 2, 4):
        close(ref.attn_decode(q, keys2, vals2, torch.tensor(p), 0.25, window, sinks=sk),
              tri.attn_decode(q, keys2, vals2, torch.tensor(p), 0.25, window, sinks=sk, splits=3, merge_block=mb))
# the merge kernel (merge 2): one program a query head, its splits' partials in one load here; the sink in its max
# and sum; per-row positions, one row with a single active split (which writes its output itself)
for p, window, sk in ((150, 0, None), (199, 0, sinks), (180, 100, sinks), (torch.tensor([199, 20, 120]), 0, sinks)):
    for splits in (2, 3):
        pos = p if isinstance(p, torch.Tensor) else torch.tensor(p)
        close(ref.attn_decode(q, keys2, vals2, pos, 0.25, window, sinks=sk),
              tri.attn_decode(q, keys2, vals2, pos, 0.25, window, sinks=sk, splits=splits, merge=2))
assert all(int(s.abs().sum()) == 0 for s in launch._SEMS.values())
logits = torch.randn(T, E + 3)[:, :E]
for norm in (True, False):
    i1, w1 = ref.route(logits, K, norm, torch.float32)
    i2, w2 = tri.route(logits, K, norm, torch.float32)
    assert torch.equal(i1, i2)
    close(w1, w2)
# residual + norm + router GEMV + top-k in one kernel, against the composition of the references; GPT-OSS's router:
# its own bias (added before the logits' rounding) and top-k then softmax; 64-128 experts also with the top-k a warp
# a row (NormRouteTiles.warp_topk)
import dataclasses  # noqa: E402

from moecg.kernels import tiles as tiles_mod  # noqa: E402

NORM_ROUTE_TILES = tiles_mod.norm_route_tiles
for (En, kw), wt in itertools.product(
        ((8, {}), (12, {"logit_bias": torch.randn(12)}), (64, {"cast_last": True}),
         (12, {"router_b": torch.randn(12), "kind": "topk_softmax"}),
         (32, {"router_b": torch.randn(32), "logit_bias": torch.randn(32), "kind": "topk_softmax"}),
         (128, {}), (100, {"router_b": torch.randn(100), "kind": "topk_softmax"})), (False, True)):
    tiles_mod.norm_route_tiles = lambda *a, wt=wt: dataclasses.replace(NORM_ROUTE_TILES(*a), warp_topk=wt)
    a_, r_, nw_, rw_ = torch.randn(T, D), torch.randn(T, D), torch.randn(D), torch.randn(En, D) / 8
    for norm in (True, False):
        got, want = tri.norm_route(a_, r_, nw_, 1e-6, rw_, K, norm, torch.float32, **kw), \
            ref.norm_route(a_, r_, nw_, 1e-6, rw_, K, norm, torch.float32, **kw)
        close(got[0], want[0])
        close(got[1], want[1])
        assert torch.equal(got[2], want[2])
        close(got[3], want[3])
tiles_mod.norm_route_tiles = NORM_ROUTE_TILES
gu = torch.randn(T, 2 * inter + 3)
close(ref.silu_mul(gu, inter), tri.silu_mul(gu, inter))


for Tm in (1, 3, 20):  # 20 tokens: two row blocks per expert
    x = torch.randn(Tm, D)
    gate_up, down = torch.randn(E, 2 * inter, D) / 8, torch.randn(E, D, inter) / 6
    # one expert hit by every token, the others drawn from the rest (a token's top-k never repeats an expert: the
    # kernels size an expert's row blocks by the tokens)
    rest = torch.tensor([e for e in range(E) if e != 1])
    idx = torch.stack([torch.cat([torch.tensor([1]), rest[torch.randperm(E - 1)[:K - 1]]]) for _ in range(Tm)])
    wts = torch.rand(Tm, K)
    vm = torch.rand(Tm) > 0.3
    for v in (None, vm):
        c1, c2 = LayerCounters.zeros(E), LayerCounters.zeros(E)
        close(ref.moe_experts(x, idx, wts, gate_up, down, v, c1), tri.moe_experts(x, idx, wts, gate_up, down, v, c2))
        assert torch.equal(c1.routed, c2.routed) and torch.equal(c1.tokens, c2.tokens)
        close(c1.routed_mass, c2.routed_mass)
        # both grids (a program per expert / per assignment) and the split-K down and up GEMMs with their in-kernel
        # fix-ups (D 64 at 32-wide K steps: 2 up splits; 3 asked gives 2 as well)
        for grid, split, usplit, bm in (("expert", 3, 2, 16), ("slot", 1, 1, 16), ("slot", 2, 3, 16),
                                        ("slot", 1, 2, 1)):
            c3 = LayerCounters.zeros(E)
            tiles = MoeTiles(block_m=bm, up_n=16, up_k=32, down_n=16, down_k=16, down_split=split, up_split=usplit)
            close(ref.moe_experts(x, idx, wts, gate_up, down, v),
                  tri.moe_experts(x, idx, wts, gate_up, down, v, c3, grid=grid, tiles=tiles))
            assert torch.equal(c1.routed, c3.routed) and torch.equal(c1.tokens, c3.tokens), (grid, split, usplit)
            close(c1.routed_mass, c3.routed_mass)
assert all(int(s.abs().sum()) == 0 for s in launch._SEMS.values())  # every split tile's counter zeroed again

# a whole model: fused decode with the Triton ops == with the torch ops (fp32), incl. the fused dispatcher
# (qwen2_moe_tiny: a shared expert beside the router; qwen3_moe_tiny: the router alone, so norm_route runs)
for preset in ("qwen2_moe_tiny", "qwen3_moe_tiny"):
    model = build_model(preset, dtype="fp32", device="cpu", seed=0).model
    prompts = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    for step in fused_backends_agree(model, prompts, 32, 6, preset):
        assert any(L.norm_route for L in step.layers) == (preset == "qwen3_moe_tiny")
# the small-batch GEMV: N not a multiple of the column block, K not a multiple of the K step, with and without bias,
# T up to the one row block (16); above it, and where the table has no rule, F.linear
from moecg.kernels.tiles import GemvTiles  # noqa: E402

for Tg in (1, 3, 16):
    xg, wg, bg = torch.randn(Tg, 72), torch.randn(40, 72), torch.randn(40)
    for bias in (None, bg):
        for tl_ in (GemvTiles(block_n=16, block_k=32), GemvTiles(block_n=32, block_k=64)):
            close(ref.linear(xg, wg, bias), tri.linear(xg, wg, bias, tiles=tl_), 1e-4)
x17 = torch.randn(17, 72)
assert torch.equal(tri.linear(x17, wg, tiles=GemvTiles()), torch.nn.functional.linear(x17, wg))  # 17 rows: cuBLAS
# split-K partial rows: S ranges of whole K steps (S from split_k, the last range ragged), the bias in one of them;
# their fp32 sum is the projection; unsplit (split_k 1, no tiles, 17 rows): linear's output as the one row
for Tg, split, bk, S in ((1, 2, 32, 2), (3, 3, 32, 3), (16, 4, 16, 3), (2, 8, 64, 2)):
    xg = torch.randn(Tg, 72)
    for bias in (None, bg):
        got = tri.linear_partials(xg, wg, bias, tiles=GemvTiles(block_n=16, block_k=bk, split_k=split))
        assert got.shape == (Tg, S, 40) and got.dtype == torch.float32, (got.shape, split)
        close(got.sum(1), ref.linear(xg, wg, bias), 1e-4)
        assert ref.linear_partials(xg, wg, bias).shape == (Tg, 1, 40)
        # the consumers add the partials in order and round once: as on their sum
        r_, nw_, rw_ = torch.randn(Tg, 40), torch.rand(40) + 0.5, torch.randn(8, 40)
        for u, v in zip(tri.norm_route(got, r_, nw_, 1e-6, rw_, 2, True, torch.float32),
                        ref.norm_route(got.sum(1), r_, nw_, 1e-6, rw_, 2, True, torch.float32)):
            close(u.float(), v.float(), 1e-5)
        close(tri.add_rmsnorm(got, r_, nw_, 1e-6)[1], ref.add_rmsnorm(got.sum(1, keepdim=True), r_, nw_, 1e-6)[1], 1e-5)
for t_ in (GemvTiles(split_k=1), None):
    assert torch.equal(tri.linear_partials(x17, wg, bg, tiles=t_)[:, 0], tri.linear(x17, wg, bg, tiles=t_))
# the fused step with every o projection split (a rule for its shape, N = hidden): the same tokens as the torch ops
from moecg.kernels import gemv as gemv_mod  # noqa: E402

rules, launch_ = tiles_mod.GEMV_RULES, gemv_mod.launch
splits = []
gemv_mod.launch = lambda k, g, *a, **kw: (splits.append(kw.get("SPLIT", 1)), launch_(k, g, *a, **kw))[1]
try:
    for preset in ("qwen2_moe_tiny", "qwen3_moe_tiny"):  # add_rmsnorm, then norm_route, after the o projection
        model = build_model(preset, dtype="fp32", device="cpu", seed=0).model
        D = model.config.hidden_size
        tiles_mod.GEMV_RULES = (tiles_mod.GemvRule(GemvTiles(16, 16, split_k=3), out=(D, D + 1)),)
        prompts = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
        splits.clear()
        fused_backends_agree(model, prompts, 32, 6, preset + " o split")
        assert max(splits) > 1, (preset, set(splits))  # the o projection ran split
finally:
    tiles_mod.GEMV_RULES, gemv_mod.launch = rules, launch_
# weights loaded before the PDL wait (launch.PRELOAD) or after it: the same bits from every kernel that preloads (GEMV
# unsplit, split and block-FP8, norm_route, add_rmsnorm)
from moecg.models.formats import quantize_stacked  # noqa: E402


def _each_preload():
    xg, wg, bg = torch.randn(2, 256), torch.randn(40, 256), torch.randn(40)
    r_, nw_, rw_ = torch.randn(2, 40), torch.rand(40) + 0.5, torch.randn(8, 40)
    parts = tri.linear_partials(xg, wg, bg, tiles=GemvTiles(block_n=16, block_k=64, split_k=3))
    xm, gu_, dn_ = torch.randn(3, 64), torch.randn(6, 64, 64) / 8, torch.randn(6, 64, 32) / 6
    xq, guq, dnq = torch.randn(1, 128), quantize_stacked(torch.randn(6, 256, 128), 2), quantize_stacked(
        torch.randn(6, 128, 128))  # block-FP8 experts, one row (the CUDA-core tiles)
    im, wm, vm_ = torch.tensor([[1, 4], [1, 0], [5, 1]]), torch.rand(3, 2), torch.tensor([True, False, True])
    moe = [tri.moe_experts(xm, im, wm, gu_, dn_, vm_, grid=grid, tiles=MoeTiles(
        block_m=bm, up_n=16, up_k=32, down_n=16, down_k=16, down_split=split))
        for grid, split, bm in (("slot", 1, 1), ("expert", 3, 16), ("slot", 2, 1))]
    moe += [tri.moe_experts(xq, im[:1], wm[:1], guq, dnq, tiles=MoeTiles(
        block_m=1, up_n=16, up_k=128, down_n=16, down_k=64, down_split=split)) for split in (1, 2)]
    return (*moe, tri.linear(xg, wg, bg, tiles=GemvTiles(block_n=16, block_k=64)),
            tri.linear(xg[:1], wg, tiles=GemvTiles(block_n=4, block_k=128, rows=1)), parts,
            tri.linear(xg[:1], quantize_stacked(torch.randn(256, 256)), tiles=GemvTiles(4, 256, rows=1)),
            *tri.norm_route(parts, r_, nw_, 1e-6, rw_, 2, True, torch.float32), *tri.add_rmsnorm(parts, r_, nw_, 1e-6))


assert launch.PRELOAD is True
outs = []
for pre in (True, False):
    torch.manual_seed(11)
    launch.PRELOAD = pre
    outs.append(_each_preload())
launch.PRELOAD = True
assert all(torch.equal(u, v) for u, v in zip(*outs))
print("ALL OK")
