"""docs/extending.md's contributor test, run: its family, dispatcher and metric examples execute as written, and what
they add is found by the rest of moecg (the zoo and adapters, the dispatcher registry and transformers' experts
interface, the run plan and harness) with nothing else to edit."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from moecg.dispatch import REGISTRY, attach, detach, make_dispatcher
from moecg.engine import DecodeEngine
from moecg.models import adapter, build_model, zoo

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def _example(kind: str) -> str:
    blocks = dict((k, code) for code, k in re.findall(r"```python\n(# extending: (\w+)\n.*?)```", DOC.read_text(),
                                                      re.S))
    return blocks[kind]


@pytest.fixture
def dense_dispatcher():
    exec(compile(_example("dispatcher"), "docs/extending.md (dispatcher)", "exec"), {})
    yield REGISTRY["dense"]
    REGISTRY.pop("dense", None)


@pytest.fixture
def phimoe_family():
    saved = (dict(zoo.FAMILIES), dict(zoo.PRESETS), dict(adapter.ADAPTERS), dict(adapter.ROUTER_KINDS))
    exec(compile(_example("family"), "docs/extending.md (family)", "exec"), {})
    yield "phimoe_tiny"
    for live, old in zip((zoo.FAMILIES, zoo.PRESETS, adapter.ADAPTERS, adapter.ROUTER_KINDS), saved):
        live.clear()
        live.update(old)


def _tokens(model, dispatcher, prompts, new_tokens=6):
    attach(model, dispatcher, max_rows=prompts.shape[0])
    try:
        return DecodeEngine(model, prompts.shape[1] + new_tokens, prompts.shape[0]).generate(
            prompts, new_tokens, timing=False).tokens
    finally:
        detach(model)


def test_a_dispatcher_is_one_file(dense_dispatcher):
    """The example's dispatcher is registered by its decorator alone, takes its option from its fields, and computes
    what HF's own experts loop computes (dynamic), on a family with a shared expert too."""
    assert dense_dispatcher.options() == ("combine_fp32",)
    assert make_dispatcher("dense", combine_fp32=False).combine_fp32 is False
    for preset in ("mixtral_tiny", "qwen2_moe_tiny"):
        model = build_model(preset, dtype="float32", device="cpu", seed=0).model
        prompts = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
        want = _tokens(model, make_dispatcher("dynamic"), prompts)
        got = _tokens(model, make_dispatcher("dense"), prompts)
        assert torch.equal(want, got), preset


def test_a_family_is_an_adapter_entry_and_a_preset(phimoe_family):
    """The example's family runs through the plan and the harness as `model.preset=<preset>` (HF's modules, graphs
    emulated), and the fused step refuses it before any work with the router kind named."""
    from hydra import compose, initialize_config_dir

    import moecg
    from moecg.harness import Phases, run_experiment
    from moecg.plan import PlanError, resolve_plan

    class Quiet(Phases):
        def say(self, msg):
            pass

    def cfg(*extra):
        with initialize_config_dir(config_dir=str(Path(moecg.__file__).parent / "conf"), version_base="1.3"):
            return compose(config_name="config", overrides=[
                f"model.preset={phimoe_family}", "strategy=full", "capture.backend=emulate", "batch_size=2",
                "prompt_len=4", "new_tokens=4", "measure.repeats=1", "measure.skip_steps=0",
                "measure.eager_baseline=false", "capture.warmup=1", *extra])

    record = run_experiment(resolve_plan(cfg()), phases=Quiet())
    assert record["status"] == "ok" and record["family"] == "phimoe"
    assert record["token_agreement_vs_eager"] == 1.0
    with pytest.raises(PlanError, match="sparsemixer"):
        resolve_plan(cfg("capture.kernels=fused"))


def test_a_metric_is_its_component_and_a_schema_entry():
    exec(compile(_example("metric"), "docs/extending.md (metric)", "exec"), {})  # the example asserts its own value
