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

import bisect
import copy
import math
from contextlib import contextmanager
from pathlib import Path
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.integrations.moe import ExpertsInterface

FORMATS = ("full", "fp8_block", "mxfp4")  # the `model.weights` values
BLOCK = 128  # the published block edge, both dims
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest e4m3 value
SCALE = "_scale_inv"  # the published suffix of a weight's scales (`<weight name>_scale_inv`)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # the fused experts' quantized parameters
MX_BLOCK = 32  # values per mxfp4 scale, along K
MX_SCALES = "_scales"  # the published suffix of an mxfp4 weight's scales (its values: `<name>_blocks`)
MX_BIAS = 127  # e8m0: scale byte s is 2^(s - 127)
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

    @property
    def shape(self):
        return self.q.shape

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
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(*lead, nb * BLOCK, kb * BLOCK)
    return q[..., :N, :K].to(FP8).contiguous(), scale.contiguous()


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


# ------------------------------------------------------------------------------------------------------------
# the model's modules, quantized in place
class Fp8Linear(nn.Module):
    """nn.Linear with a block-FP8 weight: `weight` e4m3 [N, K], `weight_scale_inv` [ceil(N/128), ceil(K/128)] fp32,
    `bias` in the model dtype; forward = F.linear on the dequantized weight (the reference path)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.compute_dtype = dtype

    @classmethod
    def from_linear(cls, lin: nn.Linear, quantizer=quantize) -> Fp8Linear:
        q, s = quantizer(lin.weight.detach())
        return cls(q, s, lin.bias, lin.weight.dtype)

    def stored(self) -> BlockFp8:
        return BlockFp8(self.weight, self.weight_scale_inv, BLOCK, self.compute_dtype)

    def forward(self, x):
        return F.linear(x, self.stored().dense(), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_block"


def stored(module: nn.Module, name: str = "weight"):
    """A module's weight as stored: a tensor in the model dtype, a BlockFp8 (an Fp8Linear's weight, a block-FP8
    experts module's `gate_up_proj` / `down_proj`) or an Mxfp4 (an mxfp4 experts module's)."""
    if isinstance(module, Fp8Linear) and name == "weight":
        return module.stored()
    how = getattr(module, "_moecg_quant", {}).get(name)
    if how is None:
        return getattr(module, name)
    if how == "mxfp4":
        return Mxfp4(getattr(module, name), getattr(module, name + MX_SCALES), module._moecg_dtype,
                     bool(getattr(module, "is_transposed", False)))
    return BlockFp8(getattr(module, name), getattr(module, name + SCALE), how, module._moecg_dtype)


def scale_name(module: nn.Module, name: str) -> str:
    """The attribute holding a quantized parameter's scales (`<name>_scale_inv` or `<name>_scales`)."""
    return name + (MX_SCALES if module._moecg_quant[name] == "mxfp4" else SCALE)


def dense(w) -> torch.Tensor:
    """A stored weight in the model dtype (BlockFp8 / Mxfp4 dequantized by the reference, a tensor as it is)."""
    return w.dense() if isinstance(w, QUANTIZED) else w


def compute_dtype(experts: nn.Module) -> torch.dtype:
    """The dtype an experts module computes in (its parameters' own, or the model's for quantized ones)."""
    return getattr(experts, "_moecg_dtype", None) or experts.gate_up_proj.dtype


def quantize_experts(experts: nn.Module, fmt: str = "fp8_block", values: bool = True) -> None:
    """An HF fused experts module's gate_up_proj / down_proj -> the format's parameters (in place): fp8_block, e4m3
    values + `<name>_scale_inv` (gate and up quantized as their own [I, D] weights, the published per-expert layout,
    then fused); mxfp4, packed e2m1 + `<name>_scales`, output-row major. values=False: zeros (placeholder)."""
    transposed = bool(getattr(experts, "is_transposed", False))
    if fmt == "fp8_block" and transposed:
        raise WeightFormatError(f"model.weights=fp8_block: {type(experts).__name__} stores its experts transposed "
                                "([E, D, 2I], GPT-OSS); block-FP8 covers the [E, 2I, D] layout: use "
                                "model.weights=full or mxfp4 for this family")
    experts._moecg_dtype = experts.gate_up_proj.dtype
    experts._moecg_quant = {}
    for name, parts in (("gate_up_proj", 2), ("down_proj", 1)):  # [E, 2I, D] gate | up, [E, D, I]
        w = getattr(experts, name).detach()
        if fmt == "mxfp4":
            w = w.transpose(-1, -2) if transposed else w  # [E, N, K]: scales run along a row's K
            if values:
                q, sc = mx_quantize(w)
            else:
                *lead, N, K = w.shape
                q = torch.zeros(*lead, N, K // 2, dtype=torch.uint8, device=w.device)
                sc = torch.zeros(*lead, N, K // MX_BLOCK, dtype=torch.uint8, device=w.device)
            experts._moecg_quant[name] = "mxfp4"
        else:
            b = quantize_stacked(w, parts, quantizer=quantize if values else placeholder)
            q, sc = b.q, b.scale
            experts._moecg_quant[name] = b.rows
        setattr(experts, name, nn.Parameter(q, requires_grad=False))
        setattr(experts, scale_name(experts, name), nn.Parameter(sc, requires_grad=False))


def quantized_linears(layer: nn.Module, adapter) -> list[tuple[nn.Module, str]]:
    """(parent module, attribute) of every nn.Linear of a decoder layer that block-FP8 quantizes: all but the router
    and the shared-expert gate."""
    block = adapter.moe_block(layer)
    keep = set() if block is None else {id(getattr(block, adapter.router)), id(adapter.shared_gate_of(layer))}
    return [(parent, name) for parent in layer.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and id(child) not in keep]


DEQUANTIZING = "moecg_dequantized"  # the ExpertsInterface implementation quantized models run without a dispatcher


def _dequantizing_forward(self, *args, **kwargs):
    """HF's experts implementation the model had before quantization, on the dequantized weights (the reference; a
    moecg dispatcher, once attached, replaces it)."""
    inner = ExpertsInterface().get_interface(self._moecg_base_impl, type(self).forward.__wrapped__)
    with dequantized(self):
        return inner(self, *args, **kwargs)


ExpertsInterface.register(DEQUANTIZING, _dequantizing_forward)


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise WeightFormatError(f"model.weights={fmt!r}: choose one of {', '.join(FORMATS)}")


def quantize_layer(model, adapter, layer: nn.Module, fmt: str, values: bool = True) -> None:
    """Store one decoder layer's weights in format `fmt` (in place): its routed experts, and for fp8_block its linears
    too (mxfp4 quantizes the routed experts only, as GPT-OSS publishes them). mark_quantized finishes the model."""
    check_format(fmt)
    if fmt == "full":
        return
    with torch.no_grad():
        experts = adapter.experts_of(layer)
        if experts is not None:
            quantize_experts(experts, fmt, values)
            experts._moecg_base_impl = model.config._experts_implementation
        if fmt == "fp8_block":
            quantizer = quantize if values else placeholder
            for parent, name in quantized_linears(layer, adapter):
                setattr(parent, name, Fp8Linear.from_linear(getattr(parent, name), quantizer))


def mark_quantized(model, adapter, fmt: str) -> None:
    """The model level of a quantized model: HF's experts run through the dequantizing implementation."""
    if fmt != "full" and adapter.moe_layers(model) and model.config._experts_implementation != DEQUANTIZING:
        model.set_experts_implementation(DEQUANTIZING)
    model._moecg_weights = fmt


def quantize_model(model, adapter, fmt: str, values: bool = True) -> None:
    """Store `model`'s weights in format `fmt` (in place; `full` leaves them as they are). values=False: the format's
    tensors only, zeros (placeholder), for a checkpoint to fill (load_checkpoint)."""
    check_format(fmt)
    if fmt == "full":
        return
    for layer in adapter.layers(model):
        quantize_layer(model, adapter, layer, fmt, values)
    mark_quantized(model, adapter, fmt)


def dequantize_model(model, adapter) -> None:
    """Back to `full` (in place): every quantized weight replaced by its reference dequantization, so the model
    computes what the quantized one does with plain modules (the reference every quantized path is held to)."""
    with torch.no_grad():
        for _, experts in adapter.moe_layers(model):
            quant = getattr(experts, "_moecg_quant", None)
            if not quant:
                continue
            for name in list(quant):
                w = stored(experts, name).dense()
                delattr(experts, scale_name(experts, name))
                setattr(experts, name, nn.Parameter(w, requires_grad=False))
            base = experts._moecg_base_impl
            del experts._moecg_quant, experts._moecg_dtype, experts._moecg_base_impl
            if model.config._experts_implementation == DEQUANTIZING:
                model.set_experts_implementation(base)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, Fp8Linear):
                    lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                    dtype=child.compute_dtype, device=child.weight.device)
                    lin.weight.copy_(child.stored().dense())
                    if child.bias is not None:
                        lin.bias.copy_(child.bias)
                    setattr(parent, name, lin)
    model._moecg_weights = "full"


def weight_format(model) -> str:
    return getattr(model, "_moecg_weights", "full")


@contextmanager
def dequantized(experts: nn.Module):
    """Inside: the experts module's quantized parameters replaced by their dequantized values (the reference), for
    code that reads the parameters itself (HF's own experts loop); restored on exit. Not graph-safe (the loop it
    serves is not either)."""
    quant = getattr(experts, "_moecg_quant", None)
    if not quant:
        yield experts
        return
    saved = {name: experts._parameters[name] for name in quant}
    try:
        for name in quant:
            experts._parameters[name] = nn.Parameter(stored(experts, name).dense(), requires_grad=False)
        yield experts
    finally:
        experts._parameters.update(saved)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters as stored (values and block scales; a tied weight once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ------------------------------------------------------------------------------------------------------------
# checkpoints in the published layout (HF's per-expert tensor names, `<weight>_scale_inv` beside each e4m3 weight)
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
MX_CONFIG = {"quant_method": "mxfp4"}  # GPT-OSS's (its modules_to_not_convert: what is not quantized, read as such)
MX_KEYS = ("quant_method", "modules_to_not_convert")


def checkpoint_format(config) -> str:
    """The weight format of a checkpoint's config (`quantization_config`), refused where moecg does not know it."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return "full"
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "mxfp4":
        unknown = sorted(set(qc) - set(MX_KEYS))
        if unknown:
            raise WeightFormatError(f"quantization_config.{unknown[0]}={qc[unknown[0]]!r}: moecg's mxfp4 format is "
                                    "GPT-OSS's (e2m1 experts, one e8m0 scale per 32 values; keys "
                                    f"{', '.join(MX_KEYS)}): remove the key or dequantize the checkpoint to bf16")
        return "mxfp4"
    if method != "fp8":
        raise WeightFormatError(f"quantization_config.quant_method={method!r}: moecg reads fp8 (block-scaled e4m3, "
                                "the DeepSeek-V3 / Qwen3 FP8 releases) and mxfp4 (GPT-OSS) checkpoints; dequantize "
                                "this one to bf16 first")
    for key in ("fmt", "activation_scheme", "weight_block_size"):
        if key in qc and qc[key] is not None and qc[key] != QUANT_CONFIG[key]:
            raise WeightFormatError(f"quantization_config.{key}={qc[key]!r}: moecg's fp8_block format is "
                                    f"{key}={QUANT_CONFIG[key]!r} (block-scaled e4m3 weights, bf16 activations)")
    if qc.get("weight_block_size") is None:
        raise WeightFormatError("quantization_config.weight_block_size is missing: moecg reads per-block scales "
                                "(weight_block_size: [128, 128]); per-tensor FP8 checkpoints are not supported")
    return "fp8_block"


def _quantized_params(model) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """state_dict name of every quantized weight -> (values, scales, rows per scale row)."""
    out = {}
    for mname, module in model.named_modules():
        prefix = f"{mname}." if mname else ""
        if isinstance(module, Fp8Linear):
            out[prefix + "weight"] = (module.weight, module.weight_scale_inv, BLOCK)
        for name, rows in getattr(module, "_moecg_quant", {}).items():
            if rows != "mxfp4":
                out[prefix + name] = (getattr(module, name), getattr(module, name + SCALE), rows)
    return out


def _mx_params(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """state_dict name of every mxfp4 weight -> (values [..., N, K/2], scales [..., N, K/32]), published under their
    own names as GPT-OSS does: `<name>_blocks` [..., N, K/32, 16] and `<name>_scales` (whatever the family)."""
    out = {}
    for mname, module in model.named_modules():
        prefix = f"{mname}." if mname else ""
        for name, how in getattr(module, "_moecg_quant", {}).items():
            if how == "mxfp4":
                out[prefix + name] = (getattr(module, name), getattr(module, name + MX_SCALES))
    return out


def _published_rows(model, state: dict) -> dict[str, tuple[str, torch.Tensor, tuple]]:
    """Published tensor name -> (the model's state_dict name, the flat row ids [n] of that parameter it holds, its
    published shape but the last dim), from HF's own save-time conversion applied to row-id tensors: every family's
    renaming and per-expert split is HF's. A parameter [..., K] is rows [prod(...), K]; a 1-d one [n] rows of one."""
    from transformers.core_model_loading import revert_weight_conversion

    tags, names, bases = {}, [], []
    base = 0
    for name, t in state.items():
        if name.endswith(SCALE):
            continue  # a weight's scales follow its rows
        n = t.shape[:-1].numel() if t.dim() > 1 else t.shape[0]
        # row ids unique across parameters: a published tensor's first id names the parameter it came from
        ids = torch.arange(base, base + n)
        tags[name] = ids.view(*t.shape[:-1], 1) if t.dim() > 1 else ids
        names.append(name)
        bases.append(base)
        base += n
    out = {}
    for pub, tag in revert_weight_conversion(model, tags).items():
        flat = tag.reshape(-1)
        j = bisect.bisect_right(bases, int(flat[0])) - 1
        out[pub] = (names[j], flat - bases[j], tuple(tag.shape[:-1]) if state[names[j]].dim() > 1 else ())
    return out


def _scale_index(weight, scale, g, rows, lead) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale as rows [-1, nk], the ids [..., ceil(n/g)] of the scale rows a published tensor's rows use): row ids
    `rows` of a weight [..., N, K] (published shape `lead` + [K]) inside its scale [..., ceil(N/g), nk], where each
    scale row covers g weight rows; one id per g published rows, in the published order."""
    n = weight.shape[-2]
    r = rows.view(*lead)[..., ::g]  # the first of every g published rows
    if (rows.view(*lead).diff(dim=-1) != 1).any() or (r % n % g).any():
        raise WeightFormatError(f"published rows do not fall on whole {g}-row scale groups of the fused weight")
    return scale.view(-1, scale.shape[-1]), r // n * scale.shape[-2] + r % n // g


def _state(model) -> dict:
    """The model's state_dict (a tied weight once), the mxfp4 weights and their scales left out: they are published
    under their own names (_mx_params), not through HF's conversion."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    mx = _mx_params(model)
    skip = set(mx) | {n + MX_SCALES for n in mx}
    return {k: v for k, v in remove_tied_weights_from_state_dict(model.state_dict(), model).items() if k not in skip}


def save_checkpoint(model, path: str) -> None:
    """Write `model` (any weight format) as a checkpoint in the published layout: HF's per-expert tensor names, and for
    fp8_block the e4m3 weights with `<name>_scale_inv` beside each (one fp32 scale per 128 x 128 block of that
    tensor), for mxfp4 GPT-OSS's `<experts>.<name>_blocks` / `_scales`, with the published `quantization_config`.
    model=local reads it back (load_checkpoint)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = _state(model)
    quant = _quantized_params(model)
    tensors = {}
    for pub, (name, rows, lead) in _published_rows(model, state).items():
        t = state[name]
        if t.dim() > 1:
            tensors[pub] = t.reshape(-1, t.shape[-1])[rows].reshape(*lead, t.shape[-1]).contiguous()
        else:
            tensors[pub] = t[rows].contiguous()
        if name in quant:
            _, scale, g = quant[name]
            # the tensor's own 128-row blocks: the scale row of every 128th of its rows (g divides 128)
            flat, ids = _scale_index(state[name], scale.detach(), g, rows, lead)
            tensors[pub + SCALE] = flat[ids[..., :: BLOCK // g]].contiguous()
    for name, (q, scale) in _mx_params(model).items():
        tensors[name + "_blocks"] = q.detach().reshape(*scale.shape, MX_BLOCK // 2).contiguous()
        tensors[name + MX_SCALES] = scale.detach().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    if weight_format(model) == "fp8_block":
        config.quantization_config = dict(QUANT_CONFIG)
    elif weight_format(model) == "mxfp4":
        config.quantization_config = dict(MX_CONFIG)
    elif hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(out))


def load_checkpoint(model, path: str) -> None:
    """Fill `model` (built from the checkpoint's config and stored in its format: quantize_model(values=False)) from
    the checkpoint at `path` in the published layout (HF's per-expert names, as save_checkpoint writes them). Every
    tensor of the model must be found, with the shape and dtype it publishes, and each e4m3 weight its scales."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise WeightFormatError(f"model.pretrained_path={path}: no *.safetensors files")
    handles = [safe_open(str(f), "pt", device="cpu") for f in files]
    where = {k: h for h in handles for k in h.keys()}
    state = _state(model)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    quant = _quantized_params(model)
    filled = set()
    with torch.no_grad():
        for pub, (name, rows, lead) in _published_rows(model, state).items():
            if pub not in where:
                raise WeightFormatError(f"model.pretrained_path={path}: no tensor {pub} (the model's {name})")
            src = where[pub].get_tensor(pub)
            dst = params[name]
            want = (*lead, dst.shape[-1]) if dst.dim() > 1 else (rows.numel(),)
            if tuple(src.shape) != want:
                raise WeightFormatError(f"model.pretrained_path={path}: {pub} is {tuple(src.shape)}, the model "
                                        f"expects {want} (its config and tensors disagree)")
            if name in quant and src.dtype != FP8:
                raise WeightFormatError(f"model.pretrained_path={path}: {pub} is {src.dtype}; the checkpoint's "
                                        "quantization_config says fp8 (e4m3) weights")
            flat = dst.view(-1, dst.shape[-1]) if dst.dim() > 1 else dst.view(-1)
            flat[rows] = src.reshape(flat[rows].shape).to(dst.dtype)
            filled.add(name)
            if name in quant:
                _, scale, g = quant[name]
                key = pub + SCALE
                if key not in where:
                    raise WeightFormatError(f"model.pretrained_path={path}: {pub} has no {key} beside it")
                s = where[key].get_tensor(key).float()
                want = (*lead[:-1], math.ceil(lead[-1] / BLOCK), scale.shape[-1])
                if tuple(s.shape) != want:
                    raise WeightFormatError(f"model.pretrained_path={path}: {key} is {tuple(s.shape)}, expected "
                                            f"{want} (one scale per 128 x 128 block of {pub})")
                flat, ids = _scale_index(dst, scale, g, rows, lead)
                flat[ids.reshape(-1)] = s.repeat_interleave(BLOCK // g, dim=-2)[..., : math.ceil(lead[-1] / g), :] \
                    .reshape(-1, flat.shape[-1])
        for name, (q, scale) in _mx_params(model).items():
            for key, dst, want in ((name + "_blocks", q, (*scale.shape, MX_BLOCK // 2)),
                                   (name + MX_SCALES, scale, tuple(scale.shape))):
                if key not in where:
                    raise WeightFormatError(f"model.pretrained_path={path}: no tensor {key} (the mxfp4 experts' "
                                            "values and scales are published as <name>_blocks and <name>_scales)")
                src = where[key].get_tensor(key)
                if tuple(src.shape) != want or src.dtype != torch.uint8:
                    raise WeightFormatError(f"model.pretrained_path={path}: {key} is {src.dtype} "
                                            f"{tuple(src.shape)}, the model expects torch.uint8 {want}")
                if key.endswith(MX_SCALES) and bool((src == 255).any()):
                    raise WeightFormatError(f"model.pretrained_path={path}: {key} holds scale byte 255 (NaN in e8m0): "
                                            "a block moecg cannot compute with")
                dst.copy_(src.reshape(dst.shape))
    missing = sorted(set(state) - filled - {n + SCALE for n in quant})
    if missing:
        raise WeightFormatError(f"model.pretrained_path={path}: the model's {missing[0]} was not in the checkpoint")
