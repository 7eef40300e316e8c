"""Run loggers: wandb (offline by default) or a do-nothing logger with the same methods (nanochat's DummyWandb).

Logging never breaks a run: every wandb call is guarded and `finish()` is called from the runner's `finally`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


class NullLogger:
    def log_results(self, res: dict) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger:
    def __init__(self, cfg, out_dir: Path):
        import wandb
        from omegaconf import OmegaConf

        lc = cfg.logger
        os.environ.setdefault("WANDB_SILENT", "true")
        group = lc.get("group") or _sweep_group()
        w = cfg.get("workload") or {}
        load = {"poisson": f"poisson{w.get('rate')}-mb{w.get('max_batch')}",
                "trace": f"trace-mb{w.get('max_batch')}"}.get(w.get("name"), f"bs{cfg.batch_size}")
        name = f"{cfg.model.preset or 'local'}-{cfg.strategy.name}-{cfg.dispatch.name}-{load}"
        if cfg.dispatch.get("capacity_factor") is not None:
            name += f"-cf{cfg.dispatch.capacity_factor}"
        self.wandb = wandb
        self.run = wandb.init(project=lc.project, entity=lc.get("entity"), mode=lc.get("mode", "offline"),
                              dir=str(out_dir), group=group, name=name,
                              tags=[cfg.strategy.name, cfg.dispatch.name, w.get("name", "fixed"),
                                    *(lc.get("tags") or [])],
                              config=OmegaConf.to_container(cfg, resolve=True), reinit="finish_previous")

    def log_results(self, res: dict) -> None:
        try:
            wb = self.wandb
            batch = res.get("step_batch")  # serving: live requests of each step
            for i, ms in enumerate(res.get("step_ms") or []):
                row = {"step_ms": ms, "decode_step": i}
                if batch:
                    row["batch_size"] = batch[i]
                self.run.log(row)
            per_layer = res.get("per_layer_drop_rate") or []
            table = wb.Table(columns=["layer", "drop_rate"], data=[[i, r] for i, r in enumerate(per_layer)])
            self.run.log({"per_layer_drop_rate": table,
                          "per_layer_drop_rate_bar": wb.plot.bar(table, "layer", "drop_rate",
                                                                 title="drop rate per layer")})
            for k, v in res.items():
                if isinstance(v, (int, float, str, bool)) or v is None:
                    self.run.summary[k] = v
        except Exception as e:  # noqa: BLE001 - logging must never break a run
            print(f"moecg: wandb logging failed ({type(e).__name__}: {e}); the run's results.json is intact",
                  file=sys.stderr)

    def finish(self) -> None:
        try:
            offline, where = self.run.settings.mode == "offline", self.run.settings.sync_dir
            self.run.finish()
        except Exception:  # noqa: BLE001
            return
        if offline:  # nothing was uploaded: say where the run is and how to upload it
            print(f"moecg: wandb offline run in {where}; upload it with: wandb sync {where}")


def _sweep_group():
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        return hc.sweep.dir if hc.mode.name == "MULTIRUN" else None
    except Exception:  # noqa: BLE001
        return None


def make_logger(cfg, out_dir: Path):
    name = cfg.logger.name
    if name == "none":
        return NullLogger()
    if name == "wandb":
        try:
            return WandbLogger(cfg, out_dir)
        except Exception as e:  # noqa: BLE001
            print(f"moecg: wandb unavailable ({type(e).__name__}: {e}); continuing without logging", file=sys.stderr)
            return NullLogger()
    raise ValueError(f"logger={name!r}: choose none or wandb")
