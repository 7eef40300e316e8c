"""Ragged decode (moecg.ragged): per-row positions, joins and leaves, slot reuse, emulated capture, refusals.

Every request decoded in a ragged batch must give the tokens (and fp32 logits within 1e-5) it gets decoded alone
with DecodeEngine (itself equal to HF generate: tests/test_models.py). Dims: V vocab, L cache slots.
"""
import pytest
import torch

from moecg.capture import Capture
from moecg.capture.graph import GraphRunner
from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import CacheOverflowError, DecodeEngine
from moecg.models import build_model
from moecg.models.zoo import FAMILY_PRESETS, SLIDING_PRESETS
from moecg.ragged import RaggedEngine

PRESETS = ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny", *FAMILY_PRESETS]
L = 32
# scenario: prompt lengths, tokens to generate, and when each request joins (after that many steps)
PROMPT_LENS, NEW, JOIN = [3, 7, 12, 5], [10, 4, 8, 7], [0, 0, 0, 2]


@pytest.fixture(scope="module", params=PRESETS)
def built(request):
    model = build_model(request.param, dtype="fp32", device="cpu").model
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (s,), generator=g) for s in PROMPT_LENS]
    attach(model, make_dispatcher("dropless"), max_rows=4)
    alone = [DecodeEngine(model, L, 1).generate(p[None], n, keep_logits=True, timing=False)
             for p, n in zip(prompts, NEW)]
    detach(model)
    return model, prompts, alone


def _run(engine, prompts, new=NEW, join=JOIN):
    """Join each request after join[i] steps, remove it once it has new[i] tokens -> (tokens, logits) per request."""
    logits, done, t = {}, {}, 0
    pending = list(range(len(prompts)))
    while pending or engine.n_live:
        for i in [i for i in engine.order if len(engine.tokens[i]) >= new[i]]:
            done[i] = engine.remove(i)
        for i in [i for i in pending if join[i] <= t]:
            if engine.n_live == engine.max_rows:
                break  # waits for a free slot
            engine.add(i, prompts[i])
            logits[i] = [engine.last_logits[0].clone()]
            pending.remove(i)
        if not engine.n_live:
            continue
        order = list(engine.order)
        engine.step()
        t += 1
        for j, i in enumerate(order):
            logits[i].append(engine.last_logits[j].clone())
    return done, logits


def _check_alone(done, logits, alone):
    for i, ref in enumerate(alone):
        assert done[i] == ref.tokens[0].tolist(), f"request {i}"
        got = torch.stack(logits[i])
        want = torch.cat([lg[:1] for lg in ref.logits])
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_per_row_positions_match_each_request_alone(built):
    model, prompts, alone = built
    attach(model, make_dispatcher("dropless"), max_rows=4)
    try:
        # all together from the start (3, 7, 12, 5 tokens): per-row positions, masks and KV slots
        eng = RaggedEngine(model, L, 4)
        done, logits = _run(eng, prompts, join=[0, 0, 0, 0])
        _check_alone(done, logits, alone)
        # joins after 2 steps of the others and leaves: the batch shrinks 3 -> 4 -> 3 -> 2 -> 1 rows
        eng = RaggedEngine(model, L, 4)
        done, logits = _run(eng, prompts)
        _check_alone(done, logits, alone)
        assert eng.step_rows == [3, 3, 4, 3, 3, 3, 3, 2, 1]
    finally:
        detach(model)


def test_matches_hf_generate(built):
    model, prompts, _ = built
    attach(model, make_dispatcher("dropless"), max_rows=4)
    try:
        eng = RaggedEngine(model, L, 4)
        done, _ = _run(eng, prompts[:3], new=[6, 6, 6], join=[0, 0, 0])
        for i, p in enumerate(prompts[:3]):
            ref = model.generate(p[None], max_new_tokens=6, do_sample=False, pad_token_id=0)[0, p.numel():]
            assert done[i] == ref.tolist()
    finally:
        detach(model)


STRATS = [("full", None, "dropless"), ("capacity", None, "capacity"), ("partial", None, "dynamic"),
          ("layer", None, "dropless"), ("mixed", "0-0:layer,1-1:attn", "dropless")]


@pytest.mark.parametrize("strategy,layers,dispatch", STRATS)
def test_emulated_capture_matches_eager_ragged(built, strategy, layers, dispatch, monkeypatch):
    model, prompts, alone = built
    kw = {"capacity_factor": 1e3} if dispatch == "capacity" else {}
    attach(model, make_dispatcher(dispatch, **kw), max_rows=4)
    try:
        eng = RaggedEngine(model, L, 4)
        cap = Capture(eng, strategy, layers=layers, buckets=[1, 2, 4], backend="emulate").apply()
        assert cap.stats()["captured"]
        graphs = cap.stats()["graphs"]
        calls = []
        orig = GraphRunner.capture
        monkeypatch.setattr(GraphRunner, "capture", lambda self, *a, **k: calls.append(a[0]) or orig(self, *a, **k))
        done, logits = _run(eng, prompts)
        _check_alone(done, logits, alone)  # the same tokens as eager ragged and as each request alone
        assert eng.step_rows == [4, 4, 4, 4, 4, 4, 4, 2, 1]  # padded to buckets; shrinks to smaller ones
        assert not calls and cap.stats()["graphs"] == graphs  # joins, leaves and shrinking: no re-capture
        replays = sum(e.replays for e in cap.runner.entries.values())
        assert replays >= len(eng.step_rows)  # graphs actually served the steps
        assert cap.stats()["layer_fallbacks"] == 0
        cap.unwrap()
    finally:
        detach(model)


def test_slots_are_reused_and_memory_stays_bounded(built):
    model, prompts, alone = built
    attach(model, make_dispatcher("dropless"), max_rows=2)
    try:
        eng = RaggedEngine(model, L, 2)
        eng.add(0, prompts[0])
        eng.add(9, prompts[1])
        with pytest.raises(ValueError, match="slots are busy"):
            eng.add(10, prompts[2])
        eng.remove(9)
        eng.remove(0)
        # 4 requests through 2 slots: each joins when a slot frees
        done, logits = _run(eng, prompts, join=[0, 0, 3, 4])
        _check_alone(done, logits, alone)
        assert max(eng.step_rows) <= 2
        assert all(k.shape[0] == 2 for k in eng.cache.keys) and eng.cache.lengths.numel() == 2
        assert eng.n_live == 0 and int(eng.cache.lengths.sum()) == 0 and int(eng.live.sum()) == 0
    finally:
        detach(model)


def test_overflow_and_unsupported_refused(built):
    model, prompts, _ = built
    attach(model, make_dispatcher("dropless"), max_rows=2)
    try:
        eng = RaggedEngine(model, 12, 2)
        with pytest.raises(CacheOverflowError, match="exceeds the KV cache"):
            eng.add(0, torch.arange(12))  # no slot left for its first decode step
        with pytest.raises(CacheOverflowError, match="exceeds the KV cache"):
            eng.add(0, torch.arange(5), max_new_tokens=8)
        assert eng.n_live == 0
        eng.add(1, torch.arange(10))
        eng.step(), eng.step()  # writes slots 10 and 11
        with pytest.raises(CacheOverflowError, match="filled their 12 cache slots"):
            eng.step()
        with pytest.raises(TypeError, match="add / step / remove"):
            eng.generate(prompts[0][None], 2)
    finally:
        detach(model)


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_sliding_windows_match_each_request_alone(preset):
    """Windows of 6 (Qwen2-MoE: layer 0 only, a per-layer-type mask dict) below the positions reached (up to 21)."""
    model = build_model(preset, dtype="fp32", device="cpu").model
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (s,), generator=g) for s in PROMPT_LENS]
    attach(model, make_dispatcher("dropless"), max_rows=4)
    try:
        alone = [DecodeEngine(model, L, 1).generate(p[None], n, keep_logits=True, timing=False)
                 for p, n in zip(prompts, NEW)]
        for strategy in ("eager", "full", "layer"):
            eng = RaggedEngine(model, L, 4)
            if strategy != "eager":
                Capture(eng, strategy, buckets=[1, 2, 4], backend="emulate").apply()
            done, logits = _run(eng, prompts)
            _check_alone(done, logits, alone)
    finally:
        detach(model)


def test_unsupported_attention_refused(built):
    model, _, _ = built
    impl = model.config._attn_implementation
    try:
        model.config._attn_implementation = "flex_attention"
        with pytest.raises(ValueError, match="attn_implementation='flex_attention' is not supported"):
            RaggedEngine(model, L, 2)
    finally:
        model.config._attn_implementation = impl
    assert model.config._attn_implementation == impl


def test_eager_attention_takes_the_additive_mask():
    model = build_model("qwen3_moe_tiny_swa", dtype="fp32", device="cpu", attn_implementation="eager").model
    assert model.config._attn_implementation == "eager"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (s,), generator=g) for s in PROMPT_LENS]
    attach(model, make_dispatcher("dropless"), max_rows=4)
    try:
        alone = [DecodeEngine(model, L, 1).generate(p[None], n, keep_logits=True, timing=False)
                 for p, n in zip(prompts, NEW)]
        eng = RaggedEngine(model, L, 4)
        assert eng._mask(eng.cache.lengths[:2, None]).dtype == torch.float32
        _check_alone(*_run(eng, prompts), alone)
    finally:
        detach(model)
