"""Time to capture every bucket of a strategy, from a cold and from a warm Triton cache.

  python experiments/capture_time.py --preset qwen1_5_moe_a2_7b --out experiments/results/capture_time/capture_time.md \
      --json experiments/results/capture_time/capture_time.json
  python experiments/capture_time.py --preset mixtral_tiny --device cpu --buckets 1 2 4  # smoke (emulated graphs)

Each run is a fresh process (nothing compiled in memory): `cold` with TRITON_CACHE_DIR (and TORCHINDUCTOR_CACHE_DIR)
a new empty directory, so every Triton kernel compiles; then `warm`, a second fresh process on the same directory.
Each process builds the model, attaches the dispatcher, makes a DecodeEngine of max(--buckets) rows, runs one small
GEMM (CUDA context and cuBLAS set up outside the timing), then times what experiments/bench_vs_compile.py's moecg_ms
times: `Capture(engine, ...)` + `.apply()`, every bucket largest first, split as
  setup       Capture(): the strategy's checks and, for capture.kernels=fused, FastDecode (weights concatenated)
  precompile  kernels=fused on Triton: every bucket's step run dry, then each distinct kernel specialisation compiled
              on a thread pool (Capture(precompile=...); --no-precompile: none, the first warmups compile); Triton's
              source hash computed (cold) or read from the cache directory (warm)
  first warm  each bucket's first warmup call: the step's first run at that shape, Triton's JIT compiles included
              (none where capture.warmup=auto follows the dry pass)
  jit (est.)  first warm minus the bucket's later warmup calls' mean: what the first call cost beyond a step
              (with capture.warmup 1 there is no later call, so it is the whole first warmup)
  warmups     the later warmup calls (capture.warmup - 1 per bucket): eager steps
  graphs      the captures themselves (CUDA graph recording + one sync per bucket)
  other       apply() minus the above (cache resets, bookkeeping)
--recapture: then a second Capture of the same engine in that process (what a sweep pays per configuration).
`new cache files`: files the process added to the Triton cache directory (0 when warm compiled nothing).
On CPU graphs are emulated (a capture re-runs the step eagerly) and there is no Triton: the split is only a smoke test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moecg.capture import DEFAULT_BUCKETS, Capture, validate_buckets
from moecg.report import env_fields, write_json, write_report

PHASES = ("setup_s", "precompile_s", "first_warmup_s", "jit_s", "steady_warmup_s", "graph_capture_s", "other_s")


def _files(d) -> int:
    return sum(len(f) for _, _, f in os.walk(d)) if d and os.path.isdir(d) else 0


def _timed_backend(backend, per_bucket: list, sync):
    """Wrap the capture backend's warmup and capture (from outside) to time each part; same calls, in order."""
    warmup, capture = backend.warmup, backend.capture

    def timed_warmup(fn, args, n):
        t = []
        for _ in range(n):
            t0 = time.perf_counter()
            warmup(fn, args, 1)
            sync()
            t.append(time.perf_counter() - t0)
        per_bucket.append({"warmups_s": t})

    def timed_capture(fn, args):
        t0 = time.perf_counter()
        out = capture(fn, args)
        sync()
        per_bucket[-1]["graph_capture_s"] = time.perf_counter() - t0
        return out

    backend.warmup, backend.capture = timed_warmup, timed_capture


def measure(args) -> dict:
    """One process's capture of every bucket (module docstring); the Triton cache is whatever the environment says."""
    from moecg.dispatch import attach, detach, make_dispatcher
    from moecg.engine import DecodeEngine
    from moecg.models import build_model

    cache_dir = os.environ.get("TRITON_CACHE_DIR")
    files0 = _files(cache_dir)
    built = build_model(args.preset, num_layers=args.num_layers, device=args.device, dtype=args.dtype)
    model, dev = built.model, built.device
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    buckets = validate_buckets(args.buckets)
    backend = args.backend if args.backend != "auto" else ("cuda" if cuda else "emulate")
    attach(model, make_dispatcher(args.dispatch), max_rows=max(buckets))
    try:
        engine = DecodeEngine(model, args.cache_len, max(buckets))
        x = torch.ones(64, 64, dtype=built.dtype, device=dev)
        (x @ x).sum().item()  # CUDA context and cuBLAS handle: not part of capturing
        per_bucket: list[dict] = []
        t0 = time.perf_counter()
        cap = Capture(engine, args.strategy, buckets=buckets, backend=backend, warmup=args.warmup,
                      kernels=args.kernels, precompile=not args.no_precompile)
        setup_s = time.perf_counter() - t0
        if cap.runner is None:
            raise SystemExit(f"capture backend {backend} captures nothing on {dev.type}: use --backend emulate")
        _timed_backend(cap.runner.backend, per_bucket, sync)
        prof = None
        if args.profile_out:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        t1 = time.perf_counter()
        cap.apply()
        sync()
        apply_s = time.perf_counter() - t1
        if prof is not None:
            prof.disable()
            _write_profile(prof, args.profile_out)
        stats = cap.stats()
        cap.unwrap()
        recapture_s = None
        if args.recapture:  # the same engine captured again in this process: every kernel already in memory
            del cap
            t2 = time.perf_counter()
            cap2 = Capture(engine, args.strategy, buckets=buckets, backend=backend, warmup=args.warmup,
                           kernels=args.kernels, precompile=not args.no_precompile)
            cap2.apply()
            sync()
            recapture_s = time.perf_counter() - t2
            cap2.unwrap()
    finally:
        detach(model)
    order = sorted(buckets, reverse=True)  # Capture's order: largest first
    rows = {}
    for b, p in zip(order, per_bucket):
        w = p["warmups_s"]
        steady = statistics.mean(w[1:]) if len(w) > 1 else 0.0
        first = w[0] if w else 0.0  # no warmup: capture.warmup=auto after the dry pass
        rows[b] = {"first_warmup_s": first, "jit_s": max(first - steady, 0.0), "steady_warmup_s": sum(w[1:]),
                   "graph_capture_s": p["graph_capture_s"], "total_s": sum(w) + p["graph_capture_s"]}
    tot = {k: sum(r[k] for r in rows.values()) for k in ("first_warmup_s", "jit_s", "steady_warmup_s",
                                                          "graph_capture_s")}
    pre = stats["precompiled"] or {}
    tot["precompile_s"] = pre.get("seconds", 0.0)
    return {"capture_all_s": setup_s + apply_s, "setup_s": setup_s, "apply_s": apply_s, **tot,
            "precompile": not args.no_precompile, "recapture_s": recapture_s, "warmup": stats["warmup"],
            "specialisations": pre.get("specialisations", 0),
            "other_s": apply_s - tot["precompile_s"] - tot["first_warmup_s"] - tot["steady_warmup_s"]
            - tot["graph_capture_s"],
            "graphs": stats["graphs"], "capture_backend": stats["capture_backend"],
            "kernel_backend": stats["kernel_backend"], "new_cache_files": _files(cache_dir) - files0,
            "buckets": {str(b): rows[b] for b in sorted(rows)}, "model": built.name,
            "num_layers": len(built.adapter.layers(model)), "dtype": str(built.dtype).replace("torch.", ""),
            "device": dev.type, "env": {**env_fields(), "triton_version": _triton_version()}}


def _write_profile(prof, path: str) -> None:
    """The host-side profile of apply(): the 40 costliest calls by cumulative and by own time (paths trimmed)."""
    import io
    import pstats
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.strip_dirs()
    for key in ("cumulative", "tottime"):
        st.sort_stats(key).print_stats(40)
    Path(path).write_text(buf.getvalue())


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _child_argv(args, out: Path, what: str) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", str(out), "--preset", args.preset,
            "--strategy", args.strategy, "--kernels", args.kernels, "--dispatch", args.dispatch, "--device",
            args.device, "--dtype", args.dtype, "--backend", args.backend, "--cache-len", str(args.cache_len),
            "--warmup", str(args.warmup), "--buckets", *map(str, args.buckets)]
    argv += ["--num-layers", str(args.num_layers)] if args.num_layers is not None else []
    argv += ["--no-precompile"] if args.no_precompile else []
    argv += ["--recapture"] if args.recapture else []
    return argv + (["--profile-out", f"{args.profile}.{what}.txt"] if args.profile else [])


def run_fresh(args, cache_dir: str, what: str) -> dict:
    """measure() in a fresh process whose Triton (and Inductor) caches live in cache_dir."""
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        t0 = time.perf_counter()
        p = subprocess.run(_child_argv(args, out, what), env=env, capture_output=True, text=True)
        if p.returncode != 0 or not out.exists():
            raise SystemExit(f"the {what} process failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
        row = json.loads(out.read_text())
    row.update(run=what, process_s=time.perf_counter() - t0)
    return row


def report(rows: list[dict], args) -> str:
    r0 = rows[0]
    env = r0["env"]  # the measuring process's
    head = (f"{r0['model']}, {r0['num_layers']} layers, {r0['dtype']}, {env['device_name']}, torch "
            f"{env['torch_version']}, transformers {env['transformers_version']}, triton {env['triton_version']}, commit "
            f"{env['git_sha']}: strategy={args.strategy} capture.kernels={args.kernels} dispatch={args.dispatch} "
            f"(kernel backend {r0['kernel_backend']}), {r0['capture_backend']} graphs, buckets {list(args.buckets)}, "
            f"cache {args.cache_len}, capture.warmup {args.warmup} ({r0.get('warmup')} a bucket), precompile {not args.no_precompile}; seconds, each run a "
            "fresh process")
    lines = [head, "", "| run | capture all buckets | setup | precompile | first warmups | of which jit (est.) | warmups "
             "| graphs | other | specialisations precompiled | new cache files |", "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['run']} | **{r['capture_all_s']:.2f}** | " + " | ".join(
            f"{r[k]:.2f}" for k in PHASES) + f" | {r['specialisations']} | {r['new_cache_files']} |")
    lines += ["", "per bucket (warmups + graph), " + " / ".join(r["run"] for r in rows) + ":", "",
              "| bucket | " + " | ".join(r["run"] for r in rows) + " |", "|---|" + "---|" * len(rows)]
    for b in r0["buckets"]:
        lines.append(f"| {b} | " + " | ".join(f"{r['buckets'][b]['total_s']:.3f}" for r in rows) + " |")
    if any(r.get("recapture_s") is not None for r in rows):
        lines += ["", "re-capture of every bucket in the same process (Capture + apply, kernels in memory): " + ", ".join(
            f"{r['run']} {r['recapture_s']:.2f} s" for r in rows if r.get("recapture_s") is not None)]
    by = {r["run"]: r["capture_all_s"] for r in rows}
    if r0["device"] != "cuda":
        lines += ["", f"the targets (cold <= {args.target_cold} s, warm <= {args.target_warm} s) are for a GPU "
                  f"with Triton; this {r0['device']} run is a smoke test"]
        return "\n".join(lines)
    met = lambda x, t: f"{'met' if x <= t else 'NOT met'}, {x:.2f} s"  # noqa: E731
    lines += ["", f"target: cold <= {args.target_cold} s ({met(by['cold'], args.target_cold)}), warm <= "
              f"{args.target_warm} s ({met(by['warm'], args.target_warm)})"]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen1_5_moe_a2_7b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--strategy", default="full")
    ap.add_argument("--kernels", default="fused", help="capture.kernels: hf | fused")
    ap.add_argument("--dispatch", default="fused")
    ap.add_argument("--buckets", type=int, nargs="+", default=list(DEFAULT_BUCKETS))
    ap.add_argument("--cache-len", type=int, default=256)
    ap.add_argument("--warmup", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="capture.warmup: auto (none after the fused step's dry pass, else 3) or a count")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend", default="auto", help="auto (cuda on a GPU, emulate on CPU) | cuda | emulate")
    ap.add_argument("--cache-dir", default=None, help="where the cold run's caches go (default: a new temporary "
                                                      "directory, removed after); must not exist or be empty")
    ap.add_argument("--target-cold", type=float, default=3.0)
    ap.add_argument("--target-warm", type=float, default=1.0)
    ap.add_argument("--no-precompile", action="store_true", help="Capture.precompile = False: each kernel compiles "
                                                                   "inside the first warmup that launches it")
    ap.add_argument("--recapture", action="store_true", help="after each run's capture, capture the same engine again "
                                                              "in that process (what a sweep pays per configuration)")
    ap.add_argument("--profile", default=None, help="write each run's host-side cProfile of apply() to "
                                                    "PROFILE.cold.txt / PROFILE.warm.txt")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: measure() here, write the row
    ap.add_argument("--profile-out", default=None, help=argparse.SUPPRESS)  # internal: the child's profile file
    args = ap.parse_args(argv)
    try:
        validate_buckets(args.buckets)
    except ValueError as e:
        ap.error(str(e).replace("capture.buckets", "--buckets"))
    if args.child:
        write_json(args.child, measure(args), indent=None)
        return 0
    if args.cache_dir and Path(args.cache_dir).exists() and any(Path(args.cache_dir).iterdir()):
        ap.error(f"--cache-dir {args.cache_dir} is not empty: a cold run needs an empty cache (give a new directory)")
    with tempfile.TemporaryDirectory(prefix="moecg_capture_time_") as tmp:
        cache_dir = args.cache_dir or tmp
        rows = [run_fresh(args, cache_dir, "cold"), run_fresh(args, cache_dir, "warm")]
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k not in ("buckets", "env")}), flush=True)
    write_report(report(rows, args), rows, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
