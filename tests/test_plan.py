"""The run plan: every bad input is refused before any model is built, with one line naming the key and the fix."""
import pytest
from hydra import compose, initialize_config_dir

import moecg
from moecg.plan import PlanError, check_fits, resolve_plan

CONF_DIR = __import__("pathlib").Path(moecg.__file__).parent / "conf"


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _refused(match, *overrides):
    with pytest.raises(PlanError, match=match) as e:
        resolve_plan(_cfg(*overrides))
    assert "\n" not in str(e.value), "errors are one line"
    return str(e.value)


def test_default_plan_resolves():
    plan = resolve_plan(_cfg())
    assert plan.batch_size == 4 and plan.bucket is None and plan.max_rows == 4  # CPU: no graphs, no padding
    assert plan.prompts.shape == (4, 16) and plan.model.layers == 2
    assert plan.measure.hbm_bandwidth_gbps is None and plan.measure.bandwidth_source == "unknown"  # CPU
    with pytest.raises(Exception):
        plan.batch_size = 8  # frozen


def test_bench_bandwidth_comes_from_the_device(monkeypatch):
    """A benchmark's floor bandwidth: the flag, else the device table by name, else a copy measured on that GPU;
    never another device's number (a CPU has none)."""
    import torch

    from moecg import floor
    assert floor.bench_bandwidth_gbps(torch.device("cpu"), 1234) == (1234.0, "given")
    assert floor.bench_bandwidth_gbps(torch.device("cpu")) == (None, "unknown")
    measured = []
    monkeypatch.setattr(floor, "measure_copy_gbps", lambda dev: measured.append(dev) or 2000.0)
    for name, bw in floor.DEVICE_BANDWIDTH_GBPS.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None, n=name: n)
        assert floor.bench_bandwidth_gbps(torch.device("cuda")) == (bw, "device table")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA B200")
    assert floor.bench_bandwidth_gbps(torch.device("cuda")) == (2000.0, "measured copy") and len(measured) == 1


def test_emulated_capture_pads_to_the_bucket():
    plan = resolve_plan(_cfg("strategy=full", "capture.backend=emulate", "batch_size=5"))
    assert plan.captures and plan.bucket == 8 and plan.max_rows == 8


@pytest.mark.parametrize("override,match", [
    ("batch_size=2.5", r"batch_size=2\.5: must be an integer >= 1 \(e\.g\. batch_size=4\)"),
    ("batch_size=0", r"batch_size=0: must be an integer >= 1"),
    ("measure.repeats=0", r"measure\.repeats=0: must be an integer >= 1"),
    ("model.router_skew=abc", r"model\.router_skew='abc': must be a number"),
    ("model.router_skew=-1", r"model\.router_skew=-1\.0: must be a finite number >= 0"),
    ("seed=abc", r"seed='abc': must be an integer"),
    ("new_tokens=100000", r"exceeds the model's max_position_embeddings=1024.*lower new_tokens"),
    ("max_cache_len=8", r"exceeds max_cache_len=8: raise max_cache_len"),
    ("+dispatch.capacity_factor=0", r"dispatch\.capacity_factor does not apply to dispatch=dropless \(it belongs to "
                                    r"dispatch=capacity"),
    ("dispatch.capacity_factor=abc", None),  # not in dropless's YAML: Hydra itself refuses the key
    ("capture.kernel_backend=torch", r"capture\.kernel_backend=torch only applies with capture\.kernels=fused"),
    ("capture.compile_mode=max-autotune-no-cudagraphs", r"only applies with capture\.compile=true"),
    ("capture.backend=cuda", r"capture\.backend=cuda needs a CUDA device"),
    ("capture.buckets=[4,2]", r"capture\.buckets=\[4, 2\]: must be strictly ascending"),
    ("prompts=nope", r"prompts='nope': choose one of random, heldout, file"),
    ("prompt_file=/x", r"prompt_file is only read with prompts=file"),
    ("measure.heldout_bpb=true", r"measure\.heldout_bpb=true needs a byte-level model"),
    ("measure.hbm_bandwidth_gbps=0", r"measure\.hbm_bandwidth_gbps=0\.0: must be a finite number > 0"),
    ("measure.skip_steps=40", r"measure\.skip_steps=40 leaves none of the 31 decode steps"),
    ("model.num_layers=0", r"model\.num_layers=0: must be an integer >= 1"),
    ("model.dtype=fp8", r"model\.dtype='fp8': choose one of"),
])
def test_bad_inputs_are_refused_with_the_key_and_fix(override, match):
    if match is None:
        from hydra.errors import ConfigCompositionException

        with pytest.raises(ConfigCompositionException):
            _cfg(override)
        return
    _refused(match, override)


def test_dispatch_options_are_typed():
    _refused(r"dispatch\.capacity_factor='abc': dispatch=capacity needs a number", "dispatch=capacity",
             "dispatch.capacity_factor=abc")
    _refused(r"dispatch\.capacity_factor=0\.0: must be > 0", "dispatch=capacity", "dispatch.capacity_factor=0")
    _refused(r"dispatch\.drop_policy='rand'", "dispatch=capacity", "dispatch.drop_policy=rand")
    _refused(r"dispatch\.prefill='nope'", "dispatch.prefill=nope")


def test_strategy_combinations_refused_by_capability():
    _refused(r"dispatch=dynamic is not graph-safe", "strategy=full", "dispatch=dynamic")
    _refused(r"strategy=capacity needs", "strategy=capacity", "dispatch=dropless")
    _refused(r"capture\.kernels=fused .* not strategy=layer", "strategy=layer", "capture.kernels=fused")
    _refused(r"strategy\.layers is only read by strategy=mixed", "strategy=full", "strategy.layers=0-1:layer")
    _refused(r"strategy\.layers: range 0-9 is outside", "strategy=mixed", "strategy.layers=0-9:layer")


def test_checkpoint_path_errors(tmp_path):
    _refused(r"model\.pretrained_path=/no/such/dir: is not a directory; give a local directory written by "
             r"save_pretrained", "model=local", "model.pretrained_path=/no/such/dir")
    _refused(r"has no config\.json", "model=local", f"model.pretrained_path={tmp_path}")


def test_prompt_file_with_words_names_file_and_key(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("hello world\n")
    _refused(r"prompt_file=.*p\.txt, line 1: 'hello' is not a token id", "prompts=file", f"prompt_file={f}")


def test_runs_that_cannot_fit_are_refused_with_the_depth_that_fits():
    # the real Mixtral-8x7B shape in fp32 on CPU: ~190 GB of weights
    msg = _refused(r"this run needs about \d+\.\d GiB .* is available: model\.num_layers=\d+ fits",
                   "model=mixtral_8x7b")
    plan = resolve_plan(_cfg("model=mixtral_8x7b", f"model.num_layers={msg.split('model.num_layers=')[1].split()[0]}"))
    check_fits(plan)  # the suggested depth does fit
    # and a depth that fits on a given budget is what the message says
    with pytest.raises(PlanError, match=r"model\.num_layers=1 fits|no depth fits"):
        check_fits(resolve_plan(_cfg("model=mixtral_8x7b", "model.num_layers=2")), available=int(plan.memory_bytes / 2))


def test_fp32_grouped_mm_fallback_that_cannot_fit_is_refused():
    """On CUDA outside bf16, grouped_mm's fallback gathers an expert weight per assignment (~140 GiB for this prefill:
    measured as an OOM on the H200); the plan refuses it up front with the dtype fix."""
    import dataclasses

    import torch

    plan = resolve_plan(_cfg("model=mixtral_8x7b", "model.num_layers=2", "batch_size=5", "prompt_len=32"))
    on_gpu = dataclasses.replace(plan, device=torch.device("cuda"), dtype=torch.float32)
    with pytest.raises(PlanError, match=r"model\.dtype=auto on CUDA: grouped_mm has a fast kernel only for bf16.*"
                                        r"use model\.dtype=bf16"):
        check_fits(on_gpu, available=140 * 2**30)
    check_fits(dataclasses.replace(plan, device=torch.device("cuda"), dtype=torch.bfloat16), available=140 * 2**30)


@pytest.mark.slow
@pytest.mark.parametrize("override,key", [
    ("batch_size=2.5", "batch_size"), ("measure.repeats=0", "measure.repeats"), ("measure.repeats=abc", "measure.repeats"),
    ("new_tokens=abc", "new_tokens"), ("model.router_skew=abc", "model.router_skew"),
    ("seed=abc", "seed"), ("model.pretrained_path=/no/such/dir", "model.pretrained_path"),
    ("new_tokens=100000", "new_tokens"), ("+dispatch.capacity_factor=0", "dispatch.capacity_factor"),
])
def test_cli_bad_input_one_line_and_failed_record(tmp_path, override, key):
    """Through the CLI: exit 1, one stderr line naming the key, results.json with status failed in phase plan."""
    import json
    import os
    import subprocess
    import sys

    extra = ["model=local"] if "pretrained_path" in override else []
    p = subprocess.run([sys.executable, "-m", "moecg.run", *extra, override, f"hydra.run.dir={tmp_path}"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "HYDRA_FULL_ERROR": "0"})
    assert p.returncode == 1
    failed = [ln for ln in p.stderr.splitlines() if ln.startswith("moecg: job failed")]
    assert len(failed) == 1 and key in failed[0] and "Traceback" not in p.stderr, p.stderr
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["status"] == "failed" and r["phase"] == "plan" and key in r["error"] and "\n" not in r["error"]
    assert not (tmp_path / "wandb").exists()  # nothing half-written beside the record


# -- the config groups: registered from the registries, one default each ---------------------------------------------
def test_every_registered_option_composes_from_the_cli():
    """Every zoo preset, dispatcher, strategy and workload is a CLI option with no file written for it; a dispatcher's
    keys and defaults are its own dataclass fields'."""
    import dataclasses

    from moecg.capture.plan import STRATEGIES
    from moecg.config import options
    from moecg.config.workload import WORKLOADS
    from moecg.dispatch import REGISTRY
    from moecg.models.zoo import PRESETS

    opts = options()
    assert set(opts["model"]) == {*PRESETS, "local"} and set(opts["dispatch"]) == set(REGISTRY)
    assert set(opts["strategy"]) == set(STRATEGIES) and set(opts["workload"]) == set(WORKLOADS)
    for p in PRESETS:
        assert _cfg(f"model={p}").model.preset == p
    assert _cfg("model=gpt_oss_tiny").model.attn_implementation == "eager"  # the family has no sdpa
    for name, cls in REGISTRY.items():
        d = _cfg(f"dispatch={name}").dispatch
        fields = {f.name: f.default for f in dataclasses.fields(cls) if f.init}
        assert dict(d) == {"name": name, **fields, "prefill": "same"}, name
    for name, spec in STRATEGIES.items():
        cfg = _cfg(f"strategy={name}")
        assert cfg.strategy.name == name and cfg.strategy.layers == spec.layers
        assert cfg.dispatch.name == (spec.dispatch or "dropless")
    assert _cfg("strategy=capacity", "dispatch=dropless").dispatch.name == "dropless"  # the CLI still wins
    for name in WORKLOADS:
        assert _cfg(f"workload={name}").workload.name == name
    resolve_plan(_cfg("model=gpt_oss_tiny", "strategy=capacity", "workload=poisson"))


def test_no_default_is_stated_twice():
    """A default lives in its dataclass: conf/ holds no file for a registered group (it would shadow the registered
    option), the root config only its defaults list and Hydra's settings, and an experiment only values it changes."""
    import yaml

    from moecg.config import options

    assert not [g for g in options() if (CONF_DIR / g).exists()]
    root = yaml.safe_load((CONF_DIR / "config.yaml").read_text())
    assert set(root) == {"defaults", "hydra"}

    def leaves(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and k != "hydra":
                yield from leaves(v, f"{prefix}{k}.")
            elif k not in ("hydra", "defaults"):
                yield f"{prefix}{k}", v

    from omegaconf import OmegaConf

    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        exp = yaml.safe_load(path.read_text())
        chosen = [f"{k.split('/')[-1]}={v}" for item in exp.get("defaults", []) if isinstance(item, dict)
                  for k, v in item.items()]
        base = _cfg(*chosen)  # what the experiment's own group choices give, before its values
        for key, value in leaves(exp):
            assert OmegaConf.select(base, key) != value, f"{path.name}: {key}={value!r} is already the default"


def test_unknown_keys_are_refused_with_the_nearest_known_one():
    _refused(r"^batchsize: not a config key \(did you mean batch_size\?\): fix the spelling or drop it", "+batchsize=4")
    _refused(r"^model\.num_layer: not a key of model \(did you mean model\.num_layers\?\)", "+model.num_layer=2")
    _refused(r"^capture\.pld: not a key of capture \(did you mean capture\.pdl\?\)", "+capture.pld=1")


def test_local_model_without_a_path_names_the_key():
    _refused(r"model\.preset is null and no model\.pretrained_path: .* model=local model\.pretrained_path=/dir",
             "model=local")


def test_capture_knobs_are_typed_recorded_and_passed_to_capture():
    from moecg.harness import _capture_kwargs

    _refused(r"capture\.pdl=3: choose one of auto, 0, 1, 2", "capture.pdl=3")
    _refused(r"capture\.pdl=True: choose one of", "capture.pdl=true")
    _refused(r"capture\.overlap_shared='maybe': must be true or false", "capture.overlap_shared=maybe")
    for key in ("preload", "overlap_shared", "fuse_router", "precompile"):
        _refused(rf"capture\.{key}=false only applies with capture\.kernels=fused", f"capture.{key}=false")
    plan = resolve_plan(_cfg("strategy=full", "capture.kernels=fused", "capture.pdl=1", "capture.fuse_router=false",
                             "capture.precompile=false", "capture.preload=false"))
    c = plan.capture
    assert (c.pdl, c.preload, c.overlap_shared, c.fuse_router, c.precompile) == (1, False, True, False, False)
    assert c.record() == {"pdl": 1, "preload": False, "overlap_shared": True, "fuse_router": False, "precompile": False}
    assert resolve_plan(_cfg()).capture.record()["pdl"] == "auto"
    kwargs = _capture_kwargs(plan)
    assert kwargs["kernels"] == "fused" and kwargs["buckets"] == plan.capture.buckets
    import inspect

    from moecg.capture import Capture

    assert set(kwargs) <= set(inspect.signature(Capture).parameters)
