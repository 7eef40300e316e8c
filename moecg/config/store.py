"""Every config group registered with Hydra's ConfigStore (structured configs), from the registries themselves:
`model/<preset>` per moecg.models.zoo.PRESETS key and `model/local`, `dispatch/<name>` per moecg.dispatch.REGISTRY
entry, `strategy/<name>` per moecg.capture.plan.STRATEGIES entry, `workload/<name>` per moecg.config.workload
class, and the root schema `moecg` that conf/config.yaml lists first. Each default lives in its dataclass.
"""
from __future__ import annotations

from hydra.core.config_store import ConfigStore

from moecg.config import dispatch, model, strategy
from moecg.config.root import RootConfig
from moecg.config.workload import WORKLOADS

ROOT = "moecg"  # the root schema's name in conf/config.yaml's defaults list


def options() -> dict[str, tuple[str, ...]]:
    """The options of each group moecg registers, as `group=<option>` takes them."""
    return {"model": tuple(model.options()), "dispatch": tuple(dispatch.options()),
            "strategy": tuple(strategy.options()), "workload": tuple(WORKLOADS)}


def register() -> None:
    """Store every group's options (idempotent: a second call stores the same nodes again)."""
    cs = ConfigStore.instance()
    cs.store(name=ROOT, node=RootConfig)
    for name, node in model.options().items():
        cs.store(group="model", name=name, node=node)
    for name, node in dispatch.options().items():
        cs.store(group="dispatch", name=name, node=node)
    for name, (node, package) in strategy.options().items():
        cs.store(group="strategy", name=name, node=node, package=package)
    for name, node in WORKLOADS.items():
        cs.store(group="workload", name=name, node=node)
