"""Graph mechanism: capture a function once per key into one shared memory pool, then replay it.

Knows nothing about MoE, layers or decoding. Inputs are static tensors the caller updates in place; outputs
are the static tensors the capture produced. Two backends: `cuda` (torch.cuda.CUDAGraph) and `emulate`, a
CPU stand-in that re-runs the function on the static inputs at replay, so the buffer, bucket and wrapping
logic can be tested without a GPU (a stale or wrongly aliased buffer gives wrong results there too).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_map


@dataclass
class GraphEntry:
    key: object
    handle: object
    outputs: object  # pytree of static output tensors
    capture_s: float = 0.0
    mem_bytes: int = 0
    replays: int = 0
    meta: dict = field(default_factory=dict)


class CudaBackend:
    name = "cuda"

    def __init__(self, device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()  # one pool for every graph: buckets share memory
        self.stream = None

    def warmup(self, fn, args, n: int):
        # Warm up on a side stream, as torch.cuda.graphs asks: lazy inits and allocator state settle there.
        if n == 0:
            return
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(n):
                fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(s)

    def capture(self, fn, args):
        # capture_begin/end on our own stream rather than `with torch.cuda.graph()`, whose __enter__ runs
        # gc.collect() + empty_cache() per graph: that costs seconds over hundreds of per-layer graphs.
        g = torch.cuda.CUDAGraph()
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            g.capture_begin(pool=self.pool)
            try:
                out = fn(*args)
            except BaseException:
                try:
                    g.capture_end()
                except Exception:  # noqa: BLE001 - the original error is the one to report
                    pass
                raise
            g.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return g, out

    def replay(self, handle, fn, args, outputs):
        handle.replay()

    def memory(self) -> int:
        return torch.cuda.memory_reserved(self.device)


class EmulateBackend:
    """CPU stand-in: replay re-executes `fn` on the static inputs and writes into the static outputs."""

    name = "emulate"

    def __init__(self, device=None):
        self.device = device

    def warmup(self, fn, args, n: int):
        for _ in range(n):
            fn(*args)

    def capture(self, fn, args):
        # A capture records without executing: emulate that by running on copies and discarding side effects
        # is impossible in general, so the emulated capture runs once; callers wrap capture in scratch state.
        out = fn(*args)
        return fn, tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)

    def replay(self, handle, fn, args, outputs):
        fresh = handle(*args)
        tree_map(lambda o, f: o.copy_(f) if isinstance(o, torch.Tensor) else None, outputs, fresh)

    def memory(self) -> int:
        return 0


def make_backend(name: str, device: torch.device):
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "none"
    if name == "cuda":
        if device.type != "cuda":
            raise ValueError("capture.backend=cuda needs the model on a CUDA device (use capture.backend=auto)")
        return CudaBackend(device)
    if name == "emulate":
        return EmulateBackend(device)
    if name == "none":
        return None
    raise ValueError(f"capture.backend={name!r}: choose auto, cuda, emulate or none")


class GraphRunner:
    """Captures `fn(*static_args)` per key (after `warmup` runs) and replays it."""

    def __init__(self, backend, warmup: int = 3):
        if warmup < 1:  # (the runner's warmup may be set to 0 later by whoever has done the first-call work itself)
            raise ValueError(f"capture.warmup={warmup}: at least 1 warmup run must precede a capture (3 is safe)")
        self.backend, self.warmup = backend, warmup
        self.entries: dict[object, GraphEntry] = {}
        self._fns: dict[object, tuple] = {}

    def __contains__(self, key) -> bool:
        return key in self.entries

    def capture(self, key, fn, args, on_warmed=None) -> GraphEntry:
        mem0 = self.backend.memory()
        t0 = time.perf_counter()
        self.backend.warmup(fn, args, self.warmup)
        if on_warmed is not None:
            on_warmed()
        handle, out = self.backend.capture(fn, args)
        if self.backend.name == "cuda":
            torch.cuda.synchronize(self.backend.device)
        entry = GraphEntry(key, handle, out, time.perf_counter() - t0, self.backend.memory() - mem0)
        self.entries[key] = entry
        self._fns[key] = (fn, args)
        return entry

    def replay(self, key):
        entry = self.entries[key]
        fn, args = self._fns[key]
        self.backend.replay(entry.handle, fn, args, entry.outputs)
        entry.replays += 1
        return entry.outputs
