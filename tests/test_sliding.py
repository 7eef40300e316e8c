"""Sliding-window attention (Mixtral `sliding_window`; Qwen2-MoE `use_sliding_window` + `max_window_layers`;
Qwen3-MoE `use_sliding_window`) on the engine's linear row cache: HF generate's tokens, repeated generates with
smaller batches, every emulated capture strategy, the fused step, a local checkpoint round trip, and the decode
attention window against HF's mask function.

Windows (6) are shorter than the prompt (8) and than prompt + new tokens (18), so every step masks real keys.
Dims: B rows, S prompt tokens, L cache slots.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers.cache_utils import StaticLayer
from transformers.masking_utils import sliding_window_causal_mask_function

from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import DecodeEngine
from moecg.kernels import ref
from moecg.models import build_model
from moecg.models.zoo import SLIDING_PRESETS

S, NEW, L = 8, 10, 32
WINDOWS = {"mixtral_tiny_swa": [6, 6], "qwen2_moe_tiny_swa": [6, 0, 0], "qwen3_moe_tiny_swa": [6, 6]}


def _prompts(n, seed=0):
    return torch.randint(0, 512, (n, S), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=SLIDING_PRESETS)
def swa(request):
    b = build_model(request.param, dtype="fp32", device="cpu", seed=0)
    prompts = _prompts(4)
    hf = b.model.generate(prompts, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[:, S:]  # HF's own cache
    return b, prompts, hf


def test_windows_are_the_modeling_codes(swa):
    """One adapter fact, as HF's modeling code masks: Qwen2-MoE slides even layers < max_window_layers only."""
    b, _, _ = swa
    windows = b.adapter.attention_windows(b.model.config)
    assert windows == WINDOWS[b.name]
    assert 0 < max(windows) < S
    if b.family == "qwen2_moe":  # the module attribute HF sets on its sliding layers only
        assert [getattr(layer.self_attn, "sliding_window", 0) for layer in b.adapter.layers(b.model)] == windows


def test_engine_matches_hf_generate_on_every_generate(swa):
    """The defect: later generates on one engine with fewer rows than max_rows (views created earlier, rows
    leaving mid-decode) gave other tokens (~0.3 agreement) on HF's ring-buffer sliding layers."""
    b, prompts, hf = swa
    attach(b.model, make_dispatcher("dropless"), max_rows=4)
    try:
        eng = DecodeEngine(b.model, L, 4)
        assert torch.equal(eng.generate(prompts, NEW, timing=False).tokens, hf)
        for _ in range(2):  # the second time reuses the 2-row view
            assert torch.equal(eng.generate(prompts[:2], NEW, timing=False).tokens, hf[:2])
        lengths = [NEW, 3, 6, 2]  # rows leave: 4 -> 3 -> 2 -> 1 rows, views reused from before
        got = eng.generate(prompts, NEW, lengths=lengths, timing=False).tokens
        for i, n in enumerate(lengths):
            assert torch.equal(got[i, :n], hf[i, :n])
        assert torch.equal(eng.generate(prompts[:3], NEW, timing=False).tokens, hf[:3])
        # how: every layer a linear StaticLayer of L slots (memory bounded by max_cache_len as for full attention)
        assert all(type(layer) is StaticLayer and layer.keys.shape[2] == L for layer in eng.cache.full.layers)
    finally:
        detach(b.model)


@pytest.mark.parametrize("strategy", ["full", "layer", "partial", "mixed"])
def test_emulated_capture_replays_eager(swa, strategy):
    b, prompts, hf = swa
    n = len(b.adapter.layers(b.model))
    layers = f"0-0:layer,1-{n - 1}:attn" if strategy == "mixed" else None
    attach(b.model, make_dispatcher("dropless"), max_rows=4)
    try:
        eng = DecodeEngine(b.model, L, 4)
        lengths = [NEW, 4, 7]
        want = eng.generate(prompts[:3], NEW, lengths=lengths, timing=False)
        cap = Capture(eng, strategy, layers=layers, buckets=[1, 2, 4], backend="emulate").apply()
        assert cap.stats()["captured"]
        for _ in range(2):
            got = eng.generate(prompts[:3], NEW, lengths=lengths, timing=False)  # 3 rows in bucket 4, shrinking
            assert torch.equal(got.tokens, want.tokens)
        assert set(got.step_rows) == {4, 2, 1}
        assert torch.equal(eng.generate(prompts, NEW, timing=False).tokens, hf)
        cap.unwrap()
    finally:
        detach(b.model)


@pytest.mark.parametrize("strategy", ["eager", "full"])
def test_fused_reference_path_agrees_teacher_forced(swa, strategy):
    """capture.kernels=fused (torch references): the window each layer reads, rotary tables sized from the linear
    cache (HF's ring buffer made them window-long: IndexError)."""
    b, prompts, hf = swa
    attach(b.model, make_dispatcher("dropless"), max_rows=4)
    try:
        eng = DecodeEngine(b.model, L, 4)
        want = eng.generate(prompts, NEW, keep_logits=True, timing=False)
        cap = Capture(eng, strategy, buckets=[1, 2, 4], backend="emulate", kernels="fused",
                      kernel_backend="torch").apply()
        got = eng.generate(prompts, NEW, keep_logits=True, timing=False, force_tokens=want.tokens)
        assert float((got.tokens == want.tokens).float().mean()) >= 0.99
        assert max(float((x - y).abs().max()) for x, y in zip(got.logits, want.logits)) < 1e-3
        got2 = eng.generate(prompts[:2], NEW, timing=False, force_tokens=want.tokens[:2])  # fewer rows, again
        assert float((got2.tokens == want.tokens[:2]).float().mean()) >= 0.99
        assert [layer.window for layer in cap.fast.layers] == WINDOWS[b.name]
        cap.unwrap()
    finally:
        detach(b.model)


def test_local_checkpoint_round_trip(swa, tmp_path):
    b, prompts, hf = swa
    b.model.save_pretrained(tmp_path / "ck")
    loaded = build_model(pretrained_path=str(tmp_path / "ck"), dtype="fp32", device="cpu")
    assert loaded.adapter.attention_windows(loaded.model.config) == WINDOWS[b.name]
    attach(loaded.model, make_dispatcher("dropless"), max_rows=4)
    try:
        eng = DecodeEngine(loaded.model, L, 4)
        assert torch.equal(eng.generate(prompts, NEW, timing=False).tokens, hf)
        assert torch.equal(eng.generate(prompts[:2], NEW, timing=False).tokens, hf[:2])
    finally:
        detach(loaded.model)


# -- the decode attention window, both backends, against HF's mask function -------------------------------------
CASES = [(0, 0), (5, 1), (5, 6), (5, 7), (40, 6), (40, 41), (79, 20), (79, 100)]  # (pos, window)


def _hf_masked_attention(q, keys, values, pos, scaling, window):
    """Decode attention with HF's mask: keep kv_idx > q_idx - window (and causal), over every cache slot."""
    T, Hq, Dh = q.shape
    g = Hq // keys.shape[1]
    kv = torch.arange(keys.shape[2])
    if window:
        ok = sliding_window_causal_mask_function(window)(0, 0, torch.tensor(pos), kv)
    else:
        ok = kv <= pos
    scores = torch.einsum("thd,thld->thl", q, keys.repeat_interleave(g, 1)) * scaling
    p = torch.softmax(scores.masked_fill(~ok, float("-inf")), -1)
    return torch.einsum("thl,thld->thd", p, values.repeat_interleave(g, 1)).reshape(T, Hq * Dh)


def test_reference_attention_window_is_hfs_mask():
    torch.manual_seed(0)
    q, keys, values = torch.randn(3, 4, 16), torch.randn(3, 2, 80, 16), torch.randn(3, 2, 80, 16)
    for pos, window in CASES:
        got = ref.attn_decode(q, keys, values, torch.tensor(pos), 0.25, window)
        torch.testing.assert_close(got, _hf_masked_attention(q, keys, values, pos, 0.25, window),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode != 0,
                    reason="triton not installed")
def test_triton_attention_window_under_interpreter():
    """The Triton decode attention (one split and split contexts) keeps exactly the reference's window; a sliding
    model's fused step gives the same tokens with the Triton ops as with the torch ops."""
    script = textwrap.dedent(f"""
        import torch
        from moecg.kernels import ref, triton_ops as tri
        torch.manual_seed(0)
        for T, Lc, cases in ((3, 80, {CASES!r}), (1, 192, [(150, 0), (191, 150), (191, 129), (100, 64)])):
            q, k, v = torch.randn(T, 4, 16), torch.randn(T, 1, Lc, 16), torch.randn(T, 1, Lc, 16)
            for pos, w in cases:
                a = ref.attn_decode(q, k, v, torch.tensor(pos), 0.25, w)
                b = tri.attn_decode(q, k, v, torch.tensor(pos), 0.25, w)
                assert float((a - b).abs().max()) < 1e-5, (T, Lc, pos, w)
        # a whole sliding model (windows [6, 0, 0]): fused step with the Triton ops == with the torch ops
        from moecg.dispatch import attach, detach, make_dispatcher
        from moecg.engine import DecodeEngine
        from moecg.fast import FastDecode
        from moecg.models import build_model
        model = build_model("qwen2_moe_tiny_swa", dtype="fp32", device="cpu", seed=0).model
        prompts = torch.randint(0, 512, (2, {S}), generator=torch.Generator().manual_seed(0))
        runs = []
        for backend in ("torch", "triton"):
            attach(model, make_dispatcher("dropless"), max_rows=2)
            eng = DecodeEngine(model, {L}, 2)
            eng.decode_forward = FastDecode(model, backend)
            runs.append(eng.generate(prompts, 6, keep_logits=True, timing=False))
            detach(model)
        assert torch.equal(runs[0].tokens, runs[1].tokens)
        assert max(float((a - b).abs().max()) for a, b in zip(runs[0].logits, runs[1].logits)) < 1e-4
        print("WINDOW OK")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and "WINDOW OK" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
