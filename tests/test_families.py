"""The families beyond Mixtral/Qwen (DeepSeek-V3, DeepSeek-V2, GLM-4-MoE, OLMoE, GPT-OSS) on every HF-module path.

Dims: B rows, S tokens per row, T = B*S tokens, K top-k, E experts, L MoE layers, V vocab.
Per tiny family preset, against references: the engine's greedy decode vs HF `generate`; every dispatcher vs HF's own
experts (its default grouped_mm and its eager loop); pad rows vs the unpadded batch; capacity drops vs Megatron-core's
`apply_router_token_dropping` on the family's real router outputs; emulated capture of every strategy vs eager; a
save_pretrained round trip; the skewed routers vs HF's routers; the results record's KV bytes per token. HF
initialises biases (router, experts, attention, sinks, e_score_correction_bias) to zero, which would hide a dropped
one: every test model gets random ones.
"""
import io
import warnings
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import moecg
from moecg.capture import Capture
from moecg.dispatch import attach, capacity_slots, detach, make_dispatcher
from moecg.dispatch.capacity import capacity
from moecg.engine import DecodeEngine
from moecg.floor import floor_bytes
from moecg.harness import Phases, run_experiment
from moecg.models import apply_router_skew, build_model, make_config
from moecg.models.adapter import UnsupportedConfigError, adapter_for
from moecg.models.skew import ROUTES_FROM_LOGITS
from moecg.models.zoo import FAMILY_PRESETS

S, NEW, ROWS = 7, 8, 4
# GPT-OSS: a clamp at 7 never bites on random weights; at 1.0 it does (test_dispatchers_match_hf_experts checks that)
OVERRIDES = {"gpt_oss_tiny": {"swiglu_limit": 1.0}}
DISPATCHERS = [("dynamic", {}), ("dropless", {}), ("fused", {}), ("capacity", {"capacity_factor": 1e3})]
TOL = dict(atol=1e-5, rtol=1e-5)


def _randomise_biases(model, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts are chosen
                b.copy_(torch.rand(b.shape, generator=g) * 0.2)


def _build(preset, seed=0, **kw):
    b = build_model(preset, dtype="fp32", device="cpu", seed=seed,
                    config_overrides={**OVERRIDES.get(preset, {}), **kw})
    _randomise_biases(b.model, seed)
    return b


@pytest.fixture(scope="module", params=FAMILY_PRESETS)
def fam(request):
    return request.param, _build(request.param)


def _prompts(n=3, seed=0):
    return torch.randint(0, 512, (n, S), generator=torch.Generator().manual_seed(seed))  # [B, S]


def _expected_moe_layers(config) -> list[int]:
    """MoE layers as the family's HF decoder layer builds them, restated from the config (not asked of the adapter)."""
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    return list(range(first_dense, config.num_hidden_layers))


def _logits(model, ids, name=None, valid_rows=None, **kw):
    """(logits [B, S, V], counter snapshot) with dispatcher `name` attached, or HF's own experts when name is None."""
    if name is None:
        with torch.no_grad():
            return model(ids).logits, None
    state = attach(model, make_dispatcher(name, **kw), max_rows=ids.shape[0])
    try:
        if valid_rows is not None:
            state.set_rows(valid_rows, ids.shape[0])
        with torch.no_grad():
            return model(ids).logits, state.snapshot()
    finally:
        detach(model)


# -- the engine --------------------------------------------------------------------------------------------------
def test_engine_decode_matches_hf_generate(fam):
    preset, b = fam
    prompts = _prompts()
    hf = b.model.generate(prompts, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[:, S:]  # [B, NEW]
    attach(b.model, make_dispatcher("dropless"), max_rows=ROWS)
    try:
        eng = DecodeEngine(b.model, S + NEW, ROWS)
        assert torch.equal(eng.generate(prompts, NEW, timing=False).tokens, hf)
        # the cache holds what the family's attention writes: MLA its latent, the others per-head K and V
        (hk, dk), (hv, dv) = b.adapter.kv_shapes(b.model.config)
        layer = eng.cache.full.layers[0]
        assert tuple(layer.keys.shape) == (ROWS, hk, S + NEW, dk) and tuple(layer.values.shape) == (ROWS, hv, S + NEW, dv)
    finally:
        detach(b.model)


def test_kv_cache_shapes_are_what_hf_writes(fam):
    """kv_shapes is what HF's own cache allocates from the first update, and what the floor prices."""
    preset, b = fam
    from transformers import DynamicCache

    cache = DynamicCache(config=b.model.config)
    with torch.no_grad():
        b.model(_prompts(2), cache=cache, use_cache=True)
    (hk, dk), (hv, dv) = b.adapter.kv_shapes(b.model.config)
    for layer in cache.layers:  # [B, H, tokens kept, D]: a sliding layer of HF's cache keeps only its window
        k, v = layer.keys.shape, layer.values.shape
        assert (k[0], k[1], k[3], v[0], v[1], v[3]) == (2, hk, dk, 2, hv, dv), preset
    per_token = sum(layer.keys[0, :, 0].numel() + layer.values[0, :, 0].numel() for layer in cache.layers)
    # floor's KV term: rows * per-token elements of every layer * context * bytes, at a context no longer than the
    # smallest window (so every layer, sliding or not, reads all of it)
    ctx = min([w for w in b.adapter.attention_windows(b.model.config) if w] or [S])
    base = floor_bytes(b.model, b.adapter, [0] * len(b.adapter.moe_layers(b.model)), 1, 0)
    assert floor_bytes(b.model, b.adapter, [0] * len(b.adapter.moe_layers(b.model)), 1, ctx) - base == per_token * ctx * 4


# -- dispatchers vs HF's experts ------------------------------------------------------------------------------------
def test_dispatchers_match_hf_experts(fam):
    preset, b = fam
    model, ids = b.model, _prompts()
    T, K = ids.numel(), b.adapter.top_k(model.config)
    hf, _ = _logits(model, ids)  # HF's default experts implementation (grouped_mm)
    model.set_experts_implementation("eager")
    try:
        eager, _ = _logits(model, ids)  # HF's own loop
    finally:
        model.set_experts_implementation("grouped_mm")
    torch.testing.assert_close(hf, eager, **TOL)
    moe = _expected_moe_layers(model.config)
    assert [i for i, _ in b.adapter.moe_layers(model)] == moe and b.adapter.moe_layers(model)
    if getattr(model.config, "first_k_dense_replace", 0):
        assert moe[0] > 0 and all(b.adapter.moe_block(layer) is None for layer in b.adapter.layers(model)[:moe[0]])
    ref_snap = None
    for name, kw in DISPATCHERS:
        got, snap = _logits(model, ids, name, **kw)
        torch.testing.assert_close(got, eager, **TOL, msg=lambda m, n=name: f"{preset} {n}: {m}")
        # dense layers are never counted: one counter row per MoE layer, T*K assignments in each
        assert len(snap["per_layer_drop_rate"]) == len(moe) and snap["routed_assignments"] == len(moe) * T * K
        assert snap["tokens"] == len(moe) * T and snap["dropped_assignments"] == 0
        ref_snap = ref_snap or snap
        assert snap["routed"] == ref_snap["routed"], name  # the same routing, expert by expert
    # teeth: the routed experts (and GPT-OSS's clamp) move the logits by far more than the tolerance
    experts = [e for _, e in b.adapter.moe_layers(model)]
    saved = [e.down_proj.detach().clone() for e in experts]
    with torch.no_grad():
        try:
            for e in experts:
                e.down_proj.zero_()
            assert (model(ids).logits - eager).abs().max() > 1e-3
        finally:
            for e, w in zip(experts, saved):
                e.down_proj.copy_(w)
    if hasattr(experts[0], "limit"):
        try:
            for e in experts:
                e.limit = 100.0
            with torch.no_grad():
                assert (model(ids).logits - eager).abs().max() > 1e-4, "the SwiGLU clamp never acted: no teeth"
        finally:
            for e in experts:
                e.limit = model.config.swiglu_limit


@pytest.mark.parametrize("name,kw", DISPATCHERS + [("capacity", {"capacity_factor": 1.0})],
                         ids=["dynamic", "dropless", "fused", "capacity-huge", "capacity-1.0"])
def test_pad_rows_through_the_model(fam, name, kw):
    """2 real rows run as 4 (the pad rows duplicate them): real-row logits and every counter equal the unpadded
    batch's. GPT-OSS's own loop one-hots over E classes, so `dynamic` must keep pad rows out of it."""
    preset, b = fam
    real = _prompts(2, seed=1)
    ref, ref_snap = _logits(b.model, real, name, **kw)
    got, snap = _logits(b.model, torch.cat([real, real]), name, valid_rows=2, **kw)
    torch.testing.assert_close(got[:2], ref, **TOL)
    for k in ("routed", "dropped", "tokens", "tokens_lost_all", "routed_assignments", "dropped_assignments"):
        assert snap[k] == ref_snap[k], f"{preset} {name}: counter {k}"
    if kw.get("capacity_factor") == 1.0:
        assert ref_snap["dropped_assignments"] > 0, "cf=1.0 dropped nothing: no teeth"


# -- capacity drops vs Megatron on the family's own routing -----------------------------------------------------
@pytest.fixture(scope="module")
def megatron_moe_utils():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.transformer.moe.moe_utils")


def _dense(idx, w, E):
    probs = torch.zeros(idx.shape[0], E).scatter(1, idx, w.float())  # [T, E]
    routed = torch.zeros(idx.shape[0], E, dtype=torch.bool).scatter(1, idx, True)  # [T, E]
    return probs, routed


def test_capacity_drops_match_megatron(fam, megatron_moe_utils):
    """`probs` ranks each expert's tokens by the combine weights the router hands the experts, as Megatron ranks its
    routing probs: for DeepSeek-V3/GLM the unbiased sigmoid scores, renormalised and scaled, while the correction bias
    only picked the experts."""
    preset, b = fam
    mu, model, ad = megatron_moe_utils, b.model, b.adapter
    cf, E, K = 1.0, ad.num_experts(model.config), ad.top_k(model.config)
    routes, handles = [], []
    for layer in ad.layers(model):
        router = ad.router_of(layer)
        if router is not None:  # router outputs: (logits [T, E], weights [T, K], ids [T, K]) in every family
            handles.append(router.register_forward_hook(lambda m, i, out: routes.append((out[0], out[2], out[1]))))
    ids = _prompts(4, seed=2)  # T = 28 tokens
    try:
        _, snap = _logits(model, ids, "capacity", capacity_factor=cf, drop_policy="probs")
    finally:
        for h in handles:
            h.remove()
    assert len(routes) == len(ad.moe_layers(model))
    dropped = []
    biased_differs = False
    for slot, (logits, idx, w) in enumerate(routes):
        probs, routed = _dense(idx, w, E)
        _, kept = mu.apply_router_token_dropping(probs, routed, K, cf, drop_policy="probs")  # [T, E]
        _, _, _, ours, _ = capacity_slots(idx, w, None, E, capacity(idx.shape[0], K, E, cf), "probs")
        assert torch.equal(ours, kept), f"{preset} layer slot {slot}: {(ours != kept).sum()} assignments differ"
        dropped.append((routed & ~kept).sum(0))
        router = ad.router_of(ad.layers(model)[ad.moe_layers(model)[slot][0]])
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            # the scores the bias picked by rank differently: ranking by them would drop other assignments
            spec = ad.router_spec(router)
            assert torch.allclose(w.sum(-1), torch.full_like(w[:, 0], spec.scaling)) if spec.normalize else True
            choice = (logits.sigmoid() + bias).gather(1, idx)  # [T, K]
            _, kept_biased = mu.apply_router_token_dropping(_dense(idx, choice, E)[0], routed, K, cf)
            biased_differs |= not torch.equal(kept_biased, kept)
    assert snap["dropped"] == [d.tolist() for d in dropped]  # the dispatcher through the model drops the same
    assert snap["dropped_assignments"] > 0, "cf=1.0 dropped nothing: no teeth"
    if any(getattr(ad.router_of(ad.layers(model)[i]), "e_score_correction_bias", None) is not None
           for i, _ in ad.moe_layers(model)):
        assert biased_differs, "ranking by the biased choice scores keeps the same assignments: no teeth"


# -- capture strategies ------------------------------------------------------------------------------------------
STRATEGY_DISPATCH = [("eager", "dropless", {}), ("partial", "dynamic", {}), ("partial", "dropless", {}),
                     ("layer", "dropless", {}), ("full", "dropless", {}), ("full", "fused", {}),
                     ("capacity", "capacity", {"capacity_factor": 1.0}), ("mixed", "dropless", {})]


def test_emulated_capture_of_every_strategy_replays_eager(fam):
    """3 rows in bucket 4 (a pad row in every graph): tokens and logits equal eager with the same dispatcher, and a
    capacity graph drops exactly what eager capacity drops at the real batch."""
    preset, b = fam
    prompts = _prompts()
    eager = {}
    for strategy, dispatch, kw in STRATEGY_DISPATCH:
        state = attach(b.model, make_dispatcher(dispatch, **kw), max_rows=ROWS)
        try:
            eng = DecodeEngine(b.model, S + NEW, ROWS)
            key = (dispatch, tuple(kw.items()))
            if key not in eager:
                state.reset()
                eager[key] = (eng.generate(prompts, NEW, keep_logits=True, timing=False), state.snapshot())
            want, want_snap = eager[key]
            layers = "0-0:layer,1-1:attn" if strategy == "mixed" else None
            cap = Capture(eng, strategy, layers=layers, buckets=[1, 2, 4], backend="emulate", warmup=1).apply()
            assert cap.captured or strategy == "eager"
            state.reset()
            got = eng.generate(prompts, NEW, keep_logits=True, timing=False)
            snap = state.snapshot()
            cap.unwrap()
        finally:
            detach(b.model)
        cell = f"{preset} strategy={strategy} dispatch={dispatch}"
        assert torch.equal(got.tokens, want.tokens), cell
        assert max(float((x - y).abs().max()) for x, y in zip(got.logits, want.logits)) <= 1e-4, cell
        if strategy != "eager":
            assert set(got.step_rows) == {ROWS}, cell  # every decode step ran padded in the bucket
        assert snap["dropped"] == want_snap["dropped"] and snap["routed"] == want_snap["routed"], cell
        if dispatch == "capacity":
            assert snap["dropped_assignments"] > 0, f"{cell}: no drops, no teeth"


# -- checkpoints -------------------------------------------------------------------------------------------------
def test_save_pretrained_round_trip(fam, tmp_path):
    preset, b = fam
    b.model.save_pretrained(tmp_path / "ck")
    loaded = build_model(pretrained_path=str(tmp_path / "ck"), dtype="fp32", device="cpu")
    assert loaded.family == b.family and type(loaded.model) is type(b.model)
    ids = _prompts(2, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, b.model(ids).logits, atol=0, rtol=0)
    tokens = []
    for m in (b.model, loaded.model):
        attach(m, make_dispatcher("dropless"), max_rows=2)
        try:
            tokens.append(DecodeEngine(m, S + NEW, 2).generate(ids, NEW, timing=False).tokens)
        finally:
            detach(m)
    assert torch.equal(*tokens)


# -- routers -----------------------------------------------------------------------------------------------------
def test_skewed_router_mirrors_hf_router(fam):
    """The skewed routing of the family's router kind (SkewHook's), from HF's logits with a zero bias, is HF's router
    bit for bit (ids, weights and logits), so router skew changes only what the bias changes."""
    preset, b = fam
    ad = b.adapter
    route = ROUTES_FROM_LOGITS[ad.router_kind]
    h = torch.randn(2 * S, b.model.config.hidden_size, generator=torch.Generator().manual_seed(4))  # [T, D]
    for i, _ in ad.moe_layers(b.model):
        router = ad.router_of(ad.layers(b.model)[i])
        with torch.no_grad():
            want = router(h)
            logits = want[0] + torch.zeros(router.num_experts).to(want[0].dtype)  # [T, E] a new tensor, as the hook's
            for got, w in zip(route(router, logits, ad.router_spec(router)), want):
                assert got.dtype == w.dtype and torch.equal(got, w), preset
    # as users skew random-weight routers: the preset as built (the random correction bias above saturates the load)
    model = build_model(preset, dtype="fp32", device="cpu").model
    imb = []
    for skew in (0.0, 0.5):
        apply_router_skew(model, skew, seed=0)
        _, snap = _logits(model, _prompts(8, seed=5), "dropless")
        imb.append(snap["expert_load_imbalance"])
    assert imb[1] > imb[0] + 0.3, f"{preset}: skew 0.5 did not skew the load ({imb})"


# -- refusals ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["deepseek_v3_tiny", "deepseek_v2_tiny"])
def test_fused_step_takes_mla_and_refuses_odd_rotary(preset):
    cfg = make_config(preset)
    adapter_for(cfg).check_supported(cfg, "fused")
    adapter_for(cfg).check_supported(cfg, "hf", step_graph=True)
    cfg.qk_rope_head_dim = 7  # (HF's config validation refuses it too)
    with pytest.raises(UnsupportedConfigError, match=r"\.qk_rope_head_dim: rotary dims pair up.*even"):
        adapter_for(cfg).check_supported(cfg, "fused")


@pytest.mark.parametrize("preset,ov,field", [
    ("deepseek_v3_tiny", {"n_group": 3}, "n_group"),  # 16 experts do not split into 3 groups
    ("deepseek_v3_tiny", {"topk_group": 5}, "n_group"),  # more groups kept than there are
    ("glm4_moe_tiny", {"n_group": 16}, "n_group"),  # groups of one expert: the best-two group score is undefined
    ("deepseek_v3_tiny", {"n_group": 4, "topk_group": 1}, "num_experts_per_tok"),  # top-4 of the 4 kept experts: ok
    ("deepseek_v2_tiny", {"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, "n_group"),
])
def test_group_limited_routing_refusals(preset, ov, field):
    cfg = make_config(preset, overrides=ov)
    if field == "num_experts_per_tok":  # 4 experts per kept group x 1 group >= top-4: accepted; top-5 is not
        adapter_for(cfg).check_supported(cfg, "hf")
        cfg = make_config(preset, overrides={**ov, "num_experts_per_tok": 5})
    with pytest.raises(UnsupportedConfigError, match=rf"\.{field}: .*; "):
        adapter_for(cfg).check_supported(cfg, "hf")


def test_dense_prefix_must_leave_a_moe_layer():
    cfg = make_config("deepseek_v3_tiny", num_layers=1)  # layer 0 is dense (first_k_dense_replace=1)
    with pytest.raises(UnsupportedConfigError, match=r"\.num_hidden_layers: .*no MoE layer.*model.num_layers=2"):
        adapter_for(cfg).check_supported(cfg, "hf")


# -- real shapes -------------------------------------------------------------------------------------------------
# published sizes (total, active per token; billions) of the checkpoint each preset mirrors
PUBLISHED = {"deepseek_v3": (671, 37), "kimi_k2": (1040, 32), "glm4_5_air": (106, 12), "deepseek_v2_lite": (15.7, 2.4),
             "olmoe_1b_7b": (6.9, 1.3), "gpt_oss_20b": (21, 3.6), "gpt_oss_120b": (116.8, 5.1)}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_real_shapes_have_the_published_sizes(preset):
    """Counted on the meta device (no memory): total parameters, and those one token touches (every non-expert weight,
    K of the E routed experts), within 10% of the model card (active counts exclude the embedding, as published)."""
    from moecg.models import FAMILIES
    from moecg.models.zoo import family_of_config

    cfg = make_config(preset)
    with torch.device("meta"):
        model = FAMILIES[family_of_config(cfg)][1](cfg)
    ad = adapter_for(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * ad.top_k(cfg) / ad.num_experts(cfg) - model.model.embed_tokens.weight.numel()
    want_total, want_active = PUBLISHED[preset]
    assert abs(total / 1e9 / want_total - 1) < 0.1 and abs(active / 1e9 / want_active - 1) < 0.1, (total, active)


def test_deepseek_v2_group_limited_router():
    """DeepSeek-V2's other topk_method (the 236B model's): the skewed forward mirrors it too, and the spec records the
    groups only where the router uses them."""
    greedy = _build("deepseek_v2_tiny")
    assert greedy.adapter.router_spec(greedy.adapter.router_of(greedy.model.model.layers[1])).n_group == 1
    b = _build("deepseek_v2_tiny", topk_method="group_limited_greedy", n_group=4, topk_group=2)
    router = b.adapter.router_of(b.model.model.layers[1])
    spec = b.adapter.router_spec(router)
    assert (spec.n_group, spec.topk_group, spec.normalize, spec.weights_fp32) == (4, 2, False, True)
    h = torch.randn(2 * S, b.model.config.hidden_size, generator=torch.Generator().manual_seed(6))  # [T, D]
    with torch.no_grad():
        want = router(h)
        got = ROUTES_FROM_LOGITS["softmax_group"](router, want[0] + torch.zeros(router.num_experts), spec)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    ids = want[2]  # [T, K]: every token's experts lie in at most topk_group of the 4 groups
    assert int((torch.zeros(ids.shape[0], 4).scatter(1, ids // 4, 1.0).sum(1) <= 2).all())


# -- results record ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["deepseek_v3_tiny", "mixtral_tiny"])
def test_results_record_kv_bytes_per_token(preset):
    """results.json's kv_bytes_per_token is the cache formula restated from the config: MLA's latent
    (kv_lora_rank + qk_rope_head_dim) or standard K and V (2 x kv heads x head_dim), x layers x fp32 bytes."""
    with initialize_config_dir(config_dir=str(Path(moecg.__file__).parent / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"model={preset}", "strategy=eager", "device=cpu", "batch_size=1", "prompt_len=4", "new_tokens=2",
            "measure.repeats=1", "measure.skip_steps=0", "measure.eager_baseline=false", "measure.fidelity=false"])
    rec = run_experiment(cfg, phases=Phases(out=io.StringIO()))
    c = make_config(preset)
    per_layer = (c.kv_lora_rank + c.qk_rope_head_dim if preset.startswith("deepseek")
                 else 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads))
    assert rec["kv_bytes_per_token"] == per_layer * c.num_hidden_layers * 4, rec["kv_bytes_per_token"]
