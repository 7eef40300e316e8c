"""`capacity` on the fused decode step: the Triton capacity kernels (moecg.kernels.capacity), their PyTorch
reference (ref.capacity_experts) and the dispatcher's padded PyTorch path agree, on CPU.

Dims: T tokens, K top-k, E experts, C capacity, D hidden, I expert intermediate.
Torch only here: the reference against the padded path (same kept assignments, same counters, same outputs), a
huge factor against dropless, and the fused step's wiring (dispatch=capacity under capture.kernels=fused calls the
kernels). The kernels themselves run under Triton's interpreter in a subprocess (tests/capacity_interp_check.py):
against the reference, against the padded path on every family's experts, and through each family's fused step.
"""
import os
import re
import subprocess

import pytest
import torch

from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.dispatch.capacity import Capacity
from moecg.dispatch.state import LayerCounters
from moecg.engine import DecodeEngine
from moecg.kernels import ref
from moecg.kernels.tiles import (CAPACITY_ROWS, DEFAULT, MOE_TILE_RULES, QWEN3_DOWN, QWEN3_DOWN_W8, MoeTiles, TileRule,
                                 capacity_tiles, moe_tiles)
from moecg.models import build_model
from interp_runner import HAS_TRITON, run_marked  # tests/

COUNTS = ("routed", "dropped", "tokens", "lost_all", "capacity", "calls")


def _experts(preset):
    b = build_model(preset, dtype="fp32", device="cpu", seed=0)
    layer = next(lay for lay in b.adapter.layers(b.model) if b.adapter.moe_block(lay) is not None)
    experts = b.adapter.experts_of(layer)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # HF zeros biases: random ones show a dropped term
        for name, p in experts.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return experts, b.adapter.expert_spec(experts)


def _routing(T, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, K]
    w = torch.rand(T, K, generator=g)
    w[1], idx[1] = w[0], idx[0]  # an exact tie: the earlier token must win it under `probs`
    return idx, w


def _ref(experts, spec, x, idx, w, valid, counters, **kw):
    bias = dict(gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias) if spec.has_bias else {}
    return ref.capacity_experts(x, idx, w, experts.gate_up_proj, experts.down_proj, valid, counters, spec=spec,
                                **bias, **kw)


CASES = [  # capacity_factor, drop_policy, renormalize, real tokens of 12
    (0.5, "probs", False, 9), (0.5, "position", False, 9), (1.0, "probs", True, 12), (1.25, "position", True, 7),
    (0.25, "probs", False, None),
]


@pytest.mark.parametrize("preset", ["mixtral_tiny", "gpt_oss_tiny"])
@pytest.mark.parametrize("cf,policy,renorm,n_valid", CASES)
def test_reference_equals_the_padded_path(preset, cf, policy, renorm, n_valid):
    """ref.capacity_experts (what the kernels compute) == Capacity's padded [E, C, D] path: the same kept
    assignments, counters and outputs (both layouts: Mixtral's, GPT-OSS's transposed biased clamped experts)."""
    experts, spec = _experts(preset)
    E, K = experts.num_experts, 2
    T = 12
    x = torch.randn(T, experts.gate_up_proj.shape[-1 if not spec.transposed else 1],
                    generator=torch.Generator().manual_seed(2))
    idx, w = _routing(T, E, K, seed=3)
    valid = None if n_valid is None else torch.arange(T) < n_valid
    kw = dict(capacity_factor=cf, drop_policy=policy, renormalize=renorm)
    c1, c2 = LayerCounters.zeros(E, capacity=True), LayerCounters.zeros(E, capacity=True)
    with torch.no_grad():
        want = Capacity(kernels="torch", **kw).unreduced(experts, x, idx, w, valid, c1)
        got = _ref(experts, spec, x, idx, w, valid, c2, **kw)
    assert int(c1.dropped.sum()) > 0  # every case drops: the kept sets are compared, not only the outputs
    for f in COUNTS:
        assert torch.equal(getattr(c1, f), getattr(c2, f)), f
    torch.testing.assert_close(c1.dropped_mass, c2.dropped_mass, atol=1e-6, rtol=1e-6)
    assert torch.equal(want.abs().amax(-1) == 0, got.abs().amax(-1) == 0)  # the same assignments dropped
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if n_valid is not None:
        assert torch.equal(got[n_valid:], torch.zeros_like(got[n_valid:])) and int(c2.tokens) == n_valid


def test_huge_factor_is_dropless_and_forward_is_the_unreduced_sum():
    experts, spec = _experts("qwen3_moe_tiny")
    E, K, T = experts.num_experts, 4, 10
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(4))
    idx, w = _routing(T, E, K, seed=5)
    valid = torch.arange(T) < 8
    c = LayerCounters.zeros(E, capacity=True)
    with torch.no_grad():
        got = _ref(experts, spec, x, idx, w, valid, c, capacity_factor=1e3)
        dropless = make_dispatcher("dropless").unreduced(experts, x, idx, w, valid, None)
        torch.testing.assert_close(got, dropless, atol=1e-5, rtol=1e-5)
        assert int(c.dropped.sum()) == 0 and int(c.routed.sum()) == 8 * K
        disp = Capacity(capacity_factor=0.5, kernels="torch")
        assert torch.equal(disp.forward(experts, x, idx, w, valid, None),
                           disp.unreduced(experts, x, idx, w, valid, None).sum(1).to(x.dtype))


def test_capabilities_and_options():
    assert Capacity.fused_unreduced and Capacity.reads_all_experts and Capacity.drops
    disp = make_dispatcher("capacity", kernels="torch", max_assignments=64)
    assert (disp.kernels, disp.max_assignments) == ("torch", 64)
    with pytest.raises(ValueError, match=r"dispatch.kernels='gpu': choose auto, triton or torch"):
        make_dispatcher("capacity", kernels="gpu")
    with pytest.raises(RuntimeError, match="dispatch.kernels=triton: Triton cannot run here"):
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise RuntimeError("dispatch.kernels=triton: Triton cannot run here (interpreter set: skip the check)")
        experts, _ = _experts("mixtral_tiny")
        make_dispatcher("capacity", kernels="triton").unreduced(experts, torch.zeros(2, 64), torch.zeros(2, 2,
                                                                dtype=torch.long), torch.ones(2, 2), None, None)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_fused_step_calls_the_capacity_kernels(monkeypatch):
    """dispatch=capacity under capture.kernels=fused reaches capacity.capacity_experts with the dispatcher's
    options, the row mask (3 rows in bucket 4) and the counters. The kernels are replaced by their reference here
    (no Triton on CPU); the tokens and counters then equal the padded path's."""
    from moecg.kernels import capacity as capacity_ops

    calls = []

    def spy(x, idx, w, gate_up, down, valid, counters, **kw):
        calls.append((valid.clone(), counters is not None, {k: kw[k] for k in ("capacity_factor", "drop_policy",
                                                                                "renormalize", "min_capacity")}))
        return ref.capacity_experts(x, idx, w, gate_up, down, valid, counters, **kw)

    monkeypatch.setattr(capacity_ops, "capacity_experts", spy)
    monkeypatch.setattr(Capacity, "use_triton", lambda self, *a: self.kernels != "torch")
    model = build_model("qwen2_moe_tiny", dtype="fp32", device="cpu", seed=2).model
    prompts = torch.randint(0, 512, (3, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(capacity_factor=0.75, drop_policy="position", renormalize=True, min_capacity=2)
    runs = []
    for kernels in ("torch", "auto"):
        attach(model, make_dispatcher("capacity", kernels=kernels, **kw), max_rows=4)
        eng = DecodeEngine(model, 32, 4)
        cap = Capture(eng, "capacity", buckets=(4,), backend="emulate", warmup=1, kernels="fused").apply()
        runs.append((eng.generate(prompts, 5, timing=False, count_prefill=False), state_of(model).snapshot()))
        cap.unwrap()
        detach(model)
    (want, ws), (got, gs) = runs
    assert calls and all(c[1] and c[2] == kw for c in calls)
    # capture runs with every row real; each of the 4 decode steps then calls it once per MoE layer, padded
    assert sum(c[0].tolist() == [True, True, True, False] for c in calls) == 4 * len(model.model.layers)
    assert ws["dropped_assignments"] > 0
    assert torch.equal(got.tokens, want.tokens)
    for k in ("routed", "dropped", "tokens", "tokens_lost_all", "capacity_used"):
        assert gs[k] == ws[k], k


def test_tile_table():
    """One table: Mixtral-sized experts get their tiles, the others the defaults, the first matching rule wins."""
    mixtral = moe_tiles(8, 4096, 14336, 8)
    assert (mixtral.up_n, mixtral.up_k, mixtral.stages) == (32, 256, 3)
    for shape in ((8, 2048, 1408, 60), (32, 2048, 768, 128), (64, 2048, 1408, 60), (8, 4096, 2880, 32),
                  (8, 64, 32, 8), (1, 7168, 2048, 256)):
        assert moe_tiles(*shape) == DEFAULT == MoeTiles()
    # Qwen3-30B-A3B's and OLMoE's experts (D 2048, I 768 / 1024): 128-column down programs at 64 rows in bf16, 32-64 in
    # block-FP8; not at 16 rows, nor past 64
    assert moe_tiles(64, 2048, 768, 128) == moe_tiles(64, 2048, 1024, 64) == QWEN3_DOWN == MoeTiles(down_n=128)
    # (fp8_dynamic inputs; weight-only 256 columns)
    a8 = [moe_tiles(T, 2048, 768, 128, "fp8_block", "fp8_dynamic") for T in (32, 64)]
    w8 = [moe_tiles(T, 2048, 768, 128, "fp8_block") for T in (32, 64)] + [moe_tiles(32, 2048, 768, 128, "fp8_block",
                                                                                   "full")]
    assert a8 == [QWEN3_DOWN] * 2 and w8 == [QWEN3_DOWN_W8] * 3 and QWEN3_DOWN_W8 == MoeTiles(down_n=256)
    assert moe_tiles(16, 2048, 768, 128, "fp8_block") == moe_tiles(128, 2048, 768, 128) == DEFAULT
    assert moe_tiles(64, 2048, 768, 128, "fp8_block", "fp8_dynamic") == capacity_tiles(64, 2048, 768, 128, "fp8_block",
                                                                                        "fp8_dynamic")
    assert TileRule(DEFAULT, activations=("full",)).holds(1, 1, 1, 1) and not TileRule(
        DEFAULT, activations=("full",)).holds(1, 1, 1, 1, "fp8_dynamic")
    # bf16 experts: GPT-OSS's at any batch (128 down columns at 8-15; the capacity kernels on 32 up columns),
    # Qwen1.5's and GLM-4.5-Air's at batch 1 on 32 columns
    assert moe_tiles(16, 2880, 2880, 32) == moe_tiles(2, 2880, 2880, 128) == moe_tiles(1, 2880, 2880, 32) == MoeTiles(
        stages=3)
    assert capacity_tiles(1, 2880, 2880, 32) == capacity_tiles(16, 2880, 2880, 32) == MoeTiles(up_n=32, stages=3)
    assert capacity_tiles(8, 2880, 2880, 32) == MoeTiles(up_n=32, stages=3, down_n=128)
    assert not TileRule(DEFAULT, kernels=("dropless",)).holds(1, 1, 1, 1, kernel="capacity")
    with pytest.raises(ValueError, match="kernel"):
        moe_tiles(1, 2880, 2880, 32, kernel="grouped")
    assert moe_tiles(8, 2880, 2880, 32) == moe_tiles(15, 2880, 2880, 32) == MoeTiles(stages=3, down_n=128)
    assert moe_tiles(1, 2048, 1408, 60) == moe_tiles(1, 4096, 1408, 128) == MoeTiles(up_n=32)
    assert moe_tiles(2, 2048, 1408, 60) == moe_tiles(1, 2048, 1408, 64) == moe_tiles(1, 2048, 768, 128) == DEFAULT
    rule = TileRule(MoeTiles(block_m=32), tokens=(17, 65), hidden=(2048, 2049))
    assert rule.holds(17, 2048, 1408, 60) and not rule.holds(16, 2048, 1408, 60) and not rule.holds(17, 4096, 1, 1)
    assert MOE_TILE_RULES[0].holds(1, 4096, 8192, 8) and not MOE_TILE_RULES[0].holds(1, 4096, 8191, 8)
    # a format's rules come first; an unknown format is no silent default. Block-FP8: at batch 1 only
    t1, t8 = moe_tiles(1, 2880, 2880, 128, "fp8_block"), moe_tiles(8, 2880, 2880, 128, "fp8_block")
    assert (t1.up_k, t1.down_k, t1.stages) == (256, 256, 3) and t8 == DEFAULT
    assert moe_tiles(1, 4096, 14336, 8, "fp8_block") == mixtral  # Mixtral-sized experts: past the format rule's range
    # mxfp4: one row a program on the CUDA cores up to 8 rows whatever the shape, to 16 with 64 experts or more;
    # tl.dot_scaled beyond
    mx1 = moe_tiles(1, 2880, 2880, 128, "mxfp4")
    assert (mx1.block_m, mx1.up_n, mx1.up_k, mx1.down_n, mx1.down_k, mx1.stages) == (1, 16, 256, 16, 512, 3)
    assert mx1 == moe_tiles(8, 2880, 2880, 32, "mxfp4") == moe_tiles(2, 4096, 14336, 8, "mxfp4")
    assert mx1 == moe_tiles(16, 2880, 2880, 128, "mxfp4") == moe_tiles(9, 2048, 768, 64, "mxfp4")
    assert moe_tiles(9, 2880, 2880, 32, "mxfp4") == moe_tiles(17, 2880, 2880, 128, "mxfp4") == DEFAULT
    # the capacity kernels: the table's tiles for C rows, one-row tiles at C > 1 on 32 x 64 columns
    assert capacity_tiles(1, 2880, 2880, 128, "mxfp4") == mx1 and capacity_tiles(17, 2880, 2880, 128, "mxfp4") == DEFAULT
    assert capacity_tiles(3, 2880, 2880, 128, "mxfp4") == CAPACITY_ROWS == MoeTiles(block_m=1, up_n=32, down_n=64)
    assert capacity_tiles(1, 2048, 768, 128, "fp8_block") == moe_tiles(1, 2048, 768, 128, "fp8_block")
    assert capacity_tiles(2, 2048, 1408, 60) == moe_tiles(2, 2048, 1408, 60) == DEFAULT
    assert moe_tiles(1, 2880, 2880, 128, "full") == MoeTiles(stages=3)
    with pytest.raises(KeyError):
        moe_tiles(1, 2880, 2880, 128, "fp4")
    # the block-FP8 GEMV: quantized inputs (a8) take their own rules on the tensor cores (2-16 rows), batch 1 and
    # more than 16 rows keep the weight-only table's
    from moecg.kernels.tiles import CORE_GEMV_FP8, FP8_GEMV_DEFAULT, GemvTiles, fp8_gemv_tiles
    assert fp8_gemv_tiles(8, 5120, 2048, a8=True) == GemvTiles(64, 128, 4, 6)
    assert fp8_gemv_tiles(2, 2048, 4096, a8=True) == fp8_gemv_tiles(16, 2048, 4096, a8=True) == GemvTiles(32, 128, 4, 6)
    assert fp8_gemv_tiles(1, 5120, 2048, a8=True) == fp8_gemv_tiles(1, 5120, 2048) == CORE_GEMV_FP8
    # the A8 tiles up to 32 rows (16 a program), then the W8A16 default; without A8 the W8A16 table at any T
    assert fp8_gemv_tiles(32, 5120, 2048, a8=True) == GemvTiles(64, 128, 4, 6)
    assert fp8_gemv_tiles(32, 2048, 4096, a8=True) == GemvTiles(32, 128, 4, 6)
    assert fp8_gemv_tiles(33, 5120, 2048, a8=True) == fp8_gemv_tiles(8, 5120, 2048) == FP8_GEMV_DEFAULT


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_mxfp4_table_tiles_and_an_unknown_grid():
    """The tables give mxfp4 experts one row a program (quant.mx_row_mac) or 16 and more (tl.dot_scaled), never the
    2-15-row dequantized tiles on the CUDA cores (a tuning knob only); an unknown grid is refused before any kernel
    runs (CPU tensors here, which a launch would not take), naming the choices."""
    from moecg.kernels import triton_ops as tri
    from moecg.models.formats import Mxfp4, mx_quantize

    E, D, I, T, K = 4, 64, 32, 3, 2
    gate_up, down = (Mxfp4(*mx_quantize(torch.randn(shape)), torch.float32) for shape in ((E, 2 * I, D), (E, D, I)))
    x, idx, w = torch.randn(T, D), torch.stack([torch.randperm(E)[:K] for _ in range(T)]), torch.rand(T, K)
    with pytest.raises(ValueError, match=r"grid='block': choose auto, expert, slot or row"):
        tri.moe_experts(x, idx, w, gate_up, down, tiles=MoeTiles(block_m=1), grid="block")
    for T in range(1, 129):
        for shape in ((2880, 2880, 32), (2880, 2880, 128), (2048, 768, 128), (4096, 14336, 8)):
            for t in (moe_tiles(T, *shape, "mxfp4"), capacity_tiles(T, *shape, "mxfp4")):
                assert t.block_m == 1 or t.block_m >= 16, (T, shape, t)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.interp("capacity_interp_check.py", "ops")
def test_kernels_match_reference_under_interpreter(request):
    """Kept sets, counters and outputs equal ref.capacity_experts: ties, pad rows, min_capacity, several token
    chunks and slot blocks, GPT-OSS's layout, a factor that drops nothing; the in-kernel C for every count 0..100."""
    run_marked(request)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.interp("capacity_interp_check.py", "dispatch")
def test_kernels_match_padded_path_on_every_family_under_interpreter(request):
    """Each fused family's experts (Mixtral, Qwen2/3-MoE, GLM-4-MoE, OLMoE, GPT-OSS), its router's routing, 6 real
    of 8 rows: kernels=triton == kernels=torch for three factors and both policies; a huge factor == fused."""
    run_marked(request)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.interp("capacity_interp_check.py", "families")
def test_fused_step_on_every_family_under_interpreter(request):
    """Each family's fused decode step, 3 rows run as 4 (a bucket's padding), teacher-forced: the kernels give the
    padded path's tokens, logits (1e-4) and counters; it drops; a huge factor equals dispatch=fused."""
    run_marked(request)


# argument types of the kernels compiled for sm_90 below (pointers not named here: *bf16; integers: i32)
SM90_TYPES = dict(idx_ptr="*i64", valid_ptr="*i1", y_ptr="*fp32", keep_ptr="*i8", slot_ptr="*i32", nk_ptr="*i32",
                  cnt_ptr="*i64", drop_ptr="*i64", mass_ptr="*fp32", dmass_ptr="*fp32", cap_ptr="*i64",
                  calls_ptr="*i64", tok_ptr="*i64", lost_ptr="*i64", alpha="fp32", limit="fp32", cf_bits="i64",
                  part_ptr="*fp32", sem_ptr="*i32", m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", pos_ptr="*i64",
                  scaling="fp32", lg_ptr="*fp32", b_ptr="*fp32", tw_ptr="*bf16", eps="fp32", res_ptr="*bf16",
                  sg_ptr="*bf16")
# the block-FP8 kernels' weights (w_ptr: e4m3 values, ws_ptr: fp32 scales) and A8 inputs (q_ptr, qs_ptr)
SM90_F8 = dict(w_ptr="*fp8e4nv", ws_ptr="*fp32", q_ptr="*fp8e4nv", qs_ptr="*fp32")
# compile_sm90's div16 for the GEMV and MoE kernels as launched at Qwen3-30B-A3B's shapes: the integer arguments that
# are multiples of 16 there (names a kernel does not take are ignored)
SM90_DIV16 = ("N", "K", "D", "I", "s_xt", "s_wn", "s_yt", "s_sn", "s_qt", "s_xh", "s_wh", "s_yh", "s_ys",
              "s_we", "s_wj", "s_se", "s_sj", "s_hs")


def compile_sm90(fn, consts: dict, stages: int = 4, div16=(), **ptr_types):
    """fn compiled for sm_90 with Triton's bundled ptxas (constexprs `consts`, the other arguments typed by
    SM90_TYPES and ptr_types); skips the test where this Triton build has no ptxas. As the JIT specialises a launch:
    the pointers 16-byte aligned (torch's allocations are), and the integer arguments named in div16 multiples of 16
    (without them the loads' alignment is unknown and Triton pipelines none of the weight tiles a launch pipelines)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tys = {**SM90_TYPES, **ptr_types}
    params = inspect.signature(fn.fn).parameters
    # an optional pointer (default None: a producer's quantized output, an A8 kernel's quantized input) stays None
    # unless ptr_types types it, as launches leave it
    consts = {**{n: None for n, p in params.items() if p.default is None and n not in ptr_types}, **consts}
    # a constexpr left out takes its default, as a launch that leaves it out does (not a runtime i32 argument: its
    # branches would both be compiled, and branches whose values differ in shape would not compile at all)
    consts = {**{n: p.default for n, p in params.items() if "constexpr" in str(p.annotation)
                 and p.default is not inspect.Parameter.empty}, **consts}
    sig = {n: "constexpr" if n in consts else tys.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(params)
             if sig[n] != "constexpr" and (sig[n].startswith("*") or n in div16)}
    try:
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages})
    except (FileNotFoundError, RuntimeError) as e:  # no ptxas with this Triton build
        if "ptxas" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_kernels_compile_for_hopper():
    """The capacity kernels and the refactored dropless ones compile to sm_90 machine code on this CPU machine
    (Triton's bundled ptxas): a lowering or typing error shows here, not first on the GPU."""
    import inspect

    import triton

    from moecg.kernels import attention, capacity as cap, gemv, mla, moe, norm_rope, routers

    def build(fn, consts, stages=4, **ptr_types):
        params = inspect.signature(fn.fn).parameters
        consts = {**{q: 0 for q in ("QROWS", "MX", "PAIRED", "A8") if q in params}, **consts}  # bf16, unpaired unless asked
        consts = {**({"PRELOAD": 1} if "PRELOAD" in params else {}), **consts}  # weights before the wait, as launched
        if fn in (gemv._gemv_kernel, routers._norm_route_kernel):  # unsplit, one partial row, unless asked
            consts = {**{q: 1 for q in ("SPLIT", "KK") if q in params}, **consts}
        assert compile_sm90(fn, consts, stages, **ptr_types).asm["cubin"]

    for pos, K in ((False, 8), (True, 2)):
        build(cap._cap_slots_kernel, dict(K=K, KP=K, POSITION=pos, HAS_VALID=True, COUNT=True, COUNT_CAP=True,
                                          BLOCK_T=64, BLOCK_D=128))
    build(cap._cap_up_kernel, dict(K=4, KP=4, HAS_VALID=True, COUNT=True, JM=1, JU=1408, HAS_BIAS=False, ACT=0,
                                   BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, BLOCK_T=64), stages=3)
    for paired in (0, 1):  # GPT-OSS's interleaved gate/up as two strided tiles or one paired tile
        build(cap._cap_up_kernel, dict(K=4, KP=4, HAS_VALID=False, COUNT=False, JM=2, JU=1, HAS_BIAS=True, ACT=1,
                                       BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_T=64, PAIRED=paired))
    build(cap._cap_down_kernel, dict(K=4, KP=4, RENORM=True, HAS_BIAS=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128))
    mx = dict(w_ptr="*u8", ws_ptr="*u8")  # mxfp4 experts: tl.dot_scaled on bf16 activations
    build(cap._cap_up_kernel, dict(K=4, KP=4, HAS_VALID=False, COUNT=False, JM=2, JU=1, HAS_BIAS=True, ACT=1,
                                   BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_T=64, MX=1), stages=3, **mx)
    build(cap._cap_down_kernel, dict(K=4, KP=4, RENORM=True, HAS_BIAS=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
                                     MX=1), **mx)
    build(moe._moe_up_kernel, dict(K=4, HAS_VALID=True, COUNT=True, JM=1, JU=1408, HAS_BIAS=False, ACT=0,
                                   BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, BLOCK_S=64, USE_PDL=2, MX=1), **mx)
    build(moe._moe_down_kernel, dict(K=4, HAS_VALID=True, HAS_BIAS=False, SPLIT=4, BLOCK_M=16, BLOCK_N=64,
                                     BLOCK_K=128, BLOCK_S=64, USE_PDL=2, MX=1), **mx)
    for bm, k, row in ((1, 256, 1), (1, 32, 0)):  # one row on the CUDA cores: int32 words of 8 codes (mx_row_mac),
        # on the row grid (a program per assignment, BY_ROW) and the slot grid
        build(moe._moe_up_kernel, dict(K=4, HAS_VALID=True, COUNT=True, JM=2, JU=1, HAS_BIAS=True, ACT=1,
                                       BLOCK_M=bm, BLOCK_N=16, BLOCK_K=k, BLOCK_S=64, USE_PDL=2, MX=1, BY_ROW=row),
              stages=3, **mx)
        build(moe._moe_down_kernel, dict(K=4, HAS_VALID=True, HAS_BIAS=True, SPLIT=1, BLOCK_M=bm, BLOCK_N=16,
                                         BLOCK_K=k, BLOCK_S=64, USE_PDL=2, MX=1, BY_ROW=row), stages=3, **mx)
    # block-FP8's one-row tiles on the row grid: the first K step's weights loaded before the PDL wait (PRELOAD)
    build(moe._moe_down_kernel, dict(K=8, HAS_VALID=True, HAS_BIAS=False, SPLIT=2, BLOCK_M=1, BLOCK_N=16, BLOCK_K=256,
                                     BLOCK_S=64, USE_PDL=2, QROWS=128, BY_ROW=1), w_ptr="*fp8e4nv", ws_ptr="*fp32")
    for bm in (16, 1):  # GPT-OSS's paired gate/up on tl.dot and on the CUDA cores
        build(moe._moe_up_kernel, dict(K=4, HAS_VALID=True, COUNT=True, JM=2, JU=1, HAS_BIAS=True, ACT=1,
                                       BLOCK_M=bm, BLOCK_N=32, BLOCK_K=128, BLOCK_S=64, USE_PDL=2, PAIRED=1), stages=3)
    split_ptrs = dict(part_ptr="*fp32", sem_ptr="*i32")  # the up GEMM split over D: fp32 partials, tile counters
    # a split kernel keeps the unsplit one's pipelined weight loads (the same shared memory): each split's first K
    # index is a multiple of BLOCK_K the compiler sees (k_steps x BLOCK_K). A runtime chunk of unknown alignment
    # compiled the split-K down kernel with no async copies at all (12 of 61 KB of shared memory, 252 registers).
    # Typed as a launch specialises them: the weights' K stride 1, the dims and row strides multiples of 16.
    div16 = ("D", "I", "s_xt", "s_wj", "s_we", "s_hs", "s_wn", "s_ys")
    up = dict(K=8, HAS_VALID=False, COUNT=True, JM=1, JU=768, HAS_BIAS=False, ACT=0, BLOCK_M=16, BLOCK_N=64,
              BLOCK_K=128, BLOCK_S=64, USE_PDL=2, QROWS=0, MX=0, PAIRED=0, A8=0, s_wk=1)
    dn = dict(K=8, HAS_VALID=False, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_S=64, USE_PDL=2,
              QROWS=0, MX=0, A8=0, s_wk=1, PRELOAD=1)
    for fn, consts, ptrs in ((moe._moe_up_kernel, up, {}), (moe._moe_down_kernel, dn, dict(y_ptr="*fp32"))):
        smem = [compile_sm90(fn, {**consts, "SPLIT": sp}, div16=div16, **ptrs, **split_ptrs).metadata.shared
                for sp in (1, 2)]
        assert smem[0] == smem[1] > 32768, (fn.fn.__name__, smem)
    # the tensor-core tiles keep their weight tile in the async-copy ring ((stages - 1) x the input and weight tiles of
    # shared memory) in both layouts: [E, D, I] (K contiguous) read [N, K], and HF's transposed [E, I, D] / [E, D, 2I]
    # (GPT-OSS: N contiguous) read k-major (KN); read [N, K] and transposed, those compiled their weights through
    # registers (no async copy, 114-209 registers), which is what held GPT-OSS's batch-1 down kernel at 2 TB/s
    for KN, strides in ((0, dict(s_wk=1)), (1, dict(s_wn=1))):
        for bn in (32, 128):
            consts = {**{c: v for c, v in dn.items() if c != "s_wk"}, "SPLIT": 1, "HAS_BIAS": True, "BLOCK_N": bn,
                      "KN": KN, **strides}
            k = compile_sm90(moe._moe_down_kernel, consts, 3, y_ptr="*fp32",
                             div16=tuple(d for d in (*div16, "s_wk", "s_wn", "s_be") if d not in strides))
            assert k.metadata.shared == 2 * (16 * 128 + bn * 128) * 2, (KN, bn, k.metadata.shared)
    consts = {**{c: v for c, v in up.items() if c != "s_wk"}, "JM": 2, "JU": 1, "HAS_BIAS": True, "ACT": 1,
              "PAIRED": 1, "KN": 1, "BLOCK_N": 32, "s_wj": 1}
    k = compile_sm90(moe._moe_up_kernel, consts, 3, div16=("D", "I", "s_xt", "s_we", "s_wk", "s_hs", "s_be"))
    assert k.metadata.shared == 2 * (16 * 128 + 64 * 128) * 2, k.metadata.shared  # the paired 2 x 32 columns
    # the same for the split-K GEMV (linear_partials), on the tensor cores and on the CUDA cores (one row): with a
    # chunk of unknown alignment the first compiled with no async copies and the second with 16-bit loads
    for rows, bn, bk, st in ((16, 16, 256, 3), (1, 4, 1024, 2)):
        smem = [compile_sm90(gemv._gemv_kernel, dict(HAS_BIAS=False, BLOCK_T=rows, BLOCK_N=bn, BLOCK_K=bk, USE_PDL=2,
                                                     SPLIT=sp, PRELOAD=1, s_wk=1, QROWS=0, A8=0), st,
                             div16=SM90_DIV16, y_ptr="*fp32").metadata.shared for sp in (1, 2)]
        assert smem[0] == smem[1], (rows, smem)
    build(moe._moe_up_kernel, dict(K=4, HAS_VALID=True, COUNT=True, JM=2, JU=1, HAS_BIAS=True, ACT=1, BLOCK_M=16,
                                   BLOCK_N=32, BLOCK_K=128, BLOCK_S=64, USE_PDL=2, PAIRED=1, SPLIT=3), stages=3,
          **split_ptrs)
    for pdl in (0, 1, 2):  # programmatic dependent launch: the griddepcontrol instructions lower for sm_90
        build(moe._moe_up_kernel, dict(K=4, HAS_VALID=True, COUNT=True, JM=1, JU=1408, HAS_BIAS=False, ACT=0,
                                       BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_S=64, USE_PDL=pdl))
        for split in (1, 4):  # split-K: the partial stores, the tile counter's atomic and the in-order fix-up
            build(moe._moe_down_kernel, dict(K=4, HAS_VALID=True, HAS_BIAS=split == 1, SPLIT=split, BLOCK_M=16,
                                             BLOCK_N=64, BLOCK_K=128, BLOCK_S=64, USE_PDL=pdl))
    build(routers._norm_route_kernel, dict(K=8, NORM=True, HAS_SKEW=True, CAST_LAST=False, BLOCK_D=2048, BLOCK_E=8,
                                           BLOCK_EP=128, USE_PDL=2))
    # GPT-OSS's router in it: its bias, top-k then softmax
    build(routers._norm_route_kernel, dict(K=4, NORM=False, HAS_SKEW=False, CAST_LAST=True, BLOCK_D=4096, BLOCK_E=2,
                                           BLOCK_EP=32, USE_PDL=2, TOPK_FIRST=1), rb_ptr="*bf16")
    # the routers' shared packed-key top-k (int64 keys from fp32 bits)
    build(routers._route_kernel, dict(K=4, NORM=True, BLOCK_E=64, USE_PDL=2))
    for sm in (0, 1):  # sigmoid_group, softmax_group
        build(routers._route_group_kernel, dict(K=8 - 2 * sm, KP=8, NG=8, NGP=8, TOPKG=4 - sm, NORM=not sm,
                                                HAS_BIAS=not sm, BLOCK_E=256 - 192 * sm, SOFTMAX=sm, USE_PDL=2))
    build(routers._route_topk_softmax_kernel, dict(K=4, KP=4, BLOCK_E=32, USE_PDL=2))
    build(norm_rope._add_rmsnorm_kernel, dict(KK=4, HAS_RES=True, HAS_SHARED=True, HAS_SGATE=True, HAS_VALID=False,
                                              CAST_LAST=False, BLOCK_D=2048, USE_PDL=2))
    for G, Dh, split, sb, merge in ((8, 128, True, 1, 1), (1, 128, True, 4, 1), (16, 64, True, 2, 1),
                                    (16, 64, False, 1, 1), (8, 128, True, 4, 2)):
        # decode attention (Qwen3, Qwen1.5, GPT-OSS heads): active splits only, the merge unrolled SB splits at a time
        # in the kernel (merge 1) or left to the merge kernel (2)
        GP = max(16, triton.next_power_of_2(G))
        build(attention._attn_decode_kernel, dict(G=G, GP=GP, DH=Dh, BLOCK_L=64, SPLIT=split, HAS_SINK=Dh == 64,
                                                  EAGER=False, TWO_PASS=False, SUB_ROUND=False, SB=sb, USE_PDL=2,
                                                  MERGE=merge))
    for G, Dh, sink in ((8, 128, False), (8, 64, True)):  # the merge kernels: every split at once, in SB-split loads
        build(attention._attn_merge_kernel, dict(G=G, DH=Dh, GP=16, HAS_SINK=sink, SPLITS=64, SP=64, SB=32, USE_PDL=2),
              sink_ptr="*bf16", o_ptr="*bf16")
    # the producers' act_quant of their outputs (fp8_dynamic GEMMs after them): the norms, the attention per head
    q8 = dict(q_ptr="*fp8e4nv", qs_ptr="*fp32")
    build(norm_rope._add_rmsnorm_kernel, dict(KK=1, HAS_RES=True, HAS_SHARED=False, HAS_SGATE=False, HAS_VALID=False,
                                              CAST_LAST=False, BLOCK_D=2048, USE_PDL=2), **q8)
    build(routers._norm_route_kernel, dict(K=8, NORM=True, HAS_SKEW=False, CAST_LAST=False, BLOCK_D=2048, BLOCK_E=8,
                                           BLOCK_EP=128, USE_PDL=2, KK=1), a_ptr="*bf16", **q8)
    build(gemv._silu_mul_kernel, dict(BLOCK=1024, USE_PDL=2), **q8)
    for merge in (1, 2):
        build(attention._attn_decode_kernel, dict(G=8, GP=16, DH=128, BLOCK_L=64, SPLIT=True, HAS_SINK=False,
                                                  EAGER=False, TWO_PASS=False, SUB_ROUND=False, SB=1, USE_PDL=2,
                                                  MERGE=merge), oq_ptr="*fp8e4nv", os_ptr="*fp32")
    build(attention._attn_merge_kernel, dict(G=8, DH=128, GP=16, HAS_SINK=False, SPLITS=64, SP=64, SB=32, USE_PDL=2),
          sink_ptr="*bf16", o_ptr="*bf16", oq_ptr="*fp8e4nv", os_ptr="*fp32")
    for SP, SB, MC in ((128, 128, 32), (16, 16, 256), (256, 64, 64)):  # MLA's, V2-Lite's 16 heads (C 512)
        build(mla._mla_merge_kernel, dict(H=16, HB=16, HP=16, C=512, CP=512, MC=MC, SPLITS=SP, SP=SP, SB=SB,
                                          USE_PDL=2))
    from moecg.kernels.tiles import GEMV_RULES
    for i, rule in enumerate(GEMV_RULES):  # the small-batch GEMV at the table's tiles
        t = rule.tiles
        build(gemv._gemv_kernel, dict(HAS_BIAS=i == 0, BLOCK_T=min(t.rows, 16), BLOCK_N=t.block_n, BLOCK_K=t.block_k, USE_PDL=2),
              stages=t.stages)
    # split-K partial rows (fp32) on bf16 and on block-FP8 weights, and the router kernel that adds them
    build(gemv._gemv_kernel, dict(HAS_BIAS=True, BLOCK_T=16, BLOCK_N=16, BLOCK_K=256, USE_PDL=2, SPLIT=4), stages=3)
    build(gemv._gemv_kernel, dict(HAS_BIAS=False, BLOCK_T=16, BLOCK_N=16, BLOCK_K=512, USE_PDL=2, SPLIT=4, QROWS=128),
          stages=3, w_ptr="*fp8e4nv", ws_ptr="*fp32")
    build(routers._norm_route_kernel, dict(K=8, NORM=True, HAS_SKEW=False, CAST_LAST=False, BLOCK_D=2048, BLOCK_E=8,
                                           BLOCK_EP=128, USE_PDL=2, KK=4), a_ptr="*fp32")
    # fp8_dynamic activations (A8): FP8 MMAs (wgmma, the weight rows as M) on 16 rows, fp32 products on one row
    for bm, bn, bk in ((16, 64, 128), (1, 32, 1024)):
        build(moe._moe_up_kernel, dict(K=8, HAS_VALID=False, COUNT=False, JM=1, JU=768, HAS_BIAS=False, ACT=0,
                                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_S=64, USE_PDL=2, QROWS=128, A8=1),
              stages=3, **SM90_F8)
        build(moe._moe_down_kernel, dict(K=8, HAS_VALID=False, HAS_BIAS=False, SPLIT=1 if bm == 16 else 4, BLOCK_M=bm,
                                         BLOCK_N=bn // 2, BLOCK_K=128 if bm == 16 else 256, BLOCK_S=64, USE_PDL=2,
                                         QROWS=128, A8=1), **SM90_F8)
        build(gemv._gemv_kernel, dict(HAS_BIAS=False, BLOCK_T=bm, BLOCK_N=bn, BLOCK_K=bk, USE_PDL=2, QROWS=128, A8=1),
              **SM90_F8)
    from moecg.kernels.quant import act_k, check_block_k
    from moecg.kernels.tiles import FP8_A8_GEMV_RULES, FP8_GEMV_DEFAULT, FP8_GEMV_RULES
    # every block-FP8 GEMV tile the table can pick, at its rows a program (up to gemv.FP8_MAX_ROWS: a 64-row program
    # on 512-wide K steps needs 257 KB at 3 stages), within an H100's 227 KB of shared memory, with the weight and
    # input tiles pipelined as a launch at Qwen3-30B-A3B's shapes specialises them (the strides and sizes multiples of
    # 16; the K strides 1); the A8 GEMV's own tiles (six stages) keep a ring of at least two weight tiles
    fp8_tiles = [(r.tiles, 1) for r in FP8_A8_GEMV_RULES] + [(r.tiles, 0) for r in FP8_GEMV_RULES] + [
        (FP8_GEMV_DEFAULT, 0), (FP8_GEMV_DEFAULT, 1)]
    for t, a8 in fp8_tiles:
        rows = min(t.rows, gemv.FP8_MAX_ROWS)
        k = compile_sm90(gemv._gemv_kernel, dict(HAS_BIAS=False, BLOCK_T=rows, BLOCK_N=t.block_n,
                                                 BLOCK_K=act_k(t.block_k, rows) if a8 else check_block_k(t.block_k),
                                                 USE_PDL=2, QROWS=128, A8=a8, SPLIT=1, PRELOAD=1, s_wk=1, s_sk=1),
                         t.stages, div16=SM90_DIV16, **SM90_F8)
        assert 0 < k.metadata.shared <= 227 * 1024, (t, a8, k.metadata.shared)
        if a8 and rows >= 16:
            bufs = re.findall(rf"memdesc<(\d+)x{t.block_n}x128xf8E4M3FN", k.asm["ttgir"])  # the weight tile's ring
            assert bufs and min(map(int, bufs)) >= 2, (t, bufs)
    build(cap._cap_up_kernel, dict(K=8, KP=8, HAS_VALID=False, COUNT=True, JM=1, JU=768, HAS_BIAS=False, ACT=0,
                                   BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_T=64, QROWS=128, A8=1), stages=3,
          **SM90_F8)
    build(cap._cap_down_kernel, dict(K=8, KP=8, RENORM=False, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
                                     QROWS=128, A8=1), **SM90_F8)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_weights_load_before_the_pdl_wait():
    """PRELOAD: in the sm_90 machine code of the GEMV (bf16 and block-FP8, one row and tl.dot rows), norm_route,
    add_rmsnorm and the dropless MoE down kernel, loads (LDG) come before the PDL wait (griddepcontrol.wait, ACQBULK in
    SASS); without it none does, so the flag decides where the compiler puts them."""
    import inspect
    import os
    import tempfile

    import triton

    from moecg.kernels import gemv, moe, norm_rope, routers

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        pytest.skip("no nvdisasm in this Triton build")

    def loads_before_wait(fn, consts, **tys):
        a8 = {"A8": 0} if "A8" in inspect.signature(fn.fn).parameters else {}  # full inputs unless asked
        k = compile_sm90(fn, {**a8, **consts}, stages=2, **tys)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(k.asm["cubin"])
            sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
        lines = sass.splitlines()
        wait = [i for i, line in enumerate(lines) if "ACQBULK" in line]
        assert len(wait) == 1, "one PDL wait"
        return sum("LDG" in line for line in lines[: wait[0]])

    fp8 = dict(w_ptr="*fp8e4nv", ws_ptr="*fp32")
    cases = [(gemv._gemv_kernel, dict(HAS_BIAS=False, BLOCK_T=1, BLOCK_N=4, BLOCK_K=1024, QROWS=0, SPLIT=1), {}),
             (gemv._gemv_kernel, dict(HAS_BIAS=False, BLOCK_T=1, BLOCK_N=4, BLOCK_K=2048, QROWS=128, SPLIT=1), fp8),
             (gemv._gemv_kernel, dict(HAS_BIAS=True, BLOCK_T=16, BLOCK_N=16, BLOCK_K=512, QROWS=0, SPLIT=4), {}),
             (routers._norm_route_kernel, dict(K=8, NORM=True, HAS_SKEW=False, CAST_LAST=False, BLOCK_D=2048,
                                               BLOCK_E=8, BLOCK_EP=128, KK=1), {}),
             (norm_rope._add_rmsnorm_kernel, dict(KK=8, HAS_RES=True, HAS_SHARED=False, HAS_SGATE=False,
                                                  HAS_VALID=False, CAST_LAST=False, BLOCK_D=2048), {})]
    for split, q in ((1, 128), (2, 0)):  # the dropless down kernel on one-row tiles (block-FP8 and bf16)
        cases.append((moe._moe_down_kernel, dict(K=8, HAS_VALID=True, HAS_BIAS=False, SPLIT=split, BLOCK_M=1,
                                                 BLOCK_N=16, BLOCK_K=256, BLOCK_S=64, QROWS=q, MX=0),
                      fp8 if q else {}))
    for fn, consts, tys in cases:
        assert loads_before_wait(fn, {**consts, "USE_PDL": 2, "PRELOAD": 1}, **tys) > 0, (fn, consts)
        assert loads_before_wait(fn, {**consts, "USE_PDL": 2, "PRELOAD": 0}, **tys) == 0, (fn, consts)
    # its tl.dot tiles (16 rows) never preload: block-FP8 ones measured slower with it
    assert loads_before_wait(moe._moe_down_kernel, dict(K=8, HAS_VALID=True, HAS_BIAS=False, SPLIT=1, BLOCK_M=16,
                                                        BLOCK_N=16, BLOCK_K=256, BLOCK_S=64, QROWS=128, MX=0,
                                                        USE_PDL=2, PRELOAD=1), **fp8) == 0
