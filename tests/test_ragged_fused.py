"""Ragged decode on the fused step (capture.kernels=fused): each row at its own position in the fused kernels.

Every request decoded in a ragged batch on the fused step must give the tokens (and fp32 logits within 1e-5) it
gets decoded alone on the fused step (DecodeEngine, one position for every row), for every family the fused step
runs, with sliding windows, under emulated capture, joins and leaves included. The per-row kernels themselves are
checked against their references (and the references row by row against the one-position form) under Triton's
CPU interpreter (tests/triton_interp_ragged.py).
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moecg.capture import Capture
from moecg.capture.graph import GraphRunner
from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import DecodeEngine
from moecg.kernels import ref
from moecg.models import build_model
from moecg.ragged import RaggedEngine

from test_ragged import L, NEW, PROMPT_LENS, _run
from interp_runner import run_marked  # tests/

FUSED_PRESETS = ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny", "glm4_moe_tiny", "olmoe_tiny", "gpt_oss_tiny",
                 "deepseek_v3_tiny", "deepseek_v2_tiny", "mixtral_tiny_swa", "qwen2_moe_tiny_swa", "qwen3_moe_tiny_swa"]


def _fused(engine, buckets):
    return Capture(engine, "full", buckets=buckets, backend="emulate", kernels="fused", kernel_backend="torch").apply()


@pytest.fixture(scope="module", params=FUSED_PRESETS)
def built(request):
    model = build_model(request.param, dtype="fp32", device="cpu").model
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (s,), generator=g) for s in PROMPT_LENS]
    attach(model, make_dispatcher("fused"), max_rows=4)
    alone = []
    for p, n in zip(prompts, NEW):
        eng = DecodeEngine(model, L, 1)
        cap = _fused(eng, [1])
        alone.append(eng.generate(p[None], n, keep_logits=True, timing=False))
        cap.unwrap()
    detach(model)
    return model, prompts, alone


def test_fused_per_row_positions_match_each_request_alone(built, monkeypatch):
    model, prompts, alone = built
    attach(model, make_dispatcher("fused"), max_rows=4)
    try:
        eng = RaggedEngine(model, L, 4)
        cap = _fused(eng, [1, 2, 4])
        assert type(eng.decode_forward).__name__ == "FastDecode" and cap.stats()["captured"]
        graphs, calls, orig = cap.stats()["graphs"], [], GraphRunner.capture
        monkeypatch.setattr(GraphRunner, "capture", lambda self, *a, **k: calls.append(a[0]) or orig(self, *a, **k))
        done, logits = _run(eng, prompts)
        assert eng.step_rows == [4, 4, 4, 4, 4, 4, 4, 2, 1]  # padded to buckets; shrinks to smaller ones
        assert not calls and cap.stats()["graphs"] == graphs  # joins, leaves and shrinking: no re-capture
        assert sum(e.replays for e in cap.runner.entries.values()) >= len(eng.step_rows)
        for i, want in enumerate(alone):
            assert done[i] == want.tokens[0].tolist(), f"request {i}"
            got = torch.stack(logits[i][1:])  # decode steps (the prefill runs the HF modules in both)
            torch.testing.assert_close(got, torch.cat([lg[:1] for lg in want.logits[1:]]), atol=1e-5, rtol=0)
        cap.unwrap()
    finally:
        detach(model)


def test_ragged_ops_reference_row_by_row():
    """The per-row reference ops equal the one-position form applied to each row alone (windows, sinks, eager)."""
    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, Dh, R, Ls = 3, 4, 2, 16, 8, 24
    pos = torch.tensor([5, 0, 17])
    qkv = torch.randn(T, (Hq + 2 * Hkv) * Dh, generator=g)
    cos, sin = torch.randn(Ls, R, generator=g), torch.randn(Ls, R, generator=g)
    keys, vals = torch.randn(T, Hkv, Ls, Dh, generator=g), torch.randn(T, Hkv, Ls, Dh, generator=g)
    k1, v1 = keys.clone(), vals.clone()
    q1 = ref.rope_cache(qkv, pos, cos, sin, k1, v1, Hq, Hkv, Dh)
    for t in range(T):
        k2, v2 = keys[t:t + 1].clone(), vals[t:t + 1].clone()
        q2 = ref.rope_cache(qkv[t:t + 1], pos[t], cos, sin, k2, v2, Hq, Hkv, Dh)
        assert torch.equal(q1[t:t + 1], q2) and torch.equal(k1[t:t + 1], k2) and torch.equal(v1[t:t + 1], v2)
    # only slot pos[t] of row t was written
    changed = (k1 != keys).any(-1).any(1)  # [T, Ls]
    assert changed.nonzero().tolist() == [[t, int(p)] for t, p in enumerate(pos)]
    sinks = torch.randn(Hq, generator=g)
    for window, sk, eager in ((0, None, False), (4, None, False), (4, sinks, True), (0, sinks, False)):
        o1 = ref.attn_decode(q1, k1, v1, pos, 0.25, window, sinks=sk, eager=eager)
        for t in range(T):
            o2 = ref.attn_decode(q1[t:t + 1], k1[t:t + 1], v1[t:t + 1], pos[t], 0.25, window, sinks=sk, eager=eager)
            torch.testing.assert_close(o1[t:t + 1], o2, atol=1e-6, rtol=0)


@pytest.mark.interp("triton_interp_ragged.py")
def test_triton_ragged_kernels_under_interpreter(request):
    run_marked(request)


def test_ragged_cost_benchmark_smoke(tmp_path):
    """experiments/bench_ragged_cost.py end to end on CPU (emulated capture): its table and rows are written."""
    script = Path(__file__).parent.parent / "experiments" / "bench_ragged_cost.py"
    out, js = tmp_path / "cost.md", tmp_path / "cost.json"
    r = subprocess.run([sys.executable, str(script), "--preset", "qwen3_moe_tiny", "--device", "cpu", "--batch", "2",
                        "--steps", "3", "--prompt-len", "8", "--cache-len", "64", "--repeats", "1", "--out", str(out),
                        "--json", str(js)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    row = json.loads(js.read_text())["rows"][0]
    assert row["captured"] and row["final_lengths"] == [4 + 5 + 2 * 3, 12 + 5 + 2 * 3]  # prompt + warmup + both loops
    assert "| 2 |" in out.read_text()


def test_attention_split_rule():
    """attn_splits: short contexts keep the rule every short-context table was measured with; long ones aim at
    ~256 programs (up to 128 splits, >= 64 slots each)."""
    from moecg.kernels.triton_ops import LONG_SPAN, attn_splits

    assert [attn_splits(T, 16, 256) for T in (1, 8)] == [4, 1]  # Qwen1.5 shape at 256 slots: as before
    assert attn_splits(1, 4, LONG_SPAN) == 16  # up to LONG_SPAN: capped at 16
    assert [attn_splits(T, h, 32768) for T, h in ((1, 16), (8, 16), (1, 4), (8, 4), (1, 8), (8, 8))] == \
        [16, 2, 64, 8, 32, 4]
    assert attn_splits(1, 1, 32768) == 128 and attn_splits(64, 16, 32768) == 1 and attn_splits(1, 1, 4160) == 65
