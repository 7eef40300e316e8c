"""`model.activations=fp8_dynamic` (moecg.models.formats.act_quant): the per-token, per-128-column e4m3 quantization
of every block-FP8 GEMM's input, against a direct formula; every PyTorch path computes the same model with it (HF's
modules, each dispatcher, the counters), it changes the model, MLA's kv_b_proj keeps its input; refusals name the key;
the record carries it (CPU; the Triton kernels are tested apart)."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

import moecg
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.harness import run_experiment
from moecg.models import build_model
from moecg.models.checkpoint import save_checkpoint
from moecg.models.formats import BLOCK, FP8, FP8_MAX, WeightFormatError, act_fake_quant, act_quant
from moecg.models.weights import (Fp8Linear, act_experts_loop, activations, dequantize_model, set_activations,
                                  stored)
from moecg.plan import PlanError, resolve_plan

CONF_DIR = Path(moecg.__file__).parent / "conf"
TOL = dict(atol=1e-5, rtol=1e-5)  # between dispatchers with full inputs (tests/test_dispatch.py, test_families.py)
# fp8_dynamic rounds each GEMM input to e4m3, a step function: where two paths sum a GEMM in another order (F.linear,
# grouped_mm, bmm) and its output lands within an ulp of an e4m3 midpoint, the next input rounds the other way, one
# value by one e4m3 step (seen: 1.8e-4 on the logits, once in 24 runs). Paths agree to 1e-5 but for such flips; the
# knob itself moves the logits by 1.6e-2 or more.
FLIP_TOL = dict(atol=1e-3, rtol=0)
# the e4m3 values, ascending, and their codes: the grid act_quant rounds onto (NaN codes left out)
_CODES = torch.arange(256, dtype=torch.uint8)
_VALUES = _CODES.view(FP8).float()
_FINITE = ~_VALUES.isnan()
GRID, GRID_CODES = _VALUES[_FINITE].sort()[0], _CODES[_FINITE][_VALUES[_FINITE].sort()[1]]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _build(preset, act="fp8_dynamic", seed=3, **kw):
    return build_model(preset, dtype="fp32", device="cpu", seed=seed, weights="fp8_block", activations=act, **kw)


# -- the quantization -----------------------------------------------------------------------------

def _nearest_e4m3(y: torch.Tensor) -> torch.Tensor:
    """y (already in [-448, 448]) -> the nearest e4m3 value, ties to the even code, by search on the grid."""
    i = torch.searchsorted(GRID, y).clamp(1, len(GRID) - 1)
    lo, hi = GRID[i - 1], GRID[i]
    d_lo, d_hi = y - lo, hi - y
    even_hi = (GRID_CODES[i] & 1) == 0
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even_hi)
    return torch.where(pick_hi, hi, lo)


def _direct(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant written out block by block: scale = amax / 448, q = RNE_e4m3(x * (448 / amax)), zero block scale 1."""
    rows, K = x.shape
    nb = -(-K // BLOCK)
    q, s = torch.zeros(rows, K), torch.ones(rows, nb)
    for r in range(rows):
        for b in range(nb):
            blk = x[r, b * BLOCK:(b + 1) * BLOCK].float()
            amax = blk.abs().max()
            if amax == 0:
                continue
            s[r, b] = amax / FP8_MAX
            q[r, b * BLOCK:(b + 1) * BLOCK] = _nearest_e4m3((blk * (torch.tensor(FP8_MAX) / amax)).clamp(-448, 448))
    return q, s


def test_act_quant_is_the_per_token_block_formula():
    torch.manual_seed(0)
    K = 300  # blocks of 128, 128 and a 44-column tail
    x = torch.randn(5, K) * torch.logspace(-4, 3, K)
    x[1, 128:256] = 0  # an all-zero block
    x[2] *= 1e-30  # tiny values: the scale carries them
    q, s = act_quant(x)
    assert q.dtype == FP8 and s.dtype == torch.float32 and q.shape == (5, K) and s.shape == (5, 3)
    dq, ds = _direct(x)
    assert torch.equal(s, ds) and torch.equal(q.float(), dq)
    assert s[1, 1] == 1 and (q[1, 128:256].float() == 0).all()
    # each block's amax lands on 448 exactly (saturated, never past it); nothing exceeds it
    blocks = torch.nn.functional.pad(x, (0, 3 * BLOCK - K)).view(5, 3, BLOCK).abs()
    at = blocks.argmax(-1)
    qb = torch.nn.functional.pad(q.float(), (0, 3 * BLOCK - K)).view(5, 3, BLOCK)
    hit = qb.abs().gather(-1, at[..., None])[..., 0]
    assert torch.equal(hit[s != 1], torch.full_like(hit[s != 1], FP8_MAX)) and q.float().abs().max() == FP8_MAX
    # rows are independent: each row quantized alone is the same
    for r in range(5):
        q1, s1 = act_quant(x[r:r + 1])
        assert torch.equal(q1.float(), q[r:r + 1].float()) and torch.equal(s1, s[r:r + 1])


def test_act_quant_rounds_ties_to_even_and_saturates():
    """A block whose amax is 448 scales by exactly 1: the values are rounded as they stand."""
    row = torch.zeros(BLOCK)
    # midpoints of e4m3 neighbours, to the even mantissa: 1.0625 (1.0 | 1.125) -> 1.0; 1.1875 -> 1.25; 12.5 -> 12;
    # 13.5 -> 14; 15.5 -> 16; 1.5 x 2^-9 (the subnormals 2^-9 | 2^-8) -> 2^-8; 432 (416 | 448) -> 448
    vals = [448.0, 1.0625, 1.1875, 12.5, 13.5, 15.5, -1.0625, 0.0029296875, 416.0, 432.0, 13.0]
    want = [448.0, 1.0, 1.25, 12.0, 14.0, 16.0, -1.0, 0.00390625, 416.0, 448.0, 13.0]
    row[:len(vals)] = torch.tensor(vals)
    q, s = act_quant(row[None])
    assert s.item() == 1.0
    assert q.float()[0, :len(vals)].tolist() == want
    assert torch.equal(q.float(), _direct(row[None])[0])
    # the block's largest value saturates at 448 whatever the scale's rounding; act_fake_quant gives it back
    x = torch.tensor([[3.0, -7.3, 0.1] + [0.0] * 125 + [1e-3, 2e-3]])  # K 130: a 2-column tail block
    q, s = act_quant(x)
    assert q.float()[0, 1] == -FP8_MAX and q.float()[0, 129] == FP8_MAX
    fq = act_fake_quant(x)
    assert fq.dtype == x.dtype and abs(fq[0, 1].item() + 7.3) < 1e-6
    assert torch.equal(fq, (q.float() * s.repeat_interleave(BLOCK, -1)[:, :130]).to(x.dtype))
    assert torch.equal(act_fake_quant(torch.zeros(3, 200)), torch.zeros(3, 200))  # zero rows stay zero
    xb = torch.randn(4, 256, dtype=torch.bfloat16)
    assert act_fake_quant(xb).dtype == torch.bfloat16


# -- the modules ----------------------------------------------------------------------------------

def test_what_the_knob_marks():
    """Every Fp8Linear and every block-FP8 experts module takes fp8_dynamic inputs, MLA's kv_b_proj excepted; the
    routers, the shared-expert gate and the LM head are not FP8 at all; dequantize_model leaves plain modules."""
    b = _build("deepseek_v3_tiny")
    m, ad = b.model, b.adapter
    assert b.activations == activations(m) == "fp8_dynamic"
    at = m.model.layers[0].self_attn
    assert at.q_a_proj.act == at.q_b_proj.act == at.kv_a_proj_with_mqa.act == at.o_proj.act == "fp8_dynamic"
    assert at.kv_b_proj.act == "full" and stored(at.kv_b_proj).act == "full"
    x = torch.randn(3, at.kv_b_proj.in_features)
    assert torch.equal(at.kv_b_proj(x), F.linear(x, stored(at.kv_b_proj).dense()))  # its input as it is
    lin = at.o_proj
    x = torch.randn(3, lin.in_features)
    assert torch.equal(lin(x), F.linear(act_fake_quant(x), lin.stored().dense()))
    assert not torch.equal(lin(x), F.linear(x, lin.stored().dense()))
    for _, ex in ad.moe_layers(m):
        assert stored(ex, "gate_up_proj").act == stored(ex, "down_proj").act == "fp8_dynamic"
    assert all(type(ad.router_of(layer)) is not Fp8Linear for layer in ad.layers(m))
    assert type(m.lm_head) is torch.nn.Linear
    q2 = build_model("qwen2_moe_tiny", dtype="fp32", device="cpu", weights="fp8_block", activations="fp8_dynamic").model
    assert type(q2.model.layers[0].mlp.shared_expert_gate) is torch.nn.Linear
    assert q2.model.layers[0].mlp.shared_expert.down_proj.act == "fp8_dynamic"
    set_activations(m, ad, "full")  # back: every mark off
    assert activations(m) == "full" and all(mod.act == "full" for mod in m.modules() if isinstance(mod, Fp8Linear))
    dequantize_model(m, ad)
    assert activations(m) == "full" and not any(isinstance(mod, Fp8Linear) for mod in m.modules())


def test_act_experts_loop_is_hfs_loop_with_full_inputs():
    """moecg's copy of HF's eager loop (what HF's modules and dispatch=dynamic run with fp8_dynamic) computes, with
    full inputs, HF's own loop on the dequantized weights bit for bit."""
    b = _build("mixtral_tiny", act="full")
    ex = b.adapter.experts_of(b.model.model.layers[0])
    torch.manual_seed(1)
    T, K, E = 7, 2, ex.num_experts
    h, idx = torch.randn(T, ex.hidden_dim), torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    from moecg.models.weights import dequantized
    with torch.no_grad():
        got = act_experts_loop(ex, h, idx, w)
        with dequantized(ex):
            want = type(ex).forward.__wrapped__(ex, h, idx, w)
    assert torch.equal(got, want)


# -- every path -----------------------------------------------------------------------------------

def _paths(m, ids):
    """{path: (logits, counters)} for HF's experts (no dispatcher) and each dispatcher."""
    out = {}
    with torch.no_grad():
        out["hf"] = (m(ids).logits, None)
    for disp, kw in (("dynamic", {}), ("dropless", {}), ("fused", {}), ("capacity", {"capacity_factor": 8.0})):
        attach(m, make_dispatcher(disp, **kw))
        with torch.no_grad():
            out[disp] = (m(ids).logits, state_of(m).snapshot())
        detach(m)
    return out


@pytest.mark.parametrize("preset", ["mixtral_tiny", "qwen3_moe_tiny", "qwen2_moe_tiny", "deepseek_v3_tiny"])
def test_every_pytorch_path_computes_the_same_fp8_dynamic_model(preset):
    """HF's modules, dispatch=dynamic, dropless, fused (its PyTorch path) and capacity with room for every assignment
    give the same logits with fp8_dynamic on, and route the same assignments (nothing dropped); the same model with
    full inputs gives other logits (the knob does something), by about e4m3's rounding."""
    m = _build(preset).model
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (3, 6))
    out = _paths(m, ids)
    ref, _ = out["hf"]
    for name, (logits, counters) in out.items():
        torch.testing.assert_close(logits, ref, **FLIP_TOL, msg=lambda msg, n=name: f"{preset} {n}: {msg}")
        if counters is not None:
            assert counters["routed"] == out["dropless"][1]["routed"], name
            assert sum(map(sum, counters["dropped"])) == 0, name
    full = _build(preset, act="full").model
    with torch.no_grad():
        lf = full(ids).logits
    assert (lf - ref).abs().max() > 1e-3
    assert (lf - ref).abs().max() < 0.1 * lf.abs().max()


@pytest.mark.parametrize("preset", ["qwen3_moe_tiny", "deepseek_v3_tiny"])
def test_each_assignment_is_the_reference_on_every_dispatcher(preset):
    """One MoE layer, two pad rows: every dispatcher's [T, K, D] output is, per kept assignment, the reference expert
    (act_experts_loop) times its weight, pad rows zero; dispatch=dynamic sums them; capacity drops the same
    assignments as with full inputs (drops follow the routing, which the knob does not touch)."""
    from moecg.dispatch.state import LayerCounters
    from moecg.dispatch.dynamic import Dynamic

    b = _build(preset)
    ex = b.adapter.moe_layers(b.model)[0][1]
    torch.manual_seed(2)
    T, K, E = 9, b.adapter.top_k(b.model.config), ex.num_experts
    h = torch.randn(T, ex.hidden_dim)
    h[-2:] = 0
    valid = torch.arange(T) < T - 2
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    with torch.no_grad():
        want = torch.stack([act_experts_loop(ex, h, idx[:, k:k + 1], w[:, k:k + 1]) for k in range(K)], 1)
        want[~valid] = 0
        torch.testing.assert_close(Dynamic().forward(ex, h, idx, w, valid, None), want.sum(1), **FLIP_TOL)
    counts = {}
    for name, kw in (("dropless", {}), ("fused", {}), ("capacity", {"capacity_factor": 0.5})):
        disp = make_dispatcher(name, **kw)
        for act in ("fp8_dynamic", "full"):
            ex._moecg_act = act
            c = LayerCounters.zeros(E, capacity=True)
            with torch.no_grad():
                got = disp.unreduced(ex, h, idx, w, valid, c)
            counts[act] = (c.routed.tolist(), c.dropped.tolist())
            if act == "fp8_dynamic":
                kept = got.abs().amax(-1) > 0  # [T, K]
                torch.testing.assert_close(got[kept], want[kept], **FLIP_TOL, msg=lambda m, n=name: f"{n}: {m}")
                assert not got[~valid].any()
                assert int(kept.sum()) == (int(valid.sum()) * K if name != "capacity" else
                                           int(valid.sum()) * K - sum(counts[act][1]))
        ex._moecg_act = "fp8_dynamic"
        assert counts["fp8_dynamic"] == counts["full"], name
        assert (sum(counts["full"][1]) > 0) == (name == "capacity"), name  # cf 0.5 drops something


# -- the plan and the record ----------------------------------------------------------------------

def test_refusals_name_the_key_and_the_fix(tmp_path):
    with pytest.raises(PlanError, match=r"model.activations='int8': choose one of full, fp8_dynamic"):
        resolve_plan(_cfg("model=qwen3_moe_tiny", "model.weights=fp8_block", "model.activations=int8"))
    with pytest.raises(PlanError, match=r"model.activations=fp8_dynamic .* here are full: add model.weights=fp8_block"):
        resolve_plan(_cfg("model=qwen3_moe_tiny", "model.activations=fp8_dynamic"))
    with pytest.raises(PlanError, match=r"model.activations=fp8_dynamic .* here are mxfp4: add model.weights=fp8_block"):
        resolve_plan(_cfg("model=gpt_oss_tiny", "model.weights=mxfp4", "model.activations=fp8_dynamic"))
    assert resolve_plan(_cfg("model=qwen3_moe_tiny")).model.activations == "full"
    plan = resolve_plan(_cfg("model=qwen3_moe_tiny", "model.weights=fp8_block", "model.activations=fp8_dynamic"))
    assert plan.model.activations == "fp8_dynamic"
    with pytest.raises(WeightFormatError, match=r"model.activations=fp8_dynamic .* here are full"):
        build_model("qwen3_moe_tiny", dtype="fp32", device="cpu", activations="fp8_dynamic")
    # an FP8 checkpoint gives the format itself: fp8_dynamic needs no model.weights then
    save_checkpoint(_build("qwen3_moe_tiny", act="full").model, str(tmp_path))
    plan = resolve_plan(_cfg("model=local", f"model.pretrained_path={tmp_path}", "model.activations=fp8_dynamic"))
    assert plan.model.weights == "fp8_block" and plan.model.activations == "fp8_dynamic"
    loaded = build_model(pretrained_path=str(tmp_path), dtype="fp32", device="cpu", activations="fp8_dynamic")
    assert loaded.weights == "fp8_block" and loaded.activations == "fp8_dynamic"
    assert all(mod.act == "fp8_dynamic" for mod in loaded.model.modules() if isinstance(mod, Fp8Linear))


def test_results_record_the_activations():
    base = ["model=qwen3_moe_tiny", "model.weights=fp8_block", "strategy=partial", "new_tokens=4", "measure.repeats=1"]
    r = run_experiment(_cfg(*base, "model.activations=fp8_dynamic"))
    assert r["status"] == "ok" and r["activations"] == "fp8_dynamic" and r["weights"] == "fp8_block"
    assert r["token_agreement_forced_vs_eager"] == 1.0
