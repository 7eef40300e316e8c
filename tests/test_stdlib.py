"""Stdlib byte data, held-out bpb under each dispatcher, the training loop, and the shipped checkpoints (CPU)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import moecg
from moecg import data as D
from moecg.dispatch import attach, detach, make_dispatcher
from moecg.models import build_model
from moecg.quality import heldout_bpb, heldout_prompts

ROOT = Path(__file__).resolve().parents[1]
CKPT_DIR = Path(os.environ.get("MOECG_CHECKPOINTS", Path(moecg.__file__).resolve().parent / "checkpoints"))
NAMES = ["mixtral_stdlib", "qwen2_moe_stdlib"]


def _train_script():
    spec = importlib.util.spec_from_file_location("train_stdlib", ROOT / "experiments" / "train_stdlib.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bpb_with(model, dispatch: str | None, **kw) -> float:
    if dispatch is None:
        return heldout_bpb(model, **kw)
    cf = kw.pop("capacity_factor", 1.0)
    attach(model, make_dispatcher(dispatch, **({"capacity_factor": cf} if dispatch == "capacity" else {})))
    try:
        return heldout_bpb(model, **kw)
    finally:
        detach(model)


# -- data -----------------------------------------------------------------------------------------

def test_split_is_deterministic_and_disjoint():
    # Pinned values: a changed hash or threshold would silently move files between the splits.
    assert [D.split_of(p) for p in ("os.py", "json/decoder.py", "pprint.py", "warnings.py")] == \
        ["train", "train", "heldout", "heldout"]
    train = {rel for rel, _ in D.stdlib_files("train")}
    held = {rel for rel, _ in D.stdlib_files("heldout")}
    assert train and held and not train & held
    assert {rel for rel, _ in D.stdlib_files("train")} == train  # same answer twice
    assert 0.03 < len(held) / (len(train) + len(held)) < 0.2
    manifest = json.loads(D.MANIFEST_PATH.read_text())
    assert all(D.split_of(rel) == "heldout" for rel in manifest["files"])
    shipped = D.heldout_bytes()
    assert hashlib.sha256(shipped).hexdigest() == manifest["sha256"] and len(shipped) == manifest["bytes"]
    sizes = D.split_sizes()
    assert sizes["train_bytes"] > 1_000_000 and sizes["heldout_shipped_bytes"] == len(shipped)


def test_heldout_prompts_are_seeded_line_starts():
    p = heldout_prompts(4, 32, seed=3)
    assert p.shape == (4, 32) and p.dtype == torch.long
    assert torch.equal(p, heldout_prompts(4, 32, seed=3)) and not torch.equal(p, heldout_prompts(4, 32, seed=4))
    text = D.heldout_bytes()
    for row in p:
        i = text.find(bytes(row.tolist()))
        assert i == 0 or text[i - 1:i] == b"\n"


def test_bpb_windowing_scores_every_byte_once():
    class Uniform(torch.nn.Module):  # every byte equally likely: exactly 8 bits per scored byte
        config = SimpleNamespace(vocab_size=256)

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.seen = 0

        def forward(self, input_ids, **_):
            self.seen += input_ids.numel()
            return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 256))

    m = Uniform()
    assert heldout_bpb(m, max_bytes=1000, seq_len=64, batch_size=3) == pytest.approx(8.0, abs=1e-6)
    assert m.seen == 999  # 15 full windows of 64 plus a tail of 39: every byte but the first


# -- dispatchers through heldout_bpb (random tiny models) ----------------------------------------

@pytest.mark.parametrize("preset", ["mixtral_tiny", "qwen2_moe_tiny"])
def test_heldout_bpb_same_under_reference_dispatchers(preset):
    model = build_model(preset, device="cpu", dtype="fp32", config_overrides={"vocab_size": 256}).model
    kw = dict(max_bytes=4096, seq_len=128, batch_size=8)
    ref = _bpb_with(model, "dynamic", **kw)
    assert _bpb_with(model, None, **kw) == pytest.approx(ref, abs=1e-4)
    assert _bpb_with(model, "dropless", **kw) == pytest.approx(ref, abs=1e-4)
    assert _bpb_with(model, "capacity", capacity_factor=1e6, **kw) == pytest.approx(ref, abs=1e-4)


# -- training loop -------------------------------------------------------------------------------

def test_a_few_training_steps_reduce_the_loss():
    ts = _train_script()
    config = ts.stdlib_config("qwen2_moe_stdlib", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              shared_expert_intermediate_size=64, num_hidden_layers=2)
    data = D.heldout_tensor()  # any bytes do; this avoids reading the local stdlib twice
    model, history, steps, _ = ts.train(config, data, steps=20, batch_size=8, seq_len=64, lr=3e-3, log_every=1)
    first, last = history[0]["bpb_train"], sum(h["bpb_train"] for h in history[-5:]) / 5
    assert steps == 20 and math.isfinite(last) and last < first - 1.0, (first, last)
    assert not model.training and model.config.output_router_logits is False


# -- shipped checkpoints (trained on a GPU by experiments/train_stdlib.py) ------------------------

def _checkpoint(name):
    path = CKPT_DIR / name
    if not (path / "card.json").exists():
        pytest.skip(f"{path} not trained yet: run experiments/train_stdlib.py (see its docstring) to produce it")
    return path, json.loads((path / "card.json").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_loads_and_reproduces_its_card(name):
    path, card = _checkpoint(name)
    assert (path / "model.safetensors").stat().st_size < 16 * 2**20
    model = build_model(pretrained_path=str(path), device="cpu", dtype="fp32").model
    p = card["heldout_prefix"]
    bpb = heldout_bpb(model, max_bytes=p["max_bytes"], seq_len=p["seq_len"], batch_size=p["batch_size"])
    # recorded on another machine and torch build (fp32 CPU both): only summation order differs
    assert bpb == pytest.approx(p["bpb"], abs=2e-3)
    assert card["heldout"]["bpb"] < card["random_init"]["heldout"]["bpb"] - 2.0


@pytest.mark.parametrize("name", NAMES)
def test_capacity_drops_cost_bits_on_a_trained_model(name):
    path, card = _checkpoint(name)
    model = build_model(pretrained_path=str(path), device="cpu", dtype="fp32").model
    p = card["heldout_prefix"]
    kw = dict(max_bytes=p["max_bytes"], seq_len=p["seq_len"], batch_size=p["batch_size"])
    dropless = _bpb_with(model, "dropless", **kw)
    capped = _bpb_with(model, "capacity", capacity_factor=0.5, **kw)
    assert dropless == pytest.approx(p["bpb"], abs=2e-3)
    assert capped == pytest.approx(p["bpb_capacity_0.5"], abs=2e-3)
    assert capped > dropless + 0.01, (capped, dropless)
