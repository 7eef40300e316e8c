"""HF generate vs the torch.compile recipe vs moecg's strategies: one model, one process, one table.

  python experiments/bench_vs_compile.py --preset qwen1_5_moe_a2_7b --batch 1 8 --out experiments/results/vs_compile/vs_compile_qwen1_5.md
  python experiments/bench_vs_compile.py --preset mixtral_tiny --device cpu --batch 1 --compile-mode default  # smoke
  python experiments/bench_vs_compile.py --preset qwen3_30b_a3b --num-layers 12 --batch 1 8 --prompt-len 30000 \
      --cache-len 32768 --buckets 1 8 --prefill-chunk 2048 --skip-compile --skip-hf-generate \
      --strategies full full+fused  # long context: the engine holds max(--buckets) rows of the cache

Rows, all greedy, ms per decode step (prefill excluded), same prompts, same max cache length:
  hf_generate      `model.generate()` with its defaults (DynamicCache; experts_implementation grouped_mm, which
                   is what transformers 5.24 picks for these models by default);
                   per step = (t(N new tokens) - t(1 new token)) / (N - 1)
  compile          HF StaticCache + torch.compile(model.forward, mode=--compile-mode, fullgraph=True),
                   experts_implementation=grouped_mm; compile time = the first decode calls until steady
  moecg:<strategy> moecg's engine with dispatch=dropless (capacity: dispatch=capacity, cf 1.25 or the factor after
                   `@`: `capacity+fused@0.5`); `full+compile`:
                   the decode forward Inductor-compiled without its own cudagraphs, then captured by moecg;
                   `full+fused`: capture.kernels=fused + dispatch=fused (moecg.fast's Triton decode step);
                   `capacity+fused`: capture.kernels=fused + dispatch=capacity, whose experts the fused step runs
                   through moecg.kernels.capacity_ops (Triton slots + GEMMs, every expert's weights once)
  floor ms         the HBM floor of the dropless step (the experts one step hits); capacity floor ms: of the capacity
                   step, every expert's weights read (moecg.floor, the dispatcher's reads_all_experts)
                   capture_s: every bucket of --buckets captured (the engine holds max(--buckets) rows), JIT
                   compiles included
                   agree: greedy-token agreement with HF's modules run eagerly (dropless), same prompts
                   drops: the decode steps' dropped / routed assignments of a free-running generate (prefill not
                   counted) and C, the mean capacity per MoE call (capacity strategies)
Timing: CUDA events per step after warmup, median over steps of --repeats generates (perf_counter on CPU).
--prefill-chunk N: every moecg engine (the reference's too) prefills N tokens per forward (DecodeEngine prefill_chunk);
hf_generate and compile keep their one-forward prefill, which only their timing's prefill part sees.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import StaticCache

from moecg.capture import Capture, validate_buckets
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.engine import DecodeEngine, check_prefill_chunk
from moecg.fidelity import agreement, top2_margins
from moecg.floor import bench_bandwidth_gbps, step_floor_ms
from moecg.report import env_fields, write_report
from moecg.models import build_model
from moecg.models.formats import FORMATS


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def hf_generate_ms(model, prompts, new_tokens, repeats):
    dev = next(model.parameters()).device

    def run(n):
        sync(dev)
        t = time.perf_counter()
        model.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(dev)
        return time.perf_counter() - t

    run(2)
    full = statistics.median(run(new_tokens) for _ in range(repeats))
    one = statistics.median(run(1) for _ in range(repeats))
    return (full - one) / (new_tokens - 1) * 1e3


def compile_ms(model, prompts, new_tokens, repeats, cache_len, mode, ref=None):
    """HF's recipe: StaticCache + compiled forward for decode, eager prefill. Returns (ms/step, compile s)."""
    dev = next(model.parameters()).device
    torch._dynamo.reset()
    fwd = torch.compile(model.forward, mode=mode, fullgraph=True)
    def generate(force=None):  # -> (ms per decode step, tokens [B, new_tokens])
        cache = StaticCache(config=model.config, max_cache_len=cache_len)
        with torch.no_grad():
            logits = model(input_ids=prompts, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            ids = logits.argmax(-1)[:, None]
            toks = [ids]
            times = []
            for t in range(1, new_tokens):
                if force is not None:
                    ids = force[:, t - 1: t].to(dev)
                sync(dev)
                t0 = time.perf_counter()
                out = fwd(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
                ids = out.logits[:, -1].argmax(-1)[:, None].clone()
                sync(dev)
                times.append((time.perf_counter() - t0) * 1e3)
                toks.append(ids)
        return times, torch.cat(toks, 1)

    t0 = time.perf_counter()
    generate()  # compiles (and, for reduce-overhead, records its graphs) for this batch size
    generate()
    compile_s = time.perf_counter() - t0
    steps = []
    for _ in range(repeats):
        times, free = generate()
        steps += times[2:]
    fid = agreement(ref[0], free, generate(force=ref[0])[1], ref[1]) if ref is not None else None
    return statistics.median(steps), compile_s, fid


def reference_tokens(model, prompts, new_tokens, cache_len, prefill_chunk=None):
    """Greedy tokens of HF's own modules, eager, dropless dispatch, and eager's top-1 minus top-2 logit margin
    at every step ([n, new_tokens] each): what every dropless run is compared with."""
    attach(model, make_dispatcher("dropless"), max_rows=prompts.shape[0])
    try:
        r = DecodeEngine(model, cache_len, prompts.shape[0], prefill_chunk).generate(prompts, new_tokens, timing=False,
                                                                                     keep_logits=True)
        return r.tokens, top2_margins(r.logits)
    finally:
        detach(model)


def moecg_ms(model, adapter, prompts, new_tokens, repeats, cache_len, strategy, dispatch, kw, buckets,
             compile_mode, bandwidth_gbps, context, kernels="hf", ref_tokens=None, prefill_chunk=None) -> dict:
    """One strategy: ms (CUDA events), wall (ms per step, host loop included), capture_s, captured, floor,
    agree (free, forced, margin at flips; None without a reference)."""
    B = prompts.shape[0]
    rows = max(max(buckets), B)  # every bucket gets captured: capture_s is the all-buckets cost
    attach(model, make_dispatcher(dispatch, **kw), max_rows=rows)
    try:
        engine = DecodeEngine(model, cache_len, rows, prefill_chunk)
        t0 = time.perf_counter()
        cap = Capture(engine, strategy, buckets=buckets, compile=compile_mode is not None,
                      compile_mode=compile_mode or "default", kernels=kernels).apply()
        capture_s = time.perf_counter() - t0
        state = state_of(model)
        state.reset()
        first = engine.generate(prompts, new_tokens, timing=False, count_prefill=False)
        snap = state.snapshot()
        drops = {"dropped_assignments": snap["dropped_assignments"], "routed_assignments": snap["routed_assignments"],
                 "drop_rate": snap["drop_rate"], "capacity": snap["capacity_used"]}
        agree = None
        if ref_tokens is not None:
            forced = engine.generate(prompts, new_tokens, timing=False, force_tokens=ref_tokens[0])
            agree = agreement(ref_tokens[0], first.tokens, forced.tokens, ref_tokens[1])
        steps = []
        for _ in range(repeats):
            steps += engine.generate(prompts, new_tokens).step_ms[2:]
        # wall clock per step of the whole engine loop (host work included), as the compile row is timed
        walls = []
        for _ in range(repeats):
            sync(engine.device)
            t0 = time.perf_counter()
            g = engine.generate(prompts, new_tokens, timing=False)
            sync(engine.device)
            walls.append(((time.perf_counter() - t0) * 1e3 - g.prefill_ms) / (new_tokens - 1))
        floor = step_floor_ms(engine, adapter, prompts, bandwidth_gbps, context, make_dispatcher(dispatch).reads_all_experts)
        cap.unwrap()
        return {"ms": statistics.median(steps), "wall": statistics.median(walls), "capture_s": capture_s,
                "captured": cap.stats()["captured"], "floor": float("nan") if floor is None else floor, "agree": agree, **drops}
    finally:
        detach(model)
        torch._dynamo.reset()


def parse_strategy(s: str) -> tuple[str, str, float]:
    """'capacity+fused@0.5' -> ('capacity', 'fused', 0.5); the factor defaults to 1.25 and only capacity takes one."""
    head, at, factor = s.partition("@")
    name, _, extra = head.partition("+")
    if at and name != "capacity":
        raise ValueError(f"--strategies {s}: only capacity strategies take a capacity factor (@F)")
    try:
        cf = float(factor) if at else 1.25
    except ValueError:
        raise ValueError(f"--strategies {s}: the factor after '@' must be a number, e.g. capacity+fused@1.0") from None
    if cf <= 0:
        raise ValueError(f"--strategies {s}: the capacity factor must be > 0")
    return name, extra, cf


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen1_5_moe_a2_7b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--cache-len", type=int, default=256)
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                    help="capture buckets; the engine allocates max(--buckets) rows of --cache-len (long context: "
                         "e.g. --buckets 1 8)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prompt tokens per prefill forward of every moecg engine (default: the prompt in one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile-mode", default="reduce-overhead")
    ap.add_argument("--strategies", nargs="+", default=["partial", "full", "capacity", "full+fused", "capacity+fused"],
                    help="moecg strategies; '+compile' Inductor-compiles the captured pieces first, '+fused' runs "
                         "capture.kernels=fused (with dispatch=fused unless capacity)")
    ap.add_argument("--moecg-compile-mode", default="max-autotune-no-cudagraphs")
    ap.add_argument("--skip-hf-generate", action="store_true")
    ap.add_argument("--skip-compile", action="store_true", help="leave the torch.compile baseline out (ratios: nan)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--weights", default="full", choices=FORMATS,
                    help="the weight format (model.weights); a quantized model runs moecg's rows only")
    ap.add_argument("--bandwidth-gbps", type=float, default=None,
                    help="HBM GB/s for the floor (default: moecg.floor's device table, else a copy measured here)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.prompt_len + args.new_tokens > args.cache_len:
        ap.error(f"--prompt-len + --new-tokens = {args.prompt_len + args.new_tokens} exceeds --cache-len {args.cache_len}")
    try:
        buckets = validate_buckets(args.buckets)
        check_prefill_chunk(args.prefill_chunk)
        for s in args.strategies:
            parse_strategy(s)
    except (ValueError, TypeError) as e:
        ap.error(str(e).replace("prefill_chunk=", "--prefill-chunk ").replace("capture.buckets", "--buckets"))
    if args.prefill_chunk is not None and any(parse_strategy(s)[0] == "capacity" for s in args.strategies):
        ap.error("--prefill-chunk with a capacity strategy: its prefill drops by the tokens per forward, so chunks "
                 "would change what it drops; leave capacity out of --strategies or drop --prefill-chunk")

    if args.weights != "full" and not (args.skip_compile and args.skip_hf_generate):
        ap.error(f"--weights {args.weights}: HF's generate and the torch.compile recipe run HF's bf16 experts; give "
                 "--skip-compile --skip-hf-generate (moecg's rows, against HF's modules on the same quantized weights)")
    built = build_model(args.preset, num_layers=args.num_layers, device=args.device, weights=args.weights)
    model, dev = built.model, built.device
    bw, bw_source = bench_bandwidth_gbps(dev, args.bandwidth_gbps)
    results = []
    for bs in args.batch:
        prompts = torch.randint(0, model.config.vocab_size, (bs, args.prompt_len),
                                generator=torch.Generator().manual_seed(bs)).to(dev)
        row = {"batch_size": bs, "weights": built.weights, "bandwidth_gbps": bw}
        if built.weights == "full":
            model.set_experts_implementation("grouped_mm")
        if not args.skip_hf_generate:
            row["hf_generate"] = hf_generate_ms(model, prompts, args.new_tokens, args.repeats)
        ref_tokens = reference_tokens(model, prompts.cpu(), args.new_tokens, args.cache_len, args.prefill_chunk)
        row["compile"], row["compile_s"], row["compile:agree"] = float("nan"), float("nan"), None
        if not args.skip_compile:
            try:
                row["compile"], row["compile_s"], row["compile:agree"] = compile_ms(
                    model, prompts, args.new_tokens, args.repeats, args.cache_len, args.compile_mode, ref_tokens)
            except Exception as e:  # noqa: BLE001 - a family torch.compile cannot trace keeps moecg's rows
                print(f"compile failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch._dynamo.reset()
        context = args.prompt_len + args.new_tokens // 2
        for s in args.strategies:
            name, extra, cf = parse_strategy(s)
            dispatch, kw = ("capacity", {"capacity_factor": cf}) if name == "capacity" else ("dropless", {})
            if extra == "fused" and name != "capacity":
                dispatch = "fused"
            mode = args.moecg_compile_mode if extra == "compile" else None
            try:
                m = moecg_ms(model, built.adapter, prompts.cpu(), args.new_tokens, args.repeats, args.cache_len,
                             name, dispatch, kw, buckets, mode, bw, context,
                             kernels="fused" if extra == "fused" else "hf", ref_tokens=ref_tokens,
                             prefill_chunk=args.prefill_chunk)
            except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others' numbers
                print(f"moecg:{s} failed: {type(e).__name__}: {e}", flush=True)
                nan = float("nan")
                m = {"ms": nan, "wall": nan, "capture_s": nan, "captured": False, "floor": nan, "agree": None,
                     "dropped_assignments": None, "routed_assignments": None, "drop_rate": None, "capacity": None}
            row[f"moecg:{s}"], row[f"moecg:{s}:capture_s"], row["captured"] = m["ms"], m["capture_s"], m["captured"]
            row[f"moecg:{s}:agree"] = m["agree"]
            row[f"moecg:{s}:wall"] = m["wall"]
            for k in ("dropped_assignments", "routed_assignments", "drop_rate", "capacity"):
                row[f"moecg:{s}:{k}"] = m[k]
            # the dropless floor counts the experts a step routes to, capacity's every expert (reads_all_experts)
            row["capacity_floor_ms" if name == "capacity" else "floor_ms"] = m["floor"]
        results.append(row)
        print(json.dumps(row), flush=True)

    head = (f"{args.preset}, {len(built.adapter.layers(model))} layers, {built.dtype}, weights {built.weights}, "
            f"{env_fields()['device_name']}, "
            f"prompt {args.prompt_len}, {args.new_tokens} new tokens, StaticCache {args.cache_len}, "
            f"compile mode {args.compile_mode}, buckets {list(buckets)}, prefill "
            + (f"chunk {args.prefill_chunk} (moecg engines)" if args.prefill_chunk else "in one forward")
            + "; ms per decode step (ratio to compile); "
            + (f"floor at {bw:.0f} GB/s ({bw_source})" if bw else "no floor (bandwidth unknown)"))
    cols = (["hf_generate"] if not args.skip_hf_generate else []) + ["compile"] + [f"moecg:{s}" for s in args.strategies]
    nan = float("nan")
    lines = [head, "", "| bs | " + " | ".join(cols) + " | compile s | floor ms | capacity floor ms |",
             "|---|" + "---|" * (len(cols) + 3)]
    for r in results:
        cells = [f"{r[c]:.2f} ({r[c] / r['compile']:.2f}x)" for c in cols]
        lines.append(f"| {r['batch_size']} | " + " | ".join(cells) + f" | {r['compile_s']:.1f} | "
                     f"{r.get('floor_ms', nan):.2f} | {r.get('capacity_floor_ms', nan):.2f} |")
    lines += ["", f"capture time for all buckets {list(buckets)} (s; compile: its first two generates at this batch size) | "
              "greedy agreement with HF eager, free-running / teacher-forced | largest eager top-1 minus top-2 "
              "logit margin among the teacher-forced disagreements:", "",
              "| bs | compile | " + " | ".join(f"moecg:{s}" for s in args.strategies) + " |",
              "|---|---|" + "---|" * len(args.strategies)]

    def cell(t, a):
        return f"{t:.1f} s \\| " + (f"{a[0]:.3f} / {a[1]:.3f} \\| {a[2]:.3f}" if a else "-")

    for r in results:
        cells = [cell(r["compile_s"], r.get("compile:agree"))]
        cells += [cell(r[f"moecg:{s}:capture_s"], r.get(f"moecg:{s}:agree")) for s in args.strategies]
        lines.append(f"| {r['batch_size']} | " + " | ".join(cells) + " |")
    lines += ["", "moecg wall clock per step (host loop included, as the compile row is timed), ms: " + "; ".join(
        f"bs {r['batch_size']}: " + ", ".join(f"{s} {r[f'moecg:{s}:wall']:.2f}" for s in args.strategies)
        for r in results)]
    best = {r["batch_size"]: min((r[c], c) for c in cols if c.startswith("moecg:") and r[c] == r[c]) for r in results}
    lines += ["", "best moecg per batch: " + ", ".join(f"bs {b}: {c} {ms:.2f} ms = {ms / r['compile']:.2f}x compile"
                                                  + (f", {ms / r['floor_ms']:.2f}x floor" if r.get("floor_ms") else "")
                                                  for r in results for b, (ms, c) in [(r["batch_size"],
                                                                                        best[r["batch_size"]])])]
    # each strategy against its own floor: dropless ones the experts hit, capacity ones every expert
    lines += ["", "ms / own floor: " + "; ".join(
        f"bs {r['batch_size']}: " + ", ".join(
            f"{s} {r[f'moecg:{s}'] / r[key]:.2f}x" for s in args.strategies
            for key in ["capacity_floor_ms" if s.startswith("capacity") else "floor_ms"] if r.get(key))
        for r in results)]
    def drops(r, s):
        if r[f"moecg:{s}:routed_assignments"] is None:
            return f"{s} -"
        c = r[f"moecg:{s}:capacity"]
        return (f"{s} {r[f'moecg:{s}:dropped_assignments']} / {r[f'moecg:{s}:routed_assignments']}"
                + (f" (C {c:g})" if c is not None else ""))

    lines += ["", "decode drops, dropped / routed assignments of one free-running generate (C: mean capacity per MoE "
              "call): " + "; ".join(f"bs {r['batch_size']}: " + ", ".join(drops(r, s) for s in args.strategies)
                                    for r in results)]
    write_report("\n".join(lines), results, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
