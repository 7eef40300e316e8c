"""moecg.capture: apply a capture strategy to a decode engine, per batch bucket, and undo it.

`Capture.apply()` validates (before any CUDA work), installs itself as the engine's step policy (which bucket a
batch runs at, replay or eager; moecg.engine.StepPolicy) and the strategy's per-layer wrappers, and captures every
bucket largest first into one memory pool. Capture and replay are GraphRunner's (mechanism); which graph a step
replays is decided here (policy). `unwrap()` restores the engine's default policy and the model.
"""
from __future__ import annotations

import warnings
import weakref
from collections import defaultdict
from contextlib import contextmanager

import torch

from moecg.capture.buckets import DEFAULT_BUCKETS, bucket_for, validate_buckets
from moecg.capture.graph import GraphRunner, make_backend
from moecg.capture.layer import LayerGraphs
from moecg.capture.plan import (STRATEGIES, StrategyError, StrategySpec, parse_layers, resolve, validate,
                                validate_capture)
from moecg.dispatch import state_of
from moecg.fast import FastDecode
from moecg.kernels import tiles
from moecg.models.adapter import adapter_for

__all__ = ["Capture", "CaptureError", "STRATEGIES", "StrategyError", "StrategySpec", "DEFAULT_BUCKETS",
           "bucket_for", "validate_buckets", "parse_layers", "resolve", "validate"]

# model -> the keys (buckets, cache slots, PDL mode, weight preloads, tile tables, dispatcher) whose fused-step dry
# pass ran in this process: a second Capture of the same step (a sweep's next configuration, capture_time.py
# --recapture) skips it, every kernel being in memory already; anything new (other tiles passed in) still compiles,
# inside the first warmup that launches it
_PRECOMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

# capture.warmup=auto: eager runs before each capture. HF's modules (and a fused step not precompiled) get 3, for
# their lazy first-call work; the precompiled fused step gets none: its dry pass has run every bucket's torch ops
# (cuBLAS, the allocator, the step's own tables, streams and counters) and compiled and loaded every kernel with its
# launcher, which is all the first-call work a warmup would do (an eager run would only repeat it). A capture whose dry
# pass was skipped (it ran earlier in this process) gets one: a kernel it did not record compiles there.
WARMUP_HF, WARMUP_DRY, WARMUP_SKIPPED_DRY = 3, 0, 1

_FIXES = (
    "Ways to fix it:\n"
    "  1. use a graph-safe dispatcher: dispatch=dropless or dispatch=capacity\n"
    "  2. capture less: strategy=partial (attention only) or strategy=mixed with fewer 'layer' ranges\n"
    "  3. capture fewer/smaller buckets: capture.buckets=[1,2,4,8]\n"
    "  4. run strategy=eager to get a baseline without graphs\n"
    "A failed capture can leave the CUDA context unusable (later CUDA RNG calls fail with 'Offset increment "
    "outside graph capture'): restart the process before trying again."
)


class CaptureError(RuntimeError):
    pass


class Capture:
    """A capture strategy applied to a decode engine (its step policy while applied).

    kernels=fused: decode steps run moecg.fast.FastDecode(model, kernel_backend, pdl=, preload=, overlap_shared=,
    fuse_router=),
    whose knobs these are (FastDecode says what each does); with kernels=hf they must keep their defaults.
    precompile: kernels=fused on Triton: compile the step's kernels for every bucket on a thread pool before the first
    warmup (_precompile); False: each compiles inside the first warmup that launches it (benchmarks compare the two).
    warmup: eager runs before each capture (at least 1), or "auto" (WARMUP_DRY, none, after the precompile's dry pass,
    else WARMUP_HF).
    """

    def __init__(self, engine, strategy: str = "eager", *, layers: str | None = None, buckets=DEFAULT_BUCKETS,
                 backend: str = "auto", warmup: int | str = "auto", compile: bool = False,
                 compile_mode: str = "default", kernels: str = "hf", kernel_backend: str = "auto",
                 pdl: int | None = None, preload: bool = True, overlap_shared: bool = True, fuse_router: bool = True,
                 precompile: bool = True):
        self.engine = engine
        model = engine.model
        self.adapter = _adapter(model)
        self.num_layers = len(self.adapter.layers(model))
        state = state_of(model)
        if state is None:
            raise StrategyError("attach a dispatcher first: moecg.dispatch.attach(model, make_dispatcher(...))")
        self.spec, self.scopes = validate(strategy, state.dispatcher, self.num_layers, layers)
        # config features this capture cannot hold (e.g. dynamic rope in a whole-step graph): refused before CUDA work;
        # kernels=fused: FastDecode runs the fused-path audit itself below
        if kernels == "hf":
            self.adapter.check_supported(model.config, "hf", step_graph=self.spec.scope == "step")
        self.buckets = validate_buckets(buckets)
        self.backend = make_backend(backend, engine.device) if self.spec.scope != "eager" else None
        if self.backend is None and self.spec.scope != "eager":
            warnings.warn(f"CUDA graphs are unavailable on {engine.device.type}: strategy={strategy} runs eagerly "
                          "with the same dispatch (captured: false); drop counts are still real", stacklevel=2)
        if warmup != "auto" and (isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1):
            raise StrategyError(f"capture.warmup={warmup!r}: auto or an int >= 1 (eager runs before each capture)")
        self.warmup = warmup
        self.runner = GraphRunner(self.backend, WARMUP_HF if warmup == "auto" else warmup) \
            if self.backend is not None else None
        # Inductor-compiled pieces (fused kernels, no cudagraphs of its own) that moecg's graphs then capture;
        # kernels=fused: decode steps run moecg.fast.FastDecode (fused kernels) instead of HF's modules
        validate_capture(self.spec, kernels, bool(compile), compile_mode)
        self.compile, self.compile_mode = bool(compile), compile_mode
        self.kernels = kernels
        if not isinstance(precompile, bool):
            raise StrategyError(f"capture.precompile={precompile!r}: must be true or false")
        self.precompile = precompile
        self.fast = None
        if kernels == "fused":
            # checks the model (and the knobs) first, before any CUDA work
            self.fast = FastDecode(model, kernel_backend, pdl=pdl, preload=preload, overlap_shared=overlap_shared,
                                   fuse_router=fuse_router)
        else:
            for name, v, default in (("pdl", pdl, None), ("preload", preload, True),
                                     ("overlap_shared", overlap_shared, True), ("fuse_router", fuse_router, True)):
                if v is not default:
                    raise StrategyError(f"capture.{name}={v!r} only applies with capture.kernels=fused (a knob of the "
                                        f"fused step); leave it at its default ({default!r}) with capture.kernels=hf")
        self.decode_forward = None  # the step policy's forward of one-token steps (apply sets it)
        self.layer_graphs: LayerGraphs | None = None
        self.precompiled: dict | None = None  # triton_ops.Precompiler.wait()'s record, when it ran
        self._warned_big = False
        self._layer_now = None
        self.applied = False

    @property
    def captured(self) -> bool:
        return self.runner is not None and len(self.runner.entries) > 0

    # -- the step policy (moecg.engine.StepPolicy) ----------------------------------------------------
    def rows_for(self, n: int) -> int:
        """The bucket n real rows run at (n itself without graphs, or above the largest bucket)."""
        if self.runner is None:
            return n
        b = bucket_for(n, self.buckets)
        if b is None or b > self.engine.max_rows:
            if not self._warned_big:
                warnings.warn(f"batch of {n} rows is above the largest captured bucket "
                              f"({max(self.buckets)}): it runs eagerly", stacklevel=2)
                self._warned_big = True
            return n
        return b

    def step(self, ids, rows):
        """Replay the bucket's whole-step graph where there is one (scope step), else the eager step (whose layers
        replay their own graphs under the per-layer scopes)."""
        if self.spec.scope == "step" and self.runner is not None and rows in self.runner and ids is self.engine.ids:
            return self.runner.replay(rows)
        return self.engine.eager_step(ids, rows)

    # -- apply / unwrap --------------------------------------------------------------------------------
    def apply(self) -> "Capture":
        if self.applied:
            return self
        eng = self.engine
        self.decode_forward = self.fast
        if self.runner is None:  # eager strategy, or no CUDA
            eng.set_policy(self)
            self.applied = True
            return self
        state_of(eng.model).mask_in_graphs = self.spec.scope == "step" or "layer" in (self.scopes or [])
        if self.compile and self.spec.scope == "step":
            self.decode_forward = self._compiled(eng.model.forward)
        eng.set_policy(self)
        if self.spec.scope != "step":
            layers = self.adapter.layers(eng.model)
            targets = [(i, scope, layers[i]) for i, scope in enumerate(self.scopes) if scope != "eager"]
            self.layer_graphs = LayerGraphs(targets, self.runner, self.adapter,
                                            compile_fn=self._compiled if self.compile else None)
            self.layer_graphs.install()
        self.applied = True
        try:
            self._capture_all()
        except Exception:
            self.unwrap()
            raise
        return self

    def _capture_all(self) -> None:
        eng = self.engine
        state = state_of(eng.model)
        eng.cache.reset()
        order = sorted((b for b in self.buckets if b <= eng.max_rows), reverse=True)  # largest first: one pool
        if self.precompile and self.fast is not None and self.fast.backend == "triton" and order:
            self._precompile(order)
        if self.warmup == "auto" and self.runner is not None:
            if self.precompiled is None:
                self.runner.warmup = WARMUP_HF
            elif "skipped" in self.precompiled:  # the kernels in memory may miss a specialisation this step launches:
                self.runner.warmup = WARMUP_SKIPPED_DRY  # it compiles in a warmup, never inside a capture
            else:
                self.runner.warmup = WARMUP_DRY
        for b in order:
            try:
                with eng.scratch(), torch.no_grad():
                    state.set_rows(b, b)
                    eng.ids[:b].zero_()
                    if self.spec.scope == "step":
                        with state.rows(b), self._track_layer():
                            entry = self.runner.capture(b, lambda ids, b=b: eng.eager_step(ids, b), [eng.ids])
                        entry.meta.update(rows=b, layer="all", scope="step")
                    else:
                        self.layer_graphs.begin_pass()
                        try:
                            eng.eager_step(eng.ids, b)
                        finally:
                            self.layer_graphs.end_pass()
            except Exception as e:  # noqa: BLE001 - re-raised with the context a user needs
                layer = getattr(e, "layer", None)
                if layer is None:
                    layer = self._layer_now if self._layer_now is not None else "before the first decoder layer"
                raise CaptureError(f"capture failed: strategy={self.spec.name}, bucket={b}, layer={layer}, "
                                   f"dispatch={state.dispatcher.name}: {type(e).__name__}: {e}\n{_FIXES}") from e
        # pitfall 5: the captured graphs start from an empty cache
        eng.cache.reset()
        state.reset()

    def _precompile(self, order) -> None:
        """kernels=fused on Triton: run each bucket's step once dry (moecg.kernels.triton_ops.dry_run: its launches
        recorded, not run; the torch ops between them run on zeros), each distinct kernel specialisation compiling
        on a thread pool as soon as it is recorded; all done before the warmups, instead of one after another inside
        the first warmups."""
        from moecg.kernels import triton_ops  # Triton: optional, imported only where the fused step runs on it

        eng, state = self.engine, state_of(self.engine.model)
        key = (tuple(order), eng.max_cache_len, self.fast.pdl_mode(), self.fast.preload, tiles.MOE_TILE_RULES,
               tiles.GEMV_RULES, state.dispatcher.name)
        done = _PRECOMPILED.setdefault(eng.model, set())
        if key in done:
            self.precompiled = {"launches": 0, "specialisations": 0, "seconds": 0.0,
                                "skipped": "this step's kernels were precompiled earlier in this process"}
            return
        pre = triton_ops.Precompiler()
        try:
            with triton_ops.dry_run(pre):
                for b in order:
                    with eng.scratch(), torch.no_grad(), state.rows(b):
                        state.set_rows(b, b)
                        eng.ids[:b].zero_()
                        eng.eager_step(eng.ids, b)
        except BaseException:
            pre.cancel()
            raise
        self.precompiled = pre.wait()
        done.add(key)

    @contextmanager
    def _track_layer(self):
        """During a whole-step capture, remember which decoder layer is running, so a failure names it."""
        self._layer_now = None
        layers = self.adapter.layers(self.engine.model)

        def mark(i):
            def hook(*_):
                self._layer_now = i
            return hook

        handles = [layer.register_forward_pre_hook(mark(i)) for i, layer in enumerate(layers)]
        if self.fast is not None:
            self.fast.on_layer = lambda i: setattr(self, "_layer_now", i)
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            if self.fast is not None:
                self.fast.on_layer = None

    def _compiled(self, fn):
        return torch.compile(fn, mode=self.compile_mode, dynamic=False)

    def unwrap(self) -> None:
        eng = self.engine
        if self.layer_graphs is not None:
            self.layer_graphs.uninstall()
        eng.set_policy(None)
        self.decode_forward = None
        state = state_of(eng.model)
        if state is not None:
            state.mask_in_graphs = False
        self.applied = False

    # -- records -----------------------------------------------------------------------------------------
    def describe(self) -> dict:
        """The knobs of this capture that change what runs (null where they do not apply: kernels=hf)."""
        fast = self.fast.describe() if self.fast is not None else {}
        return {"pdl": fast.get("pdl"), "pdl_mode": fast.get("pdl_mode"), "preload": fast.get("preload"),
                "overlap_shared": fast.get("overlap_shared"), "fuse_router": fast.get("fuse_router"),
                "precompile": self.precompile if self.fast is not None else None,
                "fused_weight_mib": fast.get("fused_weight_mib")}

    def stats(self) -> dict:
        per = defaultdict(lambda: {"capture_s": 0.0, "graph_mem_mib": 0.0, "replays": 0, "graphs": 0})
        if self.runner is not None:
            for e in self.runner.entries.values():
                p = per[e.meta.get("rows")]
                p["capture_s"] += e.capture_s
                p["graph_mem_mib"] += e.mem_bytes / 2**20
                p["replays"] = max(p["replays"], e.replays)
                p["graphs"] += 1
        buckets = {int(k): v for k, v in sorted(per.items())}
        return {
            "captured": self.captured,
            "capture_backend": self.backend.name if self.backend is not None else "none",
            "capture_s": sum(v["capture_s"] for v in buckets.values()),
            "graph_mem_mib": sum(v["graph_mem_mib"] for v in buckets.values()),
            "graphs": sum(v["graphs"] for v in buckets.values()),
            "buckets": buckets,
            "layer_scopes": self.scopes,
            "layer_fallbacks": self.layer_graphs.fallbacks if self.layer_graphs else 0,
            "compiled": self.compile and self.runner is not None,
            "kernels": self.kernels,
            "kernel_backend": self.fast.backend if self.fast is not None else None,
            "precompiled": self.precompiled,
            "warmup": self.runner.warmup if self.runner is not None else None,
            **self.describe(),
        }


def _adapter(model):
    return adapter_for(model)
