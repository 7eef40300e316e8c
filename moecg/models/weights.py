"""A model's modules in a weight format (`model.weights`, moecg.models.formats): quantized in place (the experts' fused
parameters in their stored form, a quantized nn.Linear as Fp8Linear), marked, dequantized back, and read as stored
(`stored`: a tensor, a BlockFp8 or an Mxfp4) by every path; HF's modules run a quantized model through the
dequantizing experts implementation (`moecg_dequantized`), the reference.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.integrations.moe import ExpertsInterface

from moecg.models.formats import (BLOCK, FORMATS, MX_BLOCK, MX_SCALES, QUANTIZED, SCALE, BlockFp8, Mxfp4,
                                  WeightFormatError, mx_quantize, placeholder, quantize, quantize_stacked)


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
