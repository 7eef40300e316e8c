"""The per-rank half of tests/test_parallel.py: gloo processes spawned from pytest, each comparing its expert-parallel
decode with a single-process decode of its own rows (same seed, same dispatcher options), case by case.

Dims: B rows per rank, R ranks. Each rank writes `rank<r>.json`: per case, whether the tokens are equal, the largest
logit difference, whether every counter equals the single-process one, and how much the reference dropped (so a
capacity case that drops nothing, which would prove little, is caught by the test).
"""
from __future__ import annotations

import json
import os
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

B, PROMPT, NEW = 3, 5, 5  # 3 real rows run in bucket 4 under capture: one pad row per rank
CF = {"capacity_factor": 0.5}  # drops on every tiny preset, in the prefill and at decode

# (preset, dispatch, options, strategy, extra Capture kwargs)
CASES_2 = [
    (preset, *case) for preset in ("mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny") for case in (
        ("dropless", {}, "eager", {}), ("capacity", CF, "eager", {}),
        ("dropless", {}, "full", {}), ("capacity", CF, "capacity", {}))
] + [
    ("mixtral_tiny", "dropless", {}, "layer", {}),
    ("mixtral_tiny", "capacity", CF, "partial", {}),
    ("qwen2_moe_tiny", "capacity", {"capacity_factor": 1.0, "drop_policy": "position"}, "mixed",
     {"layers": "0-1:layer,2-2:attn"}),
    ("qwen3_moe_tiny", "dropless", {}, "full", {"kernels": "fused"}),
    # the anchor: megatron-core's MoEAlltoAllTokenDispatcher (drop-and-pad, its only path that runs without CUDA)
    # against one process's `capacity` with the same factor (eager: megatron sizes C from the padded rows)
    ("mixtral_tiny", "megatron_alltoall_capacity", CF, "eager", {}),
    # and in whole-step graphs (its drop-and-pad path has fixed shapes); 4 rows fill bucket 4: no pad rows, whose
    # capacity megatron-core would count
    ("mixtral_tiny", "megatron_alltoall_capacity", CF, "capacity", {"rows": 4}),
]
CASES_4 = [
    (preset, *case) for preset in ("mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny") for case in (
        ("dropless", {}, "eager", {}), ("capacity", CF, "eager", {}))
] + [("qwen3_moe_tiny", "capacity", CF, "capacity", {}), ("mixtral_tiny", "dropless", {}, "full", {})]

# the single-process dispatcher a case is compared with
REFERENCE = {"megatron_alltoall_capacity": "capacity", "megatron_alltoall": "dropless", "megatron_allgather": "dropless"}
COUNTERS = ("routed", "dropped", "routed_mass", "dropped_mass", "tokens", "lost_all", "capacity", "calls")


def case_id(case) -> str:
    preset, name, kw, strategy, extra = case
    opts = ",".join(f"{k}={v}" for k, v in {**kw, **extra}.items())
    return f"{preset}-{name}-{strategy}" + (f"[{opts}]" if opts else "")


def _decode(model, dispatcher, prompts, strategy: str, extra: dict, backend: str = "emulate"):
    from moecg.capture import Capture
    from moecg.dispatch import attach, detach
    from moecg.engine import DecodeEngine

    state = attach(model, dispatcher, max_rows=4)
    try:
        engine = DecodeEngine(model, PROMPT + NEW, 4)
        cap = None
        if strategy != "eager":
            cap = Capture(engine, strategy, buckets=[1, 2, 4], backend=backend, **extra).apply()
        state.reset()
        res = engine.generate(prompts, NEW, keep_logits=True)
        counters = {k: getattr(state, k).clone() for k in COUNTERS}
        if cap is not None:
            cap.unwrap()
        return res, counters
    finally:
        detach(model)


# on GPUs (tests/test_parallel_gpu.py): NCCL, real CUDA graphs, and megatron-core's CUDA-only dispatchers too
CASES_GPU = CASES_2 + [
    ("mixtral_tiny", "megatron_alltoall", {}, "eager", {}), ("mixtral_tiny", "megatron_alltoall", {}, "partial", {}),
    ("qwen3_moe_tiny", "megatron_allgather", {}, "partial", {}),
]


def run(rank: int, world: int, port: int, out: str, which: str, device: str = "cpu") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # R processes on a couple of cores
    cuda = device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    from moecg.dispatch import make_dispatcher
    from moecg.models import build_model
    from moecg.parallel import init_group, parallelize, shard_experts
    from moecg.parallel.megatron import MEGATRON, cpu_stream_stand_in

    results: dict = {}
    group = init_group(world, "nccl" if cuda else "gloo", dev, 120)
    cases = {"2": CASES_2, "4": CASES_4, "gpu": CASES_GPU}[which]
    backend = "cuda" if cuda else "emulate"
    # megatron-core's drop-and-pad path on a CPU build needs its CUDA stream stood in for; on a GPU it has its own
    stand_in = cpu_stream_stand_in if not cuda else _null
    try:
        for preset in dict.fromkeys(c[0] for c in cases):
            mine = [c for c in cases if c[0] == preset]
            t0 = time.perf_counter()
            model = build_model(preset, dtype="fp32", device=str(dev)).model  # fp32 on GPUs too: tokens compare
            vocab = model.config.vocab_size

            def rows_of(case):
                n = case[4].get("rows", B)
                g = torch.Generator().manual_seed(7)
                return torch.randint(0, vocab, (world * n, PROMPT), generator=g)[rank * n:(rank + 1) * n]

            # references: one process, all experts, the same rows and dispatcher options, eager
            refs = [_decode(model, make_dispatcher(REFERENCE.get(c[1], c[1]), **c[2]), rows_of(c), "eager", {},
                            backend) for c in mine]
            shard_experts(model, group)
            for case, (ref, ref_c) in zip(mine, refs):
                _, name, kw, strategy, extra = case
                prompts = rows_of(case)
                extra = {k: v for k, v in extra.items() if k != "rows"}
                if name in MEGATRON:
                    with stand_in():
                        res, got_c = _decode(model, MEGATRON[name](**kw).bind(group), prompts, strategy, extra,
                                             backend)
                else:
                    res, got_c = _decode(model, parallelize(make_dispatcher(name, **kw), group), prompts, strategy,
                                         extra, backend)
                bad = [k for k in COUNTERS if not torch.allclose(ref_c[k].double(), got_c[k].double(), rtol=1e-6,
                                                                 atol=1e-6)]
                results[case_id(case)] = {
                    "tokens_equal": bool(torch.equal(ref.tokens, res.tokens)),
                    "max_logit_diff": max(float((a - b).abs().max()) for a, b in zip(ref.logits, res.logits)),
                    "counters_differ": bad, "ref_dropped": int(ref_c["dropped"].sum()),
                    "routed": int(got_c["routed"].sum()),
                    "experts_held": int(next(e for e in model.modules() if hasattr(e, "_moecg_experts"))
                                        .gate_up_proj.shape[0]),
                }
            results[f"{preset}:seconds"] = time.perf_counter() - t0
        if which == "2":  # experiments/ep_projection.py's per-rank benchmark against this real rank
            import ep_projection_worker

            t0 = time.perf_counter()
            results["projection"] = str(ep_projection_worker.record(rank, world, group, out))
            results["projection:seconds"] = time.perf_counter() - t0
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        results["error"] = traceback.format_exc()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
        group.close()


@contextmanager
def _null():
    yield
