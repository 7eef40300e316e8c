"""Multi-head latent attention (DeepSeek-V2/V3) in the fused decode step, absorbed as DeepSeek serves it.

Dims: T tokens (one per row), D hidden, H heads, Dn / R / Dv the non-rotary q/k, rotary and value dims per head
(qk_nope_head_dim, qk_rope_head_dim, v_head_dim), C latent dims (kv_lora_rank), Q q_lora_rank, L cache slots.
HF's module (transformers 5.24) caches the normalised latent [C] and the roped shared key [R] per token, then at
every step re-expands the whole cached latent through kv_b_proj into per-head K and V ([L, H, Dn + Dv]): its cost
grows with the context. The absorbed form reads only the cache (C + R values per token and layer):

  q_lat[h] = q_nope[h] @ W_UK[h]                 [T, C] per head (W_UK = kv_b_proj's key rows, [H, Dn, C])
  s[h, l]  = (q_lat[h] . latent[l] + q_pe[h] . rope_key[l]) * scaling
  o[h]     = (softmax(s[h]) @ latent) @ W_UV[h]^T  [T, Dv] per head (W_UV = its value rows, [H, Dv, C])

which is the same sum as HF's q . k and p . v with the products re-associated, so it agrees with HF's module up to
bf16 rounding of q_lat and of the latent-space output, not to the bit (tests bound the difference). One layer is:
one GEMM for q_a (or q_proj) and kv_a_proj_with_mqa together | [q_a RMSNorm | q_b GEMM] | latent RMSNorm + rotary of
the shared key and q_pe + cache write (ops.mla_rope_cache) | W_UK (ops.head_linear) | ops.mla_attn_decode | W_UV
(ops.head_linear) | o GEMM (in moecg.fast). W_UK and W_UV are views of kv_b_proj's weight: nothing is copied but the
concatenated first GEMM's weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moecg.models.weights import dense, stored

__all__ = ["LatentAttention", "build", "rope_tables", "project_q_kv", "attend"]


@dataclass
class LatentAttention:
    # [Qa + C + R (+ pad), D]: q_a_proj (or q_proj) | kv_a_proj_with_mqa, concatenated (a copy); block-FP8
    # projections: a moecg.models.formats.BlockFp8 (wqb too)
    wa: torch.Tensor
    ba: torch.Tensor | None  # its bias (zeros where a part has none), when any part has one
    q_rows: int  # Qa: q_lora_rank, or H * (Dn + R) without a q LoRA
    qa_norm: torch.Tensor | None  # [Q] q_a_layernorm's weight (None: no q LoRA)
    qa_eps: float
    wqb: torch.Tensor | None  # [H * (Dn + R), Q] q_b_proj's weight
    w_uk: torch.Tensor  # [H, Dn, C] view of kv_b_proj.weight
    w_uv: torch.Tensor  # [H, Dv, C] view of kv_b_proj.weight
    kv_norm: torch.Tensor  # [C] kv_a_layernorm's weight
    kv_eps: float
    n_heads: int
    nope: int
    rope: int
    v_dim: int
    latent: int
    scaling: float
    layout: str  # moecg.kernels.ref.ROPE_LAYOUTS


def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def build(at, layout: str, fuse) -> LatentAttention:
    """The weights one MLA layer's decode reads, from HF's DeepseekV2/V3Attention `at` (read, never changed).
    fuse(params, align) -> the concatenated copy (moecg.fast counts its bytes)."""
    H, Dn, R, Dv, C = at.num_heads, at.qk_nope_head_dim, at.qk_rope_head_dim, at.v_head_dim, at.kv_lora_rank
    first = at.q_a_proj if at.q_a_proj is not None else at.q_proj
    parts = [first, at.kv_a_proj_with_mqa]
    wa = fuse([stored(p) for p in parts], 8)  # block-FP8 projections stay block-FP8 (the GEMV reads them)
    ba = None
    if any(p.bias is not None for p in parts):
        ba = torch.zeros(wa.shape[0], dtype=wa.dtype, device=first.weight.device)  # [rows]: each part's bias
        o = 0
        for p in parts:
            if p.bias is not None:
                ba[o: o + p.weight.shape[0]] = p.bias.detach()
            o += p.weight.shape[0]
    # [H, Dn + Dv, C]; a block-FP8 kv_b_proj is dequantized once (the per-head GEMVs read the model dtype)
    kvb = dense(stored(at.kv_b_proj)).detach().view(H, Dn + Dv, C)
    lora = at.q_a_proj is not None
    return LatentAttention(
        wa=wa, ba=ba, q_rows=first.weight.shape[0], qa_norm=at.q_a_layernorm.weight if lora else None,
        qa_eps=_eps(at.q_a_layernorm) if lora else 1e-6, wqb=stored(at.q_b_proj) if lora else None,
        w_uk=kvb[:, :Dn], w_uv=kvb[:, Dn:], kv_norm=at.kv_a_layernorm.weight, kv_eps=_eps(at.kv_a_layernorm),
        n_heads=H, nope=Dn, rope=R, v_dim=Dv, latent=C, scaling=float(at.scaling), layout=layout)


def rope_tables(rotary, length: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-frequency cos/sin [L, R/2] for every slot, exactly HF's rotary module's values: DeepSeek-V3's gives
    cos/sin [1, L, R] (two equal halves) in the model dtype; DeepSeek-V2's gives complex fp32 freqs [1, L, R/2]."""
    x = torch.zeros(1, 1, dtype=dtype, device=device)
    pos = torch.arange(length, device=device)[None]
    with torch.no_grad():
        out = rotary(x, pos)
    if isinstance(out, torch.Tensor) and out.is_complex():
        return out[0].real.contiguous(), out[0].imag.contiguous()
    cos, sin = out
    h = cos.shape[-1] // 2
    return cos[0, :, :h].contiguous(), sin[0, :, :h].contiguous()


def project_q_kv(ops, A: LatentAttention, h):
    """h [T, D] -> (q [T, H * (Dn + R)], kv [T, C + R]): the first GEMM, then q_a's norm and q_b where there is a
    q LoRA."""
    a = ops.linear(h, A.wa, A.ba)  # [T, Qa + C + R (+ pad)]
    kv = a[:, A.q_rows: A.q_rows + A.latent + A.rope]
    if A.wqb is None:
        return a[:, : A.q_rows], kv
    qa = ops.add_rmsnorm(a[:, None, : A.q_rows], None, A.qa_norm, A.qa_eps, out_dtype=a.dtype)[1]  # [T, Q]
    return ops.linear(qa, A.wqb), kv


def attend(ops, A: LatentAttention, h, pos, cos, sin, latents, rope_keys):
    """One decode step of the layer's attention before o_proj: h [T, D] -> [T, H * Dv]; writes this step's latent
    and rotary key into the cache (latents [B, 1, L, C], rope_keys [B, 1, L, R]) at `pos`."""
    T = h.shape[0]
    q, kv = project_q_kv(ops, A, h)
    q_pe = ops.mla_rope_cache(kv, q, pos, cos, sin, latents, rope_keys, A.kv_norm, A.kv_eps, A.n_heads, A.nope,
                              A.layout)  # [T, H, R]
    q_nope = q.view(T, A.n_heads, A.nope + A.rope)[..., : A.nope]  # [T, H, Dn]
    q_lat = ops.head_linear(q_nope, A.w_uk.transpose(1, 2))  # [T, H, C]
    o_lat = ops.mla_attn_decode(q_lat, q_pe, latents, rope_keys, pos, A.scaling)  # [T, H, C]
    o = ops.head_linear(o_lat, A.w_uv)  # [T, H, Dv]
    return o.reshape(T, A.n_heads * A.v_dim)
