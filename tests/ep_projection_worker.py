"""The real-rank half of the per-rank benchmark's test (tests/test_parallel.py, run inside tests/ep_worker.py's 2-rank
spawn, whose imports dominate): each gloo rank decodes with moecg.parallel (shard_experts over the real group, the EP
dispatchers over its all-to-alls) through experiments/ep_projection.py's `measure`, and records what it holds, sends
and receives, so the single-process per-rank benchmark can be checked against it.

Dims: R ranks, B rows per rank, L MoE layers. Each rank writes projection_rank<r>.pt: its expert spans and slices per
MoE layer, and per case its tokens, logits, the buffer shapes of one eager step's all-to-alls, and every all-to-all's
(send, received) pair in call order.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
PRESET, B, CF = "mixtral_tiny", 3, 0.5  # cf 0.5 drops at the source on mixtral_tiny
ARGS = SimpleNamespace(prompt_len=5, new_tokens=4, warmup=1, skip=0)


def load_script():
    """experiments/ep_projection.py as a module (registered first: its dataclasses look their module up)."""
    if "ep_projection" in sys.modules:
        return sys.modules["ep_projection"]
    spec = importlib.util.spec_from_file_location("ep_projection", ROOT / "experiments" / "ep_projection.py")
    mod = sys.modules["ep_projection"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Recorder:
    """A real exchange, every all-to-all's (send, received) kept."""

    def __init__(self, group):
        self.group, self.size, self.rank, self.calls = group, group.size, group.rank, []

    def all_to_all(self, x):
        y = self.group.all_to_all(x)
        self.calls.append((x.detach().clone(), y.detach().clone()))
        return y


def spans_and_slices(model, adapter):
    moe = adapter.moe_layers(model)
    return ([tuple(e._moecg_experts) for _, e in moe],
            [(e.gate_up_proj.detach().clone(), e.down_proj.detach().clone()) for _, e in moe])


def record(rank: int, world: int, group, out: str) -> Path:
    """This rank's part (the group already joined): build, shard over `group`, run every case of the script; the
    record's file."""
    from moecg.models import build_model
    from moecg.parallel import shard_experts

    proj = load_script()
    data = {}
    built = build_model(PRESET, dtype="fp32", device="cpu", seed=0)
    model, adapter = built.model, built.adapter
    shard_experts(model, group)
    data["spans"], data["slices"] = spans_and_slices(model, adapter)
    prompts = proj.rank_prompts(model.config.vocab_size, world, B, rank, ARGS.prompt_len)
    for name, strategy in proj.CASES:
        rec = Recorder(group)
        m = proj.measure(model, adapter, proj.case_dispatcher(name, CF, rec), group, strategy, prompts, ARGS,
                         "emulate", keep=True)
        data[name] = {"tokens": m["result"].tokens, "logits": m["result"].logits, "shapes": m["shapes"],
                      "calls": rec.calls}
    path = Path(out, f"projection_rank{rank}.pt")
    torch.save(data, path)
    return path
