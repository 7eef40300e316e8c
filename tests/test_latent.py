"""capture.kernels=fused on multi-head latent attention (DeepSeek-V2/V3, moecg.latent) on CPU.

The absorbed decode re-associates HF's products (q . (W_UK latent) as (q W_UK) . latent), so the checks are
teacher-forced: fp32 logits within LOGIT_TOL of HF's modules over every MLA config variant HF runs (q LoRA or
q_proj, rotary layouts, yarn, attention bias, group-limited routers, dense and MoE layers), the same routed and
dropped counters, captured (emulated graphs, padded rows, capacity) as well as plain; the comparisons have teeth
(a wrong rotary layout or a missing latent norm moves the logits far past the bound); bf16 agreement stated as a
bound; the Triton kernels against their references under Triton's CPU interpreter (tests/triton_interp_mla.py).

Dims: T tokens, B rows, V vocab.
"""

import pytest
import torch

from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.engine import DecodeEngine
from moecg.fast import FastDecode
from moecg.models import build_model
from model_terms import randomise_terms  # tests/
from interp_runner import needs_triton, run_marked  # tests/

S, NEW, LEN = 7, 8, 48
LOGIT_TOL = 1e-4  # fp32: the absorbed products and different GEMM shapes than HF's modules
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
CASES = {
    "v3": ("deepseek_v3_tiny", {}),
    "v3_halves_bias": ("deepseek_v3_tiny", {"rope_interleave": False, "attention_bias": True}),
    "v3_no_q_lora_yarn": ("deepseek_v3_tiny", {"q_lora_rank": None, "rope_parameters": YARN}),
    "v3_dims": ("deepseek_v3_tiny", {"qk_nope_head_dim": 8, "qk_rope_head_dim": 16, "v_head_dim": 24,
                                     "kv_lora_rank": 48, "first_k_dense_replace": 0}),
    "v2": ("deepseek_v2_tiny", {}),
    "v2_groups_q_lora": ("deepseek_v2_tiny", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                                              "q_lora_rank": 24, "rope_parameters": YARN}),
}


def _build(preset, overrides, seed=0, dtype="fp32"):
    b = build_model(preset, dtype=dtype, device="cpu", seed=seed, config_overrides=overrides)
    return randomise_terms(b.model, seed, norms=True)  # HF zeros biases and norms' offsets: a dropped term shows


def _prompts(n=3, seed=0):
    return torch.randint(0, 512, (n, S), generator=torch.Generator().manual_seed(seed))


def _hf(model, prompts, dispatcher="dropless", **kw):
    attach(model, make_dispatcher(dispatcher, **kw), max_rows=4)
    want = DecodeEngine(model, LEN, 4).generate(prompts, NEW, keep_logits=True, timing=False)
    counts = state_of(model).snapshot()
    detach(model)
    return want, counts


def _gap(got, want):
    agree = float((got.tokens == want.tokens).float().mean())
    return agree, max(float((a.float() - b.float()).abs().max()) for a, b in zip(got.logits, want.logits))


@pytest.mark.parametrize("case", list(CASES))
def test_fused_latent_step_matches_hf_modules(case):
    preset, overrides = CASES[case]
    model = _build(preset, overrides)
    prompts = _prompts()
    want, want_counts = _hf(model, prompts)
    attach(model, make_dispatcher("fused"), max_rows=4)
    eng = DecodeEngine(model, LEN, 4)
    eng.decode_forward = FastDecode(model, "torch")
    got = eng.generate(prompts, NEW, keep_logits=True, timing=False, force_tokens=want.tokens)
    counts = state_of(model).snapshot()
    detach(model)
    agree, diff = _gap(got, want)
    assert agree >= 0.99 and diff < LOGIT_TOL, (agree, diff)
    assert counts["tokens"] == want_counts["tokens"] and counts["routed"] == want_counts["routed"]


@pytest.mark.parametrize("strategy", ["full", "capacity"])
def test_fused_latent_capture_emulated(strategy):
    """Emulated graphs per bucket, 3 real rows padded to bucket 4: full (dropless) and capacity (cf 0.5: real drops,
    the same dropped counts as HF's modules in the same bucket)."""
    model = _build("deepseek_v3_tiny", {}, seed=1)
    prompts = _prompts(3, seed=1)
    disp, kw = ("capacity", {"capacity_factor": 0.5}) if strategy == "capacity" else ("dropless", {})
    runs = []
    for kernels in ("hf", "fused"):
        attach(model, make_dispatcher(disp if kernels == "hf" or disp == "capacity" else "fused", **kw), max_rows=4)
        eng = DecodeEngine(model, LEN, 4)
        cap = Capture(eng, strategy, buckets=(1, 2, 4), backend="emulate", kernels=kernels,
                      kernel_backend="torch").apply()
        force = runs[0][0].tokens if runs else None
        runs.append((eng.generate(prompts, NEW, keep_logits=True, timing=False, force_tokens=force),
                     state_of(model).snapshot(), cap.stats()))
        cap.unwrap()
        detach(model)
    (want, wc, _), (got, gc, st) = runs
    assert st["kernels"] == "fused" and set(got.step_rows) == {4}
    agree, diff = _gap(got, want)
    assert agree >= 0.99 and diff < LOGIT_TOL, (agree, diff)
    assert gc["routed"] == wc["routed"] and gc["dropped"] == wc["dropped"]
    if strategy == "capacity":
        assert wc["dropped_assignments"] > 0  # the comparison covers real drops


def test_dropped_terms_show():
    """The bound has teeth: the wrong rotary layout or the latent norm left out moves the logits 20x past it."""
    model = _build("deepseek_v3_tiny", {})
    prompts = _prompts(2)
    want, _ = _hf(model, prompts)
    attach(model, make_dispatcher("dropless"), max_rows=4)
    eng = DecodeEngine(model, LEN, 4)
    for broken in ("layout", "kv_norm"):
        fast = FastDecode(model, "torch")
        for L in fast.layers:
            if broken == "layout":
                L.mla.layout = "halves"
            else:
                L.mla.kv_norm = torch.ones_like(L.mla.kv_norm)
        eng.decode_forward = fast
        got = eng.generate(prompts, NEW, keep_logits=True, timing=False, force_tokens=want.tokens)
        assert _gap(got, want)[1] > 20 * LOGIT_TOL, broken
    detach(model)


def test_bf16_agreement_bound():
    """bf16: the absorbed form rounds q W_UK and the latent-space output where HF rounds W_UK latent and the
    per-head values; teacher-forced top-1 agreement >= 0.9 and the logits within 0.02 (of logits up to ~0.65) on the tiny V3 and V2."""
    for preset in ("deepseek_v3_tiny", "deepseek_v2_tiny"):
        model = _build(preset, {}, dtype="bf16")
        prompts = _prompts(4, seed=2)
        want, _ = _hf(model, prompts)
        attach(model, make_dispatcher("fused"), max_rows=4)
        eng = DecodeEngine(model, LEN, 4)
        eng.decode_forward = FastDecode(model, "torch")
        got = eng.generate(prompts, NEW, keep_logits=True, timing=False, force_tokens=want.tokens)
        detach(model)
        agree, diff = _gap(got, want)
        assert agree >= 0.9 and diff < 0.02, (preset, agree, diff)


def test_fused_weights_are_views_but_one_copy():
    """W_UK / W_UV are views of kv_b_proj (no copy); the one owned copy is the q_a | kv_a concatenation."""
    model = _build("deepseek_v3_tiny", {})
    fast = FastDecode(model, "torch")
    at = model.model.layers[0].self_attn
    A = fast.layers[0].mla
    assert A.w_uk.data_ptr() == at.kv_b_proj.weight.data_ptr()
    assert A.w_uv.untyped_storage().data_ptr() == at.kv_b_proj.weight.untyped_storage().data_ptr()
    want = sum(L.mla.wa.numel() * L.mla.wa.element_size() + (L.mla.ba.numel() * 4 if L.mla.ba is not None else 0)
               for L in fast.layers)
    moe = sum(L.wcat.numel() * L.wcat.element_size() for L in fast.layers if L.wcat is not None)
    assert want <= fast.owned_bytes <= want + moe + sum(
        L.bcat.numel() * 4 for L in fast.layers if L.bcat is not None)


@needs_triton
@pytest.mark.interp("triton_interp_mla.py")
def test_triton_latent_kernels_under_interpreter(request):
    run_marked(request)


def test_mla_tile_and_split_rules():
    """tiles.mla_tiles / mla.mla_splits, as measured (experiments/results/mla_attn/, long_mla/): 64-head blocks where
    heads x rows are many or the cache is long, 64 slots a step at short caches, 4 warps elsewhere; past 256 slots
    ~128 programs under 8 rows x head blocks, else ~256, >= 128 slots each, at most 128 splits; the tiny test models
    (latent < 512) keep the first-written tiles."""
    from moecg.kernels.mla import MERGE_INLINE_MAX, mla_splits
    from moecg.kernels.tiles import MlaTiles, mla_tiles

    assert mla_tiles(64, 128, 512, 256) == MlaTiles(64, 32, 8, 2)  # V3, 64 rows, short cache
    assert mla_tiles(16, 128, 512, 256) == MlaTiles(16, 64, 8, 2)
    assert mla_tiles(16, 128, 512, 32768) == MlaTiles(64, 32, 8, 2) == mla_tiles(32, 64, 512, 4096)
    assert mla_tiles(1, 128, 512, 32768) == MlaTiles(64, 32, 8, 2) == mla_tiles(1, 64, 512, 16384)  # long caches
    assert mla_tiles(16, 64, 512, 4096) == MlaTiles(16, 32, 4, 3) == mla_tiles(64, 16, 512, 32768)  # Kimi / V2-Lite
    assert mla_tiles(1, 128, 512, 4096) == MlaTiles(16, 32, 4, 3)
    assert mla_tiles(3, 4, 32, 64) == MlaTiles(block_l=64, warps=4)
    assert [mla_splits(T, 1, 256) for T in (1, 8, 64)] == [4, 4, 2]  # the short rule, as the standard attention's
    assert [mla_splits(T, 1, 32768) for T in (1, 2, 4, 8, 16, 64)] == [128, 64, 32, 32, 16, 4]  # V2-Lite
    assert [mla_splits(T, nhb, 32768) for T, nhb in ((1, 2), (2, 2), (4, 2), (1, 8), (16, 2))] == [64, 32, 32, 32, 8]
    assert mla_splits(1, 1, 4096) == 32 and mla_splits(128, 2, 32768) == 1 and MERGE_INLINE_MAX == 8
