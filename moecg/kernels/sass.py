"""What a step's Triton kernels compile to on a Hopper GPU (sm_90), seen from any machine, a CPU-only one included:
the launches of a dry pass (sm90_dry_run) specialised as Triton's JIT specialises them on the GPU (the same binder:
16-byte pointer alignment, integer multiples of 16, constexprs), compiled with Triton's bundled ptxas, and read back
with its cuobjdump: registers, spilled stack, shared memory and the global loads by width (stats).

What it is for: a weight-streaming kernel that loses its pipelined or vectorised weight loads runs correct bits at a
fraction of the bandwidth, and only the machine code shows it (a split whose start the compiler cannot prove aligned;
an n-major weight tile transposed through registers). Nothing here runs a kernel.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import subprocess
import tempfile

from moecg.kernels import backend, launch

# the global loads cuobjdump's SASS names, by how many bytes one thread moves
WIDE = ("LDGSTS.E.BYPASS.128", "LDGSTS.E.128", "LDG.E.128", "LDG.E.128.CONSTANT", "LDG.E.128.STRONG.GPU")
ASYNC = "LDGSTS"  # cp.async: global -> shared without registers (the pipelined tiles)
NARROW = ("LDG.E.U16", "LDG.E.S16", "LDG.E.U8", "LDG.E.S8")


@contextlib.contextmanager
def sm90_dry_run():
    """Inside: the fused ops pick their Triton kernels on any device (backend.SM90_DRY) and launch them as on sm_90
    (PDL mode 2 unless launch.PDL says otherwise), recorded, not run (launch.dry_run; outputs are zeros). Yields the
    records (kernel, grid, args, kwargs). Build the step inside it as well: an op chooses its backend when built."""
    if backend.SM90_DRY:
        raise RuntimeError("sm90_dry_run() is already active")
    backend.SM90_DRY = True
    try:
        with launch.dry_run() as rec:
            yield rec
    finally:
        backend.SM90_DRY = False


@functools.lru_cache(maxsize=None)
def _target():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    return target, make_backend(target)


def compile_launch(kernel, args, kwargs):
    """One recorded launch compiled for sm_90 as the JIT would compile it there: Triton's own binder on these
    arguments (so the same specialisation), its option parsing (num_warps, num_stages, launch_pdl)."""
    from triton.compiler import ASTSource, compile
    from triton.runtime.jit import create_function_from_signature

    target, be = _target()
    binder = create_function_from_signature(kernel.signature, kernel.params, be)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(be, dict(kwargs), bound, spec, opts)
    return compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def bundled_tool(name: str) -> str:
    """The path of a CUDA binary Triton's NVIDIA backend ships (cuobjdump, nvdisasm, ptxas); FileNotFoundError where
    this Triton build has none."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {name} in this Triton build ({path})")
    return path


def stats(compiled) -> dict:
    """A compiled kernel's registers, stack (spills), shared memory (bytes) and global loads {SASS op: count}, with
    wide (16-byte, async or not), async (cp.async) and narrow (1-2 byte) totals; its SASS instructions and block
    barriers (BAR.SYNC: a reduction or layout change across warps; what a latency-bound kernel waits on)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        cuobjdump = bundled_tool("cuobjdump")
        res = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    loads: dict = {}
    for m in re.finditer(r"\b(LDGSTS(?:\.[A-Z0-9]+)*|LDG(?:\.[A-Z0-9]+)*)\s", sass):
        loads[m.group(1)] = loads.get(m.group(1), 0) + 1
    regs, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    return {"registers": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None,
            "shared": int(compiled.metadata.shared), "loads": loads,
            "wide_loads": sum(n for op, n in loads.items() if op in WIDE),
            "async_loads": sum(n for op, n in loads.items() if op.startswith(ASYNC)),
            "narrow_loads": sum(n for op, n in loads.items() if op in NARROW),
            "instructions": len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass)), "barriers": sass.count("BAR.SYNC")}


TILE_KEYS = ("BLOCK_M", "BLOCK_T", "BLOCK_N", "BLOCK_K", "SPLIT", "KN", "PAIRED", "MX", "A8", "QROWS")


def audit(records, seen: set | None = None) -> list[dict]:
    """One row per distinct specialisation among the records (launch._spec_key; the first launch's grid) not in seen
    (updated): the kernel, its grid, warps, stages, the tile constexprs it takes (TILE_KEYS) and stats()."""
    rows, seen = [], set() if seen is None else seen
    for kernel, grid, args, kwargs in records:
        key = launch._spec_key(kernel, args, kwargs)
        if key in seen:
            continue
        seen.add(key)
        compiled = compile_launch(kernel, args, kwargs)
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        rows.append({"kernel": kernel.fn.__name__.lstrip("_"), "grid": list(grid),
                     "programs": math.prod(int(g) for g in grid), "warps": compiled.metadata.num_warps,
                     "stages": compiled.metadata.num_stages,
                     "tiles": {k: kwargs[k] for k in TILE_KEYS if k in kwargs}, **stats(compiled)})
    return rows

