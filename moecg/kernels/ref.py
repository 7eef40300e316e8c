"""Pure-PyTorch reference implementations of moecg's fused decode ops (the CPU path and the test oracle).

Dims: T tokens (one per row at decode), D hidden, Hq / Hkv query / key-value heads, Dh head dim, L cache slots,
E experts, K top-k, I expert intermediate. Every op rounds where HF's modules round (bf16 after each
elementwise op), so a model run through these ops matches the HF forward to the last bit wherever the GEMMs do.
The Triton ops in `moecg.kernels.triton_ops` have the same signatures and are tested against these.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moecg.dispatch.base import count_valid, route_counts, routed_mass


def rmsnorm(x, weight, eps: float):
    """HF's RMSNorm: fp32 statistics, cast back, times the weight in the weight's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rmsnorm(y, residual, weight, eps: float, shared=None, shared_gate=None, valid=None):
    """y [T, KK, D] partial outputs (summed in fp32), + gated shared expert, + residual, then RMSNorm.

    Returns (new residual [T, D], normed [T, D]); residual None: the new residual is sum(y) itself.
    shared [T, D] and shared_gate [T] (a logit): HF's Qwen2-MoE shared expert, sigmoid(gate) * shared.
    valid [T] bool: rows marked False contribute no routed output (their y rows may be garbage).
    """
    dt = weight.dtype if residual is None else residual.dtype
    routed = y.float().sum(1)  # [T, D]
    if valid is not None:
        routed = torch.where(valid[:, None], routed, 0.0)
    out = routed.to(dt)
    if shared is not None:
        sg = torch.sigmoid(shared_gate.to(dt)[:, None]) if shared_gate is not None else None
        sh = shared if sg is None else sg * shared
        out = out + sh
    if residual is not None:
        out = residual + out
    return out, rmsnorm(out, weight, eps)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_cache(qkv, pos, cos, sin, keys, values, n_q: int, n_kv: int, head_dim: int,
               q_norm=None, k_norm=None, eps: float = 1e-6):
    """qkv [T, (Hq+2Hkv)*Dh] -> roped q [T, Hq, Dh]; roped k and v written into keys/values [T, Hkv, L, Dh] at
    slot `pos` (a device scalar: no host sync). cos/sin [L, Dh] tables in the model dtype."""
    T = qkv.shape[0]
    q = qkv[:, : n_q * head_dim].reshape(T, n_q, head_dim)
    k = qkv[:, n_q * head_dim: (n_q + n_kv) * head_dim].reshape(T, n_kv, head_dim)
    v = qkv[:, (n_q + n_kv) * head_dim:].reshape(T, n_kv, head_dim)
    if q_norm is not None:
        q = rmsnorm(q, q_norm, eps)
        k = rmsnorm(k, k_norm, eps)
    p = pos.reshape(1)
    c, s = cos.index_select(0, p), sin.index_select(0, p)  # [1, Dh]
    q = (q * c) + (rotate_half(q) * s)
    k = (k * c) + (rotate_half(k) * s)
    keys.index_copy_(2, p, k[:, :, None, :].to(keys.dtype))
    values.index_copy_(2, p, v[:, :, None, :].to(values.dtype))
    return q


def attn_decode(q, keys, values, pos, scaling: float, window: int = 0):
    """q [T, Hq, Dh] against cache slots [0, pos] (the last `window` only, if window) -> [T, Hq*Dh]."""
    T, Hq, Dh = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    g = Hq // Hkv
    k = keys.repeat_interleave(g, dim=1)  # [T, Hq, L, Dh]
    v = values.repeat_interleave(g, dim=1)
    slots = torch.arange(L, device=q.device)
    ok = slots <= pos
    if window:
        ok = ok & (slots > pos - window)
    scores = torch.matmul(q[:, :, None, :].float(), k.float().transpose(-1, -2)) * scaling  # [T, Hq, 1, L]
    scores = scores.masked_fill(~ok, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q.dtype)
    o = torch.matmul(p, v)  # [T, Hq, 1, Dh]
    return o.reshape(T, Hq * Dh)


def route(logits, top_k: int, normalize: bool, out_dtype):
    """Router logits [T, E] -> (idx [T, K] int64, weights [T, K] out_dtype): softmax fp32, top-k, renormalise."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return idx, w.to(out_dtype)


def silu_mul(gu, inter: int):
    """gu [T, >= 2I] (gate | up, maybe more columns after) -> silu(gate) * up [T, I], rounded as HF's MLP."""
    return F.silu(gu[:, :inter]) * gu[:, inter: 2 * inter]


def moe_experts(x, idx, w, gate_up, down, valid=None, counters=None):
    """Dropless routed experts, unreduced: [T, K, D] fp32, y[t, k] = w[t, k] * expert_{idx[t,k]}(x[t]).

    Rows with valid False get zeros and are not counted. counters: a LayerCounters (routed, mass, tokens).
    """
    T, K = idx.shape
    E, two_i, D = gate_up.shape
    inter = two_i // 2
    gu = torch.bmm(x[:, None, :].expand(T, K, D).reshape(T * K, 1, D).to(gate_up.dtype),
                   gate_up[idx.reshape(-1)].transpose(1, 2))  # [S, 1, 2I]
    h = F.silu(gu[..., :inter]) * gu[..., inter:]
    y = torch.bmm(h, down[idx.reshape(-1)].transpose(1, 2)).reshape(T, K, D)  # [T, K, D] model dtype
    y = y.float() * w.float()[..., None]
    if valid is not None:
        y = torch.where(valid[:, None, None], y, 0.0)
    if counters is not None:
        idx_m, counts = route_counts(idx, valid, E)
        counters.add_routed(counts, routed_mass(idx_m, w, E), count_valid(valid, T, x.device))
    return y
