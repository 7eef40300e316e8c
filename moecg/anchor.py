"""The anchor: transformers' own continuous batching on the same requests, in the same process.

transformers 5.24's `model.generate_batch` wraps `init_continuous_batching`: a paged KV cache, a FIFO scheduler
that mixes prefill chunks with decode steps, optional CUDA graphs, all in a background thread. generate_batch
submits every request at once; for arrivals in real time this drives the same manager as generate_batch does (warm
up, start), adding each request at its arrival time, and reads each result. Times come from its per-token host
timestamps (`record_timestamps=True`: taken as each token reaches the host), in the same time base as moecg's.

Settings, everything else left at its defaults: greedy, no EOS (every request generates its output_len, as moecg
does), `max_requests_per_batch` = max_batch, `num_blocks` sized for max_batch requests of max_cache_len (left
alone, it takes 90% of the free GPU memory, and moecg's engine shares the process), `use_cuda_graph=True` on
CUDA (no graph backend elsewhere), HF's own experts (moecg's dispatcher detached first). It runs on CPU too.
"""
from __future__ import annotations

import math
import time

import torch

from moecg.serving import RequestTimes


def anchor_configs(requests, max_batch: int, max_cache_len: int, cuda: bool):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in requests), eos_token_id=-1,
                           pad_token_id=0)
    page = 256 if max_cache_len > 64 else 16
    blocks = max_batch * (math.ceil(max_cache_len / page) + 1)
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_requests_per_batch=max_batch,
                                  use_cuda_graph=True if cuda else None,
                                  max_batch_tokens=None if cuda else 512)  # CPU: a small mask for tests
    return gen, cb


@torch.no_grad()
def serve_hf(model, requests, prompts, max_batch: int, max_cache_len: int) -> dict:
    """Serve `requests` (ascending arrival_s) with transformers' continuous batching -> {"times": [RequestTimes],
    "tokens": {id: tokens}, "cuda_graphs": (varlen, decode), "attn_implementation": str}."""
    cuda = next(model.parameters()).device.type == "cuda"
    gen, cb = anchor_configs(requests, max_batch, max_cache_len, cuda)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.warmup()
    attn = model.config._attn_implementation
    graphs = tuple(manager.continuous_batching_config.use_cuda_graph)
    manager.start()
    results = {}
    try:
        t0 = time.perf_counter()
        for r, p in zip(requests, prompts):
            delay = t0 + r.arrival_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            manager.add_request(p.tolist(), request_id=str(r.id), max_new_tokens=r.output_len,
                                record_timestamps=True, eos_token_id=-1)
        while len(results) < len(requests):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                results[res.request_id] = res
            elif res is None and not manager.is_running():
                break
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    missing = [r.id for r in requests if str(r.id) not in results]
    failed = {k: v.error for k, v in results.items() if v.error is not None}
    if missing or failed:
        raise RuntimeError(f"transformers' continuous batching lost requests {missing[:5]} or failed "
                           f"{dict(list(failed.items())[:3])}: see its log above")
    times, tokens = [], {}
    for r in requests:
        res = results[str(r.id)]
        ts = res.timestamps
        times.append(RequestTimes(r.id, r.arrival_s, r.prompt_len, r.output_len, res.lifespan[0] - t0,
                                  ts[0] - t0, ts[-1] - t0))
        tokens[r.id] = list(res.generated_tokens)
    return {"times": times, "tokens": tokens, "cuda_graphs": graphs, "attn_implementation": attn}


def token_agreement(a: dict, b: dict) -> float:
    """Equal tokens at equal positions / tokens, over the requests of `a`."""
    same = total = 0
    for rid, ta in a.items():
        tb = b.get(rid, [])
        same += sum(x == y for x, y in zip(ta, tb))
        total += len(ta)
    return same / total if total else float("nan")
