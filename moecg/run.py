"""`python -m moecg.run [overrides]`: one experiment (or a Hydra multirun sweep) -> results.json + a summary table."""
from __future__ import annotations

import json
import math
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from moecg.logger import make_logger

TABLE_FIELDS = ["model", "strategy", "dispatch", "capacity_factor", "batch_size", "bucket", "captured",
                "ms_per_token_p50", "ms_per_token_p90", "tokens_per_s", "eager_ms_per_token_p50", "speedup_vs_eager",
                "capture_s", "graph_mem_mib", "floor_ms", "floor_ratio", "drop_rate", "dropped_prob_mass",
                "expert_load_imbalance", "token_agreement_vs_eager", "token_agreement_forced_vs_eager",
                "max_logit_diff_vs_eager", "heldout_bpb",
                "heldout_bpb_delta_vs_dropless"]


def _fmt(v):
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def print_summary(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"moecg: {res.get('model')} / strategy={res.get('strategy')} / dispatch={res.get('dispatch')}")
    table.add_column("field")
    table.add_column("value")
    for k in TABLE_FIELDS:
        if k in res:
            table.add_row(k, _fmt(res[k]))
    console = Console()
    console.print(table)
    if not res.get("captured"):
        console.print(f"[yellow]No CUDA graphs were captured on {res.get('device')}: every strategy ran eagerly with "
                      f"dispatch={res.get('dispatch')}. Latencies are eager {res.get('device')} times; drop rates, "
                      "load imbalance and fidelity are real.[/yellow]")


def _job_dir(cfg) -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - called outside Hydra (tests)
        return Path(".")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    out_dir = _job_dir(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    logger = make_logger(cfg, out_dir)
    results_path = out_dir / cfg.results_file
    try:
        if _isolate(cfg):
            res = _run_isolated(cfg)
        else:
            res = _run_with_progress(cfg)
        res["status"] = "ok"
        res["config"] = OmegaConf.to_container(cfg, resolve=True)
        results_path.write_text(json.dumps(res, indent=2, default=str))
        logger.log_results(res)
        print_summary(res)
        print(f"results: {results_path}")
    except Exception as e:
        # a failed job is recorded and reported; in a multirun the other jobs still run
        err = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
               "strategy": cfg.strategy.name, "dispatch": cfg.dispatch.name, "batch_size": cfg.batch_size,
               "config": OmegaConf.to_container(cfg, resolve=True)}
        results_path.write_text(json.dumps(err, indent=2, default=str))
        print(f"moecg: job failed: {err['error']}\n(recorded in {results_path})", file=sys.stderr)
        if not _is_multirun():
            raise SystemExit(1)
    finally:
        logger.finish()


def _run_with_progress(cfg) -> dict:
    from rich.progress import Progress

    from moecg.measure import run_experiment

    with Progress(transient=True) as bar:
        task = bar.add_task("decode (timed repeats)", total=int(cfg.measure.repeats) * max(cfg.new_tokens - 1, 1))
        return run_experiment(cfg, progress=lambda: bar.advance(task))


def _isolate(cfg) -> bool:
    iso = cfg.get("isolate", "auto")
    if iso == "auto":
        # a failed capture poisons the CUDA context: sweep jobs on a GPU run in a child process each
        import torch

        return _is_multirun() and torch.cuda.is_available()
    return bool(iso)


def _child(cfg_dict, q) -> None:
    try:
        q.put(("ok", _run_with_progress(OmegaConf.create(cfg_dict))))
    except BaseException as e:  # noqa: BLE001
        q.put(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _run_isolated(cfg) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(OmegaConf.to_container(cfg, resolve=True), q))
    p.start()
    import queue

    status, payload = "err", "the job's process died without a result (killed, or a crash inside CUDA)"
    while True:  # poll, so a child that dies hard (segfault, OOM kill) cannot hang the sweep
        try:
            status, payload = q.get(timeout=5)
            break
        except queue.Empty:
            if not p.is_alive():
                break
    p.join()
    if status != "ok":
        print(payload, file=sys.stderr)
        raise RuntimeError(f"isolated job failed: {payload.splitlines()[0]}")
    return payload


def _is_multirun() -> bool:
    try:
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":
    main()
