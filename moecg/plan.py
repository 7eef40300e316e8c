"""The run plan: a Hydra config resolved once, validated before any CUDA work, frozen, and passed down.

Everything a run needs to decide is decided here, group by group (moecg.config: each group types and checks its
own keys), then across groups: the model's HF config (from the preset or the checkpoint's config.json, without
building weights), the workload's rows and lengths, the dispatcher and its declared capabilities, the strategy
and its per-layer scopes against them, the capture and measurement options, expert parallelism, the prompts, and
whether it fits this machine's memory (moecg.memory). Every error names the config key and the fix
(`PlanError`); options that do not apply to the chosen dispatcher or strategy are refused, not ignored.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

import moecg.config  # noqa: F401  (registers the config groups with Hydra's ConfigStore)
from moecg.capture.buckets import bucket_for
from moecg.capture.plan import StrategyError, StrategySpec, validate
from moecg.config.capture import CaptureConfig, CapturePlan
from moecg.config.dispatch import resolve_dispatch
from moecg.config.measure import MeasureConfig, MeasurePlan
from moecg.config.model import ModelConfig, ModelPlan, check_attn_implementation
from moecg.config.parallel import ParallelConfig
from moecg.config.readers import PlanError, as_choice, as_int, read_group
from moecg.config.root import RunConfig, read_run
from moecg.config.strategy import StrategyConfig
from moecg.dispatch import Dispatcher
from moecg.engine import check_prefill_chunk
from moecg.memory import check_fits, estimate_memory
from moecg.models import FAMILIES, _attn_implementation, resolve_device, resolve_dtype
from moecg.models.adapter import ADAPTERS
from moecg.parallel.plan import ParallelError, ParallelPlan, resolve_parallel
from moecg.prompts import PromptError, make_prompts
from moecg.ragged import ragged_windows
from moecg.workload import FIXED, WorkloadPlan, resolve_workload, workload_name

__all__ = ["CapturePlan", "MeasurePlan", "ModelPlan", "PlanError", "RunPlan", "check_fits", "estimate_memory",
           "resolve_plan"]

PROMPTS = ("random", "heldout", "file")


# -- the plan -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunPlan:
    model: ModelPlan
    device: torch.device
    dtype: torch.dtype
    strategy: StrategySpec
    strategy_layers: str | None
    scopes: tuple[str, ...] | None  # per decoder layer, for per-layer strategies
    dispatcher: Dispatcher
    prefill_dispatcher: Dispatcher | None
    capture: CapturePlan
    measure: MeasurePlan
    workload: WorkloadPlan  # FIXED, or the requests a serving run replays
    parallel: ParallelPlan  # expert parallelism (ep=1: one process)
    batch_size: int
    prompt_len: int
    new_tokens: int
    max_cache_len: int
    prefill_chunk: int | None  # prompt tokens per prefill forward (None: the whole prompt in one)
    seed: int
    prompts_kind: str
    prompts: torch.Tensor = field(repr=False, compare=False)  # [B, S] int64 on the host
    captures: bool  # graphs will be captured (a graph strategy and a backend that can capture)
    bucket: int | None  # rows a captured step runs (None: no graphs, or above the largest bucket)
    max_rows: int  # rows the engine's cache holds
    needs_baseline: bool  # time strategy=eager on HF's modules (same dispatch) for speedup_vs_eager
    decode_steps: int  # decode steps the whole run executes (every repeat, baseline and fidelity pass)

    @property
    def serving(self) -> bool:
        return self.workload.serving

    @cached_property
    def memory_bytes(self) -> int:
        """Estimate: weights + KV caches + the largest transient (moecg.memory), derived from the plan itself."""
        return estimate_memory(self)

    def describe(self) -> str:
        d = self.dispatcher
        opts = ", ".join(f"{k}={getattr(d, k)}" for k in d.options())
        if self.serving:
            return (f"{self.model.preset or self.model.pretrained_path} ({self.model.family}, {self.model.layers} "
                    f"layers, {self.dtype}) on {self.device.type} | strategy={self.strategy.name} | dispatch={d.name}"
                    f"{' (' + opts + ')' if opts else ''} | {self.workload.describe()}"
                    f"{' in buckets up to ' + str(self.bucket) if self.bucket else ''} | cache {self.max_cache_len} | "
                    f"~{self.memory_bytes / 2**30:.2f} GiB")
        kernels = self.capture.kernels
        return (f"{self.model.preset or self.model.pretrained_path} ({self.model.family}, {self.model.layers} layers, "
                f"{self.dtype}) on {self.device.type} | strategy={self.strategy.name}"
                f"{' kernels=' + kernels if kernels != 'hf' else ''} | dispatch={d.name}"
                f"{' (' + opts + ')' if opts else ''} | batch {self.batch_size}"
                f"{' in bucket ' + str(self.bucket) if self.bucket else ''}"
                f"{f' per rank x {self.parallel.ep} ranks ({self.parallel.backend})' if self.parallel.ep > 1 else ''}"
                f" | prompt {self.prompt_len} + "
                f"{self.new_tokens} new | ~{self.decode_steps} decode steps | ~{self.memory_bytes / 2**30:.2f} GiB")


# -- resolution ---------------------------------------------------------------------------------------------------
def resolve_plan(cfg) -> RunPlan:
    """Validate the whole config (no CUDA kernels run) and return the frozen plan."""
    run = read_run(cfg)  # a key no group declares is refused first, wherever it is
    model_cfg = read_group(ModelConfig, cfg.get("model"), "model")
    strategy_cfg = read_group(StrategyConfig, cfg.get("strategy"), "strategy")
    capture_cfg = read_group(CaptureConfig, cfg.get("capture"), "capture")
    measure_cfg = read_group(MeasureConfig, cfg.get("measure"), "measure")
    parallel_cfg = read_group(ParallelConfig, cfg.get("parallel"), "parallel")

    serving = workload_name(cfg.get("workload")) != "fixed"
    batch, prompt_len, new_tokens, seed, max_cache_len = _fixed_shape(run, serving)
    device = _device(run.device)
    model = model_cfg.resolve()
    prompts_kind = as_choice(run.prompts, "prompts", PROMPTS)
    workload, batch, prompt_len, new_tokens, max_cache_len = _workload(
        cfg.get("workload"), model, prompts_kind, seed, (batch, prompt_len, new_tokens, max_cache_len),
        run.max_cache_len)
    try:
        dtype = resolve_dtype(model.dtype if isinstance(model.dtype, str) or model.dtype is None else repr(model.dtype),
                              device)
    except ValueError as e:
        raise PlanError(str(e)) from None
    check_attn_implementation(model, device)

    dispatcher, prefill_dispatcher = resolve_dispatch(cfg.get("dispatch"))
    prefill_chunk = _prefill_chunk(run.prefill_chunk, prefill_dispatcher or dispatcher, workload.name)
    spec, scopes = _strategy(strategy_cfg, dispatcher, model.layers)
    capture = capture_cfg.resolve(spec, device)
    _check_family(model, capture.kernels, step_graph=spec.scope == "step")
    if workload.serving:
        _check_ragged(model, capture.compile, workload.name)
    parallel, device = _parallel(parallel_cfg, device, model, (dispatcher, prefill_dispatcher), capture.compile,
                                 workload)

    resolved_backend = ("cuda" if device.type == "cuda" else "none") if capture.backend == "auto" else capture.backend
    captures = spec.scope != "eager" and resolved_backend != "none"
    bucket = bucket_for(batch, capture.buckets) if captures else None
    measure = measure_cfg.resolve(device, model, None if workload.serving else new_tokens, parallel.ep)
    # the eager baseline (HF modules, same dispatch) is timed unless the run itself is that path
    needs_baseline = measure.eager_baseline and (spec.scope != "eager" or capture.kernels != "hf") \
        and not workload.serving
    plan = RunPlan(
        model=model, device=device, dtype=dtype, strategy=spec, strategy_layers=strategy_cfg.layers,
        scopes=tuple(scopes) if scopes is not None else None, dispatcher=dispatcher,
        prefill_dispatcher=prefill_dispatcher, capture=capture, measure=measure, workload=workload, parallel=parallel,
        batch_size=batch, prompt_len=prompt_len, new_tokens=new_tokens, max_cache_len=max_cache_len,
        prefill_chunk=prefill_chunk, seed=seed, prompts_kind=prompts_kind, prompts=_NO_PROMPTS, captures=captures,
        bucket=bucket, max_rows=max(bucket or batch, batch), needs_baseline=needs_baseline,
        decode_steps=_decode_steps(measure, needs_baseline, workload, new_tokens),
    )
    check_fits(plan)  # before the prompts are drawn: a batch that cannot fit is refused, not allocated
    prompts = _prompts(prompts_kind, run, batch, prompt_len, seed, model, parallel, workload.serving)
    return dataclasses.replace(plan, prompts=prompts)


_NO_PROMPTS = torch.zeros(0, 0, dtype=torch.long)


def _fixed_shape(run: RunConfig, serving: bool) -> tuple[int, int, int, int, int | None]:
    """(batch_size, prompt_len, new_tokens, seed, max_cache_len) as the fixed batch reads them (max_cache_len None
    when serving: the requests decide it)."""
    batch = as_int(run.batch_size, "batch_size", 1, 4)
    prompt_len = as_int(run.prompt_len, "prompt_len", 1, 16)
    new_tokens = as_int(run.new_tokens, "new_tokens", 1, 32)
    seed = as_int(run.seed, "seed", None, 0)
    if serving:
        return batch, prompt_len, new_tokens, seed, None
    max_cache_len = prompt_len + new_tokens if run.max_cache_len is None else \
        as_int(run.max_cache_len, "max_cache_len", 1, prompt_len + new_tokens)
    if prompt_len + new_tokens > max_cache_len:
        raise PlanError(f"prompt_len + new_tokens = {prompt_len + new_tokens} exceeds max_cache_len="
                        f"{max_cache_len}: raise max_cache_len (or leave it null) or lower new_tokens")
    return batch, prompt_len, new_tokens, seed, max_cache_len


def _device(device) -> torch.device:
    if device is not None and not isinstance(device, str):
        raise PlanError(f"device={device!r}: choose auto, cpu or cuda (cuda:N for one GPU)")
    try:
        return resolve_device(device)
    except ValueError as e:
        raise PlanError(str(e)) from None
    except RuntimeError:  # torch's own parse of the string
        raise PlanError(f"device={device!r}: choose auto, cpu or cuda (cuda:N for one GPU)") from None


def _workload(w, model: ModelPlan, prompts_kind: str, seed: int, fixed: tuple, max_cache_len) -> tuple:
    """(workload, batch, prompt_len, new_tokens, max_cache_len): a serving workload's requests decide the cache, the
    rows and the lengths (batch_size, prompt_len and new_tokens are the fixed batch's)."""
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if workload_name(w) == "fixed":
        resolve_workload(w, vocab=0, prompts_kind="random", max_cache_len=None, max_positions=None,
                         default_seed=seed)  # refuses keys fixed does not read
        cache = fixed[3]
        if max_pos and cache > max_pos:
            raise PlanError(f"max_cache_len = {cache} (prompt_len + new_tokens unless set) exceeds the model's "
                            f"max_position_embeddings={max_pos}: positions past it are outside what the model was "
                            f"built for; lower new_tokens/prompt_len (at most {max_pos} in all)")
        return (FIXED, *fixed)
    workload, cache = resolve_workload(w, vocab=model.config.vocab_size, prompts_kind=prompts_kind,
                                       max_cache_len=max_cache_len, max_positions=max_pos, default_seed=seed)
    return (workload, workload.max_batch, max(r.prompt_len for r in workload.requests),
            max(r.output_len for r in workload.requests), cache)


def _prefill_chunk(value, prefiller: Dispatcher, workload: str) -> int | None:
    """prefill_chunk (moecg.engine.DecodeEngine): None, or tokens per prefill forward on the fixed-batch engine."""
    if value is None:
        return None
    chunk = as_int(value, "prefill_chunk", 2, 2048)
    if workload != "fixed":
        raise PlanError(f"prefill_chunk={chunk} with workload={workload}: serving prefills on the ragged engine, which "
                        "does not chunk (workload.prefill_tokens bounds its batched prefills instead); set "
                        "prefill_chunk=null or use workload=fixed")
    try:
        return check_prefill_chunk(chunk, prefiller)
    except ValueError as e:
        raise PlanError(str(e)) from None


def _strategy(s: StrategyConfig, dispatcher: Dispatcher, layers: int) -> tuple[StrategySpec, list[str] | None]:
    """strategy x dispatch x layers: the spec and per-layer scopes."""
    try:
        return validate(s.name, dispatcher, layers, s.layers)
    except StrategyError as e:
        raise PlanError(str(e)) from None


def _check_family(model: ModelPlan, kernels: str, step_graph: bool) -> None:
    """The family adapter's own audit of the config (features a path does not model are refused there)."""
    try:
        ADAPTERS[model.family].check_supported(model.config, kernels, step_graph=step_graph,
                                               attn_implementation=model.attn_implementation)
    except ValueError as e:
        raise PlanError(str(e)) from None


def _check_ragged(model: ModelPlan, compile_: bool, workload: str) -> None:
    """What serving (moecg.ragged.RaggedEngine: a length per row) runs, in one place. capture.kernels=fused runs
    (FastDecode reads each row's position, in standard and latent attention alike)."""
    if compile_:
        raise PlanError(f"capture.compile=true with workload={workload}: the ragged decode step is not compiled "
                        "(untested); drop capture.compile")
    _, cls = FAMILIES[model.family]
    try:
        ragged_windows(model.config, _attn_implementation(cls, model.attn_implementation))
    except ValueError as e:
        raise PlanError(f"workload={workload}: {e} (model.attn_implementation)") from None


def _parallel(p: ParallelConfig, device: torch.device, model: ModelPlan, dispatchers, compile_: bool,
              workload: WorkloadPlan) -> tuple[ParallelPlan, torch.device]:
    """The expert-parallel plan and this rank's device."""
    t = p.timeout_s
    if not isinstance(t, bool) and isinstance(t, float) and not math.isfinite(t):  # a timedelta of inf fails later
        raise PlanError(f"parallel.timeout_s={t}: must be a finite number of seconds > 0 (e.g. parallel.timeout_s=300)")
    try:
        parallel = resolve_parallel(p, device, ADAPTERS[model.family].num_experts(model.config), dispatchers, compile_)
    except ParallelError as e:
        raise PlanError(str(e)) from None
    if workload.serving and parallel.ep > 1:
        raise PlanError(f"workload={workload.name} with parallel.ep={parallel.ep}: serving runs on one process "
                        "(expert-parallel ragged decode is not built); use workload=fixed or parallel.ep=1")
    if parallel.ep > 1 and device.type == "cuda":
        device = torch.device("cuda", parallel.local_rank)  # one GPU per rank
    return parallel, device


def _prompts(kind: str, run: RunConfig, batch: int, prompt_len: int, seed: int, model: ModelPlan,
             parallel: ParallelPlan, serving: bool) -> torch.Tensor:
    """[B, S] prompt ids of this rank (serving: [0, 0], each request has its own in workload.prompts)."""
    if kind != "file" and run.prompt_file:
        raise PlanError(f"prompt_file is only read with prompts=file (got prompts={kind}): "
                        "add prompts=file or drop prompt_file")
    if serving:
        return torch.zeros(0, 0, dtype=torch.long)
    ep, rank = parallel.ep, parallel.rank
    try:
        # every rank decodes batch_size rows of its own: rows [rank*B, (rank+1)*B) of the ep*B prompts one process
        # would make, so a dropless job's tokens equal one process decoding all ep*B rows
        return make_prompts(kind, batch * ep, prompt_len, seed, model.config.vocab_size,
                            run.prompt_file)[rank * batch:(rank + 1) * batch]
    except PromptError as e:
        where = f" (parallel.ep={ep}: batch_size={batch} rows on each rank, {batch * ep} in all)" if ep > 1 else ""
        raise PlanError(f"{e}{where}") from None


def _decode_steps(measure: MeasurePlan, needs_baseline: bool, workload: WorkloadPlan, new_tokens: int) -> int:
    """Decode steps the whole run executes: the estimate the phases print and the progress bar's total."""
    if workload.serving:  # at most one step per generated token; fidelity decodes its requests alone
        steps = sum(r.output_len - 1 for r in workload.requests)
        if measure.fidelity:
            steps += sum(r.output_len - 1 for r in workload.requests[:measure.fidelity_rows])
        return steps
    passes = (measure.repeats + 1) * (2 if needs_baseline else 1) + (3 if measure.fidelity else 0) + 1
    return passes * max(new_tokens - 1, 1)
