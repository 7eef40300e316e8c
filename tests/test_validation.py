"""Every input examined before any work: the bad inputs a new user tried, each refused in the plan (or at the CLI
before Hydra composes) with one line naming the key and the fix; strict, atomic results.json; and a seeded config
fuzzer over every config group and value kind.

The fuzzer: `MOECG_FUZZ_CASES=N` runs N cases (default 200), `MOECG_FUZZ_SEED=S` replays a seed (printed on failure).
It composes in-process (Hydra compose once per group option, then the cases' values applied the way Hydra applies
overrides: its own override parser and OmegaConf.update in struct mode; a test checks this equals a real compose)
and resolves the plan; no model is built.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import re
import runpy
import shutil
import sys
import time
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

import moecg
from moecg import run
from moecg.config import options
from moecg.config.capture import CaptureConfig
from moecg.config.dispatch import options as dispatch_options
from moecg.config.measure import MeasureConfig
from moecg.config.model import ModelConfig
from moecg.config.parallel import ParallelConfig
from moecg.config.root import RunConfig
from moecg.config.workload import WORKLOADS
from moecg.plan import PlanError, resolve_plan
from moecg.report import write_json

CONF = str(Path(moecg.__file__).parent / "conf")


def _cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _refused(match, *overrides):
    with pytest.raises(PlanError, match=match) as e:
        resolve_plan(_cfg(*overrides))
    assert "\n" not in str(e.value), "errors are one line"
    return str(e.value)


def strict_loads(text: str):
    """json.loads that refuses NaN/Infinity, as every JSON parser but Python's does."""
    def refuse(c):
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(text, parse_constant=refuse)


# -- the table's rows ---------------------------------------------------------------------------------------------
def test_num_layers_only_cuts_the_depth():
    _refused(r"^model\.num_layers=1000: model=qwen3_moe_tiny has 2 decoder layers and num_layers only cuts the depth: "
             r"give 1 to 2", "model=qwen3_moe_tiny", "model.num_layers=1000")
    _refused(r"model\.num_layers=5: model=mixtral_stdlib has 4", "model=mixtral_stdlib", "model.num_layers=5")
    assert resolve_plan(_cfg("model=qwen3_moe_tiny", "model.num_layers=1")).model.layers == 1


@pytest.mark.parametrize("overrides", [("new_tokens=1",), ("new_tokens=2",), ("new_tokens=1", "measure.skip_steps=0"),
                                       ("new_tokens=3", "measure.skip_steps=2")])
def test_new_tokens_leaving_no_timed_decode_step_is_refused(overrides):
    _refused(r"measure\.skip_steps=\d leaves none of the \d decode steps to time \(new_tokens=\d, the first token by "
             r"the prefill\): raise new_tokens to at least \d", *overrides)


def test_new_tokens_with_one_timed_step_runs():
    assert resolve_plan(_cfg("new_tokens=2", "measure.skip_steps=0")).new_tokens == 2


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_non_finite_floats_are_refused_in_the_plan(value):
    _refused(rf"^dispatch\.capacity_factor={value}: dispatch=capacity needs a finite number", "strategy=capacity",
             f"dispatch.capacity_factor={value}")
    _refused(r"^model\.router_skew=.*: must be a finite number", f"model.router_skew={value}")
    _refused(r"^parallel\.timeout_s=.*: must be a", f"parallel.timeout_s={value}")
    _refused(r"^workload\.rate=.*: must be a finite number", "workload=poisson", f"workload.rate={value}")
    _refused(r"^measure\.hbm_bandwidth_gbps=.*: must be a finite number", f"measure.hbm_bandwidth_gbps={value}")


def test_poisson_bounds_requests_and_arrival_span():
    _refused(r"^workload\.n_requests=1000000000: at most", "workload=poisson", "workload.n_requests=1000000000")
    _refused(r"^workload\.rate=1e-06: 32 requests would arrive over", "workload=poisson", "workload.rate=1e-6")


def test_a_batch_that_cannot_fit_is_refused_before_its_prompts_are_drawn():
    _refused(r"this run needs about .* GiB", "batch_size=1000000000")  # was a 128 GB allocation for the prompts


@pytest.mark.parametrize("value", ["abc", "[a,b]", "[1,2.5]", "true"])
def test_buckets_that_are_not_batch_sizes_name_the_key_and_an_example(value):
    _refused(r"^capture\.buckets=.*: must be a list of batch sizes \(integers\), e.g\. capture\.buckets=\[1,2,4,8\]",
             f"capture.buckets={value}")


def test_attn_implementation_this_install_cannot_run_lists_what_it_has():
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        _refused(r"^model\.attn_implementation=flash_attention_2: its package is not installed .*; this install runs "
                 r"eager, sdpa.* for qwen3_moe on cpu: pick one of them", "model=qwen3_moe_tiny",
                 "model.attn_implementation=flash_attention_2")
    _refused(r"^model\.attn_implementation=nope: not an attention implementation transformers knows; this install "
             r"runs eager", "model.attn_implementation=nope")
    assert resolve_plan(_cfg("model.attn_implementation=eager")).model.attn_implementation == "eager"


def _hint(*overrides) -> str:
    with pytest.raises(ConfigCompositionException) as e:
        _cfg(*overrides)
    line = run.override_hint(e.value)
    assert line is not None and "\n" not in line
    return line


def test_a_key_of_another_group_option_names_that_option():
    assert _hint("workload.rate=8") == ("workload.rate belongs to workload=poisson, not workload=fixed: add "
                                        "workload=poisson (python -m moecg.run workload=poisson workload.rate=8)")
    assert _hint("dispatch.capacity_factor=1.5").startswith(
        "dispatch.capacity_factor belongs to dispatch=capacity, not dispatch=dropless: add dispatch=capacity")
    assert _hint("workload=poisson", "workload.file=x.jsonl").startswith("workload.file belongs to workload=trace")


def test_a_misspelt_key_names_the_nearest_one():
    assert _hint("batchsize=4").startswith("batchsize: not a config key (did you mean batch_size?)")
    assert _hint("model.num_layer=2").startswith("model.num_layer: not a key of model (did you mean model.num_layers?)")
    assert _hint("workload=poisson", "workload.rat=2").startswith("workload.rat: not a key of workload (did you mean "
                                                                  "workload.rate?)")


def _cli(monkeypatch, *argv) -> None:
    """python -m moecg.run, in this process (runpy, as `-m` does: Hydra finds conf/ beside the script; its logging
    left alone)."""
    monkeypatch.setattr(sys, "argv", ["moecg.run", *argv, "hydra/job_logging=none", "hydra/hydra_logging=none"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # moecg.run is imported already: runpy says so
            runpy.run_module("moecg.run", run_name="__main__", alter_sys=True)
    finally:
        GlobalHydra.instance().clear()
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().cfg = None


def test_cli_words_hydras_refusal_as_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as e:
        _cli(monkeypatch, "workload.rate=8", f"hydra.run.dir={tmp_path}")
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.strip().splitlines() == [
        "moecg: workload.rate belongs to workload=poisson, not workload=fixed: add workload=poisson "
        "(python -m moecg.run workload=poisson workload.rate=8)"]
    assert "HYDRA_FULL_ERROR" not in os.environ  # restored


@pytest.mark.skipif(shutil.which("srun") is not None, reason="on a SLURM cluster")
def test_submitit_slurm_off_a_cluster_is_one_line(monkeypatch, capsys, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as e:
        _cli(monkeypatch, "-m", "hydra/launcher=submitit_slurm", "model=qwen3_moe_tiny",
             f"hydra.sweep.dir={tmp_path}")
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "moecg: hydra/launcher=submitit_slurm: not on a SLURM cluster (no srun on PATH): use "
        "hydra/launcher=submitit_local to run the sweep on this machine, or run on the cluster's login node"]


def test_eager_caveat_whenever_no_cuda_graph_ran():
    base = {"device": "cpu", "dispatch": "dropless", "anchor_output_tokens_per_s": None}
    assert run.eager_caveat({**base, "captured": False}).startswith("No CUDA graphs were captured on cpu")
    emulated = run.eager_caveat({**base, "captured": True, "capture_backend": "emulate"})
    assert emulated.startswith("No CUDA graph ran on cpu: capture.backend=emulate") and "eager cpu times" in emulated
    anchored = run.eager_caveat({**base, "captured": True, "capture_backend": "emulate",
                                 "anchor_output_tokens_per_s": 80.0})
    assert "transformers' continuous batching beside it" in anchored
    assert run.eager_caveat({**base, "device": "cuda", "captured": True, "capture_backend": "cuda"}) is None


def test_serving_spread_compares_steps_of_equal_rows():
    from moecg.serving import Step, rows_spread

    def steps(rows, times):
        t, out = 0.0, []
        for d in times:
            out.append(Step(t, t + d, batch=rows, rows=rows))
            t += d + 0.001
        return out

    # a bigger batch is slower, and that is no noise: each rows value is steady
    assert rows_spread(steps(1, [1.0] * 6) + steps(8, [4.0] * 6)) == pytest.approx(1.0)
    assert rows_spread(steps(4, [1.0] * 5 + [3.0] * 3)) > 1.5  # one rows value, unsteady
    assert rows_spread(steps(4, [1.0, 9.0])) is None  # too few steps to say


def test_wandb_offline_run_prints_its_folder_and_sync_line(capsys):
    from moecg.logger import WandbLogger

    class Run:
        settings = type("S", (), {"mode": "offline", "sync_dir": "/x/wandb/offline-run-1"})()
        finished = False

        def finish(self):
            self.finished = True

    lg = WandbLogger.__new__(WandbLogger)
    lg.run = Run()
    lg.finish()
    assert lg.run.finished
    assert capsys.readouterr().out.strip() == ("moecg: wandb offline run in /x/wandb/offline-run-1; upload it with: "
                                               "wandb sync /x/wandb/offline-run-1")


# -- results.json: strict JSON, written atomically -------------------------------------------------------------------
def test_results_are_strict_json_and_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    write_json(path, {"p50": float("nan"), "xs": [1.0, float("inf"), (float("-inf"),)], "path": tmp_path})
    assert strict_loads(path.read_text()) == {"p50": None, "xs": [1.0, None, [None]], "path": str(tmp_path)}
    before = path.read_text()

    def killed(*a):
        raise KeyboardInterrupt  # the job killed between writing the temp file and the rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_json(path, {"p50": 1.0})
    assert path.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_no_results_file_is_written_around_the_helper():
    """Every results/records JSON file in moecg/ and experiments/ goes through moecg.report.write_json."""
    root = Path(moecg.__file__).parents[1]
    # the helper; the recorder runs other commits' trees; the data manifest (sizes and hashes) is no record
    skip = {"moecg/report.py", "experiments/record_diff.py", "moecg/data/__init__.py"}
    bad = []
    for f in [*root.glob("moecg/**/*.py"), *root.glob("experiments/*.py")]:
        rel = f.relative_to(root).as_posix()
        if rel not in skip and re.search(r"write_text\(json\.dumps|json\.dump\(", f.read_text()):
            bad.append(rel)
    assert not bad, f"write JSON through moecg.report.write_json: {bad}"


# -- the fuzzer ------------------------------------------------------------------------------------------------------
# per-key valid values where the default alone says too little (a choice, a path); every other key: by its default's type
CHOICES = {
    "device": ["auto", "cpu", "cuda"], "prompts": ["random", "heldout", "file"], "isolate": ["auto", True, False],
    "model.dtype": ["auto", "bf16", "fp16", "fp32"], "model.attn_implementation": ["sdpa", "eager", "flex_attention"],
    "model.pretrained_path": [None, "/no/such/dir"], "model.preset": None,  # set by model=<preset>
    "capture.backend": ["auto", "emulate", "none", "cuda"], "capture.kernels": ["hf", "fused"],
    "capture.kernel_backend": ["auto", "torch", "triton"], "capture.compile_mode": ["default"],
    "capture.pdl": ["auto", 0, 1, 2], "capture.buckets": [[1, 2, 4, 8], [1, 4], [8]],
    "measure.hbm_bandwidth_gbps": ["auto", 4300.0], "measure.nvlink_bandwidth_gbps": ["auto", 450.0],
    "measure.heldout_bpb": ["auto", True, False], "parallel.backend": ["auto", "gloo"],
    "strategy.layers": [None, "'0-0:layer'", "'0-1:attn'"], "workload.file": [None],
    "workload.prompt_len": [[4, 8], 6], "workload.output_len": [[3, 6], 4],
    "dispatch.prefill": ["same", "dropless"], "dispatch.drop_policy": ["probs", "position"],
    "dispatch.kernels": ["auto", "torch"],
}
FIXED_KEYS = {"results_file", "prompt_file", "logger", "capture.compile", "workload.anchor"}  # paths, slow switches
KINDS = ("valid", "valid", "valid", "missing", "wrong_type", "out_of_range", "non_finite", "unknown_key",
         "wrong_option")


def _keys(prefix, cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.name == "name":
            continue
        d = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out[f"{prefix}{f.name}"] = d
    return out


def catalogue():
    """(keys every run has: key -> default, option keys: (group, option) -> {key: default})."""
    common = {**_keys("", RunConfig), **_keys("model.", ModelConfig), **_keys("capture.", CaptureConfig),
              **_keys("measure.", MeasureConfig), **_keys("parallel.", ParallelConfig), "strategy.layers": None}
    per_option = {("workload", n): _keys("workload.", c) for n, c in WORKLOADS.items()}
    per_option.update({("dispatch", n): _keys("dispatch.", c) for n, c in dispatch_options().items()})
    return {k: v for k, v in common.items() if k not in FIXED_KEYS}, per_option


def _fmt(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return {float("inf"): "inf", float("-inf"): "-inf"}.get(v, "nan" if v != v else repr(v))
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(map(_fmt, v)) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


def _value(rng: random.Random, key: str, default, kind: str):
    if kind == "missing":
        return None
    if kind == "wrong_type":
        return rng.choice(["abc", [1, 2], True] if not isinstance(default, bool) else ["abc", 3, [1]])
    if kind == "out_of_range":
        return rng.choice([-1, 0, -2.5, 5000, 10**9])
    if kind == "non_finite":
        return rng.choice([float("inf"), float("-inf"), float("nan")])
    if CHOICES.get(key):
        return rng.choice(CHOICES[key])
    if isinstance(default, bool):
        return rng.choice([True, False])
    if isinstance(default, int):
        return rng.choice([default, 1, 2, 3])
    if isinstance(default, float):
        return rng.choice([default, 0.5, 1.0, 2.0])
    return default


def draw_case(rng: random.Random, common, per_option):
    """(group choices, value overrides, kind of the case)."""
    groups = {"model": rng.choice(options()["model"]), "strategy": rng.choice(options()["strategy"]),
              "workload": rng.choice(["fixed", "fixed", "poisson", "trace"])}
    if rng.random() < 0.5:
        groups["dispatch"] = rng.choice(options()["dispatch"])
    # a small run, so the plans that pass are the cheap ones a user would try first
    values = {"new_tokens": 6, "prompt_len": 8}
    if groups["workload"] == "poisson":
        values.update({"workload.n_requests": 4, "workload.rate": 50.0})
    kind = rng.choice(KINDS)
    n = rng.randint(1, 3)
    own = {k: v for (g, o), keys in per_option.items() if groups.get(g, "dropless" if g == "dispatch" else None) == o
           for k, v in keys.items()}
    pool = {**common, **own}
    value_kind = "valid" if kind in ("unknown_key", "wrong_option") else kind
    for key in rng.sample(sorted(pool), n):
        values[key] = _value(rng, key, pool[key], value_kind)
    if kind == "unknown_key":
        key = rng.choice(sorted(pool))
        typo = key[:-1] + rng.choice(["", "s", "x"])
        if typo not in pool:
            values["+" + typo] = 1
    elif kind == "wrong_option":
        others = [(k, v) for (g, o), keys in per_option.items() for k, v in keys.items() if k not in pool]
        key, default = rng.choice(others)
        values[key] = _value(rng, key, default, "valid")
    return groups, values, kind


class Composer:
    """Hydra compose once per group option; a case is the default config with its options' nodes put in, then its
    values applied the way Hydra applies overrides (its parser, OmegaConf.update in struct mode)."""

    def __init__(self):
        self.nodes: dict = {}
        self.base = None
        self.parser = OverridesParser.create()

    def _compose(self, overrides):
        return compose(config_name="config", overrides=list(overrides))

    def node(self, group, option):
        if (group, option) not in self.nodes:
            cfg = self._compose([f"{group}={option}"])
            # strategy=capacity also picks dispatch=capacity (a defaults-list override): keep what it composes to
            self.nodes[(group, option)] = (cfg[group], cfg.dispatch if group == "strategy" else None)
        return self.nodes[(group, option)]

    def __call__(self, groups: dict, values: dict):
        if self.base is None:
            self.base = self._compose([])
        cfg = copy.deepcopy(self.base)
        for group in ("model", "strategy", "workload", "dispatch"):
            if group in groups:
                node, dispatch = self.node(group, groups[group])
                cfg[group] = copy.deepcopy(node)
                if dispatch is not None and "dispatch" not in groups:
                    cfg.dispatch = copy.deepcopy(dispatch)
        for o in self.parser.parse_overrides([f"{k}={_fmt(v)}" for k, v in values.items()]):
            key, value = o.key_or_group, o.value()
            try:
                if o.is_add():
                    OmegaConf.update(cfg, key, value, merge=True, force_add=True)
                else:
                    OmegaConf.update(cfg, key, value, merge=True)
            except (ConfigAttributeError, ConfigKeyError) as e:
                raise ConfigCompositionException(f"Could not override '{key}'.\nTo append to your config use "
                                                 f"+{o.input_line}") from e
        return cfg


def known_key_in(msg: str, common, per_option, given=()) -> bool:
    """The message names a config key: a known one, or one the case gave (a misspelt key is named as given)."""
    keys = {*common, *(k for keys in per_option.values() for k in keys), "model", "dispatch", "strategy", "workload",
            *(k.lstrip("+") for k in given)}
    return any(re.search(rf"(^|[^\w.]){re.escape(k)}([=.:\s]|$)", msg) for k in keys)


def _fuzz(seed: int, cases: int):
    rng = random.Random(seed)
    common, per_option = catalogue()
    composer = Composer()
    outcomes, refused = {"passed": 0, "plan": 0, "hydra": 0}, []
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        for i in range(cases):
            groups, values, kind = draw_case(rng, common, per_option)
            argv = [f"{g}={o}" for g, o in groups.items()] + [f"{k}={_fmt(v)}" for k, v in values.items()]
            where = f"case {i} ({kind}) of MOECG_FUZZ_SEED={seed}: python -m moecg.run {' '.join(argv)}"
            try:
                cfg = composer(groups, values)
            except ConfigCompositionException as e:
                line = run.override_hint(e)
                assert line is not None and "\n" not in line and known_key_in(line, common, per_option, values), \
                    f"{where}: Hydra's refusal is not worded by moecg.run: {e} / {e.__cause__}"
                outcomes["hydra"] += 1
                continue
            try:
                resolve_plan(cfg)
                outcomes["passed"] += 1
            except PlanError as e:
                msg = str(e)
                assert "\n" not in msg and known_key_in(msg, common, per_option, values), f"{where}: {msg!r} names no key"
                outcomes["plan"] += 1
                refused.append(argv)
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"{where}: {type(e).__name__}: {e} (not a PlanError)") from e
    return outcomes, refused


def test_config_fuzzer(monkeypatch, tmp_path, capsys):
    seed = int(os.environ.get("MOECG_FUZZ_SEED", time.time_ns() % 2**31))
    cases = int(os.environ.get("MOECG_FUZZ_CASES", 200))
    print(f"config fuzzer: MOECG_FUZZ_SEED={seed} MOECG_FUZZ_CASES={cases}")  # shown with the failure
    outcomes, refused = _fuzz(seed, cases)
    assert outcomes["passed"] and outcomes["plan"], outcomes  # the generator reaches both sides
    # a few of the refused cases end to end through the CLI's entry: a failed, strict results.json from the plan
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    for j, argv in enumerate(random.Random(seed).sample(refused, min(4, len(refused)))):
        out = tmp_path / str(j)
        with pytest.raises(SystemExit) as e:
            _cli(monkeypatch, *argv, f"hydra.run.dir={out}")
        assert e.value.code == 1, argv
        rec = strict_loads((out / "results.json").read_text())
        assert rec["status"] == "failed" and rec["phase"] == "plan" and rec["error"].startswith("PlanError: "), argv
    err = capsys.readouterr().err
    assert "Traceback" not in err


def test_fuzzers_composer_equals_hydras_compose():
    """The fuzzer's fast composition is Hydra's: the same config for the same command line."""
    rng = random.Random(7)
    common, per_option = catalogue()
    composer = Composer()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        done = 0
        while done < 4:
            groups, values, kind = draw_case(rng, common, per_option)
            if kind in ("wrong_option", "unknown_key"):
                continue
            argv = [f"{g}={o}" for g, o in groups.items()] + [f"{k}={_fmt(v)}" for k, v in values.items()]
            same = [json.dumps(OmegaConf.to_container(c), sort_keys=True)  # as text: NaN equals NaN
                    for c in (composer(groups, values), compose(config_name="config", overrides=argv))]
            assert same[0] == same[1], argv
            done += 1
