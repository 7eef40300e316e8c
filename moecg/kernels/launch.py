"""How every Triton kernel of the fused decode step launches: programmatic dependent launch (PDL), the dry run that
records launches instead of running them, and the Precompiler that compiles what a dry run recorded.

Shared launch arguments live here too: `p2` (block sizes), `pos_stride` (a decode position's layout) and the split
kernels' arrival counters (`split_sems`). Nothing here computes; the ops are in norm_rope, attention, routers, gemv,
moe and capacity.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import os
import threading
import time

import torch
import triton
import triton.language as tl

from moecg.kernels import backend
from moecg.kernels.backend import interpreting


def p2(n: int) -> int:
    return triton.next_power_of_2(int(n))


# Programmatic dependent launch (Hopper+): a kernel launched with it may start while its predecessor drains; it
# waits (gdc_wait) for the predecessor's completion and memory before touching memory, so results are unchanged
# and only launch latency and prologue overlap. Modes: 0 off; 1 wait only (the next kernel may launch as this one's
# blocks exit); 2 also trigger the next kernel's launch at once (gdc_launch_dependents at the start).
# PDL None: mode 2 where the device (sm90+) and Triton support it; benchmarks set 0, 1 or 2. Off under the CPU
# interpreter.
PDL: int | None = None
# PRELOAD: a kernel that reads constant weights (the GEMV's first K step, norm_route's router rows, a norm's weight,
# the dropless MoE down kernel's first K step of its expert, which the router kernel two launches back chose) issues
# those loads before its PDL wait, so they run while its predecessor does; results are unchanged (no kernel writes
# weights). The fused step sets it from capture.preload while it runs (FastDecode(preload=)); True outside.
PRELOAD: bool = True


def pdl_mode(device) -> int:
    if backend.SM90_DRY:  # launches recorded for sm_90 (moecg.kernels.sass): as a Hopper GPU with PDL would launch them
        return 2 if PDL is None else int(PDL)
    if device.type != "cuda":
        return 0
    if PDL is not None:
        return int(PDL)
    if interpreting() or not _pdl_supported():
        return 0
    return 2 if _capability(device.index if device.index is not None else torch.cuda.current_device()) >= 9 else 0


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=None)
def _pdl_supported() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # noqa: BLE001 - no CUDA backend: no PDL
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and hasattr(tl.extra.cuda, "gdc_wait")


_SEMS: dict = {}  # (device, tiles, kernel) -> int32 zeros: split tiles' arrival counters, zeroed again by the kernel


def split_sems(device, n: int, kind: str) -> torch.Tensor:
    key = (str(device), n, kind)
    if key not in _SEMS:
        _SEMS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _SEMS[key]


def k_split(K: int, splits: int, block_k: int) -> tuple:
    """Split-K over K in whole K steps of block_k (each split's start a multiple of BLOCK_K that the kernel computes
    from a step count: aligned, pipelined loads): (K steps a split, the splits that then hold columns, at most
    `splits`). splits 1: (all of K's steps, 1)."""
    steps = triton.cdiv(triton.cdiv(K, splits), block_k)
    return steps, triton.cdiv(K, steps * block_k)


def pdl_args(device, trigger: bool = True, preload: bool = False) -> dict:
    """The launch arguments of a PDL-aware kernel: its USE_PDL mode and, when on, Triton's launch option.
    trigger False: at most mode 1 (the kernel's successor launches only as its blocks exit).
    preload: the kernel takes PRELOAD (its weight loads before the wait), set from the module's PRELOAD."""
    mode = pdl_mode(device)
    mode = min(mode, 1) if not trigger else mode
    return {"USE_PDL": mode, **({"launch_pdl": True} if mode else {}),
            **({"PRELOAD": int(PRELOAD)} if preload else {})}


@triton.jit
def pdl_enter(MODE: tl.constexpr):
    """A PDL-launched kernel's first statement (modes as PDL's): wait for the predecessor's completion and memory,
    then (mode 2) let the successor launch."""
    if MODE:
        tl.extra.cuda.gdc_wait()
        if MODE == 2:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def last_arrival(sem_ptr, i, n):
    """A split program's arrival at counter i after storing its partials: True for the last of n to arrive, which then
    sees every other program's partials (the add is acq_rel at gpu scope), merges them and stores 0 at sem_ptr + i
    again for the next call (and graph replay). The barrier first: every thread's partial stores are issued."""
    tl.debug_barrier()
    done = tl.atomic_add(sem_ptr + i, 1, sem="acq_rel", scope="gpu")
    return done == n - 1


def pos_stride(pos: torch.Tensor, T: int) -> int:
    """A decode position: a device scalar (stride 0: every row at one position) or [T] (each row's own)."""
    if pos.numel() == 1:
        return 0
    assert pos.shape == (T,) and pos.stride(0) == 1 and pos.dtype in (torch.int32, torch.int64), (pos.shape, T)
    return 1


# ------------------------------------------------------------------------------------------------------------
# Every kernel launch goes through `launch`. Inside `dry_run()` nothing launches: each launch is recorded (kernel, grid,
# arguments) and every public op returns zeros of its outputs' shapes (the launches that would have written them
# did not run), so a step run dry goes on safely (zeros are valid indices and weights for any torch op after).
# A Precompiler given to dry_run compiles each distinct specialisation on a thread pool as soon as it is recorded:
# Triton's code generation holds the GIL, but its ptxas and launcher (C compiler) subprocesses, about half of a cold
# compile, overlap each other and the rest of the dry pass.
_DRY: list | None = None
_PRE = None  # the active dry_run's Precompiler, if any


def launch(kernel, grid, *args, **kwargs):
    if _DRY is not None:
        _DRY.append((kernel, grid, args, kwargs))
        if _PRE is not None:
            _PRE.submit(kernel, grid, args, kwargs)
        return
    kernel[grid](*args, **kwargs)


def dry_zeros(fn):
    """An op whose outputs are zeros under dry_run() (its launches recorded, not run); tuples of outputs too, nested
    ones included (a producer's (output, (values, scales)) with `quant`)."""
    def zero(out):
        if isinstance(out, torch.Tensor):
            out.zero_()
        elif isinstance(out, tuple):
            for t in out:
                zero(t)

    @functools.wraps(fn)
    def op(*args, **kwargs):
        out = fn(*args, **kwargs)
        if _DRY is not None:
            zero(out)
        return out
    return op


@contextlib.contextmanager
def dry_run(precompiler=None):
    """Record the Triton launches of what runs inside, instead of launching them; yields the list. precompiler: a
    Precompiler that each recorded launch is submitted to (compiled meanwhile; its wait() gives the record)."""
    global _DRY, _PRE
    if _DRY is not None:
        raise RuntimeError("dry_run() is already active")
    rec = []
    _DRY, _PRE = rec, precompiler
    try:
        yield rec
    finally:
        _DRY = _PRE = None


def _spec_key(kernel, args, kwargs) -> tuple:
    """What Triton specialises a launch on, roughly: tensor dtype and 16-byte alignment, int 1 / multiple of 16 /
    width (width only for do_not_specialize arguments), the constexpr and launch keywords. Launches with one key
    compile once; a key finer than Triton's only costs a compile that finds Triton's cache filled."""
    names = list(getattr(kernel, "arg_names", ()))
    dns = {names.index(d) if isinstance(d, str) and d in names else d for d in getattr(kernel, "do_not_specialize", ())}

    def one(i, a):
        if isinstance(a, torch.Tensor):
            return ("t", a.dtype, a.data_ptr() % 16 == 0)
        if isinstance(a, bool):
            return ("b", a)
        if isinstance(a, int):
            wide = not -2**31 <= a < 2**31
            return ("i", wide) if i in dns else ("i", wide, a == 1, a % 16 == 0)
        return (type(a).__name__, a if a is None or isinstance(a, str) else None)
    return (id(kernel), tuple(one(i, a) for i, a in enumerate(args)),
            tuple(sorted((k, one(-1, v) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items())))


def _build(kernel, grid, args, kwargs) -> None:
    """Compile one launch's specialisation without running it, and build its launcher (a C module per signature)."""
    dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if dev is not None and dev.type == "cuda":
        torch.cuda.set_device(dev)
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()


# Triton's hash of its own sources (triton.runtime.cache.triton_key: sha256 over its Python files and libtriton, part of
# every kernel's cache key) takes 0.3-0.5 s in each process that compiles or loads a kernel. The Precompiler keeps it in
# a file of Triton's cache directory beside the fingerprint of the package it hashed (every .py / .so file's path,
# size and modification time, ~10 ms to take): a later process whose package has the same fingerprint reads it there
# instead of hashing; any file changed, added or removed gives another fingerprint, and the hash is computed again.
TRITON_KEY_FILE = "moecg-triton-key.txt"  # two lines: the fingerprint, the hash


def _triton_fingerprint() -> str:
    import triton

    root = os.path.dirname(os.path.abspath(triton.__file__))
    h = hashlib.sha256(f"{triton.__version__}\0{root}".encode())
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            if f.endswith((".py", ".so")):
                st = os.stat(os.path.join(d, f))
                h.update(f"{os.path.relpath(os.path.join(d, f), root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _key_file() -> str:
    try:
        from triton import knobs
        d = knobs.cache.dir
    except (ImportError, AttributeError):  # an older Triton: its default
        d = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return os.path.join(d, TRITON_KEY_FILE)


def load_triton_key() -> bool:
    """Triton's source hash for this process: True where it needs no computing (already computed here, or read from
    the key file with this package's fingerprint, and then installed as triton.runtime.cache.triton_key)."""
    from triton.runtime import cache

    info = getattr(cache.triton_key, "cache_info", None)
    if info is not None and info().currsize:
        return True
    try:
        with open(_key_file()) as f:
            lines = f.read().split("\n")
        if len(lines) != 3 or lines[2] or not lines[1] or lines[0] != _triton_fingerprint():
            return False
    except (OSError, UnicodeDecodeError):  # no file (a cold cache), or a package file unreadable: hash
        return False
    key = lines[1]
    cache.triton_key = functools.lru_cache(maxsize=None)(lambda: key)
    return True


def store_triton_key() -> None:
    """Compute Triton's source hash (triton.runtime.cache.triton_key) and write it with the package's fingerprint to the
    key file (a temporary file renamed over it: readers see the old file or the new one)."""
    from triton.runtime import cache

    key = cache.triton_key()  # first (lru-cached): whatever fails below, the compiles find it computed
    path = _key_file()
    try:
        text = f"{_triton_fingerprint()}\n{key}\n"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:  # a read-only cache or package: the next process hashes again
        pass


class Precompiler:
    """Compiles each distinct specialisation submitted (kernel, grid, args, kwargs) once, on a thread pool; wait()
    joins them, re-raises the first error and returns {"launches", "specialisations", "seconds"} (from creation).
    Under the CPU interpreter, or for kernels that are not Triton JIT functions, nothing compiles."""

    def __init__(self, workers: int | None = None):
        self._t0 = time.perf_counter()
        self.launches = 0
        self._futures: dict = {}
        self._off = interpreting()
        self._key = None
        if not self._off:
            try:
                known = load_triton_key()
            except ImportError:
                known = True  # no triton.runtime.cache: nothing to hash
            if not known:  # Triton's hash of its own sources (lru-cached; mostly sha256 over libtriton, which releases
                # the GIL): on a thread of its own while the dry pass records, each compile waiting for it (threads
                # racing to fill the cache would each hash it), then kept in the key file for the next process
                self._key = threading.Thread(target=store_triton_key, name="moecg-triton-key", daemon=True)
                self._key.start()
        n = workers or min(os.cpu_count() or 1, 16)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="moecg-precompile")

    def submit(self, kernel, grid, args, kwargs) -> None:
        self.launches += 1
        if self._off or not hasattr(kernel, "warmup"):
            return
        key = _spec_key(kernel, args, kwargs)
        if key not in self._futures:
            self._futures[key] = self._pool.submit(self._build, kernel, grid, args, kwargs)

    def _build(self, kernel, grid, args, kwargs) -> None:
        if self._key is not None:
            self._key.join()
        _build(kernel, grid, args, kwargs)

    def cancel(self) -> None:
        """Drop what has not started (the dry pass failed); running compiles finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def wait(self) -> dict:
        try:
            if self._key is not None:
                self._key.join()
            for f in self._futures.values():
                f.result()
        finally:
            self._pool.shutdown(wait=True)
        return {"launches": self.launches, "specialisations": len(self._futures),
                "seconds": time.perf_counter() - self._t0}
