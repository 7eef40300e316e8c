"""fp8_dynamic activations (`model.activations`) on a real GPU: the in-kernel quantization (moecg.kernels.quant.act_q8)
gives act_quant's values and scales bit for bit; the GEMV, MoE and capacity kernels on block-FP8 weights with FP8 MMAs
(or fp32 products on the CUDA cores) match the PyTorch reference (act_fake_quant, then the dequantize-then-matmul)
within its two roundings to bf16; whole models captured on the fused step against HF's modules on the same model.

Dims: T tokens, D hidden, E experts, K top-k, I expert intermediate, N/K a projection's.
Skipped without CUDA. Run on the GPU: `pytest -m gpu -s tests/test_act_gpu.py`.
"""
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytestmark = pytest.mark.gpu

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moecg.kernels import ref, triton_ops as tri  # noqa: E402
from moecg.kernels.quant import act_q8, quantize_rows  # noqa: E402
from moecg.kernels.tiles import GemvTiles, MoeTiles, moe_tiles  # noqa: E402
from moecg.models import build_model  # noqa: E402
from moecg.models.formats import act_quant, expand_scale, quantize_stacked  # noqa: E402
from moecg.moe_math import assign_slots, kept_weights  # noqa: E402
from interp_common import same_quant  # noqa: E402 (tests/)
from forced_runs import captured_run, hf_reference, prompts_for  # noqa: E402 (tests/)

BF = torch.bfloat16


def _close(a, b, tol=2e-2):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def _a8(w):
    return replace(w, act="fp8_dynamic")


def _close_flips(a, b):
    """Two computations of a GEMM chain whose second input is quantized (the MoE's down projection takes act(gate) *
    up in e4m3): where the two round gate/up a bf16 ulp apart, an input that lands on the other side of an e4m3
    midpoint, or moves its block's amax, moves the output by an e4m3 step times a weight. So: nearly every value
    within bf16 rounding, the rest within a few such steps, and the whole within 1% of its norm."""
    a, b = a.float(), b.float()
    far = ((a - b).abs() > 2e-2 + 2e-2 * b.abs()).float().mean()
    assert far < 0.02 and float((a - b).abs().max()) < 0.15, (float(far), float((a - b).abs().max()))
    assert float((a - b).norm() / b.norm()) < 1e-2


def _a8_exact(x, w):
    """The A8 GEMM as the kernels compute it: x's e4m3 values times their scales and the weight's times its block
    scales, in fp32, unrounded (the reference rounds both to bf16 first: BlockFp8.input, dense), one fp32 GEMM, the
    output rounded once to bf16."""
    q, s = act_quant(x)
    N, K = w.q.shape
    xe = q.float() * s.repeat_interleave(128, dim=-1)[..., :K]
    return (xe @ (w.q.float() * expand_scale(w.scale, w.rows, N, K)).T).to(x.dtype)


def _moe_exact(x, idx, w, gate_up, down):
    """ref.moe_experts with each GEMM as _a8_exact: the kernels' arithmetic up to the order of fp32 sums, so the MoE
    chain can be held to its flips (_close_flips) against it rather than against the bf16 rounding of every operand."""
    T, K = idx.shape
    y = torch.zeros(T, K, x.shape[1], device=x.device)
    for e in idx.unique().tolist():
        t, k = (idx == e).nonzero(as_tuple=True)
        gu = _a8_exact(x[t], replace(gate_up, q=gate_up.q[e], scale=gate_up.scale[e]))
        h = ref.expert_act(gu)
        o = _a8_exact(h, replace(down, q=down.q[e], scale=down.scale[e]))
        y[t, k] = o.float() * w[t, k].float()[:, None]
    return y


@triton.jit
def _act_q8_kernel(x_ptr, q_ptr, s_ptr, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    i = tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_K)
    m = (j < K)[None, :]
    q, s = act_q8(tl.load(x_ptr + i[:, None] * K + j[None, :], mask=m, other=0.0), BLOCK_M, BLOCK_K)
    tl.store(q_ptr + i[:, None] * K + j[None, :], q.to(tl.float8e4nv), mask=m)
    NS: tl.constexpr = BLOCK_K // 128
    tl.store(s_ptr + i[:, None] * NS + tl.arange(0, NS)[None, :], s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_in_kernel_quantization_is_act_quant_bit_for_bit(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16, 300, device="cuda", generator=g) * torch.logspace(-6, 4, 300, device="cuda")
    x[3, :128] = 0  # a zero block: scale 1
    x[5, :8] = torch.tensor([448.0, 1.0625, 1.1875, 3 * 2 ** -10, 2 ** -10, 5 * 2 ** -10, -1.0625, 2 ** -12])  # ties
    x = x.to(dtype)
    q = torch.empty(16, 300, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(16, 4, device="cuda")
    _act_q8_kernel[(1,)](x, q, s, 300, BLOCK_M=16, BLOCK_K=512)  # 16 rows a program, as the CUDA-core tiles
    rq, rs = act_quant(x)
    cq, cs = act_quant(x.cpu())  # the reference is the same on every device
    assert torch.equal(rq.cpu().view(torch.uint8), cq.view(torch.uint8)) and torch.equal(rs.cpu(), cs)
    for got_q, got_s in ((q, s[:, :3]), quantize_rows(x)):  # quantize_rows: one row a program
        bad = (got_q.view(torch.uint8) != rq.view(torch.uint8)).nonzero().tolist()[:4]
        detail = [(i, j, float(x[i, j]), float(got_q[i, j].float()), float(rq[i, j].float()), float(got_s[i, j // 128]),
                   float(rs[i, j // 128])) for i, j in bad]
        assert not bad and torch.equal(got_s, rs), (detail, (got_s != rs).nonzero().tolist()[:4])


@pytest.mark.parametrize("T", [1, 8])
def test_producers_quantize_their_outputs_as_act_quant(T):
    """The kernels whose outputs feed fp8_dynamic GEMMs write those outputs' act_quant beside them (`quant`), bit for
    bit act_quant of what they wrote: the norms (D 2048, and 2880 with a ragged last block), the attention per head of
    128 (one split, splits merged in the kernel and by the merge kernel), silu_mul (I 768); and a GEMM reading them
    (xq) gives the bits of quantizing its input itself."""
    g = torch.Generator(device="cuda").manual_seed(T)
    rnd = lambda *sh: torch.randn(*sh, device="cuda", generator=g).to(BF)  # noqa: E731
    for D in (2048, 2880):
        y, res, nw = rnd(T, 1, D), rnd(T, D), rnd(D)
        _, h, hq = tri.add_rmsnorm(y, res, nw, 1e-6, quant=True)
        same_quant(hq, h)
        _, h, _, _, hq = tri.norm_route(y, res, nw, 1e-6, rnd(128, D), 8, True, BF, quant=True)
        same_quant(hq, h)
    Hq, Hkv, Dh, L = 32, 4, 128, 4096
    q, kc, vc = rnd(T, Hq, Dh), rnd(T, Hkv, L, Dh), rnd(T, Hkv, L, Dh)
    for p, splits, merge in ((40, None, None), (4000, 16, 1), (4000, 64, 2)):
        pos = torch.full((T,), p, device="cuda")
        o, oq = tri.attn_decode(q, kc, vc, pos, 0.08, splits=splits, merge=merge, quant=True)
        assert torch.equal(o, tri.attn_decode(q, kc, vc, pos, 0.08, splits=splits, merge=merge))
        same_quant(oq, o)
    h, hq = tri.silu_mul(rnd(T, 2 * 768), 768, quant=True)
    same_quant(hq, h)
    w = _a8(quantize_stacked(torch.randn(2048, 768, device="cuda", generator=g) * 0.02, 1, BF))
    assert torch.equal(tri.linear(h, w, xq=hq), tri.linear(h, w))


@pytest.mark.parametrize("T", [1, 8, 33])
@pytest.mark.parametrize("N,K,parts", [(4096 + 2 * 512, 2048, 1), (2048, 4096, 1), (1536, 2048, 2)])
def test_gemv_on_quantized_inputs_is_the_reference(T, N, K, parts):
    g = torch.Generator(device="cuda").manual_seed(T)
    w = _a8(quantize_stacked(torch.randn(N, K, device="cuda", generator=g) * 0.02, parts, BF))
    x = torch.randn(T, K, device="cuda", generator=g).to(BF)
    want = ref.linear(x, w)
    _close(tri.linear(x, w), want)
    assert float((want.float() - ref.linear(x, replace(w, act="full")).float()).abs().max()) > 1e-3
    for tiles in (GemvTiles(64, 128, 4, 3), GemvTiles(16, 512, 4, 3), GemvTiles(4, 2048, rows=1),
                  GemvTiles(16, 256, 4, 3, split_k=4)):
        _close(tri.linear_partials(x, w, tiles=tiles).sum(1), want)


@pytest.mark.parametrize("T", [1, 8, 32])
@pytest.mark.parametrize("shape", [(2048, 768, 128, 8), (4096, 1408, 64, 6)])  # Qwen3-30B-A3B, DeepSeek-V2-Lite-ish
def test_moe_and_capacity_kernels_on_quantized_inputs_are_the_reference(shape, T):
    D, I, E, K = shape
    g = torch.Generator(device="cuda").manual_seed(T)
    gate_up = _a8(quantize_stacked(torch.randn(E, 2 * I, D, device="cuda", generator=g) * 0.02, 2, BF))
    down = _a8(quantize_stacked(torch.randn(E, D, I, device="cuda", generator=g) * 0.02, 1, BF))
    x = torch.randn(T, D, device="cuda", generator=g).to(BF)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, device="cuda", generator=g).to(BF)
    want = _moe_exact(x, idx, w, gate_up, down)
    assert float((want - ref.moe_experts(x, idx, w, gate_up, down)).norm() / want.norm()) < 5e-2  # the reference's
    t = moe_tiles(T, D, I, E, "fp8_block")
    for tiles in (t, replace(t, up_k=256, down_k=256, stages=3), MoeTiles(block_m=16, down_split=2)):
        _close_flips(tri.moe_experts(x, idx, w, gate_up, down, tiles=tiles), want)
    for cf in (0.5, 1.0):  # ref.capacity_experts's slots and weights, the experts as _moe_exact
        sl = assign_slots(idx, w, None, E, cf, 1, "probs")
        keep, wk = kept_weights(idx, w, sl.kept, None, False)
        _close_flips(tri.capacity_experts(x, idx, w, gate_up, down, capacity_factor=cf),
                     torch.where(keep[..., None], _moe_exact(x, idx, wk, gate_up, down), 0.0))


@pytest.mark.parametrize("preset,over", [("qwen3_moe_tiny", None), ("qwen3_moe_tiny", {"head_dim": 128}),
                                         ("qwen2_moe_tiny", None), ("deepseek_v3_tiny", None)])
def test_fused_full_capture_on_quantized_inputs_matches_hf(preset, over):
    """fp8_dynamic on the fused step (its kernels quantizing every block-FP8 GEMM's input, or reading the producers'
    quantization: 128-wide heads quantize the o projection's input in the attention kernel), teacher-forced against
    HF's modules on the same model (Fp8Linear and the experts quantizing the same inputs): the same greedy tokens
    nearly everywhere, every real token routed K times per layer."""
    m = build_model(preset, dtype="bf16", device="cuda", seed=1, weights="fp8_block", activations="fp8_dynamic",
                    config_overrides=over).model
    prompts = prompts_for(m)
    r_ref, s_ref = hf_reference(m, prompts)
    f = captured_run(m, prompts, r_ref)
    print(f"{preset} {over or ''} fp8_dynamic fused: forced agreement {f.agreement:.3f}, max logit diff "
          f"{f.max_logit_diff:.4f}")
    # random tiny models' near-tie logits, and the e4m3 flips of each layer's inputs where the kernels' exact products
    # and the reference's bf16 operands round a value apart (see _close_flips): 0.94-0.98 measured, W8A16 0.95+
    assert f.agreement >= 0.9 and f.state["routed_assignments"] == s_ref["routed_assignments"]
