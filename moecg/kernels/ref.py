"""Pure-PyTorch reference implementations of moecg's fused decode ops (the CPU path and the test oracle).

Dims: T tokens (one per row at decode), D hidden, Hq / Hkv query / key-value heads, Dh head dim, R rotary dims
(<= Dh), L cache slots, E experts, G expert groups, K top-k, I expert intermediate, S = T*K assignments.
Every op rounds where HF's modules round (bf16 after each elementwise op), so a model run through these ops
matches the HF forward to the last bit wherever the GEMMs do. The routers are bit-identical to HF's router modules
on the same device (same ops in the same order). The Triton ops in `moecg.kernels.triton_ops` have the same
signatures and are tested against these.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moecg.models.formats import act_quant
from moecg.models.weights import dense, gemm_input
from moecg.moe_math import add_counters, assign_slots, count_valid, kept_weights, route_counts, routed_mass


def rmsnorm(x, weight, eps: float, cast_last: bool = False):
    """HF's RMSNorm: fp32 statistics; Llama-style casts the normalised x back, then multiplies by the weight in the
    weight's dtype; cast_last (GPT-OSS) multiplies in fp32 and casts the product to x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if cast_last:
        return (weight * y).to(x.dtype)
    return weight * y.to(x.dtype)


def add_rmsnorm(y, residual, weight, eps: float, shared=None, shared_gate=None, valid=None, cast_last: bool = False,
                out_dtype=None, quant: bool = False):
    """y [T, KK, D] partial outputs (summed in fp32), + gated shared expert, + residual, then RMSNorm.

    Returns (new residual [T, D], normed [T, D]); residual None: the new residual is sum(y) itself, in out_dtype
    (default the weight's dtype; give the model dtype where the norm weights are kept in fp32, as GPT-OSS's are).
    shared [T, D] and shared_gate [T] (a logit): HF's Qwen2-MoE shared expert, sigmoid(gate) * shared; shared
    without a gate: added as is (GLM-4-MoE's shared experts).
    valid [T] bool: rows marked False contribute no routed output (their y rows may be garbage).
    cast_last: the norm's rounding (see rmsnorm).
    quant: also return normed's act_quant (q [T, D] e4m3, s [T, ceil(D/128)] fp32), the input of the GEMMs after it
    that take fp8_dynamic inputs (the kernels' `xq`), as a third value.
    """
    dt = (out_dtype or weight.dtype) if residual is None else residual.dtype
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
    normed = rmsnorm(out, weight, eps, cast_last)
    return (out, normed, act_quant(normed)) if quant else (out, normed)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_cache(qkv, pos, cos, sin, keys, values, n_q: int, n_kv: int, head_dim: int,
               q_norm=None, k_norm=None, eps: float = 1e-6, clip: float | None = None):
    """qkv [T, (Hq+2Hkv)*Dh] -> roped q [T, Hq, Dh]; roped k and v written into keys/values [T, Hkv, L, Dh] at
    slot `pos`: a device scalar (every row at one position) or [T] (each row at its own, moecg.ragged); no host
    sync.

    cos/sin [L, R] tables in the model dtype (HF's rotate_half layout, both halves of the R rotary dims): R < Dh is
    partial rotary (GLM-4-MoE), the last Dh - R dims of each head pass through.
    q_norm/k_norm: RMSNorm weights, [Dh] per head (Qwen3-MoE, GLM-4-MoE) or [Hq*Dh] / [Hkv*Dh] over the whole
    projection (OLMoE); normed before the rotary as HF does.
    clip: clamp q, k (after the norm) and v to [-clip, clip] (OLMoE's clip_qkv).
    """
    T = qkv.shape[0]
    q = qkv[:, : n_q * head_dim]
    k = qkv[:, n_q * head_dim: (n_q + n_kv) * head_dim]
    v = qkv[:, (n_q + n_kv) * head_dim:].reshape(T, n_kv, head_dim)
    if q_norm is not None:
        if q_norm.numel() == head_dim:  # per head
            q = rmsnorm(q.reshape(T, n_q, head_dim), q_norm, eps)
            k = rmsnorm(k.reshape(T, n_kv, head_dim), k_norm, eps)
        else:  # over the whole projection
            q = rmsnorm(q, q_norm, eps)
            k = rmsnorm(k, k_norm, eps)
    q = q.reshape(T, n_q, head_dim)
    k = k.reshape(T, n_kv, head_dim)
    if clip is not None:
        q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
    p = pos.reshape(-1)  # [1] (every row at one position) or [T] (each row at its own)
    c, s = cos.index_select(0, p)[:, None], sin.index_select(0, p)[:, None]  # [1 or T, 1, R]
    r = c.shape[-1]
    q = torch.cat([(q[..., :r] * c) + (rotate_half(q[..., :r]) * s), q[..., r:]], dim=-1)
    k = torch.cat([(k[..., :r] * c) + (rotate_half(k[..., :r]) * s), k[..., r:]], dim=-1)
    rows, p = torch.arange(T, device=qkv.device), p.expand(T)
    # [T, L, H, Dh] views: row t's new key/value goes to slot p[t]
    keys.transpose(1, 2).index_put_((rows, p), k.to(keys.dtype))
    values.transpose(1, 2).index_put_((rows, p), v.to(values.dtype))
    return q


def attn_decode(q, keys, values, pos, scaling: float, window: int = 0, sinks=None, eager: bool = False,
                quant: bool = False):
    """q [T, Hq, Dh] against cache slots [0, pos] (the last `window` only, if window) -> [T, Hq*Dh]; pos a device
    scalar or [T] (each row's own position).

    sinks [Hq]: GPT-OSS's learned per-head logit, one more softmax column whose probability is dropped (it only
    enlarges the denominator).
    eager: round as HF's eager attention does (the only one GPT-OSS's sinks run with here): scores in the model
    dtype after the QK product and after the scaling, and with sinks the max-subtracted logits too, softmax in that
    dtype. Otherwise as sdpa: fp32 scores and softmax.
    quant: also return the output's act_quant, second (the o projection's input where it takes fp8_dynamic inputs).
    """
    o = _attn_decode(q, keys, values, pos, scaling, window, sinks, eager)
    return (o, act_quant(o)) if quant else o


def _attn_decode(q, keys, values, pos, scaling: float, window: int, sinks, eager: bool):
    T, Hq, Dh = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    g = Hq // Hkv
    k = keys.repeat_interleave(g, dim=1)  # [T, Hq, L, Dh]
    v = values.repeat_interleave(g, dim=1)
    slots = torch.arange(L, device=q.device)
    p = pos.reshape(-1, 1, 1, 1)  # [1 or T, 1, 1, 1]: one position for every row, or each row's own
    ok = slots <= p  # [1 or T, 1, 1, L]
    if window:
        ok = ok & (slots > p - window)
    if eager:  # transformers' eager_attention_forward (GPT-OSS's with sinks), op for op
        scores = torch.matmul(q[:, :, None, :], k.transpose(-1, -2)) * scaling  # [T, Hq, 1, L] model dtype
        scores = scores.masked_fill(~ok, float("-inf"))
        if sinks is not None:
            combined = torch.cat([scores, sinks.reshape(1, Hq, 1, 1).expand(T, Hq, 1, 1)], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            p = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(v.dtype)
        else:
            p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(p, v).reshape(T, Hq * Dh)
    scores = torch.matmul(q[:, :, None, :].float(), k.float().transpose(-1, -2)) * scaling  # [T, Hq, 1, L]
    scores = scores.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, Hq, 1, 1).expand(T, Hq, 1, 1)
        p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)  # [T, Hq, 1, L]
    else:
        p = torch.softmax(scores, dim=-1).to(q.dtype)
    o = torch.matmul(p, v)  # [T, Hq, 1, Dh]
    return o.reshape(T, Hq * Dh)



# ------------------------------------------------------------------------------------------------------------
# multi-head latent attention (DeepSeek-V2/V3), absorbed: C latent dims (kv_lora_rank), R rotary dims
# (qk_rope_head_dim), H heads, Dn the non-rotary q/k dims (qk_nope_head_dim). The cache holds, per token, the
# normalised latent [C] as "keys" and the roped shared key [R] as "values" (as transformers writes them).
ROPE_LAYOUTS = ("halves", "pairs_to_halves", "pairs")


def rope_rotate(x, cos, sin, layout: str):
    """x [..., R] rotated by per-frequency cos/sin [..., R/2] (broadcast), computed in the tables' dtype and cast
    back to x's dtype, op for op as HF:
      halves: rotate_half (x1 = x[:R/2], x2 = x[R/2:]) -> (x1 c - x2 s | x2 c + x1 s)  (DeepSeek-V3, rope_interleave
        off; HF's q*cos + rotate_half(q)*sin, the same rounded products);
      pairs_to_halves: x1 = x[0::2], x2 = x[1::2], the same output halves (DeepSeek-V3 rope_interleave);
      pairs: the same pairs, out interleaved again (DeepSeek-V2's complex product, fp32 tables)."""
    h = x.shape[-1] // 2
    xc = x.to(cos.dtype)
    x1, x2 = (xc[..., :h], xc[..., h:]) if layout == "halves" else (xc[..., 0::2], xc[..., 1::2])
    a, b = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.stack([a, b], dim=-1).flatten(-2) if layout == "pairs" else torch.cat([a, b], dim=-1)
    return out.to(x.dtype)


def mla_rope_cache(kv, q, pos, cos, sin, latents, rope_keys, kv_norm, eps: float, n_heads: int, nope: int,
                   layout: str):
    """kv [T, C + R] (kv_a_proj_with_mqa's output), q [T, H * (Dn + R)] -> roped q_pe [T, H, R]; the normalised
    latent (RMSNorm kv_norm [C]) written into latents [T, 1, L, C] and the roped shared key into rope_keys
    [T, 1, L, R] at slot `pos` (a device scalar, or [T]: each row at its own).
    cos/sin [L, R/2]: per-frequency tables (model dtype for DeepSeek-V3, whose rotary rounds each op to it; fp32
    for DeepSeek-V2's complex product); layout: ROPE_LAYOUTS."""
    T = kv.shape[0]
    C, R = latents.shape[-1], rope_keys.shape[-1]
    p = pos.reshape(-1)  # [1] or [T]
    c, s = cos.index_select(0, p)[:, None], sin.index_select(0, p)[:, None]  # [1 or T, 1, R/2]
    lat = rmsnorm(kv[:, :C], kv_norm, eps)  # [T, C]
    kr = rope_rotate(kv[:, None, C: C + R], c, s, layout)  # [T, 1, R]
    q_pe = rope_rotate(q.reshape(T, n_heads, nope + R)[..., nope:], c, s, layout)  # [T, H, R]
    rows, p = torch.arange(T, device=kv.device), p.expand(T)
    latents[:, 0].index_put_((rows, p), lat.to(latents.dtype))  # [T, L, C]: row t's latent to slot p[t]
    rope_keys[:, 0].index_put_((rows, p), kr[:, 0].to(rope_keys.dtype))
    return q_pe


def mla_attn_decode(q_lat, q_pe, latents, rope_keys, pos, scaling: float):
    """Absorbed MLA decode: q_lat [T, H, C] (q's non-rotary part mapped into the latent space by W_UK), q_pe
    [T, H, R] against cache slots [0, pos] -> o_lat [T, H, C] (the attention-weighted latents; W_UV maps them to
    the value heads). Scores (q_lat . latent + q_pe . rope_key) * scaling and the softmax in fp32, as sdpa."""
    T, H, C = q_lat.shape
    L = latents.shape[2]
    lat, kr = latents[:T, 0].float(), rope_keys[:T, 0].float()  # [T, L, C], [T, L, R]
    scores = (torch.matmul(q_lat.float(), lat.transpose(1, 2)) + torch.matmul(q_pe.float(), kr.transpose(1, 2)))
    scores = scores * scaling  # [T, H, L]
    ok = torch.arange(L, device=q_lat.device) <= pos.reshape(-1, 1, 1)  # [1 or T, 1, L]
    p = torch.softmax(scores.masked_fill(~ok, float("-inf")), dim=-1)  # [T, H, L]
    return torch.matmul(p.to(q_lat.dtype), latents[:T, 0])  # [T, H, C]

# ------------------------------------------------------------------------------------------------------------
# routers, one per router kind (moecg.models.adapter.ROUTER_KINDS); each is HF's router after its logits GEMM
def route(logits, top_k: int, normalize: bool, out_dtype):
    """softmax_topk: router logits [T, E] -> (idx [T, K] int64, weights [T, K] out_dtype): softmax fp32, top-k,
    renormalise."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return idx, w.to(out_dtype)


NORM_ROUTE_KINDS = ("softmax_topk", "topk_softmax")  # router kinds (moecg.models.adapter.ROUTER_KINDS) norm_route runs


def norm_route(a, residual, weight, eps: float, router_w, top_k: int, normalize: bool, out_dtype, logit_bias=None,
               cast_last: bool = False, quant: bool = False, router_b=None, kind: str = "softmax_topk"):
    """a [T, D] or [T, S, D] (the attention output, or its partial rows: linear_partials), residual [T, D] -> (new
    residual, normed [T, D], idx [T, K], weights [T, K]): add_rmsnorm, the router linear (router_w [E, D], its own
    bias router_b [E] or none; output in the model dtype), + logit_bias [E] (moecg's router skew, in the logits'
    dtype), then the router kind's choice: softmax_topk (route: softmax, top-k, normalize) or topk_softmax
    (route_topk_softmax: top-k of the logits, softmax over those k; normalize and out_dtype unused, the weights in the
    logits' dtype). quant: normed's act_quant too, last (as add_rmsnorm's)."""
    if kind not in NORM_ROUTE_KINDS:
        raise ValueError(f"norm_route: router kind {kind!r} is not one of {NORM_ROUTE_KINDS}")
    res, h = add_rmsnorm(a[:, None] if a.dim() == 2 else a, residual, weight, eps, cast_last=cast_last)
    logits = torch.nn.functional.linear(h, router_w, router_b)
    if logit_bias is not None:
        logits = logits + logit_bias.to(logits.dtype)
    idx, w = route_topk_softmax(logits, top_k) if kind == "topk_softmax" else route(logits, top_k, normalize,
                                                                                     out_dtype)
    return (res, h, idx, w, act_quant(h)) if quant else (res, h, idx, w)


def route_softmax_group(logits, top_k: int, n_group: int, topk_group: int, scaling: float):
    """softmax_group (DeepSeek-V2): fp32 logits [T, E] -> (idx [T, K] int64, weights [T, K] fp32): softmax over all
    experts; n_group 1 is topk_method=greedy (top-k of all), else group_limited_greedy (keep the topk_group groups
    with the best single expert, top-k in them); times scaling, never renormalised. HF's ops in HF's order."""
    scores = logits.softmax(dim=-1, dtype=torch.float32)  # [T, E]
    if n_group > 1:
        T, E = scores.shape
        group_scores = scores.view(T, n_group, E // n_group).max(dim=-1).values  # [T, G]
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)  # [T, E]
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
    w, idx = torch.topk(scores, k=top_k, dim=-1, sorted=False)  # [T, K]
    return idx, w * scaling

def route_sigmoid_group(logits, choice_bias, top_k: int, n_group: int, topk_group: int, normalize: bool,
                        scaling: float):
    """sigmoid_group (DeepSeek-V3, GLM-4-MoE): fp32 logits [T, E] -> (idx [T, K] int64, weights [T, K] fp32).

    Scores sigmoid(logits); the choice adds choice_bias [E] (e_score_correction_bias) and keeps the topk_group of
    n_group groups with the largest sum of their two best biased scores; the weights are the unbiased scores of
    the chosen experts, renormalised (+1e-20) if normalize, times scaling. HF's ops in HF's order (its top-ks are
    unsorted: the order of the K columns is torch.topk's).
    """
    T, E = logits.shape
    scores = logits.sigmoid()  # [T, E]
    choice = scores + choice_bias if choice_bias is not None else scores
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)  # [T, E]
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    idx = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # [T, K]
    w = scores.gather(1, idx)  # [T, K]
    if normalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, w * scaling


def route_topk_softmax(logits, top_k: int):
    """topk_softmax (GPT-OSS): logits [T, E] (router bias included) -> (idx [T, K] int64, weights [T, K] in the
    logits' dtype): top-k of the logits, softmax over those k in the logits' dtype."""
    top, idx = torch.topk(logits, top_k, dim=-1)  # [T, K]
    return idx, torch.softmax(top, dim=1, dtype=top.dtype)


# ------------------------------------------------------------------------------------------------------------
def linear(x, w, bias=None, tiles=None, xq=None):
    """x [T, K] @ w [N, K]^T (+ bias [N]) -> [T, N] in x's dtype: F.linear (cuBLAS on CUDA), fp32 accumulation,
    rounded once. w: a tensor, or a block-FP8 weight (moecg.models.formats.BlockFp8), dequantized first (and x taken
    as the weight takes it: BlockFp8.input). tiles: the Triton GEMV's tile choice (moecg.kernels.tiles.GemvTiles); xq:
    x's act_quant from its producer, which the kernels read instead of quantizing x; neither has a meaning here (x is
    quantized from itself)."""
    return F.linear(gemm_input(w, x), dense(w), bias)


def router_logits(h, w):
    """An fp32 router's logits, as HF's DeepSeek / GLM routers compute them: F.linear(h.float(), w.float()) -> [T, E]
    fp32 (h [T, D] in the model's dtype, w [E, D] in fp32 or the model's dtype)."""
    return F.linear(h.float(), w.float())


def linear_partials(x, w, bias=None, tiles=None, xq=None):
    """linear as [T, S, N] partial rows whose fp32 sum is the projection (its consumer, add_rmsnorm or norm_route,
    adds them and rounds once): here S = 1, linear's output itself. The Triton GEMV splits K where its tiles say
    (GemvTiles.split_k), the same products summed in another order."""
    return linear(x, w, bias)[:, None]


def head_linear(x, w, tiles=None):
    """Per-head projections: x [T, H, K] @ w[h] [N, K]^T for every head h -> [T, H, N] in x's dtype (MLA's W_UK into
    the latent space and W_UV out of it; w may be any strided view, e.g. kv_b_proj's rows). torch.bmm over the heads
    (cuBLAS on CUDA), fp32 accumulation, rounded once. tiles: the Triton kernel's; no meaning here."""
    return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


def silu_mul(gu, inter: int, quant: bool = False):
    """gu [T, >= 2I] (gate | up, maybe more columns after) -> silu(gate) * up [T, I], rounded as HF's MLP. quant: its
    act_quant too, second (the down projection's input where it takes fp8_dynamic inputs)."""
    h = F.silu(gu[:, :inter]) * gu[:, inter: 2 * inter]
    return (h, act_quant(h)) if quant else h


def expert_act(gu, spec=None):
    """Gate/up projections [..., 2I] -> [..., I] as the family's experts compute them (rounded as HF).

    spec: a moecg.models.adapter.ExpertSpec (None: SiLU, [gate | up] halves). act "silu": silu(gate) * up;
    "swiglu_clamp" (GPT-OSS): gate.clamp(max=limit), up.clamp(-limit, limit), (up + 1) * gate * sigmoid(alpha * gate).
    interleaved: gate/up columns alternate (g0 u0 g1 u1 ...) instead of two halves.
    """
    if spec is not None and spec.interleaved:
        gate, up = gu[..., ::2], gu[..., 1::2]
    else:
        gate, up = gu.chunk(2, dim=-1)
    if spec is None or spec.act == "silu":
        return F.silu(gate) * up
    if spec.act == "swiglu_clamp":
        gate = gate.clamp(min=None, max=spec.limit)
        up = up.clamp(min=-spec.limit, max=spec.limit)
        glu = gate * torch.sigmoid(gate * spec.alpha)
        return (up + 1) * glu
    raise ValueError(f"expert activation {spec.act!r}: the fused ops know silu and swiglu_clamp")


def moe_experts(x, idx, w, gate_up, down, valid=None, counters=None, *, spec=None, gate_up_bias=None,
                down_bias=None, tiles=None, xq=None):
    """Dropless routed experts, unreduced: [T, K, D] fp32, y[t, k] = w[t, k] * expert_{idx[t,k]}(x[t]).

    gate_up [E, 2I, D] and down [E, D, I] (spec.transposed: [E, D, 2I] and [E, I, D], GPT-OSS); biases [E, 2I] and
    [E, D] are added after each GEMM's rounding, as HF adds them. spec: see expert_act.
    Rows with valid False get zeros and are not counted. counters: a LayerCounters (routed, mass, tokens).
    tiles: the Triton kernel's tile choice (moecg.kernels.tiles); xq: x's act_quant from its producer (linear's);
    neither has a meaning here.
    """
    T, K = idx.shape
    transposed = spec is not None and spec.transposed
    x_in = gemm_input(gate_up, x)  # one row per token: quantized per token, as each expert's GEMM takes it
    down_stored = down
    gate_up, down = dense(gate_up), dense(down)  # block-FP8 weights: the format's reference dequantization
    E = gate_up.shape[0]
    D = x.shape[1]
    sel = idx.reshape(-1)  # [S]
    xs = x_in[:, None, :].expand(T, K, D).reshape(T * K, 1, D).to(gate_up.dtype)  # [S, 1, D]
    wg = gate_up[sel] if transposed else gate_up[sel].transpose(1, 2)  # [S, D, 2I]
    gu = torch.bmm(xs, wg)  # [S, 1, 2I]
    if gate_up_bias is not None:
        gu = gu + gate_up_bias[sel][:, None, :]
    h = gemm_input(down_stored, expert_act(gu, spec))  # [S, 1, I]
    wd = down[sel] if transposed else down[sel].transpose(1, 2)  # [S, I, D]
    y = torch.bmm(h, wd)  # [S, 1, D] model dtype
    if down_bias is not None:
        y = y + down_bias[sel][:, None, :]
    y = y.reshape(T, K, D).float() * w.float()[..., None]  # [T, K, D]
    if valid is not None:
        y = torch.where(valid[:, None, None], y, 0.0)
    if counters is not None:
        idx_m, counts = route_counts(idx, valid, E)
        counters.add_routed(counts, routed_mass(idx_m, w, E), count_valid(valid, T, x.device))
    return y


def capacity_experts(x, idx, w, gate_up, down, valid=None, counters=None, *, capacity_factor: float,
                     drop_policy: str = "probs", min_capacity: int = 1, renormalize: bool = False, spec=None,
                     gate_up_bias=None, down_bias=None, tiles=None, xq=None):
    """`capacity`'s routed experts, unreduced: [T, K, D] fp32, moe_experts on the assignments that keep a slot,
    zeros for the dropped ones and for pad rows.

    The slots are the capacity dispatcher's (moecg.moe_math.assign_slots: C = Megatron's capacity of the
    real tokens; `probs` keeps each expert's highest combine weights, equal weights to the earlier token;
    `position` the earliest tokens), the weights its kept_weights (renormalize), the counters its add_counters.
    The Triton kernels (moecg.kernels.capacity) compute this while reading every expert's weights once; tiles
    is their tile choice, xq x's act_quant from its producer (no meaning here).
    """
    sl = assign_slots(idx, w, valid, gate_up.shape[0], capacity_factor, min_capacity, drop_policy)
    keep_k, w_k = kept_weights(idx, w, sl.kept, valid, renormalize)  # [T, K], [T, K] fp32
    y = moe_experts(x, idx, w_k, gate_up, down, spec=spec, gate_up_bias=gate_up_bias, down_bias=down_bias)
    if counters is not None:
        add_counters(counters, sl)
    return torch.where(keep_k[..., None], y, 0.0)  # [T, K, D]
