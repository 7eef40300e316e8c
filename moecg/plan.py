"""The run plan: a Hydra config resolved once, validated before any CUDA work, frozen, and passed down.

Everything a run needs to decide is decided here: the model's HF config (from the preset or the checkpoint's
config.json, without building weights), the strategy and its per-layer scopes, the buckets and the rows run,
the cache length, the dispatcher and its declared capabilities, the capture and measurement options, the
prompts, and whether it fits this machine's memory. Every error names the config key and the fix
(`PlanError`); options that do not apply to the chosen dispatcher or strategy are refused, not ignored.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moecg.capture.buckets import bucket_for, validate_buckets
from moecg.capture.plan import COMPILE_MODES, KERNELS, StrategyError, StrategySpec, validate, validate_capture
import moecg.config  # noqa: F401  (registers the config groups with Hydra's ConfigStore)
from moecg.config.readers import PlanError, as_bool, as_choice, as_float, as_int
from moecg.dispatch import REGISTRY, Dispatcher, make_dispatcher
from moecg.parallel.plan import ParallelError, ParallelPlan, resolve_parallel

BACKENDS = ("auto", "cuda", "emulate", "none")
KERNEL_BACKENDS = ("auto", "triton", "torch")
PROMPTS = ("random", "heldout", "file")
MEMORY_HEADROOM = 0.85  # refuse a run whose estimate exceeds this share of the memory available now


# -- the plan -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelPlan:
    preset: str | None
    pretrained_path: str | None
    num_layers: int | None  # the override (None: the checkpoint's or preset's depth)
    dtype: str
    router_skew: float
    attn_implementation: str
    family: str
    config: object = field(repr=False, compare=False)  # the HF config the model will be built from
    layers: int = 0  # decoder layers the model will have


@dataclass(frozen=True)
class MeasurePlan:
    repeats: int
    skip_steps: int
    eager_baseline: bool
    fidelity: bool
    fidelity_rows: int
    hbm_bandwidth_gbps: float | None  # None: unknown for this device (no floor)
    bandwidth_source: str  # "config" | "device table" | "unknown"
    nvlink_bandwidth_gbps: float | None  # per direction, for the all-to-all floor (parallel.ep > 1); None: unknown
    nvlink_source: str  # "config" | "device table" | "unknown"
    heldout_bpb: bool
    heldout_bytes: int


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
    buckets: tuple[int, ...]
    batch_size: int
    bucket: int | None  # rows a captured step runs (None: no graphs, or above the largest bucket)
    max_rows: int  # rows the engine's cache holds
    prompt_len: int
    new_tokens: int
    max_cache_len: int
    seed: int
    prompts_kind: str
    prompts: torch.Tensor = field(repr=False, compare=False)  # [B, S] int64 on the host
    capture_backend: str = "auto"  # as configured; `captures` says whether graphs will be made
    captures: bool = False  # graphs will be captured (a graph strategy and a backend that can capture)
    warmup: int = 3
    compile: bool = False
    compile_mode: str = "default"
    kernels: str = "hf"
    kernel_backend: str = "auto"
    measure: MeasurePlan | None = None
    needs_baseline: bool = False  # time strategy=eager on HF's modules (same dispatch) for speedup_vs_eager
    memory_bytes: int = 0  # estimate: weights + KV caches + the largest transient
    decode_steps: int = 0  # decode steps the whole run executes (every repeat, baseline and fidelity pass)
    workload: object = None  # moecg.workload.WorkloadPlan: FIXED, or the requests a serving run replays
    prefill_chunk: int | None = None  # prompt tokens per prefill forward (None: the whole prompt in one)

    @property
    def serving(self) -> bool:
        return self.workload is not None and self.workload.serving
    parallel: ParallelPlan = field(default_factory=ParallelPlan)  # expert parallelism (ep=1: one process)

    def describe(self) -> str:
        d = self.dispatcher
        opts = ", ".join(f"{k}={getattr(d, k)}" for k in d.options())
        if self.serving:
            return (f"{self.model.preset or self.model.pretrained_path} ({self.model.family}, {self.model.layers} "
                    f"layers, {self.dtype}) on {self.device.type} | strategy={self.strategy.name} | dispatch={d.name}"
                    f"{' (' + opts + ')' if opts else ''} | {self.workload.describe()}"
                    f"{' in buckets up to ' + str(self.bucket) if self.bucket else ''} | cache {self.max_cache_len} | "
                    f"~{self.memory_bytes / 2**30:.2f} GiB")
        return (f"{self.model.preset or self.model.pretrained_path} ({self.model.family}, {self.model.layers} layers, "
                f"{self.dtype}) on {self.device.type} | strategy={self.strategy.name}"
                f"{' kernels=' + self.kernels if self.kernels != 'hf' else ''} | dispatch={d.name}"
                f"{' (' + opts + ')' if opts else ''} | batch {self.batch_size}"
                f"{' in bucket ' + str(self.bucket) if self.bucket else ''}"
                f"{f' per rank x {self.parallel.ep} ranks ({self.parallel.backend})' if self.parallel.ep > 1 else ''}"
                f" | prompt {self.prompt_len} + "
                f"{self.new_tokens} new | ~{self.decode_steps} decode steps | ~{self.memory_bytes / 2**30:.2f} GiB")


# -- resolution ---------------------------------------------------------------------------------------------------
def resolve_plan(cfg) -> RunPlan:
    """Validate the whole config (no CUDA kernels run) and return the frozen plan."""
    from moecg.models import resolve_device, resolve_dtype
    from moecg.workload import FIXED, resolve_workload, workload_name

    batch = as_int(cfg.batch_size, "batch_size", 1, 4)
    prompt_len = as_int(cfg.prompt_len, "prompt_len", 1, 16)
    new_tokens = as_int(cfg.new_tokens, "new_tokens", 1, 32)
    seed = as_int(cfg.seed, "seed", None, 0)
    serving = workload_name(cfg.get("workload")) != "fixed"
    if not serving:
        max_cache_len = prompt_len + new_tokens if cfg.max_cache_len is None else \
            as_int(cfg.max_cache_len, "max_cache_len", 1, prompt_len + new_tokens)
        if prompt_len + new_tokens > max_cache_len:
            raise PlanError(f"prompt_len + new_tokens = {prompt_len + new_tokens} exceeds max_cache_len="
                            f"{max_cache_len}: raise max_cache_len (or leave it null) or lower new_tokens")
    try:
        device = resolve_device(cfg.device)
    except ValueError as e:
        raise PlanError(str(e)) from None

    model = _model_plan(cfg.model)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    workload = FIXED
    if serving:
        # the requests decide the cache, the rows and the lengths: batch_size/prompt_len/new_tokens are fixed's
        workload, max_cache_len = resolve_workload(
            cfg.workload, vocab=model.config.vocab_size, prompts_kind=as_choice(cfg.prompts, "prompts", PROMPTS),
            max_cache_len=cfg.max_cache_len, max_positions=max_pos, default_seed=seed)
        batch = workload.max_batch
        prompt_len = max(r.prompt_len for r in workload.requests)
        new_tokens = max(r.output_len for r in workload.requests)
    else:
        resolve_workload(cfg.get("workload"), vocab=0, prompts_kind="random", max_cache_len=None, max_positions=None,
                         default_seed=seed)  # refuses keys fixed does not read
    if max_pos and max_cache_len > max_pos and not serving:
        raise PlanError(f"max_cache_len = {max_cache_len} (prompt_len + new_tokens unless set) exceeds the model's "
                        f"max_position_embeddings={max_pos}: positions past it are outside what the model was built "
                        f"for; lower new_tokens/prompt_len (at most {max_pos} in all)")
    try:
        dtype = resolve_dtype(cfg.model.dtype, device)
    except ValueError as e:
        raise PlanError(str(e)) from None

    # dispatcher: options it does not read are refused; values are type-checked against its fields
    d = cfg.dispatch
    name = d.name
    if name not in REGISTRY:
        raise PlanError(f"dispatch={name!r}: choose one of {', '.join(sorted(REGISTRY))}")
    try:
        dispatcher = make_dispatcher(name, **{k: v for k, v in dict(d).items() if k not in ("name", "prefill")})
    except (ValueError, TypeError) as e:
        raise PlanError(str(e)) from None
    prefill = d.prefill
    if prefill in (None, "same", name):
        prefill_dispatcher = None
    elif prefill in REGISTRY:
        prefill_dispatcher = make_dispatcher(prefill)
    else:
        raise PlanError(f"dispatch.prefill={prefill!r}: choose same or one of {', '.join(sorted(REGISTRY))}")
    prefill_chunk = _prefill_chunk(cfg.prefill_chunk, prefill_dispatcher or dispatcher, cfg.get("workload"))

    # strategy x dispatch x layers
    layers_spec = cfg.strategy.layers
    try:
        spec, scopes = validate(cfg.strategy.name, dispatcher, model.layers, layers_spec)
    except StrategyError as e:
        raise PlanError(str(e)) from None

    # capture
    c = cfg.capture
    try:
        buckets = validate_buckets(c.buckets)
    except (ValueError, TypeError) as e:
        raise PlanError(str(e)) from None
    backend = as_choice(c.backend, "capture.backend", BACKENDS)
    if backend == "cuda" and device.type != "cuda":
        raise PlanError("capture.backend=cuda needs a CUDA device: use capture.backend=auto (or emulate on CPU)")
    warmup = as_int(c.warmup, "capture.warmup", 1, 3)
    compile_ = as_bool(c.compile, "capture.compile")
    compile_mode = as_choice(c.compile_mode, "capture.compile_mode", COMPILE_MODES)
    if not compile_ and compile_mode != "default":
        raise PlanError(f"capture.compile_mode={compile_mode} only applies with capture.compile=true")
    kernels = as_choice(c.kernels, "capture.kernels", KERNELS)
    kernel_backend = as_choice(c.kernel_backend, "capture.kernel_backend", KERNEL_BACKENDS)
    if kernels == "hf" and kernel_backend != "auto":
        raise PlanError(f"capture.kernel_backend={kernel_backend} only applies with capture.kernels=fused")
    try:
        validate_capture(spec, kernels, compile_, compile_mode)  # the same check Capture makes
    except StrategyError as e:
        raise PlanError(str(e)) from None
    if kernels == "fused" and kernel_backend == "triton" and device.type != "cuda":
        raise PlanError("capture.kernel_backend=triton needs CUDA: use capture.kernel_backend=auto on CPU")
    if spec.scope == "eager" and compile_:
        raise PlanError("capture.compile=true compiles the captured pieces, and strategy=eager captures none: "
                        "pick a graph strategy or drop capture.compile")
    _check_family(model, kernels, step_graph=spec.scope == "step")
    if serving:
        _check_ragged(model, kernels, compile_, workload.name)

    from moecg.models.adapter import ADAPTERS

    try:
        parallel = resolve_parallel(cfg.parallel, device, ADAPTERS[model.family].num_experts(model.config),
                                    (dispatcher, prefill_dispatcher), compile_)
    except ParallelError as e:
        raise PlanError(str(e)) from None
    if serving and parallel.ep > 1:
        raise PlanError(f"workload={workload.name} with parallel.ep={parallel.ep}: serving runs on one process "
                        "(expert-parallel ragged decode is not built); use workload=fixed or parallel.ep=1")
    if parallel.ep > 1 and device.type == "cuda":
        device = torch.device("cuda", parallel.local_rank)  # one GPU per rank

    resolved_backend = ("cuda" if device.type == "cuda" else "none") if backend == "auto" else backend
    captures = spec.scope != "eager" and resolved_backend != "none"
    bucket = bucket_for(batch, buckets) if captures else None
    max_rows = max(bucket or batch, batch)

    measure = _measure_plan(cfg.measure, device, model, None if serving else new_tokens, parallel.ep)
    prompts_kind = as_choice(cfg.prompts, "prompts", PROMPTS)
    if prompts_kind != "file" and cfg.prompt_file:
        raise PlanError(f"prompt_file is only read with prompts=file (got prompts={prompts_kind}): "
                        "add prompts=file or drop prompt_file")
    from moecg.prompts import PromptError, make_prompts

    ep, rank = parallel.ep, parallel.rank
    if serving:
        prompts = torch.zeros(0, 0, dtype=torch.long)  # each request's prompt: workload.prompts
    else:
        try:
            # every rank decodes batch_size rows of its own: rows [rank*B, (rank+1)*B) of the ep*B prompts one
            # process would make, so a dropless job's tokens equal one process decoding all ep*B rows
            prompts = make_prompts(prompts_kind, batch * ep, prompt_len, seed, model.config.vocab_size,
                                   cfg.prompt_file)[rank * batch:(rank + 1) * batch]
        except PromptError as e:
            where = f" (parallel.ep={ep}: batch_size={batch} rows on each rank, {batch * ep} in all)" if ep > 1 else ""
            raise PlanError(f"{e}{where}") from None

    # the eager baseline (HF modules, same dispatch) is timed unless the run itself is that path
    needs_baseline = measure.eager_baseline and (spec.scope != "eager" or kernels != "hf") and not serving
    passes = (measure.repeats + 1) * (2 if needs_baseline else 1) \
        + (3 if measure.fidelity else 0) + 1
    if serving:  # at most one step per generated token; fidelity decodes its requests alone
        steps = sum(r.output_len - 1 for r in workload.requests)
        if measure.fidelity:
            steps += sum(r.output_len - 1 for r in workload.requests[:measure.fidelity_rows])
    plan = RunPlan(
        model=model, device=device, dtype=dtype, strategy=spec, strategy_layers=layers_spec,
        scopes=tuple(scopes) if scopes is not None else None, dispatcher=dispatcher,
        prefill_dispatcher=prefill_dispatcher, buckets=buckets, batch_size=batch, bucket=bucket, max_rows=max_rows,
        prompt_len=prompt_len, new_tokens=new_tokens, max_cache_len=max_cache_len, seed=seed,
        prompts_kind=prompts_kind, prompts=prompts, capture_backend=backend, captures=captures, warmup=warmup,
        compile=compile_, compile_mode=compile_mode, kernels=kernels, kernel_backend=kernel_backend,
        measure=measure, needs_baseline=needs_baseline, memory_bytes=0,
        decode_steps=steps if serving else passes * max(new_tokens - 1, 1), workload=workload, parallel=parallel,
        prefill_chunk=prefill_chunk,
    )
    need = estimate_memory(plan)
    object.__setattr__(plan, "memory_bytes", need)
    check_fits(plan)
    return plan


def _prefill_chunk(value, prefiller: Dispatcher, workload) -> int | None:
    """prefill_chunk (moecg.engine.DecodeEngine): None, or tokens per prefill forward on the fixed-batch engine."""
    from moecg.engine import check_prefill_chunk
    from moecg.workload import workload_name

    if value is None:
        return None
    chunk = as_int(value, "prefill_chunk", 2, 2048)
    wl = workload_name(workload)
    if wl != "fixed":
        raise PlanError(f"prefill_chunk={chunk} with workload={wl}: serving prefills on the ragged engine, which does "
                        "not chunk (workload.prefill_tokens bounds its batched prefills instead); set "
                        "prefill_chunk=null or use workload=fixed")
    try:
        return check_prefill_chunk(chunk, prefiller)
    except ValueError as e:
        raise PlanError(str(e)) from None


def _model_plan(m) -> ModelPlan:
    from moecg.models import PRESETS, make_config
    from moecg.models.zoo import family_of_config

    preset, path = m.preset, m.pretrained_path
    num_layers = None if m.num_layers is None else as_int(m.num_layers, "model.num_layers", 1, 2)
    skew = as_float(m.router_skew, "model.router_skew", 0.0, example=0.1)
    if path:
        p = Path(str(path)).expanduser()
        if not (p / "config.json").is_file():
            what = "is not a directory" if not p.is_dir() else "has no config.json"
            raise PlanError(f"model.pretrained_path={path}: {what}; give a local directory written by "
                            "save_pretrained (models cannot be downloaded here)")
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(p), local_files_only=True)
        except Exception as e:  # noqa: BLE001
            raise PlanError(f"model.pretrained_path={path}: cannot read its config.json ({type(e).__name__}: {e})")
        if num_layers is not None:
            config.num_hidden_layers = num_layers
        path = str(p)
    else:
        if preset is None:
            raise PlanError("model.preset is null and no model.pretrained_path: pick model=<preset> "
                            f"({', '.join(sorted(PRESETS))}) or model=local model.pretrained_path=/dir")
        if preset not in PRESETS:
            raise PlanError(f"model.preset={preset!r}: choose one of {', '.join(sorted(PRESETS))}")
        from moecg.models import shipped_checkpoint

        config = make_config(preset, num_layers)
        if shipped_checkpoint(preset):
            path = None  # build_model finds the shipped weights itself
    try:
        family = family_of_config(config)
    except ValueError as e:
        raise PlanError(f"model: {e}") from None
    return ModelPlan(preset, path, num_layers, m.dtype, skew, m.attn_implementation, family, config,
                     int(config.num_hidden_layers))


def _check_family(model: ModelPlan, kernels: str, step_graph: bool) -> None:
    """The family adapter's own audit of the config (features a path does not model are refused there)."""
    from moecg.models.adapter import ADAPTERS

    try:
        ADAPTERS[model.family].check_supported(model.config, kernels, step_graph=step_graph)
    except ValueError as e:
        raise PlanError(str(e)) from None


def _check_ragged(model: ModelPlan, kernels: str, compile_: bool, workload: str) -> None:
    """What serving (moecg.ragged.RaggedEngine: a length per row) runs, in one place. capture.kernels=fused runs
    (FastDecode reads each row's position; the MLA families are refused by the fused-path audit, as everywhere)."""
    from moecg.models import FAMILIES
    from moecg.models import _attn_implementation
    from moecg.ragged import ragged_windows

    if compile_:
        raise PlanError(f"capture.compile=true with workload={workload}: the ragged decode step is not compiled "
                        "(untested); drop capture.compile")
    _, cls = FAMILIES[model.family]
    try:
        ragged_windows(model.config, _attn_implementation(cls, model.attn_implementation))
    except ValueError as e:
        raise PlanError(f"workload={workload}: {e} (model.attn_implementation)") from None


def _measure_plan(m, device, model: ModelPlan, new_tokens: int | None, ep: int = 1) -> MeasurePlan:
    from moecg.floor import device_bandwidth_gbps, device_nvlink_gbps

    bw = m.hbm_bandwidth_gbps
    if bw in (None, "auto"):
        bw, source = device_bandwidth_gbps(device)
    else:
        bw, source = as_float(bw, "measure.hbm_bandwidth_gbps", 0.0, strict=True, example=4300), "config"
    nvl = m.nvlink_bandwidth_gbps
    if nvl in (None, "auto"):
        nvl, nvl_source = device_nvlink_gbps(device) if ep > 1 else (None, "unknown")
    elif ep == 1:
        raise PlanError(f"measure.nvlink_bandwidth_gbps={nvl} prices the all-to-all of parallel.ep > 1, and this run has "
                        "parallel.ep=1 (no exchange): drop it")
    else:
        nvl, nvl_source = as_float(nvl, "measure.nvlink_bandwidth_gbps", 0.0, strict=True, example=450), "config"
    want = m.heldout_bpb
    byte_level = model.config.vocab_size == 256
    if want == "auto":
        heldout = byte_level
    else:
        heldout = as_bool(want, "measure.heldout_bpb")
        if heldout and not byte_level:
            raise PlanError(f"measure.heldout_bpb=true needs a byte-level model (vocab_size 256; this one has "
                            f"{model.config.vocab_size}): use a *_stdlib model or measure.heldout_bpb=auto")
    repeats = as_int(m.repeats, "measure.repeats", 1, 3)
    skip = as_int(m.skip_steps, "measure.skip_steps", 0, 2)
    if new_tokens is not None and skip >= new_tokens - 1 and new_tokens > 1:
        raise PlanError(f"measure.skip_steps={skip} leaves none of the {new_tokens - 1} decode steps to time: "
                        f"lower measure.skip_steps or raise new_tokens")
    return MeasurePlan(
        repeats=repeats, skip_steps=skip, eager_baseline=as_bool(m.eager_baseline, "measure.eager_baseline"),
        fidelity=as_bool(m.fidelity, "measure.fidelity"), fidelity_rows=as_int(m.fidelity_rows, "measure.fidelity_rows", 0, 8),
        hbm_bandwidth_gbps=bw, bandwidth_source=source, nvlink_bandwidth_gbps=nvl, nvlink_source=nvl_source,
        heldout_bpb=heldout,
        heldout_bytes=as_int(m.heldout_bytes, "measure.heldout_bytes", 2, 16384),
    )


# -- memory ---------------------------------------------------------------------------------------------------------
def _param_bytes(config, dtype_bytes: int) -> tuple[int, int]:
    """(all parameters, one decoder layer's) in bytes, counted on the meta device (no memory, no init)."""
    from moecg.models.zoo import FAMILIES, family_of_config

    _, cls = FAMILIES[family_of_config(config)]
    with torch.device("meta"):
        m = cls(config)
    total = sum(p.numel() for p in m.parameters())
    per_layer = max(sum(p.numel() for p in layer.parameters()) for layer in m.model.layers)
    return total * dtype_bytes, per_layer * dtype_bytes


def _kv_bytes_per_layer(plan: RunPlan, dtype_bytes: int) -> int:
    from moecg.models.adapter import ADAPTERS

    cfg = plan.model.config
    # keys + values per token as the cache holds them (MLA: its latent, not per-head K/V)
    per_token = ADAPTERS[plan.model.family].kv_elems_per_token(cfg)
    return plan.max_rows * per_token * plan.max_cache_len * dtype_bytes


def _prefill_tokens(plan: RunPlan) -> int:
    """Prompt tokens per row in the largest prefill forward (the engine's chunk_bounds)."""
    from moecg.engine import chunk_bounds

    return max(e - s for s, e in chunk_bounds(plan.prompt_len, plan.prefill_chunk))


def estimate_memory(plan: RunPlan) -> int:
    """Bytes the run holds at its peak: weights, the KV caches of the reference and measured engines, logits."""
    nbytes = torch.empty((), dtype=plan.dtype).element_size()
    weights, _ = _param_bytes(plan.model.config, nbytes)
    engines = 2 if plan.measure.fidelity else 1
    if plan.serving:  # fidelity decodes one request at a time; the anchor's paged cache holds the KV again
        engines = 1 + (1 if plan.workload.anchor else 0)
    kv = engines * plan.model.layers * _kv_bytes_per_layer(plan, nbytes)
    cfg = plan.model.config
    # prefill transient, per forward (a chunk with prefill_chunk): hidden states and the MLP's widest activation for
    # every token, and HF's [B, 1, S, L] boolean mask over the whole cache; fp32 logits kept
    width = max(getattr(cfg, "intermediate_size", 0), getattr(cfg, "moe_intermediate_size", 0) or 0) * 2
    tokens = plan.max_rows * _prefill_tokens(plan)
    transient = tokens * (cfg.hidden_size * 4 + width) * 4 + tokens * plan.max_cache_len
    logits = plan.max_rows * cfg.vocab_size * 4 * (plan.new_tokens + 2)
    return int(weights + kv + transient + logits)


def grouped_fallback_bytes(plan: RunPlan) -> int:
    """The sort + grouped-GEMM experts (dropless, fused's prefill, the fidelity reference) on CUDA outside bf16 take
    grouped_mm's sync-free fallback, which gathers one expert weight per assignment: [S, Din, Dout] for the prefill."""
    if plan.device.type != "cuda" or plan.dtype == torch.bfloat16:
        return 0
    cfg = plan.model.config
    from moecg.models.adapter import ADAPTERS

    k = ADAPTERS[plan.model.family].top_k(cfg)
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    nbytes = torch.empty((), dtype=plan.dtype).element_size()
    return plan.max_rows * _prefill_tokens(plan) * k * cfg.hidden_size * 2 * inter * nbytes


def available_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(plan: RunPlan, available: int | None = None) -> None:
    """Refuse a run that cannot fit this machine's memory, with what it needs and the override that fits."""
    avail = available_memory(plan.device) if available is None else available
    if avail is not None and plan.device.type == "cpu" and plan.parallel.ep > 1:
        avail //= plan.parallel.ep  # the ranks of one torchrun share this machine's RAM, each builds the whole model
    fallback = grouped_fallback_bytes(plan)
    if avail is not None and fallback and (plan.measure.fidelity or not plan.dispatcher.reads_all_experts) \
            and plan.memory_bytes + fallback > MEMORY_HEADROOM * avail:
        raise PlanError(f"model.dtype={plan.model.dtype} on CUDA: grouped_mm has a fast kernel only for bf16, and its "
                        f"fallback gathers an expert weight per assignment, {fallback / 2**30:.0f} GiB for this prefill "
                        f"(batch {plan.max_rows} x prompt {_prefill_tokens(plan)} per forward): use model.dtype=bf16 (or "
                        "auto), or a smaller batch_size/prompt_len/prefill_chunk")
    if avail is None or plan.memory_bytes <= MEMORY_HEADROOM * avail:
        return
    nbytes = torch.empty((), dtype=plan.dtype).element_size()
    weights, per_layer = _param_bytes(plan.model.config, nbytes)
    engines = 2 if plan.measure.fidelity else 1
    per_layer_total = per_layer + engines * _kv_bytes_per_layer(plan, nbytes)
    fixed = plan.memory_bytes - plan.model.layers * per_layer_total
    fit = int((MEMORY_HEADROOM * avail - fixed) // per_layer_total) if per_layer_total else 0
    from moecg.models.adapter import ADAPTERS

    least = ADAPTERS[plan.model.family].min_layers(plan.model.config)  # a cut must keep a routed layer
    fix = (f"model.num_layers={fit} fits" if fit >= least else
           "no depth that keeps a routed layer fits: use a smaller preset, model.dtype=bf16 on a GPU, or a machine "
           "with more memory")
    where = "GPU" if plan.device.type == "cuda" else "CPU RAM" + (" per rank" if plan.parallel.ep > 1 else "")
    raise PlanError(f"this run needs about {plan.memory_bytes / 2**30:.1f} GiB ({plan.model.layers} layers, "
                    f"{plan.dtype}, batch {plan.max_rows}, cache {plan.max_cache_len}) but {avail / 2**30:.1f} GiB of "
                    f"{where} is available: {fix}")
