"""moecg.config: the config groups as typed dataclasses, registered with Hydra's ConfigStore on import.

One module per group (model, dispatch, strategy, capture, measure, workload, parallel; root: the run's own keys and
the groups), each a dataclass with a comment per field and the group's one set of defaults; `resolve()` (or the
run plan, for combinations across groups) types every value and refuses a bad one with a `PlanError` that names
the key and the fix (moecg.config.readers). The options of model, dispatch and strategy come from the registries
(zoo presets, dispatchers, strategies): conf/ holds only the root's defaults list, the logger options and the
experiments. Importing this package registers the groups (Hydra's idiom: a ConfigStore is filled at import), so
anything that composes the config imports it first (moecg.run and moecg.plan do).
"""
from moecg.config.readers import PlanError
from moecg.config.store import options, register

register()

__all__ = ["PlanError", "options", "register"]
