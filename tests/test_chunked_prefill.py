"""Chunked prefill (DecodeEngine(prefill_chunk=c), config key `prefill_chunk`): the prompt in forwards of c tokens on one
cache gives the logits and tokens of one forward, on full and sliding-window layers; dropping prefills are refused.

fp32 on CPU. Chunks change only the GEMM and attention shapes, so logits differ from one forward's by a few fp32 ulps
(measured: at most 1.8e-7 over eight tiny presets, every step); ATOL leaves 5x room. Prompts (S=23) are longer than
every window (4-6) and than most chunks, so chunks see keys of earlier chunks and windows cross chunk borders.
Dims: B rows, S prompt tokens, V vocab.
"""
import pytest
import torch
from hydra import compose, initialize_config_dir

import moecg
from moecg import schema
from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import DecodeEngine, check_prefill_chunk, chunk_bounds
from moecg.models import build_model
from moecg.plan import PlanError, resolve_plan

S, NEW, L, ROWS = 23, 8, 40, 4
ATOL = 1e-6
# full attention; sliding windows on every layer (mixtral) or some (qwen2: [6, 0, 0]); gpt_oss: window 4 and sinks
PRESETS = ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny", "mixtral_tiny_swa", "qwen2_moe_tiny_swa",
           "gpt_oss_tiny"]
CHUNKS = [2, 5, 7, S, 64]  # divides S? 2, 5, 7: no (tails 1 -> joined, 3, 2); S and 64: one forward


def _prompts(n, vocab, seed=0):
    return torch.randint(0, vocab, (n, S), generator=torch.Generator().manual_seed(seed))  # [n, S]


@pytest.fixture(scope="module", params=PRESETS)
def built(request):
    return build_model(request.param, dtype="fp32", device="cpu", seed=0)


def _forwards(model):
    """Count the multi-token (prefill) forwards of the decoder stack, with the tokens of each."""
    seen = []
    h = model.model.register_forward_pre_hook(lambda _, args, kw: seen.append(kw["input_ids"].shape[1]),
                                              with_kwargs=True)
    return seen, h


def test_chunk_bounds():
    assert chunk_bounds(23, None) == [(0, 23)]
    assert chunk_bounds(23, 5) == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]
    assert chunk_bounds(21, 5) == [(0, 5), (5, 10), (10, 15), (15, 21)]  # the 1-token tail joins the chunk before
    assert chunk_bounds(23, 23) == chunk_bounds(23, 64) == chunk_bounds(23, 22) == [(0, 23)]
    assert chunk_bounds(1, 4) == [(0, 1)]
    for s in range(1, 40):
        for c in range(2, 12):
            b = chunk_bounds(s, c)
            assert b[0][0] == 0 and b[-1][1] == s and all(x[1] == y[0] for x, y in zip(b, b[1:]))
            assert all(2 <= e - a <= c + 1 for a, e in b) or s == 1
            assert sum(e - a > c for a, e in b) <= 1


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_prefill_gives_one_forwards_logits_and_tokens(built, chunk):
    model, V = built.model, built.model.config.vocab_size
    prompts = _prompts(3, V)
    attach(model, make_dispatcher("dropless"), max_rows=ROWS)
    try:
        ref = DecodeEngine(model, L, ROWS).generate(prompts, NEW, keep_logits=True, timing=False)
        seen, h = _forwards(model)
        try:
            got = DecodeEngine(model, L, ROWS, prefill_chunk=chunk).generate(prompts, NEW, keep_logits=True,
                                                                             timing=False)
        finally:
            h.remove()
    finally:
        detach(model)
    assert [n for n in seen if n > 1] == [e - a for a, e in chunk_bounds(S, chunk)]  # it did chunk
    torch.testing.assert_close(got.logits[0], ref.logits[0], atol=ATOL, rtol=0)  # the first token's [n, V]
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert torch.equal(got.tokens, ref.tokens)


def test_the_comparison_sees_positions_restarted_per_chunk(built):
    """The test above can fail: chunks that restart their positions at 0 (the cache's length ignored) differ."""
    model, V = built.model, built.model.config.vocab_size
    prompts = _prompts(3, V)
    orig = model.forward

    def restarted(input_ids=None, **kw):
        kw["position_ids"] = torch.arange(input_ids.shape[1])[None]  # [1, c] from 0, each chunk
        return orig(input_ids=input_ids, **kw)

    attach(model, make_dispatcher("dropless"), max_rows=ROWS)
    try:
        ref = DecodeEngine(model, L, ROWS).prefill(prompts)[1]  # [n, V]
        model.forward = restarted
        bad = DecodeEngine(model, L, ROWS, prefill_chunk=5).prefill(prompts)[1]  # [n, V]
    finally:
        del model.forward
        detach(model)
    assert not torch.allclose(bad, ref, atol=ATOL, rtol=0)


def test_drop_counters_equal_under_dropless():
    """Chunks route the same tokens: every counter of a counted dropless prefill + decode equals one forward's; with a
    capacity decode and dispatch.prefill=dropless the decode's drops are equal too (bucket 4 for 3 rows: pad rows),
    counted with the prefill and without."""
    b = build_model("qwen2_moe_tiny", dtype="fp32", device="cpu", seed=0)
    prompts = _prompts(3, b.model.config.vocab_size)

    def run(chunk, dispatcher, prefill=None, strategy="eager"):
        state = attach(b.model, dispatcher, max_rows=ROWS)
        state.prefill_dispatcher = prefill
        try:
            eng = DecodeEngine(b.model, L, ROWS, prefill_chunk=chunk)
            cap = Capture(eng, strategy, buckets=[1, 2, 4], backend="emulate").apply()
            res = eng.generate(prompts, NEW, timing=False)
            snap = state.snapshot()
            state.reset()
            decode = eng.generate(prompts, NEW, timing=False, count_prefill=False)
            cap.unwrap()
            return res, snap, decode, state.snapshot()
        finally:
            detach(b.model)

    ints = ("routed", "dropped", "routed_assignments", "dropped_assignments", "tokens", "tokens_lost_all")
    for args in [(make_dispatcher("dropless"),),
                 (make_dispatcher("capacity", capacity_factor=0.5), make_dispatcher("dropless"), "full"),
                 (make_dispatcher("capacity", capacity_factor=0.5), make_dispatcher("dropless"), "layer")]:
        one, chunked = run(None, *args), run(11, *args)  # chunks 0-11-23: the 1-token tail joined the one before
        for r1, s1, r2, s2 in [(one[0], one[1], chunked[0], chunked[1]), (one[2], one[3], chunked[2], chunked[3])]:
            assert torch.equal(r1.tokens, r2.tokens)
            assert all(s1[k] == s2[k] for k in ints), args
            assert s1["dropped_prob_mass"] == pytest.approx(s2["dropped_prob_mass"], abs=1e-6)
    assert s1["dropped_assignments"] > 0  # capacity did drop in decode: the comparison is not of zeros


def test_no_decode_graph_replays_a_prefill_chunk():
    """A one-token chunk has a decode step's shapes: a layer graph captured for decode would replay it, with the decode
    dispatcher (here capacity) and counters that count even when the prefill is not counted. The tail joins the chunk
    before it instead. (Emulated graphs re-run eagerly, so on CPU only the replay count shows it.)"""
    b = build_model("qwen2_moe_tiny", dtype="fp32", device="cpu", seed=0)
    state = attach(b.model, make_dispatcher("capacity", capacity_factor=0.5), max_rows=ROWS)
    state.prefill_dispatcher = make_dispatcher("dropless")
    try:
        eng = DecodeEngine(b.model, L, ROWS, prefill_chunk=11)  # S = 23 = 11 + 11 + 1
        cap = Capture(eng, "layer", buckets=[1, 2, 4], backend="emulate").apply()
        eng.prefill(_prompts(3, b.model.config.vocab_size))
        assert all(v["replays"] == 0 for v in cap.stats()["buckets"].values())
        cap.unwrap()
    finally:
        detach(b.model)


def test_fused_step_after_a_chunked_prefill():
    """capture.kernels=fused (the PyTorch reference ops on CPU, emulated graphs): the decode that follows a chunked
    prefill gives the tokens it gives after one forward."""
    b = build_model("qwen3_moe_tiny", dtype="fp32", device="cpu", seed=0)
    prompts = _prompts(3, b.model.config.vocab_size)
    out = []
    for chunk in (None, 4):
        attach(b.model, make_dispatcher("fused"), max_rows=ROWS)
        try:
            eng = DecodeEngine(b.model, L, ROWS, prefill_chunk=chunk)
            cap = Capture(eng, "full", buckets=[1, 2, 4], backend="emulate", kernels="fused").apply()
            out.append(eng.generate(prompts, NEW, keep_logits=True, timing=False))
            cap.unwrap()
        finally:
            detach(b.model)
    assert torch.equal(out[0].tokens, out[1].tokens)
    torch.testing.assert_close(out[0].logits[0], out[1].logits[0], atol=ATOL, rtol=0)


# -- refusals ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [1, 0, -3, 2.5, True, "8"])
def test_bad_chunk_sizes_refused(bad):
    with pytest.raises(ValueError, match=r"prefill_chunk=.*must be null \(one forward\) or an integer >= 2"):
        check_prefill_chunk(bad)


def test_dropping_prefill_dispatcher_refused():
    b = build_model("mixtral_tiny", dtype="fp32", device="cpu", seed=0)
    prompts = _prompts(2, b.model.config.vocab_size)
    fix = r"prefill_chunk=4 with a prefill dispatcher that drops \(capacity\).*dispatch\.prefill=dropless"
    state = attach(b.model, make_dispatcher("capacity"), max_rows=ROWS)
    try:
        with pytest.raises(ValueError, match=fix):  # at construction, before any work
            DecodeEngine(b.model, L, ROWS, prefill_chunk=4)
        state.prefill_dispatcher = make_dispatcher("dropless")
        eng = DecodeEngine(b.model, L, ROWS, prefill_chunk=4)
        eng.generate(prompts, 2, timing=False)  # capacity decode after a dropless chunked prefill runs
        state.prefill_dispatcher = None  # changed after construction: refused at the prefill, the cache untouched
        before = int(eng.cache.length())
        with pytest.raises(ValueError, match=fix):
            eng.prefill(prompts)
        assert int(eng.cache.length()) == before
        DecodeEngine(b.model, L, ROWS)  # no chunking: a dropping prefill is today's path
    finally:
        detach(b.model)


# -- the config key ----------------------------------------------------------------------------------------------
def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(__import__("pathlib").Path(moecg.__file__).parent / "conf"),
                               version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("overrides,match", [
    (["prefill_chunk=1"], r"prefill_chunk=1: must be an integer >= 2 \(e\.g\. prefill_chunk=2048\)"),
    (["prefill_chunk=abc"], r"prefill_chunk='abc': must be an integer >= 2"),
    (["prefill_chunk=8", "dispatch=capacity"], r"prefill_chunk=8 with a prefill dispatcher that drops \(capacity\): "
                                               r".*dispatch\.prefill=dropless, or set prefill_chunk=null"),
    (["prefill_chunk=8", "workload=poisson"], r"prefill_chunk=8 with workload=poisson: serving prefills on the "
                                              r"ragged engine.*set prefill_chunk=null or use workload=fixed"),
])
def test_plan_refuses(overrides, match):
    with pytest.raises(PlanError, match=match) as e:
        resolve_plan(_cfg(*overrides))
    assert "\n" not in str(e.value)


def test_plan_accepts_and_prices_it():
    plan = resolve_plan(_cfg("prefill_chunk=8", "dispatch=capacity", "dispatch.prefill=dropless"))
    assert plan.prefill_chunk == 8 and resolve_plan(_cfg()).prefill_chunk is None
    # the prefill's transient (activations, mask) is a chunk's, not the prompt's
    long = ["prompt_len=900", "new_tokens=4", "max_cache_len=1000"]
    assert resolve_plan(_cfg(*long, "prefill_chunk=64")).memory_bytes < resolve_plan(_cfg(*long)).memory_bytes


def test_record_has_the_chunk():
    from moecg.harness import run_experiment

    res = run_experiment(_cfg("prefill_chunk=3", "prompt_len=8", "new_tokens=4", "measure.repeats=1",
                              "measure.skip_steps=0", "strategy=full", "capture.backend=emulate"))
    assert list(res) == list(schema.NAMES)
    assert res["prefill_chunk"] == 3 and res["status"] == "ok" and res["captured"]
    assert res["token_agreement_vs_eager"] == 1.0  # the reference prefills in the same chunks


def test_record_names_the_attention_that_ran():
    """model.attn_implementation=sdpa is what moecg asks for; GPT-OSS (no sdpa path for its sinks) runs eager, and
    the record says eager (it used to say nothing, while the config it carries said sdpa)."""
    from moecg.harness import run_experiment

    base = ("prompt_len=6", "new_tokens=3", "measure.repeats=1", "measure.skip_steps=0", "measure.fidelity=false",
            "measure.eager_baseline=false")
    assert run_experiment(_cfg(*base))["attn_implementation"] == "sdpa"
    assert run_experiment(_cfg("model=gpt_oss_tiny", *base))["attn_implementation"] == "eager"
