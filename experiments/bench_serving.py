"""Serving on one GPU: moecg's strategies on RaggedEngine against transformers' continuous batching,
same model, same requests, same process; and the exactness of continuous batching on HF's modules.

  python experiments/bench_serving.py --out experiments/results/serving               # Qwen1.5-MoE, 24 layers, H200
  python experiments/bench_serving.py --quick --out /tmp/serving_quick                 # the same, smaller
  python experiments/bench_serving.py --preset mixtral_tiny --device cpu --backend emulate --requests 4 3 \\
      --max-batch 4 2 --prompt 3 9 --new 4 --exact-requests 3 --out /tmp/serving_cpu  # CPU smoke (tests)

(a) exactness: dispatch=dropless on HF's modules, strategy=full, each request's greedy tokens served with up to
    --exact-batch others (all arriving at once, output lengths spread so requests join and leave) against the same
    request decoded alone (max_batch 1 on the same engine and graphs); bit-exact requests, free-running token
    agreement, teacher-forced agreement (every step fed the alone tokens).
(b) throughput: for each (max batch, requests) pair, every request arriving at t=0 (as generate_batch submits
    them) with prompts uniform in --prompt and --new tokens each: transformers' continuous batching (moecg.anchor:
    its CUDA graphs on, HF's grouped_mm experts), then each moecg variant (--variants: full, capacity (cf 1.25,
    prefills dropless so they batch), partial, full+fused = capture.kernels=fused dispatch=fused); moecg prefills
    admissions together up to --prefill-tokens padded tokens; a variant that fails is reported, not fatal.
    Reported: output tokens/s, p90 TPOT, p90 TTFT, p90 e2e, decode step p50, GPU idle share between decode steps,
    padding waste, drop rate, greedy agreement with the anchor's tokens.
Writes DIR/serving.md (tables) and DIR/serving.json (every row and the environment) with --out.
Expected on an H200 (estimated, not yet measured): ~3-4 min (model build ~10 s, exactness ~30 s, per pair: the
anchor's warm-up and run ~20-40 s, each variant ~10 s); --quick ~1-2 min.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

from moecg.anchor import serve_hf, token_agreement
from moecg.capture import Capture, bucket_for
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.models import build_model
from moecg.ragged import RaggedEngine
from moecg.report import env_fields, write_report
from moecg.serving import decode_alone, request_metrics, serve, step_metrics, warm
from moecg.workload import Request, request_prompt

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
VARIANTS = {  # name -> (strategy, dispatch, dispatcher options, capture.kernels, dispatch.prefill)
    "full": ("full", "dropless", {}, "hf", None),
    # prefills dropless (dispatch.prefill=dropless): a prefill that drops runs one request at a time (pad tokens
    # would take capacity), and the drop study is of decode
    "capacity": ("capacity", "capacity", {"capacity_factor": 1.25}, "hf", "dropless"),
    "partial": ("partial", "dropless", {}, "hf", None),
    "full+fused": ("full", "fused", {}, "fused", None),
}


def requests_for(n: int, prompt: tuple[int, int], new: tuple[int, int], seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(i, 0.0, rng.randint(*prompt), rng.randint(*new)) for i in range(n)]


def free(dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def engine_with(model, strategy, dispatch, kw, kernels, rows, cache_len, backend, prefill=None):
    """A RaggedEngine of `rows` slots with the strategy captured for every bucket up to rows -> (engine, capture)."""
    state = attach(model, make_dispatcher(dispatch, **kw), max_rows=rows)
    state.prefill_dispatcher = make_dispatcher(prefill) if prefill else None
    eng = RaggedEngine(model, cache_len, rows)
    t0 = time.perf_counter()
    cap = Capture(eng, strategy, buckets=[b for b in BUCKETS if b <= rows], backend=backend, kernels=kernels).apply()
    return eng, cap, time.perf_counter() - t0


# -- (a) exactness ------------------------------------------------------------------------------------------------
def forced_serve(eng, reqs, prompts, max_batch, ref: dict) -> dict:
    """Serve with every input forced to the reference tokens (teacher forcing): -> {id: the argmax tokens}."""
    dev = eng.device
    pending, out = list(zip(reqs, [p.to(dev) for p in prompts])), {}
    need = {r.id: r.output_len for r in reqs}
    while pending or eng.n_live:
        while pending and eng.n_live < max_batch:
            r, p = pending.pop(0)
            eng.add(r.id, p, r.output_len, sync=False)
        for rid in [rid for rid in eng.order if eng.n_generated[rid] >= need[rid]]:
            out[rid] = eng.remove(rid)
        if not eng.n_live:
            continue
        forced = [ref[rid][eng.n_generated[rid] - 1] for rid in eng.order]
        eng.ids[:len(forced)] = torch.tensor(forced, device=dev)  # the input: the reference's token there
        eng.step(sync=False)
    return out


def exactness(model, args, dev) -> dict:
    reqs = requests_for(args.exact_requests, tuple(args.prompt), (max(2, args.new // 4), args.new), args.seed + 7)
    prompts = [request_prompt("random", r, args.seed, model.config.vocab_size) for r in reqs]
    rows = bucket_for(args.exact_batch, BUCKETS) or args.exact_batch
    cache_len = max(r.prompt_len + r.output_len for r in reqs)
    eng, cap, _ = engine_with(model, "full", "dropless", {}, "hf", rows, cache_len, args.backend)
    try:
        warm(eng, prompts[0])
        alone = serve(eng, reqs, prompts, 1).tokens  # each request by itself: bucket 1, the same graphs
        batched = serve(eng, reqs, prompts, args.exact_batch).tokens
        forced = forced_serve(eng, reqs, prompts, args.exact_batch, alone)
        eager_alone = decode_alone(model, reqs[:2], prompts[:2], cache_len) if args.check_eager else None
    finally:
        cap.unwrap()
        detach(model)
        del eng, cap
        free(dev)
    exact = sum(batched[r.id] == alone[r.id] for r in reqs)
    first_diff = [next((i for i, (a, b) in enumerate(zip(batched[r.id], alone[r.id])) if a != b), None) for r in reqs]
    return {"requests": len(reqs), "max_batch": args.exact_batch, "bit_exact_requests": exact,
            "bit_exact_fraction": exact / len(reqs), "token_agreement": token_agreement(alone, batched),
            "teacher_forced_agreement": token_agreement(alone, forced),
            "first_divergence": first_diff,
            "alone_graphs_equal_eager": None if eager_alone is None else
            all(eager_alone[r.id] == alone[r.id] for r in reqs[:2])}


# -- (b) throughput -----------------------------------------------------------------------------------------------
def metrics_row(label, times, tl=None, **extra) -> dict:
    rm = request_metrics(times)
    row = {"variant": label, **{k: rm[k] for k in ("output_tokens_per_s", "serving_s", "output_tokens", "ttft_ms_p90",
                                                   "tpot_ms_p50", "tpot_ms_p90", "e2e_ms_p90")}}
    if tl is not None:
        sm = step_metrics(tl.steps, tl.prefills, tl.drops_by_batch)
        row.update({k: sm[k] for k in ("decode_steps", "ms_per_token_p50", "gpu_idle_share", "padding_waste")},
                   prefills=len(tl.prefills))
    row.update(extra)
    return row


def variant_row(model, name, reqs, prompts, max_batch, cache_len, args, dev, anchor_tokens) -> dict:
    strategy, dispatch, kw, kernels, prefill = VARIANTS[name]
    rows = max(bucket_for(max_batch, BUCKETS) or max_batch, max_batch)
    eng = cap = None
    try:
        eng, cap, capture_s = engine_with(model, strategy, dispatch, kw, kernels, rows, cache_len, args.backend,
                                          prefill)
        warm(eng, prompts[0])
        state = state_of(model)
        state.reset()
        tl = serve(eng, reqs, prompts, max_batch, prefill_tokens=args.prefill_tokens)
        drops = state.snapshot()
        return metrics_row(name, tl.requests, tl, capture_s=capture_s, captured=cap.stats()["captured"],
                           drop_rate=drops["drop_rate"],
                           anchor_agreement=token_agreement(anchor_tokens, tl.tokens) if anchor_tokens else None)
    except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others' numbers
        print(f"{name} (max_batch {max_batch}) failed: {type(e).__name__}: {e}", flush=True)
        return {"variant": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    finally:
        if cap is not None:
            cap.unwrap()
        detach(model)
        del eng, cap
        free(dev)


def fmt(v, spec=".1f"):
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen1_5_moe_a2_7b")
    ap.add_argument("--num-layers", type=int, default=None, help="default: the preset's (24 for Qwen1.5-MoE)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--backend", default="auto", help="capture backend: auto (cuda on a GPU) | emulate (CPU tests)")
    ap.add_argument("--max-batch", type=int, nargs="+", default=[64, 8])
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 16], help="requests per --max-batch entry")
    ap.add_argument("--prompt", type=int, nargs=2, default=[64, 512], metavar=("LOW", "HIGH"))
    ap.add_argument("--new", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="moecg's batched-prefill budget (0: one by one)")
    ap.add_argument("--exact-requests", type=int, default=16)
    ap.add_argument("--exact-batch", type=int, default=8)
    ap.add_argument("--check-eager", action="store_true", help="also decode 2 requests alone eagerly (slow)")
    ap.add_argument("--no-anchor", action="store_true")
    ap.add_argument("--quick", action="store_true", help="16 and 8 requests, prompts 64-128, 32 new tokens, "
                                                         "4 exactness requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for serving.md and serving.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.max_batch, args.prompt, args.new, args.exact_requests = [16, 8], [16, 8], [64, 128], 32, 4
    if len(args.requests) != len(args.max_batch):
        ap.error("--requests needs one count per --max-batch entry")

    built = build_model(args.preset, num_layers=args.num_layers, device=args.device)
    model, dev = built.model, built.device
    layers = len(built.adapter.layers(model))
    print(f"{args.preset}: {layers} layers, {built.dtype}, {env_fields()['device_name']}", flush=True)
    t_start = time.perf_counter()
    exact = exactness(model, args, dev) if args.exact_requests else None
    print("exactness:", json.dumps(exact), flush=True)

    pairs = []
    for mb, n in zip(args.max_batch, args.requests):
        reqs = requests_for(n, tuple(args.prompt), (args.new, args.new), args.seed + mb)
        prompts = [request_prompt("random", r, args.seed, model.config.vocab_size) for r in reqs]
        cache_len = max(r.prompt_len + r.output_len for r in reqs)
        rows, anchor_tokens = [], None
        if not args.no_anchor:
            try:
                hf = serve_hf(model, reqs, prompts, mb, cache_len)
                anchor_tokens = hf["tokens"]
                rows.append(metrics_row("transformers CB", hf["times"], cuda_graphs=list(hf["cuda_graphs"]),
                                        attn=hf["attn_implementation"]))
            except Exception as e:  # noqa: BLE001
                print(f"anchor (max_batch {mb}) failed: {type(e).__name__}: {e}", flush=True)
                rows.append({"variant": "transformers CB", "error": f"{type(e).__name__}: {e}"[:200]})
            free(dev)
        for name in args.variants:
            rows.append(variant_row(model, name, reqs, prompts, mb, cache_len, args, dev, anchor_tokens))
            print(json.dumps(rows[-1]), flush=True)
        pairs.append({"max_batch": mb, "requests": n, "rows": rows})

    head = (f"{args.preset}, {layers} layers, {built.dtype}, {env_fields()['device_name']}; every request arrives at "
            f"t=0, prompts uniform {args.prompt[0]}-{args.prompt[1]}, {args.new} new tokens, greedy; "
            f"{time.perf_counter() - t_start:.0f} s")
    lines = [head, ""]
    if exact:
        lines += [f"Exactness (dropless, HF modules, strategy=full; {exact['requests']} requests, up to "
                  f"{exact['max_batch']} at once, vs each decoded alone on the same graphs): bit-exact "
                  f"{exact['bit_exact_requests']}/{exact['requests']} requests, token agreement "
                  f"{exact['token_agreement']:.4f}, teacher-forced {exact['teacher_forced_agreement']:.4f}", ""]
    cols = ["output_tokens_per_s", "tpot_ms_p90", "ttft_ms_p90", "e2e_ms_p90", "ms_per_token_p50", "gpu_idle_share",
            "padding_waste", "drop_rate", "anchor_agreement"]
    for p in pairs:
        base = next((r for r in p["rows"] if r["variant"] == "transformers CB" and "error" not in r), None)
        lines += [f"max_batch {p['max_batch']}, {p['requests']} requests:", "",
                  "| variant | tokens/s | x CB | " + " | ".join(cols[1:]) + " |", "|---|" + "---|" * (len(cols) + 1)]
        for r in p["rows"]:
            if "error" in r:
                lines.append(f"| {r['variant']} | failed: {r['error']} |" + " |" * len(cols))
                continue
            x = r["output_tokens_per_s"] / base["output_tokens_per_s"] if base else None
            lines.append(f"| {r['variant']} | {fmt(r['output_tokens_per_s'])} | {fmt(x, '.2f')} | "
                         + " | ".join(fmt(r.get(c), ".3f" if c in ("gpu_idle_share", "padding_waste", "drop_rate",
                                                                   "anchor_agreement") else ".2f")
                                      for c in cols[1:]) + " |")
        lines.append("")
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    write_report("\n".join(lines), {"exactness": exact, "pairs": pairs}, args,
                 str(out / "serving.md") if out else None, str(out / "serving.json") if out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
