"""Same behaviour, shown: record every cell's results.json at two commits and compare them field by field.

    python experiments/record_diff.py record --commit <rev> --out <dir> [--only 'matrix/mixtral_tiny/*']
    python experiments/record_diff.py diff <dirA> <dirB> [--md out.md] [--common]

`record` unpacks `git archive <rev>` into a temporary directory and runs every cell there with PYTHONPATH pointing at
that tree (so that commit's moecg is imported, not the venv's editable install), on CPU, one thread
(OMP_NUM_THREADS=1: the same GEMM blocking on every run), and writes one JSON per cell into <dir>: the command, its
exit code and the job's results.json (a refused cell's is the failed record: `error` holds the error type and
message, `phase` where it was raised). The cell list is fixed here, so both commits run the same cells:

  matrix/<preset>/<strategy>.<dispatch>.<kernels>   tests/test_matrix.py's differential matrix, its overrides restated
        (13 presets x 6 strategies x 4 dispatchers x 2 kernel paths = 624 cells, batch 3 in bucket 4, emulated
        capture), refused cells included;
  skew/<preset>/<strategy>.dropless.<kernels>       test_router_skew_acts_on_every_path's cells (router_skew 0.5);
  readme/<name>[/jobNN]                             README.md's example command lines that run on CPU in seconds, each
        a `python -m moecg.run` (or torchrun) subprocess with hydra.run.dir / hydra.sweep.dir in the temporary
        directory; a multirun gives one cell per job. README_SKIPPED lists the lines left out and why.

The matrix cells run in one process, each through `python -m moecg.run`'s own entry (runpy, as `-m` does), so the
record is exactly the CLI's results.json, the same cells in the same order at both commits. 680 cells, 696 records
(the two README multiruns give 3 and 15 jobs); the whole list, no subset: 864 s for 0ce78b5 under `nice -n 10` on a
2-core machine shared with other work.

`diff` compares cell by cell every field except EXCLUDED (timings, memory of the process, the machine, the commit and
the clock; each with its reason) and, for serving records, SERVING_EXCLUDED (fields that depend on when requests
happened to arrive in real time; found by recording the same commit twice). Floats are compared exactly (and their
JSON type: 1 and 1.0 differ). A field only in B is "added" (allowed: new knobs recorded); only in A "removed";
a different value "differing"; a cell only in A "missing". Exit 1 on any difference, removal or missing cell.
"""
from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------------------- cells
# tests/test_matrix.py at 0ce78b5: PRESETS = the three base tiny presets, VARIANT_PRESETS, FAMILY_PRESETS
MATRIX_PRESETS = ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny",
                  "mixtral_tiny_swa", "qwen2_moe_tiny_swa", "qwen3_moe_tiny_swa", "qwen3_moe_tiny_dense",
                  "qwen3_moe_tiny_tied",
                  "deepseek_v3_tiny", "deepseek_v2_tiny", "glm4_moe_tiny", "olmoe_tiny", "gpt_oss_tiny"]
STRATEGIES = ["eager", "partial", "layer", "full", "capacity", "mixed"]
DISPATCHES = ["dynamic", "dropless", "fused", "capacity"]
KERNELS = ["hf", "fused"]
SKEW_PRESETS = ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny",
                "deepseek_v3_tiny", "deepseek_v2_tiny", "glm4_moe_tiny", "olmoe_tiny", "gpt_oss_tiny"]
SKEW_PATHS = [("eager", "hf"), ("partial", "hf"), ("layer", "hf"), ("full", "hf"), ("eager", "fused"),
              ("full", "fused")]


def matrix_overrides(preset, strategy, dispatch, kernels, skew=0.0) -> list[str]:
    """test_matrix._overrides(...) plus the `model.router_skew` its _run always adds."""
    ov = [f"model={preset}", f"strategy={strategy}", f"dispatch={dispatch}", f"capture.kernels={kernels}",
          "capture.backend=emulate", "batch_size=3", "prompt_len=5", "new_tokens=6", "measure.repeats=1",
          "measure.skip_steps=0", "measure.eager_baseline=false", "capture.warmup=1", f"model.router_skew={skew}"]
    if strategy == "mixed":
        ov.append("strategy.layers='0-0:layer,1-1:attn'")
    if dispatch == "capacity":
        ov.append("dispatch.capacity_factor=1.0")
    return ov


# README.md's examples (at 0ce78b5) that run on CPU in seconds: name -> (launcher, arguments as the README writes
# them). launcher: run (one job), multirun (its sweep dir; one cell per job), torchrun2 (2 processes, gloo).
README_EXAMPLES = {
    "partial": ("run", ["strategy=partial"]),
    "stdlib_capacity_heldout": ("run", ["model=mixtral_stdlib", "strategy=capacity", "dispatch.capacity_factor=0.5",
                                        "prompts=heldout"]),
    "poisson": ("run", ["workload=poisson", "workload.rate=8", "strategy=full"]),
    "trace": ("run", ["workload=trace", "strategy=full"]),
    "wandb_offline": ("run", ["logger=wandb", "strategy=full"]),
    "capacity_factor_sweep": ("multirun", ["-m", "strategy=capacity", "dispatch.capacity_factor=1.0,1.25,2.0"]),
    "capacity_sweep_tiny": ("multirun", ["experiment=capacity_sweep", "model=mixtral_tiny"]),  # README's sweep dir
    "ep2_gloo": ("torchrun2", ["parallel.ep=2", "strategy=capacity", "capture.backend=emulate"]),
}
REAL = "a real-shape preset (billions of parameters): minutes to build on CPU, not seconds"
README_SKIPPED = {
    "pip install torch==2.13.0 -e \".[dev]\"": "installs; its `python -m moecg.run strategy=partial` is readme/partial",
    "pytest -q": "the test suite, not a run",
    "python -m moecg.run model=qwen1_5_moe_a2_7b strategy=full batch_size=8": REAL,
    "python -m moecg.run model=qwen1_5_moe_a2_7b strategy=full capture.kernels=fused dispatch=fused": REAL,
    "python -m moecg.run experiment=kernels_matrix": REAL + " (qwen1_5_moe_a2_7b, 8 jobs)",
    "python -m moecg.run strategy=mixed 'strategy.layers=\"0-11:layer,12-23:attn\"' model=qwen1_5_moe_a2_7b": REAL,
    "python -m moecg.run experiment=capacity_sweep model=mixtral_8x7b model.num_layers=8": REAL + " (8 layers: 11B)",
    "python -m moecg.analysis multirun/": "reads results, writes no results.json",
    "python -m moecg.run -m hydra/launcher=submitit_slurm ...": "needs a SLURM cluster",
    "MOECG_RESULTS=... jupyter execute notebooks/analysis.ipynb": "a notebook, not a run",
    "python -m moecg.run workload=poisson ... model=qwen1_5_moe_a2_7b strategy=capacity workload.anchor=true": REAL,
    "python -m moecg.run workload=trace workload.file=/path/trace.csv workload.max_batch=16": "a placeholder path",
    "python -m moecg.run experiment=serving_sweep": REAL + " (qwen1_5_moe_a2_7b, 18 jobs)",
    "python -m moecg.analysis multirun/<date>/<time> --serving-plot serving.png": "reads results, writes none",
    "torchrun --nproc-per-node 8 -m moecg.run parallel.ep=8 model=mixtral_8x7b ...": "8 GPUs (NCCL)",
    "torchrun --nproc-per-node 8 experiments/bench_ep.py ...": "8 GPUs and megatron-core; a benchmark, not a run",
    "bash experiments/h200x8_ep.sh ...": "8 H200s",
}


def cells() -> list[dict]:
    out = []
    for p in MATRIX_PRESETS:
        for s in STRATEGIES:
            for d in DISPATCHES:
                for k in KERNELS:
                    out.append({"cell": f"matrix/{p}/{s}.{d}.{k}", "launcher": "inproc",
                                "args": matrix_overrides(p, s, d, k)})
    for p in SKEW_PRESETS:
        for s, k in SKEW_PATHS:
            out.append({"cell": f"skew/{p}/{s}.dropless.{k}", "launcher": "inproc",
                        "args": matrix_overrides(p, s, "dropless", k, 0.5)})
    for name, (launcher, args) in README_EXAMPLES.items():
        out.append({"cell": f"readme/{name}", "launcher": launcher, "args": args})
    return out


def _fname(cell: str) -> str:
    return cell.replace("/", "__") + ".json"


# ------------------------------------------------------------------------------------------------------- record
def record(args) -> int:
    sha = _git("rev-parse", "--verify", f"{args.commit}^{{commit}}").strip()
    todo = [c for c in cells() if not args.only or any(fnmatch.fnmatch(c["cell"], o) for o in args.only)]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="record_diff_"))
    tree = tmp / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", sha], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "MOECG_GIT_SHA": sha[:7], "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "HYDRA_FULL_ERROR": "1", "PYTHONHASHSEED": "0"}
    t0 = time.time()
    print(f"record {args.commit} ({sha[:7]}): {len(todo)} cells into {out} (work dir {tmp})", flush=True)
    inproc = [c for c in todo if c["launcher"] == "inproc"]
    if inproc:  # one process for the matrix: same cells, same order at both commits
        spec = tmp / "cells.json"
        spec.write_text(json.dumps(inproc))
        subprocess.run([sys.executable, __file__, "_inproc", str(tree), str(tmp), str(out), str(spec)], env=env,
                       cwd=tmp, check=True)
    for c in todo:
        if c["launcher"] != "inproc":
            _subprocess_cell(c, tree, tmp, out, env)
    secs = time.time() - t0
    manifest = {"commit": args.commit, "sha": sha, "cells": len(todo), "record_s": round(secs, 1),
                "records": sum(1 for f in out.glob("*.json") if not f.name.startswith("_")),
                "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "readme_skipped": README_SKIPPED, "only": args.only}
    (out / "_manifest.json").write_text(json.dumps(manifest, indent=2))
    print(f"recorded {len(todo)} cells in {secs:.0f} s", flush=True)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _inproc(tree: str, tmp: str, out: str, spec: str) -> int:
    """Child: every cell through `python -m moecg.run`'s entry (runpy as `-m` does), in this one process."""
    import runpy

    import moecg

    assert Path(moecg.__file__).resolve().is_relative_to(Path(tree).resolve()), \
        f"imported {moecg.__file__}, not the recorded tree {tree}: PYTHONPATH did not win over the editable install"
    todo = json.loads(Path(spec).read_text())
    logs = Path(out) / "logs"
    logs.mkdir(exist_ok=True)
    t0 = time.time()
    for i, c in enumerate(todo):
        run_dir = Path(tmp) / "runs" / f"{i:04d}"
        sys.argv = ["moecg.run", *c["args"], f"hydra.run.dir={run_dir}"]
        buf = io.StringIO()
        rc = 0
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                runpy.run_module("moecg.run", run_name="__main__", alter_sys=True)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException as e:  # noqa: BLE001 - recorded as the cell's outcome
                rc = f"{type(e).__name__}: {e}"
        (logs / (_fname(c["cell"])[:-5] + ".log")).write_text(buf.getvalue())
        _write_cell(c, rc, run_dir, buf.getvalue(), Path(out))
        el = time.time() - t0
        print(f"[{i + 1}/{len(todo)}] {c['cell']}: rc={rc} ({el:.0f} s, ~{el / (i + 1) * (len(todo) - i - 1):.0f} s "
              "left)", flush=True)
    return 0


def _subprocess_cell(c: dict, tree: Path, tmp: Path, out: Path, env: dict) -> None:
    job = tmp / "runs" / c["cell"].replace("/", "__")
    if c["launcher"] == "torchrun2":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "moecg.run"]
    else:
        cmd = [sys.executable, "-m", "moecg.run"]
    cmd += [*c["args"], f"hydra.{'sweep' if c['launcher'] == 'multirun' else 'run'}.dir={job}"]
    t0 = time.time()
    p = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=900)
    log = p.stdout + p.stderr
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / (_fname(c["cell"])[:-5] + ".log")).write_text(log)
    if c["launcher"] == "multirun":
        jobs = sorted((d for d in job.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name)) \
            if job.is_dir() else []
        for d in jobs:
            _write_cell({**c, "cell": f"{c['cell']}/job{int(d.name):02d}"}, p.returncode, d, log, out,
                        overrides=(d / ".hydra" / "overrides.yaml").read_text().splitlines())
        if not jobs:
            _write_cell(c, p.returncode, job, log, out)
    else:
        _write_cell(c, p.returncode, job, log, out)
    print(f"{c['cell']}: rc={p.returncode} ({time.time() - t0:.0f} s)", flush=True)


def _write_cell(c: dict, rc, run_dir: Path, log: str, out: Path, overrides=None) -> None:
    rec = {"cell": c["cell"], "launcher": c["launcher"], "args": c["args"], "rc": rc}
    if overrides is not None:
        rec["job_overrides"] = overrides  # the sweep's own choice of this job's values
    res = run_dir / "results.json"
    if res.is_file():
        rec["results"] = json.loads(res.read_text())
    else:
        rec["results"] = None
        rec["no_results"] = log[-3000:]  # e.g. Hydra refused an override before any job ran
    (out / _fname(c["cell"])).write_text(json.dumps(rec, indent=1, sort_keys=False))


def _git(*a) -> str:
    return subprocess.run(["git", "-C", str(REPO), *a], check=True, capture_output=True, text=True).stdout


# --------------------------------------------------------------------------------------------------------- diff
# Paths into a cell's record (results.<field>, dots between keys and list indices; * any run of characters);
# a pattern excludes the field and everything below it.
_T = "a timing (wall clock or perf_counter): differs run to run"
EXCLUDED = {
    # schema group latency: every field a step time or derived from one
    "results.ms_per_token_p50": _T, "results.ms_per_token_p90": _T, "results.step_ms": _T,
    "results.prefill_ms": _T, "results.eager_ms_per_token_p50": _T, "results.tokens_per_s": _T + " (B / p50)",
    "results.speedup_vs_eager": _T + " (eager p50 / p50)", "results.latency_spread": _T + " (p90 / p50)",
    "results.latency_noisy": _T + " (latency_spread > 1.5)",
    # schema group capture
    "results.capture_s": _T, "results.capture_buckets.*.capture_s": _T,
    # schema group memory
    "results.build_s": _T,
    "results.peak_mem_mib": "CPU: this process's peak resident set, which grows with every cell run before it in "
                            "the same process and with the allocator and libraries of the machine",
    # schema group floor
    "results.floor_ratio": _T + " (p50 / floor_ms)",
    # schema groups serving and anchor: times per request and the rates made of them
    "results.serving_s": _T, "results.output_tokens_per_s": _T, "results.ttft_ms_p*": _T, "results.tpot_ms_p*": _T,
    "results.e2e_ms_p*": _T, "results.gpu_idle_share": _T, "results.requests.*.queue_ms": _T,
    "results.requests.*.prefill_ms": _T, "results.requests.*.ttft_ms": _T, "results.requests.*.tpot_ms": _T,
    "results.requests.*.e2e_ms": _T, "results.anchor_serving_s": _T, "results.anchor_output_tokens_per_s": _T,
    "results.anchor_ttft_ms_p*": _T, "results.anchor_tpot_ms_p*": _T, "results.anchor_e2e_ms_p*": _T,
    # schema group env: where and when, not what (torch_version and transformers_version stay compared: both
    # records must come from the same environment for the comparison to mean anything)
    "results.device_name": "the machine", "results.git_sha": "the commit", "results.timestamp": "the clock",
    "results.moecg_version": "the package's version string: names the release, like git_sha",
    # failure group
    "results.traceback": "file paths and line numbers, which move with any refactor (error and phase are compared)",
    # the record's own
    "no_results": "the log's tail, kept for reading",
}
# serving records (workload poisson | trace) only: requests are admitted when their arrival time has passed on the
# wall clock, so how many decode steps run and which requests share each one depends on how fast each step ran (two
# records of 0ce78b5: readme/poisson ran 325 vs 476 decode steps, readme/trace 226 vs 374). The per-request and
# total counts (output_tokens, routed_assignments, token agreement, load imbalance) do not, and stay compared; so do
# padding_waste, drop_rate_by_batch and capture_buckets, which would move with the steps too but are constant in
# these CPU records (no graphs on CPU: no padding; dropless: no drops).
_RT = "a serving run's step schedule: set by when requests arrive on the wall clock against the step times"
SERVING_EXCLUDED = {"results.decode_steps": _RT, "results.step_batch": _RT, "results.batch_size_hist": _RT,
                    "results.bucket_hist": _RT}


def _flat(x, path="", out=None) -> dict:
    out = {} if out is None else out
    if isinstance(x, dict) and x:
        for k, v in x.items():
            _flat(v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(x, list) and x:
        out[f"{path}.len"] = len(x)
        for i, v in enumerate(x):
            _flat(v, f"{path}.{i}", out)
    else:
        out[path] = x
    return out


def _excluded(path: str, pats) -> bool:
    return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(path, p + ".*") for p in pats)


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _generic(path: str) -> str:
    """matrix-wide name of a path: list indices and bucket keys as *"""
    return ".".join("*" if p.isdigit() else p for p in path.split("."))


def _load(d: Path) -> dict:
    return {json.loads(f.read_text())["cell"]: json.loads(f.read_text()) for f in sorted(d.glob("*.json"))
            if not f.name.startswith("_")}


def diff(args) -> int:
    A, B = _load(Path(args.a)), _load(Path(args.b))
    names = [c for c in A if c in B]
    missing = [] if args.common else [c for c in A if c not in B]
    only_b = [c for c in B if c not in A]
    differing, added, removed = {}, defaultdict(list), defaultdict(list)
    for c in names:
        ra, rb = A[c], B[c]
        serving = any((r.get("results") or {}).get("workload") in ("poisson", "trace") for r in (ra, rb))
        pats = list(EXCLUDED) + (list(SERVING_EXCLUDED) if serving else [])
        fa = {p: v for p, v in _flat(ra).items() if not _excluded(p, pats)}
        fb = {p: v for p, v in _flat(rb).items() if not _excluded(p, pats)}
        for p in fa.keys() - fb.keys():
            removed[_generic(p)].append(c)
        for p in fb.keys() - fa.keys():
            added[_generic(p)].append(c)
        d = [(p, fa[p], fb[p]) for p in fa if p in fb and not _same(fa[p], fb[p])]
        if d:
            differing[c] = d
    lines = _report(args, A, B, len(names), missing, only_b, differing, added, removed)
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(text + "\n")
    return 1 if differing or removed or missing else 0


def _short(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _tally(recs: dict) -> str:
    st = [(r.get("results") or {}).get("status", "no results.json") for r in recs.values()]
    return ", ".join(f"{st.count(k)} {k}" for k in sorted(set(st)))


def _report(args, A, B, n, missing, only_b, differing, added, removed) -> list[str]:
    man = [json.loads((Path(d) / "_manifest.json").read_text()) if (Path(d) / "_manifest.json").is_file() else {}
           for d in (args.a, args.b)]
    L = [f"# record diff: A = {man[0].get('commit', args.a)} ({man[0].get('sha', '?')[:7]}), "
         f"B = {man[1].get('commit', args.b)} ({man[1].get('sha', '?')[:7]})", "",
         f"- cells compared: {n}", f"- equal: {n - len(differing)}", f"- differing: {len(differing)}",
         f"- fields added in B: {len(added)}", f"- fields removed in B: {len(removed)}",
         f"- cells missing in B: {len(missing)}", f"- cells only in B: {len(only_b)}",
         *(f"- {side}, every record: {_tally(recs)}" for side, recs in (("A", A), ("B", B))),
         f"- fields not compared: {len(EXCLUDED)} (+{len(SERVING_EXCLUDED)} in serving records), listed at the end",
         ""]
    if differing:
        by_path = defaultdict(list)
        for c, d in differing.items():
            for p, _, _ in d:
                by_path[_generic(p)].append(c)
        L += ["## differing fields (generic path: cells)", ""]
        L += [f"- `{p}`: {len(cs)} cells, e.g. {cs[0]}" for p, cs in sorted(by_path.items())]
        L += ["", "## differing values (first 5 per cell)", ""]
        for c, d in differing.items():
            L.append(f"- {c}: " + "; ".join(f"`{p}` {_short(a)} -> {_short(b)}" for p, a, b in d[:5])
                     + (f"; ... {len(d) - 5} more" if len(d) > 5 else ""))
        L.append("")
    for title, paths in (("removed fields (only in A): a failure", removed), ("added fields (only in B)", added)):
        if paths:
            L += [f"## {title}", ""] + [f"- `{p}`: {len(cs)} cells, e.g. {cs[0]}" for p, cs in sorted(paths.items())]
            L.append("")
    for title, cs in (("cells missing in B", missing), ("cells only in B", only_b)):
        if cs:
            L += [f"## {title}", ""] + [f"- {c}" for c in cs] + [""]
    L += ["## fields not compared", "", "| path | records | why |", "|---|---|---|"]
    L += [f"| `{p}` | all | {why} |" for p, why in EXCLUDED.items()]
    L += [f"| `{p}` | serving | {why} |" for p, why in SERVING_EXCLUDED.items()]
    L += ["", "RESULT: " + ("DIFFERENT" if differing or removed or missing else "SAME (every compared field equal)")]
    return L


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run every cell at one commit")
    r.add_argument("--commit", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--only", nargs="*", help="cell name globs (e.g. 'matrix/mixtral_tiny/*' 'readme/*')")
    r.add_argument("--keep", action="store_true", help="keep the temporary tree and run dirs")
    d = sub.add_parser("diff", help="compare two records")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--md", help="also write the report here")
    d.add_argument("--common", action="store_true", help="compare only cells present in both (a subset record)")
    sub.add_parser("cells", help="list the cells")
    if len(sys.argv) > 1 and sys.argv[1] == "_inproc":
        return _inproc(*sys.argv[2:6])
    a = ap.parse_args(argv)
    if a.cmd == "cells":
        for x in cells():
            print(x["cell"], " ".join(x["args"]))
        return 0
    return record(a) if a.cmd == "record" else diff(a)


if __name__ == "__main__":
    raise SystemExit(main())
