"""Triton kernels for moecg's fused decode path; same signatures as `moecg.kernels.ref`.

Dims as in ref.py. Every kernel is graph-safe: no host syncs, device-side positions and counters, fixed
launch grids per batch size (programs with no work exit at once). Integer sizes that change with the batch
are not specialised (`do_not_specialize`), so one compilation serves every bucket.
Rounding follows HF's modules: bf16 after each elementwise op that HF runs in bf16.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moecg.kernels import _interpret, tiles as _tiles


def _p2(n: int) -> int:
    return triton.next_power_of_2(int(n))


# Programmatic dependent launch (Hopper+): a kernel launched with it may start while its predecessor drains; it
# waits (gdc_wait) for the predecessor's completion and memory before touching memory, so results are unchanged
# and only launch latency and prologue overlap. Modes: 0 off; 1 wait only (the next kernel may launch as this one's
# blocks exit); 2 also trigger the next kernel's launch at once (gdc_launch_dependents at the start).
# PDL None: mode 2 where the device (sm90+) and Triton support it; benchmarks set 0, 1 or 2. Off under the CPU
# interpreter.
PDL: int | None = None


def pdl_mode(device) -> int:
    if device.type != "cuda":
        return 0
    if PDL is not None:
        return int(PDL)
    if _interpret() or not _pdl_supported():
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


def _split_sems(device, n: int, kind: str) -> torch.Tensor:
    key = (str(device), n, kind)
    if key not in _SEMS:
        _SEMS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _SEMS[key]


def _pdl_args(device, trigger: bool = True) -> dict:
    """The launch arguments of a PDL-aware kernel: its USE_PDL mode and, when on, Triton's launch option.
    trigger False: at most mode 1 (the kernel's successor launches only as its blocks exit)."""
    mode = pdl_mode(device)
    mode = min(mode, 1) if not trigger else mode
    return {"USE_PDL": mode, **({"launch_pdl": True} if mode else {})}


@triton.jit
def _pdl_enter(MODE: tl.constexpr):
    """A PDL-launched kernel's first statement (modes as PDL's): wait for the predecessor's completion and memory,
    then (mode 2) let the successor launch."""
    if MODE:
        tl.extra.cuda.gdc_wait()
        if MODE == 2:
            tl.extra.cuda.gdc_launch_dependents()


# ------------------------------------------------------------------------------------------------------------
# Every launch goes through _launch. Inside `dry_run()` nothing launches: each launch is recorded (kernel, grid,
# arguments) and every public op returns zeros of its outputs' shapes (the launches that would have written them
# did not run), so a step run dry goes on safely (zeros are valid indices and weights for any torch op after).
# A Precompiler given to dry_run compiles each distinct specialisation on a thread pool as soon as it is recorded:
# Triton's code generation holds the GIL, but its ptxas and launcher (C compiler) subprocesses, about half of a cold
# compile, overlap each other and the rest of the dry pass.
_DRY: list | None = None
_PRE = None  # the active dry_run's Precompiler, if any


def _launch(kernel, grid, *args, **kwargs):
    if _DRY is not None:
        _DRY.append((kernel, grid, args, kwargs))
        if _PRE is not None:
            _PRE.submit(kernel, grid, args, kwargs)
        return
    kernel[grid](*args, **kwargs)


def _dry_zeros(fn):
    """An op whose outputs are zeros under dry_run() (its launches recorded, not run)."""
    @functools.wraps(fn)
    def op(*args, **kwargs):
        out = fn(*args, **kwargs)
        if _DRY is not None:
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor):
                    t.zero_()
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


class Precompiler:
    """Compiles each distinct specialisation submitted (kernel, grid, args, kwargs) once, on a thread pool; wait()
    joins them, re-raises the first error and returns {"launches", "specialisations", "seconds"} (from creation).
    Under the CPU interpreter, or for kernels that are not Triton JIT functions, nothing compiles."""

    def __init__(self, workers: int | None = None):
        import concurrent.futures
        import time

        self._t0 = time.perf_counter()
        self.launches = 0
        self._futures: dict = {}
        self._off = _interpret()
        if not self._off:
            try:  # Triton's hash of its own sources (lru-cached): once here, not once per thread racing to fill it
                from triton.runtime.cache import triton_key
                triton_key()
            except ImportError:
                pass
        n = workers or min(os.cpu_count() or 1, 16)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="moecg-precompile")

    def submit(self, kernel, grid, args, kwargs) -> None:
        self.launches += 1
        if self._off or not hasattr(kernel, "warmup"):
            return
        key = _spec_key(kernel, args, kwargs)
        if key not in self._futures:
            self._futures[key] = self._pool.submit(_build, kernel, grid, args, kwargs)

    def cancel(self) -> None:
        """Drop what has not started (the dry pass failed); running compiles finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def wait(self) -> dict:
        import time

        try:
            for f in self._futures.values():
                f.result()
        finally:
            self._pool.shutdown(wait=True)
        return {"launches": self.launches, "specialisations": len(self._futures),
                "seconds": time.perf_counter() - self._t0}


# ------------------------------------------------------------------------------------------------------------
# residual add (+ routed partial sums, + gated shared expert) + RMSNorm
@triton.jit(do_not_specialize=["T"])
def _add_rmsnorm_kernel(y_ptr, res_ptr, w_ptr, sh_ptr, sg_ptr, valid_ptr, out_res_ptr, out_ptr,
                        T, D, eps, s_yt, s_yk, s_rt, s_sht, s_sgt, s_ort, s_ot,
                        KK: tl.constexpr, HAS_RES: tl.constexpr, HAS_SHARED: tl.constexpr,
                        HAS_SGATE: tl.constexpr, HAS_VALID: tl.constexpr, CAST_LAST: tl.constexpr,
                        BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = 0):
    _pdl_enter(USE_PDL)
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(KK):
        acc += tl.load(y_ptr + t * s_yt + k * s_yk + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_VALID:
        ok = tl.load(valid_ptr + t).to(tl.int1)
        acc = tl.where(ok, acc, 0.0)
    out = acc.to(dt).to(tl.float32)
    if HAS_SHARED:
        sh = tl.load(sh_ptr + t * s_sht + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_SGATE:
            g = tl.load(sg_ptr + t * s_sgt).to(tl.float32)
            g = tl.sigmoid(g).to(dt).to(tl.float32)
            sh = (g * sh).to(dt).to(tl.float32)
        out = (out + sh).to(dt).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + t * s_rt + offs, mask=m, other=0.0).to(tl.float32)
        out = (r + out).to(dt).to(tl.float32)
    tl.store(out_res_ptr + t * s_ort + offs, out.to(dt), mask=m)
    var = tl.sum(out * out, axis=0) / D
    yn = out * tl.rsqrt(var + eps)
    if not CAST_LAST:  # Llama-style: the normalised x is rounded before the weight multiplies it
        yn = yn.to(dt).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * s_ot + offs, (w * yn).to(dt), mask=m)


@_dry_zeros
def add_rmsnorm(y, residual, weight, eps: float, shared=None, shared_gate=None, valid=None, cast_last: bool = False,
                out_dtype=None):
    T, KK, D = y.shape
    dt = (out_dtype or weight.dtype) if residual is None else residual.dtype
    new_res = torch.empty(T, D, dtype=dt, device=y.device)
    normed = torch.empty(T, D, dtype=dt, device=y.device)
    assert y.stride(2) == 1 and (residual is None or residual.stride(1) == 1)
    dummy = new_res
    _launch(_add_rmsnorm_kernel, (T,),
        y, residual if residual is not None else dummy, weight,
        shared if shared is not None else dummy, shared_gate if shared_gate is not None else dummy,
        valid if valid is not None else dummy, new_res, normed,
        T, D, eps, y.stride(0), y.stride(1), residual.stride(0) if residual is not None else 0,
        shared.stride(0) if shared is not None else 0, shared_gate.stride(0) if shared_gate is not None else 0,
        new_res.stride(0), normed.stride(0),
        KK=KK, HAS_RES=residual is not None, HAS_SHARED=shared is not None, HAS_SGATE=shared_gate is not None,
        HAS_VALID=valid is not None, CAST_LAST=cast_last, BLOCK_D=_p2(D), num_warps=_tiles.norm_warps(T, D, KK),
        **_pdl_args(y.device))
    return new_res, normed


# ------------------------------------------------------------------------------------------------------------
# (q/k RMSNorm) + rotary embedding (full or partial) + (clip) + KV-cache write at the device-side position.
# One program per (row, head). Each program loads its whole head and, for the rotary dims, each element's
# rotate_half partner (a second gather of the same cache lines), so a rotary part narrower than the head (partial
# rotary) needs no power-of-two split. A norm over the whole projection (OLMoE) sums the squares of every head of
# the projection in each program: Hq*Dh elements, a few KB, re-read from L1/L2.
@triton.jit(do_not_specialize=["T"])
def _rope_cache_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, q_ptr, qn_ptr, kn_ptr,
                       T, eps, clip, s_pos, s_qkv, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_qt, s_qh,
                       HQ: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, R: tl.constexpr,
                       HAS_QKN: tl.constexpr, NORM_FULL: tl.constexpr, HAS_CLIP: tl.constexpr,
                       USE_PDL: tl.constexpr = 0):
    _pdl_enter(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)  # [0, HQ): q heads, [HQ, HQ+HKV): k heads, then v heads
    d = tl.arange(0, DH)
    pos = tl.load(pos_ptr + t * s_pos)  # s_pos 0: one position for every row; 1: each row's own
    dt = q_ptr.dtype.element_ty
    row = qkv_ptr + t * s_qkv
    x = tl.load(row + h * DH + d).to(tl.float32)
    if h >= HQ + HKV:  # v: (clip and) copy into the cache
        if HAS_CLIP:
            x = tl.minimum(tl.maximum(x, -clip), clip)
        hv = h - HQ - HKV
        tl.store(v_ptr + t * s_vb + hv * s_vh + pos * s_vl + d, x.to(v_ptr.dtype.element_ty))
    else:
        half: tl.constexpr = R // 2
        rot = d < R
        partner = tl.where(d < half, d + half, d - half)  # rotate_half(x)[d] = -x[d + R/2] | x[d - R/2]
        xp = tl.load(row + h * DH + partner, mask=rot, other=0.0).to(tl.float32)
        if HAS_QKN:
            isq = h < HQ
            hl = tl.where(isq, h, h - HQ)  # head index within its projection
            if NORM_FULL:
                nh = tl.where(isq, HQ, HKV)
                p0 = tl.where(isq, 0, HQ)  # first head of this projection
                ss = tl.zeros([DH], dtype=tl.float32)
                for j in range(0, nh):
                    xj = tl.load(row + (p0 + j) * DH + d).to(tl.float32)
                    ss += xj * xj
                var = tl.sum(ss, axis=0) / (nh * DH)
                wo = hl * DH
            else:
                var = tl.sum(x * x, axis=0) / DH
                wo = 0
            r = tl.rsqrt(var + eps)
            # masked loads select the q or k weight: an unmasked load of the other one could run past its end
            mq = (h + d * 0) < HQ  # [DH]
            nw = (tl.load(qn_ptr + wo + d, mask=mq, other=0.0).to(tl.float32)
                  + tl.load(kn_ptr + wo + d, mask=~mq, other=0.0).to(tl.float32))
            nwp = (tl.load(qn_ptr + wo + partner, mask=mq & rot, other=0.0).to(tl.float32)
                   + tl.load(kn_ptr + wo + partner, mask=~mq & rot, other=0.0).to(tl.float32))
            x = (nw * (x * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xp = (nwp * (xp * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        if HAS_CLIP:
            x = tl.minimum(tl.maximum(x, -clip), clip)
            xp = tl.minimum(tl.maximum(xp, -clip), clip)
        c = tl.load(cos_ptr + pos * R + d, mask=rot, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * R + d, mask=rot, other=0.0).to(tl.float32)
        xr = tl.where(d < half, -xp, xp)
        # (x * cos) + (rotate_half(x) * sin); bf16 after each op as HF; dims past R pass through
        o = ((x * c).to(dt).to(tl.float32) + (xr * s).to(dt).to(tl.float32)).to(dt)
        o = tl.where(rot, o, x.to(dt))
        if h < HQ:
            dst = q_ptr + t * s_qt + h * s_qh
        else:
            dst = k_ptr + t * s_kb + (h - HQ) * s_kh + pos * s_kl
        tl.store(dst + d, o)


def _pos_stride(pos: torch.Tensor, T: int) -> int:
    """A decode position: a device scalar (stride 0: every row at one position) or [T] (each row's own)."""
    if pos.numel() == 1:
        return 0
    assert pos.shape == (T,) and pos.stride(0) == 1 and pos.dtype in (torch.int32, torch.int64), (pos.shape, T)
    return 1


@_dry_zeros
def rope_cache(qkv, pos, cos, sin, keys, values, n_q: int, n_kv: int, head_dim: int,
               q_norm=None, k_norm=None, eps: float = 1e-6, clip: float | None = None):
    T = qkv.shape[0]
    R = cos.shape[-1]
    assert qkv.stride(1) == 1 and keys.stride(3) == 1 and values.stride(3) == 1 and cos.is_contiguous()
    assert R % 2 == 0 and R <= head_dim and sin.shape == cos.shape
    q = torch.empty(T, n_q, head_dim, dtype=qkv.dtype, device=qkv.device)
    full = q_norm is not None and q_norm.numel() != head_dim
    _launch(_rope_cache_kernel, (T, n_q + 2 * n_kv),
        qkv, pos, cos, sin, keys, values, q, q_norm if q_norm is not None else q,
        k_norm if k_norm is not None else q, T, eps, float(clip or 0.0), _pos_stride(pos, T), qkv.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        q.stride(0), q.stride(1), HQ=n_q, HKV=n_kv, DH=head_dim, R=R, HAS_QKN=q_norm is not None,
        NORM_FULL=full, HAS_CLIP=clip is not None, num_warps=1,
        **_pdl_args(qkv.device))
    return q


# ------------------------------------------------------------------------------------------------------------
# decode attention: one program per (row, kv head, split of the context); the query heads of a kv group
# form the rows of a tensor-core tile. Splits > 1 write partial (max, sum, acc); the split of a (row, kv head)
# that finishes last (an arrival counter) merges them in split order, in the same kernel, so the result does not
# depend on which split ends last. Attention sinks (GPT-OSS) are one more logit per head with no value: they
# start the running (max, sum) at (sink, 1) -- in the merge when the context is split -- and never touch the
# accumulator.
# EAGER rounds the scores as HF's eager attention does (model dtype after QK and after the scaling); with sinks it
# also rounds the max-subtracted logits, which needs the final max first: TWO_PASS reads K twice (max, then the
# softmax with that max fixed), in one split.
@triton.jit
def _scores(q, k, scaling, dt: tl.constexpr, EAGER: tl.constexpr):
    s = tl.dot(q, tl.trans(k))  # [GP, BLOCK_L] fp32
    if EAGER:
        return (s.to(dt).to(tl.float32) * scaling).to(dt).to(tl.float32)
    return s * scaling


@triton.jit(do_not_specialize=["T", "chunk", "window"])
def _attn_decode_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, sink_ptr, o_ptr, m_ptr, l_ptr, acc_ptr, sem_ptr,
                        T, scaling, window, chunk, s_pos, s_qt, s_qh, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_ot,
                        G: tl.constexpr, GP: tl.constexpr, DH: tl.constexpr, BLOCK_L: tl.constexpr,
                        SPLIT: tl.constexpr, HAS_SINK: tl.constexpr, EAGER: tl.constexpr,
                        TWO_PASS: tl.constexpr, SUB_ROUND: tl.constexpr, SB: tl.constexpr = 1,
                        USE_PDL: tl.constexpr = 0):
    _pdl_enter(USE_PDL)
    t = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    pos = tl.load(pos_ptr + t * s_pos)  # s_pos 0: one position for every row; 1: each row's own
    n = pos + 1
    lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)
    start = lo + sp * chunk
    stop = tl.minimum(start + chunk, n)
    gi = tl.arange(0, GP)
    d = tl.arange(0, DH)
    gm = gi < G
    q = tl.load(q_ptr + t * s_qt + (hk * G + gi)[:, None] * s_qh + d[None, :], mask=gm[:, None], other=0.0)
    dt = q_ptr.dtype.element_ty
    kb = k_ptr + t * s_kb + hk * s_kh
    vb = v_ptr + t * s_vb + hk * s_vh
    if TWO_PASS:  # HF eager with sinks: softmax(round(cat(scores, sink) - max)), the max over keys and sink
        sk = tl.load(sink_ptr + hk * G + gi, mask=gm, other=0.0).to(tl.float32)
        m = sk
        for s0 in range(start, stop, BLOCK_L):
            sl = s0 + tl.arange(0, BLOCK_L)
            lm = sl < stop
            k = tl.load(kb + sl[:, None] * s_kl + d[None, :], mask=lm[:, None], other=0.0)
            s = tl.where(lm[None, :], _scores(q, k, scaling, dt, EAGER), float("-inf"))
            m = tl.maximum(m, tl.max(s, axis=1))
        xs = sk - m
        if SUB_ROUND:
            xs = xs.to(dt).to(tl.float32)
        l_i = tl.exp(xs)
        acc = tl.zeros([GP, DH], dtype=tl.float32)
        for s0 in range(start, stop, BLOCK_L):
            sl = s0 + tl.arange(0, BLOCK_L)
            lm = sl < stop
            k = tl.load(kb + sl[:, None] * s_kl + d[None, :], mask=lm[:, None], other=0.0)
            x = _scores(q, k, scaling, dt, EAGER) - m[:, None]
            if SUB_ROUND:
                x = x.to(dt).to(tl.float32)
            p = tl.where(lm[None, :], tl.exp(x), 0.0)
            l_i += tl.sum(p, axis=1)
            v = tl.load(vb + sl[:, None] * s_vl + d[None, :], mask=lm[:, None], other=0.0)
            acc += tl.dot(p.to(v.dtype), v)
        out = acc / l_i[:, None]
        tl.store(o_ptr + t * s_ot + (hk * G + gi)[:, None] * DH + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=gm[:, None])
    else:
        # SPLIT: only the splits that hold keys at this step's position run (n_act of them, device-side: the grid is
        # fixed by the cache's capacity); when one does (a short span), it writes the output itself, no merge
        n_act = 1
        if SPLIT:
            n_act = tl.cdiv(n - lo, chunk)
        direct = n_act == 1
        if sp < n_act:
            if HAS_SINK:
                sk = tl.load(sink_ptr + hk * G + gi, mask=gm, other=0.0).to(tl.float32)
                m_i = tl.where(direct, sk, float("-inf"))  # (the merge adds the sink otherwise)
                l_i = tl.where(direct, 1.0, 0.0) + tl.zeros([GP], dtype=tl.float32)
            else:
                m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([GP], dtype=tl.float32)
            acc = tl.zeros([GP, DH], dtype=tl.float32)
            for s0 in range(start, stop, BLOCK_L):
                sl = s0 + tl.arange(0, BLOCK_L)
                lm = sl < stop
                k = tl.load(kb + sl[:, None] * s_kl + d[None, :], mask=lm[:, None], other=0.0)
                s = _scores(q, k, scaling, dt, EAGER)  # [GP, BLOCK_L]
                s = tl.where(lm[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(vb + sl[:, None] * s_vl + d[None, :], mask=lm[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            if direct:
                out = acc / l_i[:, None]
                tl.store(o_ptr + t * s_ot + (hk * G + gi)[:, None] * DH + d[None, :],
                         out.to(o_ptr.dtype.element_ty), mask=gm[:, None])
            else:  # store this split's partials; the last active split of the (row, kv head) merges them all
                head = t * tl.num_programs(1) + hk
                row0 = head * tl.num_programs(2)
                tl.store(m_ptr + (row0 + sp) * GP + gi, m_i)
                tl.store(l_ptr + (row0 + sp) * GP + gi, l_i)
                tl.store(acc_ptr + ((row0 + sp) * GP + gi)[:, None] * DH + d[None, :], acc, mask=gm[:, None])
                tl.debug_barrier()
                done = tl.atomic_add(sem_ptr + head, 1, sem="acq_rel", scope="gpu")
                if done == n_act - 1:  # the others' partials are visible (acquire)
                    _attn_merge(o_ptr, m_ptr, l_ptr, acc_ptr, sink_ptr, s_ot, t, hk, row0, n_act, G, GP, DH,
                                HAS_SINK, SB)
                    tl.store(sem_ptr + head, 0)  # zero again for the next call (and graph replay)


@triton.jit
def _attn_merge(o_ptr, m_ptr, l_ptr, acc_ptr, sink_ptr, s_ot, t, hk, row0, splits, G: tl.constexpr,
                GP: tl.constexpr, DH: tl.constexpr, HAS_SINK: tl.constexpr, SB: tl.constexpr):
    """Merge the `splits` partial (max, sum, acc) of one (row, kv head), in split order, into its output heads.
    Run by the split that finishes last; its loads go to L2 (.cg), where the other splits' stores are. SB splits'
    loads are unrolled together (issued before their adds: fewer serial L2 round trips); the adds stay in order."""
    gi = tl.arange(0, GP)
    gm = gi < G
    d = tl.arange(0, DH)
    m = tl.full([GP], float("-inf"), dtype=tl.float32)
    if HAS_SINK:
        sink = tl.load(sink_ptr + hk * G + gi, mask=gm, other=0.0).to(tl.float32)
        m = sink
    for s0 in range(0, splits, SB):
        for j in tl.static_range(SB):
            ok = gm & (gi * 0 + s0 + j < splits)  # [GP]
            m = tl.maximum(m, tl.load(m_ptr + (row0 + s0 + j) * GP + gi, mask=ok, other=float("-inf"),
                                      cache_modifier=".cg"))
    m = tl.where(gm, m, 0.0)  # pad heads: finite (no inf - inf below); not stored
    l_tot = tl.zeros([GP], dtype=tl.float32)
    if HAS_SINK:
        l_tot = tl.exp(sink - m)
    acc = tl.zeros([GP, DH], dtype=tl.float32)
    for s0 in range(0, splits, SB):
        for j in tl.static_range(SB):
            ok = gm & (gi * 0 + s0 + j < splits)
            r = row0 + s0 + j
            ms = tl.load(m_ptr + r * GP + gi, mask=ok, other=float("-inf"), cache_modifier=".cg")
            sc = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - m))
            l_tot += tl.load(l_ptr + r * GP + gi, mask=ok, other=0.0, cache_modifier=".cg") * sc
            acc += tl.load(acc_ptr + (r * GP + gi)[:, None] * DH + d[None, :], mask=ok[:, None], other=0.0,
                           cache_modifier=".cg") * sc[:, None]
    out = acc / tl.where(gm, l_tot, 1.0)[:, None]
    tl.store(o_ptr + t * s_ot + (hk * G + gi)[:, None] * DH + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=gm[:, None])


LONG_SPAN = 4096  # slots above which attn_splits aims at more programs (long contexts)


def attn_splits(T: int, Hkv: int, span: int) -> int:
    """How many programs share one (row, kv head)'s context: enough programs to keep the SMs busy when rows x kv
    heads are few, at least 64 slots each. Up to LONG_SPAN slots: ~128 programs, at most 16 splits (the choice
    every short-context table was measured with). Longer: ~256 programs, at most 128 splits. Chosen from
    experiments/bench_attn_splits.py on the H200 (experiments/results/h200/issue14_capacity/attn_splits.md; 32k
    slots at position 30000, T 1 and 8, 4-16 kv heads, one uncaptured call per timing): the best split count or
    within 2% of it in five of the six cases, where the short rule was 1.00-1.23x slower; Qwen3-30B-A3B at T=1
    (4 kv heads) 0.116 ms against the best 0.092 (128 splits) and the short rule's 0.129. Inside the captured step
    that does not hold: aiming a single row at ~512 programs (128 splits there) made the 30k-token step slower,
    1.32 -> 1.55 ms on Qwen3-30B-A3B (12 layers) and 2.13 -> 2.25 ms on Mixtral (8 layers) (commit dca50e9,
    experiments/results/h200/issue14_final/long_*_bs1.md), so the rule stays at ~256."""
    if span > LONG_SPAN:
        return max(1, min(256 // max(1, T * Hkv), span // 64, 128))
    return max(1, min(128 // max(1, T * Hkv), span // 64, 16))


def attn_merge_block(GP: int, Dh: int) -> int:
    """Splits whose loads the merge unrolls together (SB; the adds stay one split at a time, in order): 4, fewer where
    4 [GP, Dh] fp32 tiles would pass 8192 elements (64 registers a thread at 4 warps). On the H200, Qwen3-30B-A3B 12
    layers at a 30k-token context (64 splits), the step went 1.261 -> 1.241 (2) -> 1.228 ms (4), the same bits
    (results/h200/issue14_s6/variants_qwen3_long_b.md); one [SB, GP, Dh] tile loaded at once was 1.7x slower
    (variants_qwen3_long.md, commit 7fee360)."""
    return max(1, min(4, 8192 // (GP * Dh)))


@_dry_zeros
def attn_decode(q, keys, values, pos, scaling: float, window: int = 0, sinks=None, eager: bool = False,
                splits: int | None = None, merge_block: int | None = None):
    """splits: programs per (row, kv head) context (None: attn_splits' choice; benchmarks pass their own).
    merge_block: splits per load of the merge (None: attn_merge_block's choice)."""
    T, Hq, Dh = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    GP = max(16, _p2(G))
    span = min(L, window) if window else L
    splits = max(1, min(splits or attn_splits(T, Hkv, span), max(1, span // 64)))
    chunk = triton.cdiv(span, splits)
    chunk = triton.cdiv(chunk, 64) * 64
    splits = triton.cdiv(span, chunk)
    two_pass = eager and sinks is not None
    if two_pass:
        splits, chunk = 1, span
    o = torch.empty(T, Hq * Dh, dtype=q.dtype, device=q.device)
    if splits > 1:
        m = torch.empty(T * Hkv * splits, GP, dtype=torch.float32, device=q.device)
        l_ = torch.empty_like(m)
        acc = torch.empty(T * Hkv * splits, GP, Dh, dtype=torch.float32, device=q.device)
    else:
        m = l_ = acc = o
    sk = sinks if sinks is not None else o
    assert sinks is None or (sinks.is_contiguous() and sinks.numel() == Hq)
    sems = _split_sems(q.device, T * Hkv, "attn") if splits > 1 else o
    _launch(_attn_decode_kernel, (T, Hkv, splits),
        q, keys, values, pos, sk, o, m, l_, acc, sems, T, scaling, window, chunk, _pos_stride(pos, T), q.stride(0),
        q.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        o.stride(0), G=G, GP=GP, DH=Dh, BLOCK_L=64, SPLIT=splits > 1, HAS_SINK=sinks is not None, EAGER=eager,
        TWO_PASS=two_pass, SUB_ROUND=two_pass and sinks.dtype == q.dtype,
        SB=merge_block or attn_merge_block(GP, Dh), num_warps=4, **_pdl_args(q.device))
    return o


# ------------------------------------------------------------------------------------------------------------
# router: softmax (fp32) + top-k + optional renormalisation, one program per token
_KEY_NONE = tl.constexpr(-(2**63))  # below every _order_key: a lane out of the choice


@triton.jit
def _order_key(x, e, BLOCK_E: tl.constexpr):
    """An int64 per lane ordered as x (fp32, any sign; -0.0 as +0.0), ties to the lower lane e: one max reduction
    then finds the largest value and its first lane at once (two reductions otherwise, each a cross-warp sync)."""
    b = (x + 0.0).to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)  # fp32 bits -> a signed int of the same order
    return (b.to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)


@triton.jit
def _key_value(key):
    """The fp32 value an _order_key holds."""
    b = (key >> 32).to(tl.int32)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _topk_keys(key, e, K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr):
    """The K largest of the lanes' keys (_order_key; _KEY_NONE: out of the choice), largest first, ties to the lower
    lane -> (lanes [KP] int64, keys [KP]; past K: 0 and _KEY_NONE). Shared by every Triton router."""
    kk = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int64)
    best = tl.full([KP], _KEY_NONE, dtype=tl.int64)
    for k in tl.static_range(K):
        b = tl.max(key, axis=0)
        i = BLOCK_E - 1 - (b & 0xFFFFFFFF)
        ids = tl.where(kk == k, i, ids)
        best = tl.where(kk == k, b, best)
        key = tl.where(e == i, _KEY_NONE, key)
    return ids, best


@triton.jit
def _softmax_topk(x, e, em, K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr):
    """softmax_topk of one row of logits x [BLOCK_E] (fp32; lanes past E masked by em) -> (ids [K], weights [K])."""
    x = tl.where(em, x, float("-inf"))
    x = x - tl.max(x, axis=0)
    p = tl.exp(x)
    p = p / tl.sum(p, axis=0)
    ids, best = _topk_keys(tl.where(em, _order_key(p, e, BLOCK_E), _KEY_NONE), e, K, K, BLOCK_E)
    vals = _key_value(best)
    if NORM:
        vals = vals / tl.sum(vals, axis=0)
    return ids, vals


@triton.jit(do_not_specialize=["T"])
def _route_kernel(lg_ptr, idx_ptr, w_ptr, T, E, s_lt, K: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr = 0):
    _pdl_enter(USE_PDL)
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = tl.load(lg_ptr + t * s_lt + e, mask=em, other=float("-inf")).to(tl.float32)
    ids, vals = _softmax_topk(x, e, em, K, NORM, BLOCK_E)
    kk = tl.arange(0, K)
    tl.store(idx_ptr + t * K + kk, ids)
    tl.store(w_ptr + t * K + kk, vals.to(w_ptr.dtype.element_ty))


@_dry_zeros
def route(logits, top_k: int, normalize: bool, out_dtype):
    T, E = logits.shape
    assert logits.stride(1) == 1 and top_k & (top_k - 1) == 0, "top_k must be a power of two for the Triton router"
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, top_k, dtype=out_dtype, device=logits.device)
    _launch(_route_kernel, (T,), logits, idx, w, T, E, logits.stride(0), K=top_k, NORM=normalize, BLOCK_E=_p2(E),
            num_warps=1, **_pdl_args(logits.device))
    return idx, w


# residual add + RMSNorm + router GEMV + softmax_topk in one kernel (a layer whose router is its own linear: Mixtral,
# Qwen3-MoE, OLMoE). Grid (row, block of experts): every program loads the whole row and its experts' weight rows
# at once, recomputes the row's norm and dots it with them (rounded to the model dtype, as the router linear's
# output); program 0 of the row writes the new residual and the normed row; the row's last program to finish (an
# arrival counter) runs the softmax/top-k over the row's logits, as the router kernel does. A first version looped
# over D in 256-wide chunks, two passes: 12.2 us per call at Qwen3-30B-A3B's shape, bs 1, on the H200, slower than
# the three kernels it replaced (latency of 16 dependent load rounds).
@triton.jit(do_not_specialize=["T"])
def _norm_route_kernel(a_ptr, res_ptr, nw_ptr, rw_ptr, sb_ptr, lg_ptr, sem_ptr, out_res_ptr, out_ptr, idx_ptr,
                       w_ptr, T, D, E, eps, s_at, s_rt, s_rwe, s_ort, s_ot, K: tl.constexpr, NORM: tl.constexpr,
                       HAS_SKEW: tl.constexpr, CAST_LAST: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_EP: tl.constexpr, USE_PDL: tl.constexpr = 0):
    _pdl_enter(USE_PDL)
    t = tl.program_id(0)
    nb = tl.program_id(1)
    dt = out_ptr.dtype.element_ty
    kk = tl.arange(0, BLOCK_D)  # the whole row at once: every load is issued together (latency, not bandwidth)
    km = kk < D
    e = nb * BLOCK_E + tl.arange(0, BLOCK_E)
    em = e < E
    wr = tl.load(rw_ptr + e[:, None] * s_rwe + kk[None, :], mask=em[:, None] & km[None, :], other=0.0)
    a = tl.load(a_ptr + t * s_at + kk, mask=km, other=0.0).to(tl.float32).to(dt).to(tl.float32)
    r = tl.load(res_ptr + t * s_rt + kk, mask=km, other=0.0).to(tl.float32)
    nw = tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)
    out = (r + a).to(dt).to(tl.float32)  # the new residual: res + round(a), rounded
    yn = out * tl.rsqrt(tl.sum(out * out, axis=0) / D + eps)
    if not CAST_LAST:
        yn = yn.to(dt).to(tl.float32)
    h = (nw * yn).to(dt)
    if nb == 0:
        tl.store(out_res_ptr + t * s_ort + kk, out.to(dt), mask=km)
        tl.store(out_ptr + t * s_ot + kk, h, mask=km)
    lg = tl.sum(wr.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
    lg = lg.to(dt).to(tl.float32)  # the router linear's output dtype
    if HAS_SKEW:
        lg = (lg + tl.load(sb_ptr + e, mask=em, other=0.0).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(lg_ptr + t * E + e, lg, mask=em)
    tl.debug_barrier()
    done = tl.atomic_add(sem_ptr + t, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(1) - 1:  # the row's other logits are visible (acquire)
        ea = tl.arange(0, BLOCK_EP)
        eam = ea < E
        x = tl.load(lg_ptr + t * E + ea, mask=eam, other=float("-inf"), cache_modifier=".cg")
        ids, vals = _softmax_topk(x, ea, eam, K, NORM, BLOCK_EP)
        kk2 = tl.arange(0, K)
        tl.store(idx_ptr + t * K + kk2, ids)
        tl.store(w_ptr + t * K + kk2, vals.to(w_ptr.dtype.element_ty))
        tl.store(sem_ptr + t, 0)  # zero again for the next call (and graph replay)


@_dry_zeros
def norm_route(a, residual, weight, eps: float, router_w, top_k: int, normalize: bool, out_dtype, logit_bias=None,
               cast_last: bool = False):
    T, D = a.shape
    E = router_w.shape[0]
    assert a.stride(1) == 1 and residual.stride(1) == 1 and router_w.stride(1) == 1 and weight.is_contiguous()
    assert top_k & (top_k - 1) == 0, "top_k must be a power of two for the Triton router"
    assert logit_bias is None or logit_bias.is_contiguous()
    dt = residual.dtype
    new_res = torch.empty(T, D, dtype=dt, device=a.device)
    normed = torch.empty(T, D, dtype=dt, device=a.device)
    lg = torch.empty(T, E, dtype=torch.float32, device=a.device)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=a.device)
    w = torch.empty(T, top_k, dtype=out_dtype, device=a.device)
    be = max(2, min(_p2(E) // 16, 16384 // _p2(D)))  # ~16 programs per row, at most 16k weights in registers
    nb = triton.cdiv(E, be)
    sems = _split_sems(a.device, T, "norm_route")
    _launch(_norm_route_kernel, (T, nb),
        a, residual, weight, router_w, logit_bias if logit_bias is not None else lg, lg, sems, new_res, normed, idx, w,
        T, D, E, eps, a.stride(0), residual.stride(0), router_w.stride(0), new_res.stride(0), normed.stride(0),
        K=top_k, NORM=normalize, HAS_SKEW=logit_bias is not None, CAST_LAST=cast_last, BLOCK_D=_p2(D), BLOCK_E=be,
        BLOCK_EP=_p2(E), num_warps=8, **_pdl_args(a.device))
    return new_res, normed, idx, w


# sigmoid_group router (DeepSeek-V3, GLM-4-MoE): sigmoid, biased group-limited choice, unbiased weights, one
# program per token. Every top-k is an argmax loop over the row in registers (E <= a few hundred), ties to the
# lowest index; the K columns come out in descending order of the biased score (HF's are unsorted).
@triton.jit(do_not_specialize=["T"])
def _route_sigmoid_group_kernel(lg_ptr, b_ptr, idx_ptr, w_ptr, T, E, s_lt, scaling,
                                K: tl.constexpr, KP: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr,
                                TOPKG: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                                BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr = 0):
    _pdl_enter(USE_PDL)
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    sc = tl.sigmoid(tl.load(lg_ptr + t * s_lt + e, mask=em, other=0.0).to(tl.float32))  # [E] unbiased scores
    ch = sc
    if HAS_BIAS:
        ch = sc + tl.load(b_ptr + e, mask=em, other=0.0).to(tl.float32)
    ch = tl.where(em, ch, float("-inf"))
    if NG > 1:
        grp = e // (E // NG)
        gi = tl.arange(0, NGP)
        gs = tl.full([NGP], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(NG):  # group score: the sum of its two best biased scores
            cg = tl.where(em & (grp == g), ch, float("-inf"))
            m1 = tl.max(cg, axis=0)
            i1 = tl.min(tl.where(cg == m1, e, BLOCK_E), axis=0)
            m2 = tl.max(tl.where(e == i1, float("-inf"), cg), axis=0)
            gs = tl.where(gi == g, m1 + m2, gs)
        gav = gi < NG
        keep = e < 0
        for _ in tl.static_range(TOPKG):
            gm = tl.max(tl.where(gav, gs, float("-inf")), axis=0)
            gsel = tl.min(tl.where(gav & (gs == gm), gi, NGP), axis=0)
            keep = keep | (grp == gsel)
            gav = gav & (gi != gsel)
        ch = tl.where(keep & em, ch, float("-inf"))
    kk = tl.arange(0, KP)
    ids, _ = _topk_keys(tl.where(em, _order_key(ch, e, BLOCK_E), _KEY_NONE), e, K, KP, BLOCK_E)
    # the unbiased scores of the chosen lanes (past K: 0)
    ws = tl.sum(tl.where((e[None, :] == ids[:, None]) & (kk < K)[:, None], sc[None, :], 0.0), axis=1)
    if NORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    ws = ws * scaling
    tl.store(idx_ptr + t * K + kk, ids, mask=kk < K)
    tl.store(w_ptr + t * K + kk, ws, mask=kk < K)


@_dry_zeros
def route_sigmoid_group(logits, choice_bias, top_k: int, n_group: int, topk_group: int, normalize: bool,
                        scaling: float):
    T, E = logits.shape
    assert logits.stride(1) == 1 and logits.dtype == torch.float32 and E % n_group == 0
    assert choice_bias is None or choice_bias.is_contiguous()
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    _launch(_route_sigmoid_group_kernel, (T,),
        logits, choice_bias if choice_bias is not None else logits, idx, w, T, E, logits.stride(0), float(scaling),
        K=top_k, KP=_p2(top_k), NG=n_group, NGP=_p2(n_group), TOPKG=topk_group, NORM=normalize,
        HAS_BIAS=choice_bias is not None, BLOCK_E=_p2(E), num_warps=1 if E <= 256 else 4,
        **_pdl_args(logits.device))
    return idx, w


# topk_softmax router (GPT-OSS): top-k of the logits, softmax over those k (fp32, rounded once to the logits' dtype)
@triton.jit(do_not_specialize=["T"])
def _route_topk_softmax_kernel(lg_ptr, idx_ptr, w_ptr, T, E, s_lt, K: tl.constexpr, KP: tl.constexpr,
                               BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr = 0):
    _pdl_enter(USE_PDL)
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = tl.load(lg_ptr + t * s_lt + e, mask=em, other=float("-inf")).to(tl.float32)
    kk = tl.arange(0, KP)
    ids, best = _topk_keys(tl.where(em, _order_key(x, e, BLOCK_E), _KEY_NONE), e, K, KP, BLOCK_E)
    vals = tl.where(kk < K, _key_value(best), float("-inf"))
    p = tl.exp(vals - tl.max(vals, axis=0))
    p = p / tl.sum(p, axis=0)
    tl.store(idx_ptr + t * K + kk, ids, mask=kk < K)
    tl.store(w_ptr + t * K + kk, p.to(w_ptr.dtype.element_ty), mask=kk < K)


@_dry_zeros
def route_topk_softmax(logits, top_k: int):
    T, E = logits.shape
    assert logits.stride(1) == 1
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    _launch(_route_topk_softmax_kernel, (T,), logits, idx, w, T, E, logits.stride(0), K=top_k, KP=_p2(top_k),
            BLOCK_E=_p2(E), num_warps=1 if E <= 256 else 4, **_pdl_args(logits.device))
    return idx, w


# ------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["T"])
def _silu_mul_kernel(gu_ptr, h_ptr, T, I, s_gt, s_ht, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = 0):
    _pdl_enter(USE_PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    dt = h_ptr.dtype.element_ty
    g = tl.load(gu_ptr + t * s_gt + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * s_gt + I + offs, mask=m, other=0.0).to(tl.float32)
    a = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
    tl.store(h_ptr + t * s_ht + offs, (a * u).to(dt), mask=m)


@_dry_zeros
def silu_mul(gu, inter: int):
    T = gu.shape[0]
    assert gu.stride(1) == 1
    h = torch.empty(T, inter, dtype=gu.dtype, device=gu.device)
    _launch(_silu_mul_kernel, (T, triton.cdiv(inter, 1024)), gu, h, T, inter, gu.stride(0), h.stride(0),
            BLOCK=1024, num_warps=4, **_pdl_args(gu.device))
    return h


# ------------------------------------------------------------------------------------------------------------
# small-batch linear y [T, N] = x [T, K] @ w [N, K]^T (+ bias): one program per BLOCK_N output columns streams its
# rows of W once for all T rows (T <= 16: one tl.dot row block), fp32 accumulation, bias added before the one
# rounding (as cuBLAS's epilogue). cuBLAS runs some of these decode shapes as a split-K GEMM plus a reduce kernel;
# this is one kernel with no workspace. Which shapes take it: moecg.kernels.tiles.gemv_tiles (a table from bench_gemv.py).
@triton.jit(do_not_specialize=["T"])
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, T, N, K, s_xt, s_wn, s_yt, HAS_BIAS: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = 0):
    _pdl_enter(USE_PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    t = tl.arange(0, BLOCK_T)
    tm = t < T
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        x = tl.load(x_ptr + t[:, None] * s_xt + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * s_wn + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + t[:, None] * s_yt + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=tm[:, None] & nm[None, :])


GEMV_MAX_T = 16  # rows one program's tl.dot block holds


@_dry_zeros
def linear(x, w, bias=None, tiles=None):
    """As ref.linear. tiles: a moecg.kernels.tiles.GemvTiles (the Triton GEMV) or None: the table's choice for this
    shape (gemv_tiles), which is cuBLAS (F.linear) where no rule holds."""
    T, K = x.shape
    N = w.shape[0]
    t = tiles or _tiles.gemv_tiles(T, N, K)
    if t is None or T > GEMV_MAX_T or x.stride(1) != 1 or w.stride(1) != 1 or (bias is not None and
                                                                                bias.stride(0) != 1):
        return F.linear(x, w, bias)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    _launch(_gemv_kernel, (triton.cdiv(N, t.block_n),), x, w, bias if bias is not None else y, y, T, N, K,
            x.stride(0), w.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_T=16, BLOCK_N=t.block_n,
            BLOCK_K=t.block_k, num_warps=t.warps, num_stages=t.stages, **_pdl_args(x.device, t.pdl_trigger))
    return y


# ------------------------------------------------------------------------------------------------------------
# dropless MoE for small token counts (decode): grid (expert, row block, column block). Each program finds the
# assignments routed to its expert by scanning the [S] expert ids (S = T*K, small at decode), so there is no
# sort or prefix-sum kernel before it; experts nobody picked exit after the scan. Weights are read once per
# (expert, row block): the GEMM tile's rows are that expert's tokens.
# Weights are addressed by strides, so one kernel covers [E, 2I, D] / [E, D, I] and HF's transposed [E, D, 2I] /
# [E, I, D] (GPT-OSS), with gate/up as two halves or interleaved columns (j = JM*n + JG for gate column n, + JU for
# up); biases are added after each GEMM's rounding, as HF adds them; ACT 0 is SiLU, 1 GPT-OSS's clamped SwiGLU.
# The GEMM tiles (_up_tile, _down_tile) are shared with the capacity kernels (moecg.kernels.capacity_ops), which
# pick their rows differently.
@triton.jit
def _rows_for(idx_ptr, valid_ptr, e, mb, S, K: tl.constexpr, HAS_VALID: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """-> (count of valid assignments to expert e, their assignment ids for rank block mb [BLOCK_M], row mask)."""
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.zeros([BLOCK_M], dtype=tl.int32)
    base = 0
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ids = tl.load(idx_ptr + s, mask=s < S, other=-1)
        hit = ids == e
        if HAS_VALID:
            hit = hit & (tl.load(valid_ptr + s // K, mask=s < S, other=0) != 0)
        hi = hit.to(tl.int32)
        rank = tl.cumsum(hi, axis=0) - 1 + base
        sel = hit[None, :] & (rank[None, :] == r[:, None])  # [BLOCK_M, BLOCK_S]
        rows += tl.sum(tl.where(sel, s[None, :], 0), axis=1)
        base += tl.sum(hi, axis=0)
    return base, rows, r < base


@triton.jit
def _up_tile(x_ptr, rows, rmask, e, nb, w_ptr, b_ptr, D, I, s_xt, s_we, s_wj, s_wk, s_be, alpha, limit,
             dt: tl.constexpr, K: tl.constexpr, JM: tl.constexpr, JU: tl.constexpr, HAS_BIAS: tl.constexpr,
             ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act(gate, up) of assignments `rows` [BLOCK_M] (token = row // K) for expert e's columns block nb
    -> ([BLOCK_M, BLOCK_N] fp32 holding dt-rounded values, column ids [BLOCK_N], column mask)."""
    tok = rows // K
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    jg = n * JM  # gate column of output n in the 2I dim
    ju = n * JM + JU
    wg = w_ptr + e.to(tl.int64) * s_we + jg[:, None] * s_wj
    wu = w_ptr + e.to(tl.int64) * s_we + ju[:, None] * s_wj
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < D
        x = tl.load(x_ptr + tok[:, None] * s_xt + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        g = tl.load(wg + kk[None, :] * s_wk, mask=nm[:, None] & km[None, :], other=0.0)
        u = tl.load(wu + kk[None, :] * s_wk, mask=nm[:, None] & km[None, :], other=0.0)
        acc_g = tl.dot(x, tl.trans(g), acc_g)
        acc_u = tl.dot(x, tl.trans(u), acc_u)
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    if HAS_BIAS:
        bb = b_ptr + e.to(tl.int64) * s_be
        g = (g + tl.load(bb + jg, mask=nm, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        u = (u + tl.load(bb + ju, mask=nm, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
    if ACT == 0:  # silu(gate) * up
        a = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        hv = a * u
    else:  # GPT-OSS: (clamp(up) + 1) * gate * sigmoid(alpha * gate), gate clamped from above
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        sg = tl.sigmoid((g * alpha).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        glu = (g * sg).to(dt).to(tl.float32)
        hv = (u + 1.0).to(dt).to(tl.float32) * glu
    return hv, n, nm


@triton.jit
def _down_acc(h_ptr, rows, rmask, e, nb, w_ptr, D, I, k_lo, k_hi, s_hs, s_we, s_wn, s_wk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The unrounded fp32 down-projection sum over I in [k_lo, k_hi) of h rows `rows` for output columns block nb
    -> ([BLOCK_M, BLOCK_N] fp32, column ids [BLOCK_N], column mask)."""
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < D
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    wd = w_ptr + e.to(tl.int64) * s_we + n[:, None] * s_wn
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < k_hi
        h = tl.load(h_ptr + rows[:, None] * s_hs + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        w = tl.load(wd + kk[None, :] * s_wk, mask=nm[:, None] & km[None, :], other=0.0)
        acc = tl.dot(h, tl.trans(w), acc)
    return acc, n, nm


@triton.jit
def _down_round(acc, e, n, nm, b_ptr, s_be, dt: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The down projection's fp32 sum rounded (and biased) as HF: dt after the GEMM, dt after the bias."""
    o = acc.to(dt).to(tl.float32)
    if HAS_BIAS:
        o = (o + tl.load(b_ptr + e.to(tl.int64) * s_be + n, mask=nm, other=0.0).to(tl.float32)[None, :])
        o = o.to(dt).to(tl.float32)
    return o


@triton.jit
def _down_tile(h_ptr, rows, rmask, e, nb, w_ptr, b_ptr, D, I, s_hs, s_we, s_wn, s_wk, s_be,
               dt: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """Expert e's down projection of h rows `rows` for output columns block nb, rounded (and biased) as HF
    -> ([BLOCK_M, BLOCK_N] fp32, column ids [BLOCK_N], column mask); the caller applies the routing weight."""
    acc, n, nm = _down_acc(h_ptr, rows, rmask, e, nb, w_ptr, D, I, 0, I, s_hs, s_we, s_wn, s_wk,
                           BLOCK_M, BLOCK_N, BLOCK_K)
    return _down_round(acc, e, n, nm, b_ptr, s_be, dt, HAS_BIAS), n, nm


@triton.jit
def _expert_of(idx_ptr, valid_ptr, p, S, by_slot, K: tl.constexpr, HAS_VALID: tl.constexpr,
               BLOCK_S: tl.constexpr):
    """-> (the expert program p runs, whether it runs it). Expert grid (by_slot 0): program p is expert p. Slot
    grid (by_slot 1, used when the S assignments are fewer than the experts, so most expert programs would only
    exit): program p is assignment p, and runs its expert iff p is that expert's first valid assignment."""
    e = p
    lead = p >= 0
    if by_slot:
        e = tl.load(idx_ptr + p).to(tl.int32)
        first = S
        for s0 in range(0, S, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            hit = tl.load(idx_ptr + s, mask=s < S, other=-1) == e
            if HAS_VALID:
                hit = hit & (tl.load(valid_ptr + s // K, mask=s < S, other=0) != 0)
            first = tl.minimum(first, tl.min(tl.where(hit, s, S), axis=0))
        lead = first == p
    return e, lead


@triton.jit(do_not_specialize=["S", "by_slot"])
def _moe_up_kernel(x_ptr, idx_ptr, valid_ptr, tw_ptr, w_ptr, b_ptr, h_ptr, cnt_ptr, mass_ptr, tok_ptr,
                   S, by_slot, D, I, s_xt, s_we, s_wj, s_wk, s_be, s_hs, alpha, limit,
                   K: tl.constexpr, HAS_VALID: tl.constexpr, COUNT: tl.constexpr, JM: tl.constexpr,
                   JU: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                   USE_PDL: tl.constexpr):
    _pdl_enter(USE_PDL)
    p = tl.program_id(0)
    mb = tl.program_id(1)
    nb = tl.program_id(2)
    e, lead = _expert_of(idx_ptr, valid_ptr, p, S, by_slot, K, HAS_VALID, BLOCK_S)
    cnt, rows, rmask = _rows_for(idx_ptr, valid_ptr, e, mb, S, K, HAS_VALID, BLOCK_M, BLOCK_S)
    if COUNT:
        if (mb == 0) & (nb == 0):  # this expert's counters belong to this program alone: no atomics
            if lead:
                wsum = tl.zeros([BLOCK_S], dtype=tl.float32)
                for s0 in range(0, S, BLOCK_S):
                    s = s0 + tl.arange(0, BLOCK_S)
                    hit = tl.load(idx_ptr + s, mask=s < S, other=-1) == e
                    if HAS_VALID:
                        hit = hit & (tl.load(valid_ptr + s // K, mask=s < S, other=0) != 0)
                    wsum += tl.where(hit, tl.load(tw_ptr + s, mask=s < S, other=0.0).to(tl.float32), 0.0)
                tl.store(cnt_ptr + e, tl.load(cnt_ptr + e) + cnt)
                tl.store(mass_ptr + e, tl.load(mass_ptr + e) + tl.sum(wsum, axis=0))
            if p == 0:
                n_tok = S // K
                if HAS_VALID:
                    acc_v = tl.zeros([BLOCK_S], dtype=tl.int32)
                    for t0 in range(0, S // K, BLOCK_S):
                        tt = t0 + tl.arange(0, BLOCK_S)
                        acc_v += (tl.load(valid_ptr + tt, mask=tt < S // K, other=0) != 0).to(tl.int32)
                    n_tok = tl.sum(acc_v, axis=0)
                tl.store(tok_ptr, tl.load(tok_ptr) + n_tok)
    if lead & (cnt > mb * BLOCK_M):
        dt = h_ptr.dtype.element_ty
        hv, n, nm = _up_tile(x_ptr, rows, rmask, e, nb, w_ptr, b_ptr, D, I, s_xt, s_we, s_wj, s_wk, s_be, alpha,
                             limit, dt, K, JM, JU, HAS_BIAS, ACT, BLOCK_M, BLOCK_N, BLOCK_K)
        tl.store(h_ptr + rows[:, None] * s_hs + n[None, :], hv.to(dt), mask=rmask[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["S", "by_slot", "k_chunk"])
def _moe_down_kernel(h_ptr, idx_ptr, valid_ptr, tw_ptr, w_ptr, b_ptr, y_ptr, part_ptr, sem_ptr, S, by_slot, D, I,
                     k_chunk, s_hs, s_we, s_wn, s_wk, s_be, s_ys, K: tl.constexpr, HAS_VALID: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr):
    """SPLIT > 1 (split-K over I, for batch-1 steps whose column blocks alone are too few programs): each of a
    tile's SPLIT programs stores its fp32 partial sum, and the last to finish (a per-tile counter) adds the
    partials in split order, so the result is deterministic and rounded once, as without splits; it then
    zeroes the counter for the next call (and graph replay)."""
    _pdl_enter(USE_PDL)
    p = tl.program_id(0)
    mb = tl.program_id(1)
    nb = tl.program_id(2) // SPLIT
    ks = tl.program_id(2) % SPLIT
    if HAS_VALID:  # pad rows get zeros here (no kernel writes them otherwise): program 0 of each tile column
        if (p == 0) & (ks == 0):
            tt = mb * BLOCK_M + tl.arange(0, BLOCK_M)
            pad = (tt < S // K) & (tl.load(valid_ptr + tt, mask=tt < S // K, other=1) == 0)
            nz = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            for k in tl.static_range(K):
                tl.store(y_ptr + (tt * K + k)[:, None] * s_ys + nz[None, :],
                         tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), mask=pad[:, None] & (nz < D)[None, :])
    e, lead = _expert_of(idx_ptr, valid_ptr, p, S, by_slot, K, HAS_VALID, BLOCK_S)
    cnt, rows, rmask = _rows_for(idx_ptr, valid_ptr, e, mb, S, K, HAS_VALID, BLOCK_M, BLOCK_S)
    if lead & (cnt > mb * BLOCK_M):
        dt = h_ptr.dtype.element_ty
        if SPLIT == 1:
            acc, n, nm = _down_acc(h_ptr, rows, rmask, e, nb, w_ptr, D, I, 0, I, s_hs, s_we, s_wn, s_wk,
                                   BLOCK_M, BLOCK_N, BLOCK_K)
            o = _down_round(acc, e, n, nm, b_ptr, s_be, dt, HAS_BIAS)
            tw = tl.load(tw_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            tl.store(y_ptr + rows[:, None] * s_ys + n[None, :], o * tw[:, None], mask=rmask[:, None] & nm[None, :])
        else:
            k_lo = ks * k_chunk
            acc, n, nm = _down_acc(h_ptr, rows, rmask, e, nb, w_ptr, D, I, k_lo, tl.minimum(k_lo + k_chunk, I),
                                   s_hs, s_we, s_wn, s_wk, BLOCK_M, BLOCK_N, BLOCK_K)
            om = rmask[:, None] & nm[None, :]
            tile_off = rows[:, None] * D + n[None, :]  # part: [SPLIT, S, D] fp32
            tl.store(part_ptr + ks * S * D + tile_off, acc, mask=om)
            tl.debug_barrier()
            tile = (p * tl.num_programs(1) + mb) * (tl.num_programs(2) // SPLIT) + nb
            done = tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:  # the tile's last program: the other partials are visible (acquire)
                tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for j in tl.static_range(SPLIT):
                    tot += tl.load(part_ptr + j * S * D + tile_off, mask=om, other=0.0, cache_modifier=".cg")
                o = _down_round(tot, e, n, nm, b_ptr, s_be, dt, HAS_BIAS)
                tw = tl.load(tw_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
                tl.store(y_ptr + rows[:, None] * s_ys + n[None, :], o * tw[:, None], mask=om)
                tl.store(sem_ptr + tile, 0)


class ExpertArgs:
    """The layout arguments both MoE kernel families take, read off the weights and the adapter's ExpertSpec."""

    def __init__(self, gate_up, down, spec=None, gate_up_bias=None, down_bias=None):
        transposed = spec is not None and spec.transposed
        self.act = 0 if spec is None or spec.act == "silu" else 1
        if self.act and spec.act != "swiglu_clamp":
            raise ValueError(f"expert activation {spec.act!r}: the MoE kernel knows silu and swiglu_clamp")
        self.gate_up, self.down = gate_up, down
        self.num_experts = gate_up.shape[0]
        # strides along the 2I / I dim (j) and the D dim (k) of the up weights, along D (n) and I (k) of the down ones
        self.s_wj, self.s_wk = (gate_up.stride(2), gate_up.stride(1)) if transposed else (gate_up.stride(1),
                                                                                         gate_up.stride(2))
        self.s_dn, self.s_dk = (down.stride(2), down.stride(1)) if transposed else (down.stride(1), down.stride(2))
        self.inter = gate_up.shape[2 if transposed else 1] // 2
        interleaved = spec is not None and spec.interleaved
        self.jm, self.ju = (2, 1) if interleaved else (1, self.inter)
        self.alpha = float(spec.alpha) if self.act else 1.0
        self.limit = float(spec.limit) if self.act else 0.0
        assert gate_up_bias is None or gate_up_bias.stride(1) == 1
        assert down_bias is None or down_bias.stride(1) == 1
        self.gate_up_bias, self.down_bias = gate_up_bias, down_bias


@_dry_zeros
def moe_experts(x, idx, w, gate_up, down, valid=None, counters=None, *, spec=None, gate_up_bias=None,
                down_bias=None, tiles=None, grid: str = "auto"):
    """tiles: a moecg.kernels.tiles.MoeTiles; None: the table's choice for this shape (moe_tiles).
    grid: "expert" (a program per expert), "slot" (a program per assignment, the expert's first one runs it) or
    "auto": slot when the assignments are fewer than the experts (decode at small batches), else expert."""
    T, K = idx.shape
    D = x.shape[1]
    a = ExpertArgs(gate_up, down, spec, gate_up_bias, down_bias)
    E, inter = a.num_experts, a.inter
    S = T * K
    assert x.stride(1) == 1 and idx.is_contiguous()
    if grid not in ("auto", "expert", "slot"):
        raise ValueError(f"grid={grid!r}: choose auto, expert or slot")
    by_slot = grid == "slot" or (grid == "auto" and S < E)
    P = S if by_slot else E
    t = tiles or _tiles.moe_tiles(T, D, inter, E)
    split = t.down_split if down_bias is None else 1  # a biased down projection keeps one pass (bias before round)
    bm = t.block_m
    m_blocks = triton.cdiv(T, bm)  # an expert gets at most one assignment per token
    h = torch.empty(S, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(T, K, D, dtype=torch.float32, device=x.device)  # pad rows: zeroed by the down kernel
    wc = w.contiguous()
    c = counters
    _launch(_moe_up_kernel, (P, m_blocks, triton.cdiv(inter, t.up_n)),
        x, idx, valid if valid is not None else idx, wc, gate_up, gate_up_bias if gate_up_bias is not None else h,
        h, c.routed if c is not None else h, c.routed_mass if c is not None else h,
        c.tokens if c is not None else h, S, int(by_slot), D, inter, x.stride(0), gate_up.stride(0), a.s_wj, a.s_wk,
        gate_up_bias.stride(0) if gate_up_bias is not None else 0, h.stride(0), a.alpha, a.limit,
        K=K, HAS_VALID=valid is not None, COUNT=c is not None, JM=a.jm, JU=a.ju,
        HAS_BIAS=gate_up_bias is not None, ACT=a.act,
        BLOCK_M=bm, BLOCK_N=t.up_n, BLOCK_K=t.up_k, BLOCK_S=64, num_warps=t.warps, num_stages=t.stages,
        **_pdl_args(x.device, t.pdl_trigger))
    n_blocks = triton.cdiv(D, t.down_n)
    if split > 1:
        k_chunk = triton.cdiv(triton.cdiv(inter, split), t.down_k) * t.down_k
        split = triton.cdiv(inter, k_chunk)
    else:
        k_chunk = inter
    part = torch.empty(split, S, D, dtype=torch.float32, device=x.device) if split > 1 else y
    sems = _split_sems(x.device, P * m_blocks * n_blocks, "moe_down") if split > 1 else idx
    _launch(_moe_down_kernel, (P, m_blocks, n_blocks * split),
        h, idx, valid if valid is not None else idx, wc, down, down_bias if down_bias is not None else h, y, part,
        sems, S, int(by_slot), D, inter, k_chunk, h.stride(0), down.stride(0), a.s_dn, a.s_dk,
        down_bias.stride(0) if down_bias is not None else 0, y.stride(1), K=K, HAS_VALID=valid is not None,
        HAS_BIAS=down_bias is not None, SPLIT=split, BLOCK_M=bm, BLOCK_N=t.down_n, BLOCK_K=t.down_k, BLOCK_S=64,
        num_warps=t.warps, num_stages=t.stages, **_pdl_args(x.device, t.pdl_trigger))
    return y
