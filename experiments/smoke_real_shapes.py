"""Build each real-shape preset (random bf16 weights, on the GPU) and greedy-decode a few tokens.

  python experiments/smoke_real_shapes.py [--presets mixtral_8x7b qwen1_5_moe_a2_7b qwen3_30b_a3b] [--num-layers N]
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import DecodeEngine
from moecg.models import build_model


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["mixtral_8x7b", "qwen1_5_moe_a2_7b", "qwen3_30b_a3b"])
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    for preset in args.presets:
        b = build_model(preset, num_layers=args.num_layers, device=args.device)
        n_params = sum(p.numel() for p in b.model.parameters())
        attach(b.model, make_dispatcher("dropless"), max_rows=2)
        prompts = torch.randint(0, b.model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        res = DecodeEngine(b.model, 16, 2).generate(prompts, 4, timing=False)
        mem = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        print(f"{preset}: {len(b.adapter.layers(b.model))} layers, {n_params / 1e9:.2f}B params, {b.dtype}, "
              f"built in {b.build_s:.1f}s, decoded {res.tokens.tolist()} in {time.perf_counter() - t0:.1f}s, "
              f"peak {mem:.1f} GiB", flush=True)
        detach(b.model)
        del b, res
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
