"""moecg.capture on CPU: validation, buckets, padding masks, wrapping/unwrapping, and the emulated graph backend.

The `emulate` backend re-runs the captured function on the static buffers at replay, so a buffer that is not
refreshed, or aliased wrongly, gives wrong tokens here just as a real CUDA graph would.
"""
import warnings

import pytest
import torch

from moecg.capture import Capture, CaptureError, StrategyError, bucket_for, parse_layers, validate, validate_buckets
from moecg.capture.graph import GraphRunner, make_backend
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.engine import CacheOverflowError, DecodeEngine, EagerPolicy
from moecg.models import build_model

PRESETS = ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny"]


@pytest.fixture(scope="module", params=PRESETS)
def model(request):
    return build_model(request.param).model


def _prompts(n, s=6, seed=1):
    return torch.randint(0, 512, (n, s), generator=torch.Generator().manual_seed(seed))


# -- policy ------------------------------------------------------------------------------------------------
def test_buckets_validate_and_select():
    assert validate_buckets([1, 2, 4]) == (1, 2, 4)
    for bad in ([], [0, 1], [2, 1], [1, 1]):
        with pytest.raises(ValueError, match="capture.buckets"):
            validate_buckets(bad)
    b = (1, 2, 4, 8)
    assert [bucket_for(n, b) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_layer_plan_parsing():
    assert parse_layers("0-1:layer,2-3:attn", 5) == ["layer", "layer", "attn", "attn", "eager"]
    assert parse_layers("3:attn", 4) == ["eager", "eager", "eager", "attn"]
    for bad, msg in [("0-9:layer", "outside"), ("0-1:layer,1-2:attn", "given twice"), ("0-1:graph", "scope"),
                     ("zero:layer", "cannot read")]:
        with pytest.raises(StrategyError, match=msg):
            parse_layers(bad, 4)


def test_validation_names_problem_and_fix():
    dyn, cap = make_dispatcher("dynamic"), make_dispatcher("capacity")
    for strategy in ("full", "layer"):
        with pytest.raises(StrategyError, match="dispatch=dynamic is not graph-safe: use dispatch=dropless, "
                                                "dispatch=capacity, or strategy=partial"):
            validate(strategy, dyn, 4)
    with pytest.raises(StrategyError, match=r"layers \[0, 1\]"):
        validate("mixed", dyn, 4, "0-1:layer,2-3:attn")
    validate("partial", dyn, 4)  # attention-only capture takes any dispatcher
    validate("mixed", dyn, 4, "0-3:attn")
    with pytest.raises(StrategyError, match="needs dispatch=capacity"):
        validate("capacity", make_dispatcher("dropless"), 4)
    validate("capacity", cap, 4)
    with pytest.raises(StrategyError, match="unknown strategy 'nope'"):
        validate("nope", cap, 4)
    with pytest.raises(StrategyError, match="strategy.layers"):
        validate("mixed", cap, 4)


def test_dynamic_full_refused_before_any_capture(model, monkeypatch):
    attach(model, make_dispatcher("dynamic"), max_rows=4)
    try:
        engine = DecodeEngine(model, 16, 4)
        called = []
        monkeypatch.setattr(GraphRunner, "capture", lambda *a, **k: called.append(a))
        with pytest.raises(StrategyError, match="not graph-safe"):
            Capture(engine, "full", backend="emulate")
        assert not called
    finally:
        detach(model)


def test_cpu_fallback_runs_eagerly_with_one_warning(model):
    attach(model, make_dispatcher("capacity", capacity_factor=0.5), max_rows=4)
    try:
        engine = DecodeEngine(model, 16, 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cap = Capture(engine, "capacity").apply()  # backend auto on CPU: no graphs
        assert len([w for w in caught if "CUDA graphs are unavailable" in str(w.message)]) == 1
        assert cap.stats()["captured"] is False
        state_of(model).reset()
        engine.generate(_prompts(3), 4)
        assert state_of(model).snapshot()["drop_rate"] > 0  # drops are still real
    finally:
        detach(model)


def test_cache_overflow_is_a_clear_error(model):
    attach(model, make_dispatcher("dropless"), max_rows=2)
    try:
        with pytest.raises(CacheOverflowError, match="exceeds the KV cache"):
            DecodeEngine(model, 8, 2).generate(_prompts(2, s=6), 4)
    finally:
        detach(model)


# -- mechanism through the emulated backend ---------------------------------------------------------------
STRATS = [("full", None, "dropless"), ("capacity", None, "capacity"), ("partial", None, "dynamic"),
          ("layer", None, "dropless"), ("mixed", "0-0:layer,1-1:attn", "dropless")]


@pytest.mark.parametrize("strategy,layers,dispatch", STRATS)
def test_emulated_graphs_match_eager_with_padding_and_shrinking(model, strategy, layers, dispatch):
    kw = {"capacity_factor": 1e3} if dispatch == "capacity" else {}
    attach(model, make_dispatcher(dispatch, **kw), max_rows=8)
    try:
        engine = DecodeEngine(model, 24, 8)
        prompts = _prompts(3)  # 3 rows run in bucket 4: one pad row
        ref = engine.generate(prompts, 10, lengths=[10, 4, 7], keep_logits=True)
        state_of(model).reset()
        cap = Capture(engine, strategy, layers=layers, buckets=[1, 2, 4, 8], backend="emulate").apply()
        assert cap.stats()["captured"] and engine.policy is cap
        state_of(model).reset()
        got = engine.generate(prompts, 10, lengths=[10, 4, 7], keep_logits=True)
        assert torch.equal(got.tokens, ref.tokens)
        assert got.step_rows == [4, 4, 4, 2, 2, 2, 1, 1, 1]  # padded to 4, then buckets shrink with the batch
        for a, b in zip(ref.logits, got.logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        stats = cap.stats()
        assert stats["buckets"][4]["replays"] > 0 and stats["buckets"][1]["replays"] > 0
        assert stats["buckets"][8]["replays"] == 0  # captured (largest first) but never needed
        # pad rows never reach the counters: a padded run counts exactly the real tokens
        snap = state_of(model).snapshot()
        n_moe = len(state_of(model).layer_ids)
        assert snap["tokens"] == n_moe * (3 * 6 + (10 - 1) + (4 - 1) + (7 - 1))
        cap.unwrap()
        again = engine.generate(prompts, 10, lengths=[10, 4, 7])
        assert torch.equal(again.tokens, ref.tokens)
        assert type(engine.policy) is EagerPolicy and engine.decode_forward is None
    finally:
        detach(model)


def test_unwrap_restores_module_forwards(model):
    attach(model, make_dispatcher("dropless"), max_rows=4)
    try:
        layers = model.model.layers
        before = [(type(l).forward, type(l.self_attn).forward) for l in layers]
        keys = list(model.state_dict())
        engine = DecodeEngine(model, 16, 4)
        cap = Capture(engine, "mixed", layers=f"0-0:layer,1-{len(layers) - 1}:attn", buckets=[1, 2, 4],
                      backend="emulate").apply()
        assert all("forward" in layer.__dict__ for layer in layers)  # both scopes wrap the decoder layer
        cap.unwrap()
        for l, (lf, af) in zip(layers, before):
            assert "forward" not in l.__dict__ and "forward" not in l.self_attn.__dict__
            assert type(l).forward is lf and type(l.self_attn).forward is af
        assert list(model.state_dict()) == keys  # the module tree never changed: still a plain HF model
    finally:
        detach(model)


def test_batch_above_largest_bucket_runs_eagerly_with_one_warning(model):
    attach(model, make_dispatcher("dropless"), max_rows=8)
    try:
        engine = DecodeEngine(model, 16, 8)
        ref = engine.generate(_prompts(5), 4)
        cap = Capture(engine, "full", buckets=[1, 2, 4], backend="emulate").apply()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = engine.generate(_prompts(5), 4)
        assert sum("above the largest captured bucket" in str(w.message) for w in caught) == 1
        assert got.step_rows == [5, 5, 5]
        assert torch.equal(got.tokens, ref.tokens)
        cap.unwrap()
    finally:
        detach(model)


def test_failed_capture_names_strategy_bucket_and_fixes(model, monkeypatch):
    attach(model, make_dispatcher("dropless"), max_rows=4)
    try:
        engine = DecodeEngine(model, 16, 4)

        def boom(*a, **k):
            raise RuntimeError("operation not permitted when stream is capturing")

        monkeypatch.setattr(make_backend("emulate", torch.device("cpu")).__class__, "capture", boom)
        with pytest.raises(CaptureError, match=r"strategy=full, bucket=4.*dispatch=dropless") as e:
            Capture(engine, "full", buckets=[1, 2, 4], backend="emulate").apply()
        assert "restart the process" in str(e.value) and "strategy=partial" in str(e.value)
        assert type(engine.policy) is EagerPolicy  # the failed apply unwrapped itself
    finally:
        detach(model)


def test_prefill_dispatcher_keeps_prompt_tokens_undropped(model):
    """dispatch.prefill=dropless: capacity applies to decode only; at bs 1 decode cannot drop (C >= 1 >= load)."""
    prompts = _prompts(1, s=8)
    attach(model, make_dispatcher("dropless"), max_rows=1)
    try:
        ref = DecodeEngine(model, 24, 1).generate(prompts, 12)
    finally:
        detach(model)
    state = attach(model, make_dispatcher("capacity", capacity_factor=0.5), max_rows=1)
    try:
        engine = DecodeEngine(model, 24, 1)
        engine.generate(prompts, 12)
        assert state.snapshot()["dropped_assignments"] > 0  # the 8-token prefill overflowed C = 1
        state.prefill_dispatcher = make_dispatcher("dropless")
        state.reset()
        got = engine.generate(prompts, 12)
        assert state.snapshot()["dropped_assignments"] == 0
        assert torch.equal(got.tokens, ref.tokens)
        assert state.dispatcher.name == "capacity"  # restored after the prefill
    finally:
        detach(model)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["full", "partial"])
def test_compiled_pieces_captured_match_eager(strategy):
    """capture.compile=true: Inductor-compiled step / layer pieces, then captured (emulated here), same tokens."""
    model = build_model("mixtral_tiny").model
    prompts = _prompts(2)
    attach(model, make_dispatcher("dropless"), max_rows=2)
    try:
        engine = DecodeEngine(model, 24, 2)
        ref = engine.generate(prompts, 8, keep_logits=True)
        cap = Capture(engine, strategy, buckets=[1, 2], backend="emulate", compile=True).apply()
        got = engine.generate(prompts, 8, keep_logits=True)
        assert cap.stats()["compiled"]
        assert torch.equal(got.tokens, ref.tokens)
        for a, b in zip(ref.logits, got.logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        cap.unwrap()
        assert engine.decode_forward is None
        with pytest.raises(StrategyError, match="reduce-overhead"):
            Capture(engine, "full", buckets=[1], backend="emulate", compile=True, compile_mode="reduce-overhead").apply()
    finally:
        torch._dynamo.reset()
        detach(model)
