"""`dispatch=<name>`: one option per dispatcher in moecg.dispatch.REGISTRY, its keys the dispatcher's own dataclass
fields with their defaults (`dispatch.capacity_factor` is `Capacity.capacity_factor`), plus `prefill`.

A dispatcher's options and defaults live on its class; this module only mirrors them for Hydra, so a new
dispatcher is on the CLI once it is registered.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from moecg.config.readers import PlanError, plain
from moecg.dispatch import REGISTRY, Dispatcher, make_dispatcher

# dispatch.prefill: the eager prefill's dispatcher: same, or e.g. dropless to keep prompt tokens undropped
PREFILL = "same"


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory)
    return dataclasses.field(default=f.default)


def config_class(cls: type[Dispatcher]) -> type:
    """The `dispatch=<cls.name>` node: name, the dispatcher's init fields (its defaults, typed by make_dispatcher,
    so left `Any` to OmegaConf), prefill."""
    own = [(f.name, Any, _default(f)) for f in dataclasses.fields(cls) if f.init]
    return dataclasses.make_dataclass(
        f"{cls.__name__}DispatchConfig",
        [("name", Any, dataclasses.field(default=cls.name)), *own,
         ("prefill", Any, dataclasses.field(default=PREFILL))],
        namespace={"__doc__": f"dispatch={cls.name}: the options of {cls.__module__}.{cls.__qualname__} (its dataclass "
                              "fields and their comments) and dispatch.prefill"})


def options() -> dict[str, type]:
    """dispatch=<name> -> its node class, for every registered dispatcher."""
    return {name: config_class(cls) for name, cls in REGISTRY.items()}


def resolve_dispatch(node) -> tuple[Dispatcher, Dispatcher | None]:
    """(the dispatcher, the prefill's when it differs): options it does not read are refused (make_dispatcher),
    values are type-checked against its fields."""
    d = plain(node)
    name = d.get("name")
    if not isinstance(name, str) or name not in REGISTRY:
        raise PlanError(f"dispatch={name!r}: choose one of {', '.join(sorted(REGISTRY))}")
    try:
        dispatcher = make_dispatcher(name, **{k: v for k, v in d.items() if k not in ("name", "prefill")})
    except (ValueError, TypeError) as e:
        raise PlanError(str(e)) from None
    prefill = d.get("prefill", PREFILL)
    if not (prefill is None or isinstance(prefill, str)):
        raise PlanError(f"dispatch.prefill={prefill!r}: choose same or one of {', '.join(sorted(REGISTRY))}")
    if prefill in (None, "same", name):
        return dispatcher, None
    if prefill in REGISTRY:
        return dispatcher, make_dispatcher(prefill)
    raise PlanError(f"dispatch.prefill={prefill!r}: choose same or one of {', '.join(sorted(REGISTRY))}")
