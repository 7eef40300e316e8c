"""The differential matrix (CPU, emulated capture): every family preset and variant x strategy x dispatch x
capture.kernels, at a batch that is not a bucket size (3 rows run in bucket 4), through the run plan and the harness
exactly as `python -m moecg.run` runs them.

Invariants:
  - a combination the plan refuses is refused before any model is built, with the fix named;
  - dropless paths (dynamic, dropless, fused) on HF modules give dropless eager's greedy tokens exactly, logits within
    fp32 rounding of the padded GEMMs; on the fused step (PyTorch reference ops) teacher-forced agreement >= 0.99
    and a logit bound;
  - a capacity run drops the same assignments on every strategy and kernel path for the same real batch, and records
    the capacity of the real tokens (not of the bucket);
  - router skew gives the same load imbalance on every path.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import moecg
from moecg import fast
from moecg.capture.plan import KERNELS as KERNEL_PATHS
from moecg.capture.plan import STRATEGIES as STRATEGY_REGISTRY
from moecg.dispatch import REGISTRY
from moecg.dispatch.capacity import capacity
from moecg.harness import Phases, run_experiment
from moecg.models.adapter import FUSED_ATTENTION_KINDS, adapter_for
from moecg.models.zoo import FAMILY_PRESETS, VARIANT_PRESETS, make_config
from moecg.plan import PlanError, resolve_plan

CONF = str(Path(moecg.__file__).parent / "conf")
PRESETS = ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny", *VARIANT_PRESETS, *FAMILY_PRESETS]
STRATEGIES = list(STRATEGY_REGISTRY)  # every registered strategy, dispatcher and kernel path
DISPATCHES = list(REGISTRY)
KERNELS = list(KERNEL_PATHS)
BATCH, BUCKET = 3, 4
CF = 1.0
# fp32 on CPU: padding 3 rows to 4 changes GEMM blocking, so logits may move in the last bits (never a token here)
HF_LOGIT_TOL = 1e-4
FUSED_LOGIT_TOL = 1e-3


def _overrides(preset, strategy, dispatch, kernels, *extra):
    ov = [f"model={preset}", f"strategy={strategy}", f"dispatch={dispatch}", f"capture.kernels={kernels}",
          "capture.backend=emulate", f"batch_size={BATCH}", "prompt_len=5", "new_tokens=6", "measure.repeats=1",
          "measure.skip_steps=0", "measure.eager_baseline=false", "capture.warmup=1", *extra]
    if strategy == "mixed":
        ov.append("strategy.layers='0-0:layer,1-1:attn'")
    if dispatch == "capacity":
        ov.append(f"dispatch.capacity_factor={CF}")
    return ov


def _cfg(overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


class _Quiet(Phases):
    def say(self, msg):
        pass


@functools.lru_cache(maxsize=None)
def _run(preset, strategy, dispatch, kernels, skew=0.0):
    """('refused', message) or ('ok', results) for one cell; memoised, as the invariants compare cells."""
    cfg = _cfg(_overrides(preset, strategy, dispatch, kernels, f"model.router_skew={skew}"))
    try:
        plan = resolve_plan(cfg)
    except PlanError as e:
        return "refused", str(e)
    return "ok", run_experiment(plan, phases=_Quiet())


def _cells(preset):
    return [(s, d, k) for s in STRATEGIES for d in DISPATCHES for k in KERNELS]


@functools.lru_cache(maxsize=None)
def _fused_gaps(preset) -> tuple[str, ...]:
    """What the fused step lacks for this preset, read off the declarations (the family adapter's attention kind,
    router kind and features against what the fused step declares it runs: FUSED_ATTENTION_KINDS, ...), each as the plan's refusal names it."""
    cfg = make_config(preset)
    ad = adapter_for(cfg)
    gaps = [f"{ad.attention} attention"] if ad.attention not in FUSED_ATTENTION_KINDS else []
    if ad.router_kind not in fast.FUSED_ROUTER_KINDS:
        gaps.append(f"router kind {ad.router_kind!r}")
    gaps += [f for f in ad.features(cfg) if f not in getattr(fast, "FUSED_FEATURES", ())]
    return tuple(gaps)


def _expect_refusal(preset, strategy, dispatch, kernels) -> list[str]:
    """Why the plan must refuse a combination (the README's rules, restated independently); any one reason may be
    the one it names."""
    why = []
    if strategy == "capacity" and dispatch != "capacity":
        why.append("strategy=capacity needs")
    if kernels == "fused" and strategy not in ("eager", "full", "capacity"):
        why.append("capture.kernels=fused")
    if dispatch == "dynamic" and strategy in ("layer", "full", "mixed", "capacity"):
        why.append("dispatch=dynamic is not graph-safe")
    if kernels == "fused":
        why += list(_fused_gaps(preset))
    return why


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_matrix(preset):
    capacity_drops = {}
    for strategy, dispatch, kernels in _cells(preset):
        status, out = _run(preset, strategy, dispatch, kernels)
        cell = f"{preset} strategy={strategy} dispatch={dispatch} kernels={kernels}"
        want_refusal = _expect_refusal(preset, strategy, dispatch, kernels)
        if want_refusal:
            assert status == "refused" and any(w in out for w in want_refusal), \
                f"{cell}: expected refusal ({want_refusal}), got {status}: {out}"
            assert "use " in out or "choose" in out or "needs" in out, f"{cell}: the refusal names no fix: {out}"
            continue
        assert status == "ok", f"{cell}: refused: {out}"
        res = out
        assert res["status"] == "ok" and res["batch_size"] == BATCH
        graphs = strategy != "eager"
        assert res["captured"] is graphs, cell
        assert res["bucket"] == (BUCKET if graphs else None), cell
        assert res["kernels"] == kernels
        if dispatch != "capacity":
            assert res["dropped_assignments"] == 0 and res["capacity"] is None, cell
            assert res["routed_assignments"] == BATCH * res["top_k"] * (res["new_tokens"] - 1) * \
                len(res["per_layer_drop_rate"]), f"{cell}: pad rows were counted"
            if kernels == "hf":
                assert res["token_agreement_vs_eager"] == 1.0, cell
                assert res["token_agreement_forced_vs_eager"] == 1.0, cell
                assert res["max_logit_diff_vs_eager"] <= HF_LOGIT_TOL, cell
            else:
                assert res["token_agreement_forced_vs_eager"] >= 0.99, cell
                assert res["max_logit_diff_vs_eager"] <= FUSED_LOGIT_TOL, cell
        else:
            # the threshold is the real batch's capacity whatever bucket the step ran in
            assert res["capacity"] == capacity(BATCH, res["top_k"], res["num_experts"], CF), cell
            assert res["capacity_buffer"] == capacity(BUCKET if graphs else BATCH, res["top_k"], res["num_experts"], CF)
            capacity_drops[(strategy, kernels)] = (res["dropped_assignments"], res["routed_assignments"])
    # the same workload drops the same assignments whatever the strategy and kernels
    assert len(set(capacity_drops.values())) == 1, f"{preset}: capacity drops differ by path: {capacity_drops}"
    assert next(iter(capacity_drops.values()))[0] > 0, f"{preset}: cf={CF} dropped nothing: the check has no teeth"


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny", *FAMILY_PRESETS])
def test_router_skew_acts_on_every_path(preset):
    imb = {}
    paths = [("eager", "hf"), ("partial", "hf"), ("layer", "hf"), ("full", "hf"), ("eager", "fused"), ("full", "fused")]
    for strategy, kernels in paths:
        if kernels == "fused" and _fused_gaps(preset):
            continue  # refused by the plan (test_matrix checks that)
        status, res = _run(preset, strategy, "dropless", kernels, 0.5)
        assert status == "ok", res
        imb[(strategy, kernels)] = res["expert_load_imbalance"]
    _, plain = _run(preset, "eager", "dropless", "hf", 0.0)
    base = imb[("eager", "hf")]
    assert base > plain["expert_load_imbalance"] + 0.5, "skew 0.5 did not skew the load: no teeth"
    for k, v in imb.items():
        # HF-module paths: exactly the same routing; the fused step: same up to a rare near-tie flip
        tol = 0.0 if k[1] == "hf" else 0.05 * base
        assert abs(v - base) <= tol, f"{preset}: load imbalance {v} on {k} vs {base} on eager/hf"
