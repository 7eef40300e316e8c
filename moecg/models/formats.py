"""Weight formats (`model.weights`): how a model's projections are stored, and the PyTorch reference of each.

`full`: every weight in the model's dtype (HF as built). `fp8_block`: the published block-FP8 format of DeepSeek-V3's
and Qwen3's FP8 releases (`quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}`):
e4m3 values and one fp32 scale per 128 x 128 block of each weight, `weight_scale_inv` beside it, dequantized as
`value * scale` (the scale is the block's amax / 448). What is quantized, as in those releases: every routed and
shared expert, every dense MLP and every attention projection; the routers (and Qwen2-MoE's one-row shared-expert
gate), the embeddings, the LM head and the norms stay in the model's dtype.

In memory (moecg's layout, read by every path):
- an experts module keeps HF's fused parameters, now e4m3: `gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I], with
  `gate_up_proj_scale_inv` [E, ceil(2I / g), ceil(D / 128)] and `down_proj_scale_inv` beside them. `g`, the rows one
  scale row covers, is 128, or less where fused rows do not fall on 128-row boundaries (gate and up are quantized
  as the separate [I, D] weights the checkpoints publish, so a 128-block never straddles them: g = gcd(128, I), the
  published scales repeated 128 / g times; exact, and the same bytes as published where I is a multiple of 128).
- a quantized nn.Linear becomes `Fp8Linear` (`weight` e4m3 [N, K], `weight_scale_inv` [ceil(N/128), ceil(K/128)]).
The reference dequantizes in fp32 and rounds once to the model dtype: `(q.float() * scale).to(dtype)`; every
quantized kernel is checked against it. (HF's own FP8 dequantizer multiplies in bf16, rounding the scale first.)

`mxfp4`: the OCP microscaling format GPT-OSS publishes its experts in (`quantization_config: {quant_method: mxfp4}`):
e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two per byte, and one e8m0 scale (2^(s - 127)) per 32
consecutive values of a weight row (along the input dim K). What is quantized, as GPT-OSS does: the routed experts
only; attention, shared experts, dense MLPs, routers, embeddings and the LM head stay in the model dtype. Every family
can be stored so (K, the hidden and the expert intermediate size, a multiple of 32).
In memory an experts module keeps its parameter names, now uint8 and output-row major whatever the module's own
layout: `gate_up_proj` [E, 2I, D/2] (GPT-OSS: its 2I interleaved gate/up rows, as published) and `down_proj`
[E, D, I/2], with `gate_up_proj_scales` [E, 2I, D/32] and `down_proj_scales` [E, D, I/32] beside them. The
reference looks each nibble up (low nibble: the even column), multiplies by its scale in fp32 and rounds once to the
model dtype (exact: an e2m1 value times a power of two is a bf16 value, as HF's dequantizer computes it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FORMATS = ("full", "fp8_block", "mxfp4")  # the `model.weights` values
ACTIVATIONS = ("full", "fp8_dynamic")  # the `model.activations` values: how a block-FP8 GEMM's input is taken
BLOCK = 128  # the published block edge, both dims
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest e4m3 value
SCALE = "_scale_inv"  # the published suffix of a weight's scales (`<weight name>_scale_inv`)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # the fused experts' quantized parameters
MX_BLOCK = 32  # values per mxfp4 scale, along K
MX_SCALES = "_scales"  # the published suffix of an mxfp4 weight's scales (its values: `<name>_blocks`)
MX_BIAS = 127  # e8m0: scale byte s is 2^(s - 127)
MX_SCALE_MAX = 240  # the largest scale byte the kernels take: their one-row product folds 2^14 into the scale's
# exponent (moecg.kernels.quant.mx_row_mac), so 2^(s - 113) must stay finite; blocks of 6 x 2^113 and more
# (no trained or initialised weights) are refused where weights are quantized or loaded
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 codes


class WeightFormatError(ValueError):
    pass


@dataclass(frozen=True)
class BlockFp8:
    """One block-scaled e4m3 weight as a kernel reads it: q [..., N, K] e4m3, scale [..., ceil(N/rows), ceil(K/128)]
    fp32 (rows: the rows one scale row covers, 128 or a divisor of it), dequantized into `dtype`."""

    q: torch.Tensor
    scale: torch.Tensor
    rows: int
    dtype: torch.dtype
    act: str = "full"  # the input's form (ACTIVATIONS): `full` as it is, `fp8_dynamic` quantized (act_quant) first

    @property
    def shape(self):
        return self.q.shape

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """x as this weight's GEMM takes it (the reference): unchanged, or fp8_dynamic's act_fake_quant."""
        return act_fake_quant(x) if self.act == "fp8_dynamic" else x

    def dense(self) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.rows, self.dtype)

    def stored_bytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


@dataclass(frozen=True)
class Mxfp4:
    """One mxfp4 weight as a kernel reads it: q [..., N, K/2] uint8 (two e2m1 codes per byte, the low nibble the even
    column), scale [..., N, K/32] uint8 (e8m0), N the output rows; dequantized into `dtype`. transposed: the module
    holds the dense weight as [..., K, N] (GPT-OSS's experts), so dense() returns that layout."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    transposed: bool = False

    @property
    def shape(self):
        """The dense weight's shape, in the module's layout."""
        *lead, n, k = (*self.q.shape[:-1], self.q.shape[-1] * 2)
        return torch.Size((*lead, k, n) if self.transposed else (*lead, n, k))

    def dense(self) -> torch.Tensor:
        w = mx_dequantize(self.q, self.scale, self.dtype)
        return w.transpose(-1, -2) if self.transposed else w

    def stored_bytes(self) -> int:
        return self.q.numel() + self.scale.numel()


QUANTIZED = (BlockFp8, Mxfp4)  # the stored forms of a quantized weight


MX_CHUNK = 2 ** 27  # values quantized at once: the temporaries (fp32 and int64 per value) stay ~2 GiB


def mx_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (K a multiple of 32) -> (q [..., N, K/2] uint8, scale [..., N, K/32] uint8): per 32 values of a
    row the smallest power of two 2^e with amax <= 6 * 2^e (no value clipped; an all-zero block gets 2^0; e at
    least -126), each value / 2^e rounded to the nearest e2m1 value, ties to the even code. A stack of matrices
    larger than MX_CHUNK values is quantized a few matrices at a time (each block on its own: the same bytes)."""
    *lead, N, K = w.shape
    if K % MX_BLOCK:
        raise WeightFormatError(f"model.weights=mxfp4: a weight's input dim ({K}) is not a multiple of {MX_BLOCK}")
    if not lead or w.numel() <= MX_CHUNK:
        return _mx_quantize(w)
    flat = w.reshape(-1, N, K)
    q, sc = (torch.empty(flat.shape[0], N, n, dtype=torch.uint8, device=w.device) for n in (K // 2, K // MX_BLOCK))
    _by_matrices(_mx_quantize, (flat,), (q, sc), N * K)
    return q.view(*lead, N, K // 2), sc.view(*lead, N, K // MX_BLOCK)


def _by_matrices(fn, inputs, outs, values_per_matrix: int) -> None:
    """outs[j][i] = fn(*inputs)[j][i] over stacked matrices i, a few matrices (<= MX_CHUNK values) a call: the same
    result as one call, without every value's temporaries at once."""
    step = max(1, MX_CHUNK // values_per_matrix)
    for i in range(0, inputs[0].shape[0], step):
        for o, r in zip(outs, fn(*(t[i: i + step] for t in inputs))):
            o[i: i + step] = r


def _mx_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, N, K = w.shape
    b = w.float().contiguous().view(*lead, N, K // MX_BLOCK, MX_BLOCK)
    amax = b.abs().amax(-1)
    _, e = torch.frexp(amax / 6)  # amax / 6 < 2^e: e is the exponent, give or take one; fixed below, exactly
    e = e.to(torch.int32)
    e = torch.where(amax > 6 * torch.ldexp(torch.ones_like(amax), e), e + 1, e)
    e = torch.where(amax <= 6 * torch.ldexp(torch.ones_like(amax), e - 1), e - 1, e)
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(1 - MX_BIAS, 254 - MX_BIAS)
    if bool((e > MX_SCALE_MAX - MX_BIAS).any()):
        raise WeightFormatError(f"model.weights=mxfp4: a 32-value block reaches {float(amax.max()):.3g}, above "
                                f"the scale byte {MX_SCALE_MAX} the kernels take (blocks under 6 x 2^113)")
    x = b / torch.ldexp(torch.ones_like(amax), e)[..., None]
    mag = x.abs().clamp(max=6.0)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=w.device)
    code = torch.bucketize(mag, mids)  # a tie (mag on a midpoint) gets the lower code: up to the even one
    tie = (code < 7) & (mag == mids[code.clamp(max=6)]) & (code % 2 == 1)
    code = (code + tie.to(code.dtype)) | torch.where(x < 0, 8, 0)
    code = code.to(torch.uint8).reshape(*lead, N, K)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous(), (e + MX_BIAS).to(torch.uint8).contiguous()


def mx_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference: q [..., N, K/2] uint8, scale [..., N, K/32] uint8 -> [..., N, K] in dtype (each e2m1 value
    times 2^(s - 127) in fp32, rounded once). A stack larger than MX_CHUNK values: a few matrices at a time."""
    *lead, N, Kh = q.shape
    if not lead or 2 * q.numel() <= MX_CHUNK:
        return _mx_dequantize(q, scale, dtype)
    fq, fs = q.reshape(-1, N, Kh), scale.reshape(-1, N, scale.shape[-1])
    out = torch.empty(fq.shape[0], N, 2 * Kh, dtype=dtype, device=q.device)
    _by_matrices(lambda a, b: (_mx_dequantize(a, b, dtype),), (fq, fs), (out,), 2 * N * Kh)
    return out.view(*lead, N, 2 * Kh)


def _mx_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=q.device)
    v = torch.stack([lut[(q & 15).long()], lut[(q >> 4).long()]], dim=-1).flatten(-2)  # [..., N, K]
    s = torch.ldexp(torch.ones_like(scale, dtype=torch.float32), scale.to(torch.int32) - MX_BIAS)
    return (v.unflatten(-1, (-1, MX_BLOCK)) * s[..., None]).flatten(-2).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (q [..., N, K] e4m3, scale [..., ceil(N/128), ceil(K/128)] fp32): one scale per 128 x 128
    block (the block's amax / 448; an all-zero block gets scale 1), values rounded to nearest e4m3."""
    *lead, N, K = w.shape
    nb, kb = math.ceil(N / BLOCK), math.ceil(K / BLOCK)
    pad = torch.zeros(*lead, nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    pad[..., :N, :K] = w.float()
    blocks = pad.view(*lead, nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, _div(amax, FP8_MAX), torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(*lead, nb * BLOCK, kb * BLOCK)
    return q[..., :N, :K].to(FP8).contiguous(), scale.contiguous()


def _div(a, b) -> torch.Tensor:
    """a / b in IEEE fp32 on every device: both as tensors, since CUDA divides a tensor by a Python scalar as a
    multiplication by its reciprocal (its last bit differs from the quotient's on about half the values)."""
    t = a if isinstance(a, torch.Tensor) else b
    return torch.div(torch.as_tensor(a, dtype=torch.float32, device=t.device).expand_as(t),
                     torch.as_tensor(b, dtype=torch.float32, device=t.device).expand_as(t))


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`model.activations=fp8_dynamic`, the published checkpoints' `activation_scheme: dynamic` (vLLM's and SGLang's
    per-token-group quantization, DeepSeek's act_quant): x [..., K] -> (q [..., K] e4m3, scale [..., ceil(K/128)]
    fp32), each row's 128-column blocks on their own: scale = amax / 448, q = x * (448 / amax) rounded to the nearest
    e4m3 (both quotients IEEE fp32, once per block; an all-zero block gets scale 1)."""
    K = x.shape[-1]
    kb = math.ceil(K / BLOCK)
    pad = torch.zeros(*x.shape[:-1], kb * BLOCK, dtype=torch.float32, device=x.device)
    pad[..., :K] = x.float()
    blocks = pad.view(*x.shape[:-1], kb, BLOCK)
    amax = blocks.abs().amax(dim=-1)  # [..., kb]
    nz = amax > 0
    scale = torch.where(nz, _div(amax, FP8_MAX), torch.ones_like(amax))
    inv = torch.where(nz, _div(FP8_MAX, torch.where(nz, amax, torch.ones_like(amax))), torch.ones_like(amax))
    q = (blocks * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).view(*x.shape[:-1], kb * BLOCK)[..., :K]
    return q.to(FP8).contiguous(), scale


def act_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """x through act_quant and back: q times its block's scale in fp32, rounded once to x's dtype. The reference GEMMs
    take this for the input and the dequantized weight (`BlockFp8.input`); the kernels multiply the e4m3 values
    themselves (FP8 MMAs, or fp32 products), which differs from it within the two roundings to x's dtype."""
    q, scale = act_quant(x)
    return (q.float() * scale.repeat_interleave(BLOCK, dim=-1)[..., :x.shape[-1]]).to(x.dtype)


def fp8_input(w) -> bool:
    """w (a weight as stored: a tensor, BlockFp8, Mxfp4, or None) takes fp8_dynamic inputs: its GEMMs quantize x
    first (act_quant)."""
    return isinstance(w, BlockFp8) and w.act == "fp8_dynamic"


def expand_scale(scale: torch.Tensor, rows: int, n: int, k: int) -> torch.Tensor:
    """scale [..., ceil(n/rows), ceil(k/128)] -> [..., n, k]: each weight element's scale."""
    return scale.repeat_interleave(rows, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The reference: q [..., N, K] e4m3 times its block scales in fp32, rounded once to `dtype`."""
    N, K = q.shape[-2:]
    return (q.float() * expand_scale(scale, rows, N, K)).to(dtype)


def fuse_rows(parts: list[tuple[torch.Tensor, torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Quantized weights (q [.., N_i, K], scale, rows_i) stacked along N -> (q, scale, rows) of the stack, exactly:
    rows = gcd of the parts' rows and of the offsets where parts start, each part's scale rows repeated to it."""
    g = 0
    for i, (q, _, r) in enumerate(parts):
        g = math.gcd(g, r if i == len(parts) - 1 else math.gcd(r, q.shape[-2]))
    qs, ss = [], []
    for q, s, r in parts:
        qs.append(q)
        ss.append(s.repeat_interleave(r // g, dim=-2)[..., : math.ceil(q.shape[-2] / g), :])
    return torch.cat(qs, dim=-2), torch.cat(ss, dim=-2), g


def quantize_stacked(w: torch.Tensor, parts: int = 1, dtype: torch.dtype | None = None, quantizer=quantize) -> BlockFp8:
    """w [..., N, K] as `parts` equal row blocks, each quantized as its own published weight (gate | up), fused: a
    BlockFp8 computing in `dtype` (default w's). quantizer: `quantize`, or `placeholder` (shapes only)."""
    n = w.shape[-2] // parts
    q, s, rows = fuse_rows([(*quantizer(w[..., i * n:(i + 1) * n, :]), BLOCK) for i in range(parts)])
    return BlockFp8(q, s, rows, dtype or w.dtype)


def placeholder(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize's shapes and dtypes, zeros, nothing computed: the skeleton a checkpoint's tensors fill."""
    *lead, N, K = w.shape
    return (torch.zeros(*lead, N, K, dtype=FP8, device=w.device),
            torch.zeros(*lead, math.ceil(N / BLOCK), math.ceil(K / BLOCK), device=w.device))
