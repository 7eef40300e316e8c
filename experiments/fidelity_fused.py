"""How far the fused decode path's greedy tokens are from HF's modules run eagerly, and why (CPU or GPU).

  python experiments/fidelity_fused.py --preset mixtral_stdlib qwen2_moe_stdlib --backend torch   # CPU, ~2 min

Reference: HF's modules, eager, dropless dispatch. Candidate: capture.kernels=fused decode (torch reference ops
or Triton), same prompts (held-out text for the trained *_stdlib models, random tokens otherwise).
Reports free-running agreement (a row's tokens after its first disagreement all differ), teacher-forced
agreement (each step is fed the reference's token), and the reference's top-1 minus top-2 logit margin at
the teacher-forced disagreements next to its median margin: flips confined to near-ties are rounding, a
bug would flip confident steps too.
"""
from __future__ import annotations

import argparse
import sys

import torch

from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import DecodeEngine
from moecg.fast import FastDecode
from moecg.fidelity import agreement, top2_margins
from moecg.models import build_model
from moecg.quality import heldout_prompts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["mixtral_stdlib", "qwen2_moe_stdlib"])
    ap.add_argument("--backend", default="auto", help="kernel backend of the fused path: auto | triton | torch")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    print("| model | backend | free-running agreement | teacher-forced agreement | largest margin at a flip | "
          "median margin |\n|---|---|---|---|---|---|")
    for preset in args.preset:
        built = build_model(preset, dtype=args.dtype, device=args.device)
        m = built.model
        if m.config.vocab_size == 256:
            prompts = heldout_prompts(args.batch, args.prompt_len)
        else:
            prompts = torch.randint(0, m.config.vocab_size, (args.batch, args.prompt_len),
                                    generator=torch.Generator().manual_seed(0))
        cache_len = args.prompt_len + args.new_tokens
        attach(m, make_dispatcher("dropless"), max_rows=args.batch)
        ref = DecodeEngine(m, cache_len, args.batch).generate(prompts, args.new_tokens, keep_logits=True,
                                                             timing=False)
        detach(m)
        attach(m, make_dispatcher("fused"), max_rows=args.batch)
        eng = DecodeEngine(m, cache_len, args.batch)
        fast = FastDecode(m, args.backend)
        eng.decode_forward = fast
        free = eng.generate(prompts, args.new_tokens, timing=False)
        forced = eng.generate(prompts, args.new_tokens, timing=False, force_tokens=ref.tokens)
        detach(m)
        margin = top2_margins(ref.logits)
        free_agree, forced_agree, worst = agreement(ref.tokens, free.tokens, forced.tokens, margin)
        print(f"| {preset} | {fast.backend} | {free_agree:.4f} | {forced_agree:.4f} | {worst:.3f} | "
              f"{float(margin.median()):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
