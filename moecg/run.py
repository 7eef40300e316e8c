"""`python -m moecg.run [overrides]`: one experiment (or a Hydra multirun sweep) -> results.json + a summary table."""
from __future__ import annotations

import math
import os
import re
import shutil
import sys
import traceback
from dataclasses import fields, is_dataclass
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, ConfigCompositionException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

import moecg.config  # noqa: F401  (registers the config groups before Hydra composes)
from moecg.callbacks import one_line
from moecg.config.dispatch import options as dispatch_options
from moecg.config.readers import unknown_key
from moecg.config.root import RootConfig
from moecg.config.workload import WORKLOADS
from moecg.harness import Phases, plan_of, run_experiment
from moecg.logger import NullLogger, make_logger
from moecg.parallel.job import RankJob
from moecg.report import write_json
from moecg.schema import SERVING, SUMMARY, axes_from_config, failed_record


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
    for k in SUMMARY:
        if k in SERVING and res.get(k) is None:
            continue  # a fixed batch (or no anchor): the serving fields do not apply
        table.add_row(k, _fmt(res.get(k)))
    console = Console()
    console.print(table)
    caveat = eager_caveat(res)
    if caveat:
        console.print(f"[yellow]{caveat}[/yellow]")


def eager_caveat(res: dict) -> str | None:
    """The summary's warning whenever no CUDA graph ran (no capture, or capture.backend=emulate's CPU stand-in):
    the latencies, and any comparison with transformers, are then eager times of this device."""
    dev, anchor = res.get("device"), res.get("anchor_output_tokens_per_s") is not None
    beside = " (transformers' continuous batching beside it, too)" if anchor else ""
    if not res.get("captured"):
        return (f"No CUDA graphs were captured on {dev}: every strategy ran eagerly with dispatch={res.get('dispatch')}. "
                f"Latencies are eager {dev} times{beside}; drop rates, load imbalance and fidelity are real.")
    if res.get("capture_backend") != "cuda":
        return (f"No CUDA graph ran on {dev}: capture.backend={res.get('capture_backend')} replays the captured pieces "
                f"eagerly (a stand-in that tests the capture logic). Latencies are eager {dev} times{beside}; drop "
                "rates, load imbalance and fidelity are real.")
    return None


def _job_dir(cfg) -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - called outside Hydra (tests)
        return Path(".")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    # under torchrun (parallel.ep > 1) this process is one rank: rank 0 writes, the first rank that fails ends the job
    job = RankJob.from_env(_job_dir(cfg))
    job.out_dir.mkdir(parents=True, exist_ok=True)
    logger = NullLogger()  # the real one is made once there are results: a refused or failed run leaves no wandb run
    failed = None
    try:
        if job.world > 1 and _is_multirun():
            raise RuntimeError(f"a multirun under torchrun ({job.world} processes): each configuration needs every rank, "
                               "so launch one torchrun per configuration (a shell loop over the sweep's values)")
        if _isolate(cfg):
            res = _run_isolated(cfg)
        else:
            res = _run_with_progress(cfg, job)
        job.barrier()  # every rank finished: only then is the job ok
        if job.leads:
            results_path = job.out_dir / cfg.results_file
            res["status"] = "ok"
            res["config"] = OmegaConf.to_container(cfg, resolve=True)
            write_json(results_path, res)
            logger = make_logger(cfg, job.out_dir)
            logger.log_results(res)
            print_summary(res)
            print(f"results: {results_path}")
    except Exception as e:
        if job.world > 1:
            failed = e
        else:
            # a failed job is recorded and reported; in a multirun the other jobs still run and
            # moecg.callbacks.FailedJobsReport lists the failed ones at the end (exit 1)
            _record_failure(cfg, e, job.out_dir / cfg.results_file)
            if not _is_multirun():
                raise SystemExit(1)
    finally:
        logger.finish()
    if failed is not None:
        job.fail(lambda e, path, prefix: _record_failure(cfg, e, path, prefix), failed, cfg.results_file)
    job.close()


def _run_with_progress(cfg, job: RankJob | None = None) -> dict:
    from rich.progress import Progress

    job = job or RankJob(Path("."))
    quiet = None if job.leads else open(os.devnull, "w")  # noqa: SIM115 - the other ranks' phases: rank 0 speaks
    phases = Phases(out=quiet)
    plan = plan_of(cfg, phases)  # validated first: the bar's total is read from the plan, not the raw config
    group = job.start(plan, phases)
    if not job.leads:
        return run_experiment(plan, phases=phases, group=group)
    with Progress(transient=True) as bar:
        if plan.serving:
            task = bar.add_task("requests served", total=plan.workload.n_requests)
        else:
            task = bar.add_task("decode (timed repeats)", total=plan.measure.repeats * max(plan.new_tokens - 1, 1))
        return run_experiment(plan, progress=lambda: bar.advance(task), phases=phases, group=group)


def _record_failure(cfg, e: BaseException, results_path: Path, prefix: str = "") -> None:
    """results.json with `status: failed`, the full `error` and `traceback`; ONE line on stderr.

    prefix: `rank r of R: ` for the rank of an expert-parallel job that failed first."""
    config = OmegaConf.to_container(cfg, resolve=True)
    err = failed_record(prefix + (e.error if isinstance(e, JobProcessError) else f"{type(e).__name__}: {e}"),
                        getattr(e, "moecg_phase", "setup"),
                        getattr(e, "child_traceback", None) or "".join(traceback.format_exception(e)),
                        config, axes_from_config(config))
    write_json(results_path, err)
    print(f"moecg: job failed: {one_line(err['error'])} (details and traceback: {results_path})", file=sys.stderr)


class JobProcessError(RuntimeError):
    """A job that failed in its own process (`isolate`): carries the child's error and traceback."""

    def __init__(self, error: str, child_traceback: str | None = None):
        super().__init__(error)
        self.error, self.child_traceback = error, child_traceback


def _isolate(cfg) -> bool:
    iso = cfg.get("isolate", "auto")
    if iso == "auto":
        # a failed capture poisons the CUDA context: sweep jobs on a GPU run in a child process each,
        # unless the launcher already starts one process per job (submitit, local or SLURM)
        if not _is_multirun() or _launcher_has_process_per_job():
            return False
        import torch

        return torch.cuda.is_available()
    return bool(iso)


# launchers whose every job is already its own process (hydra-submitit-launcher: submitit_local, submitit_slurm)
PROCESS_PER_JOB_LAUNCHERS = ("hydra_plugins.hydra_submitit_launcher.",)


def _launcher_has_process_per_job() -> bool:
    try:
        target = str(HydraConfig.get().launcher.get("_target_") or "")
    except Exception:  # noqa: BLE001 - outside Hydra
        return False
    return target.startswith(PROCESS_PER_JOB_LAUNCHERS)


# moecg's defaults for `hydra/launcher=submitit_slurm`: one GPU per job (a job measures one configuration on one
# GPU), one task, a time limit. Any field stays overridable: hydra.launcher.partition=gpu hydra.launcher.timeout_min=90
SLURM_DEFAULTS = {"gpus_per_node": 1, "tasks_per_node": 1, "nodes": 1, "timeout_min": 30, "name": "moecg"}


def _register_launcher_defaults() -> None:
    """Re-store the submitit plugin's `submitit_slurm` node with SLURM_DEFAULTS.

    A yaml of the same name in conf/hydra/launcher/ cannot extend the plugin's config (its defaults list would
    name itself; Hydra only merges it through the deprecated automatic schema matching, with a warning), so the
    plugin's own dataclass is stored again with moecg's values. Hydra's plugin scan runs (and re-runs the
    plugin's config module) once per process in Plugins.instance(), so it is done first.
    """
    try:
        from hydra.core.config_store import ConfigStore
        from hydra.core.plugins import Plugins

        Plugins.instance()
        from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
    except ImportError:  # the launcher plugin is not installed: nothing to adjust
        return
    ConfigStore.instance().store(group="hydra/launcher", name="submitit_slurm", node=SlurmQueueConf(**SLURM_DEFAULTS),
                                 provider="submitit_launcher")


def _child(cfg_dict, q) -> None:
    try:
        q.put(("ok", _run_with_progress(OmegaConf.create(cfg_dict))))
    except BaseException as e:  # noqa: BLE001
        q.put(("err", (f"{type(e).__name__}: {e}", traceback.format_exc(), getattr(e, "moecg_phase", None))))


def _run_isolated(cfg) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(OmegaConf.to_container(cfg, resolve=True), q))
    p.start()
    import queue

    status, payload = "err", ("JobProcessError: the job's process died without a result (killed, or a crash inside "
                              "CUDA)", None)
    while True:  # poll, so a child that dies hard (segfault, OOM kill) cannot hang the sweep
        try:
            status, payload = q.get(timeout=5)
            break
        except queue.Empty:
            if not p.is_alive():
                break
    p.join()
    if status != "ok":
        error, tb, *phase = payload
        if tb is None and p.exitcode:
            error = f"{error}, exit code {p.exitcode}"
        err = JobProcessError(error, tb)
        if phase and phase[0]:
            err.moecg_phase = phase[0]
        raise err
    return payload


def _is_multirun() -> bool:
    try:
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # noqa: BLE001
        return False


def cli() -> None:
    """`python -m moecg.run`: Hydra's entry, with the refusals Hydra raises before moecg's code runs (an override of
    a key the chosen group option does not have, a launcher that cannot run here) worded as one line with the fix.

    Hydra prints its own errors unless HYDRA_FULL_ERROR=1, so it is set while Hydra runs and the error is caught
    here; a user who set HYDRA_FULL_ERROR=1 gets Hydra's full traceback, as always."""
    _register_launcher_defaults()
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        main()
        return
    before = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except Exception as e:  # noqa: BLE001 - Hydra's and its launcher's own errors: moecg's job errors never get here
        line = override_hint(e) or slurm_hint(e)
        if line is not None:
            print(f"moecg: {line}", file=sys.stderr)
        elif isinstance(e, CompactHydraException):  # as Hydra prints it
            print(str(e), file=sys.stderr)
            if isinstance(e.__cause__, OmegaConfBaseException):
                print(str(e.__cause__), file=sys.stderr)
        else:
            traceback.print_exception(e)
        raise SystemExit(1) from None
    finally:
        if before is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


# group -> its options' node classes, for a key the chosen option lacks (the other options may have it)
def _option_nodes() -> dict[str, dict[str, type]]:
    return {"workload": dict(WORKLOADS), "dispatch": dispatch_options(),
            **{f.name: {"": f.default_factory} for f in fields(RootConfig) if is_dataclass(f.default_factory)}}


def override_hint(e: BaseException) -> str | None:
    """One line for Hydra's refusal of an override whose key the config does not have (`workload.rate=8` with
    workload=fixed: "Key 'rate' is not in struct"): the group option that has it, or the nearest key; None for any
    other error (Hydra's own message stands)."""
    cause = e.__cause__
    key = getattr(cause, "full_key", None)
    if not isinstance(e, ConfigCompositionException) or not isinstance(cause, (ConfigAttributeError, ConfigKeyError)) \
            or not key:
        return None
    given = re.search(r"use \+(\S+)", str(e))
    given = given.group(1) if given else key
    group, _, leaf = key.rpartition(".")
    if not group:
        return unknown_key(key, None, [f.name for f in fields(RootConfig)]).args[0]
    nodes = _option_nodes().get(group)
    if nodes is None or "." in group:
        return None
    takers = [name for name, cls in nodes.items() if name and leaf in {f.name for f in fields(cls)}]
    chosen = getattr(getattr(cause, "object_type", None), "__name__", None)
    chosen = next((name for name, cls in nodes.items() if cls.__name__ == chosen), None)
    if takers:
        picks = " or ".join(f"{group}={t}" for t in takers)
        return (f"{key} belongs to {picks}{f', not {group}={chosen}' if chosen else ''}: add {group}={takers[0]} "
                f"(python -m moecg.run {group}={takers[0]} {given})")
    known = sorted({f.name for cls in nodes.values() for f in fields(cls)} - {"name"})
    return unknown_key(key, group, known).args[0]


def slurm_hint(e: BaseException) -> str | None:
    """One line for submitit's SLURM launcher started where there is no SLURM (it raises from inside the launch,
    "Could not detect srun", after Hydra has composed the sweep)."""
    frames = traceback.extract_tb(e.__traceback__)
    if shutil.which("srun") is None and any("submitit" in f.filename and "slurm" in f.filename for f in frames):
        return ("hydra/launcher=submitit_slurm: not on a SLURM cluster (no srun on PATH): use "
                "hydra/launcher=submitit_local to run the sweep on this machine, or run on the cluster's login node")
    return None


if __name__ == "__main__":
    cli()
