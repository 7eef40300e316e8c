"""The real-rank half of tests/test_ep_projection.py: 2 gloo ranks decode with moecg.parallel (shard_experts over the
real group, the EP dispatchers over its all-to-alls) through experiments/ep_projection.py's `measure`, and record what
each rank holds, sends and receives, so the single-process per-rank benchmark can be checked against it.

Dims: R ranks, B rows per rank, L MoE layers. Each rank writes rank<r>.pt: its expert spans and slices per MoE layer,
and per case its tokens, logits, the buffer shapes of one eager step's all-to-alls, and every all-to-all's (send,
received) pair in call order; rank<r>.json carries the error, if any (tests/test_parallel.py's spawn reads it).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
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


def run(rank: int, world: int, port: int, out: str, which: str, device: str = "cpu") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from moecg.models import build_model
    from moecg.parallel import init_group, shard_experts

    proj = load_script()
    group = init_group(world, "gloo", torch.device("cpu"), 120)
    err, data = None, {}
    try:
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
        torch.save(data, Path(out, f"rank{rank}.pt"))
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        err = traceback.format_exc()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps({"error": err} if err else {}))
        group.close()
