"""A model's modules in a weight format (`model.weights`, moecg.models.formats): quantized in place (the experts' fused
parameters in their stored form, a quantized nn.Linear as Fp8Linear), marked, dequantized back, and read as stored
(`stored`: a tensor, a BlockFp8 or an Mxfp4) by every path; HF's modules run a quantized model through the
dequantizing experts implementation (`moecg_dequantized`), the reference.

`model.activations` (formats.ACTIVATIONS) is marked on the same modules (`set_activations`): each Fp8Linear's `act`
and each block-FP8 experts module's `_moecg_act`, which `stored` hands on in the BlockFp8 (`BlockFp8.input`).

Dims: T tokens, K top-k, E experts, D hidden, I expert intermediate.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.integrations.moe import ExpertsInterface

from moecg.models.formats import (ACTIVATIONS, BLOCK, FORMATS, MX_BLOCK, MX_SCALES, QUANTIZED, SCALE, BlockFp8, Mxfp4,
                                  WeightFormatError, mx_quantize, placeholder, quantize, quantize_stacked)


class Fp8Linear(nn.Module):
    """nn.Linear with a block-FP8 weight: `weight` e4m3 [N, K], `weight_scale_inv` [ceil(N/128), ceil(K/128)] fp32,
    `bias` in the model dtype; forward = F.linear on the input as the weight takes it (`act`: formats.ACTIVATIONS,
    set_activations marks it) and the dequantized weight (the reference path)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 act: str = "full"):
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.compute_dtype = dtype
        self.act = act

    @classmethod
    def from_linear(cls, lin: nn.Linear, quantizer=quantize) -> Fp8Linear:
        q, s = quantizer(lin.weight.detach())
        return cls(q, s, lin.bias, lin.weight.dtype)

    def stored(self) -> BlockFp8:
        return BlockFp8(self.weight, self.weight_scale_inv, BLOCK, self.compute_dtype, self.act)

    def forward(self, x):
        w = self.stored()
        return F.linear(w.input(x), w.dense(), self.bias)

    def extra_repr(self) -> str:
        act = "" if self.act == "full" else f", activations={self.act}"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_block{act}"


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
    return BlockFp8(getattr(module, name), getattr(module, name + SCALE), how, module._moecg_dtype,
                    getattr(module, "_moecg_act", "full"))


def weight_input(module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """x as the module's weight `name` takes it in its GEMM (BlockFp8.input: fp8_dynamic quantizes each row's 128-column
    blocks, act_fake_quant; row by row, so gathered, sorted or padded rows are quantized as their tokens are)."""
    return gemm_input(stored(module, name), x)


def scale_name(module: nn.Module, name: str) -> str:
    """The attribute holding a quantized parameter's scales (`<name>_scale_inv` or `<name>_scales`)."""
    return name + (MX_SCALES if module._moecg_quant[name] == "mxfp4" else SCALE)


def gemm_input(w, x: torch.Tensor) -> torch.Tensor:
    """x as a stored weight's GEMM takes it (the reference): a block-FP8 weight's BlockFp8.input, else x itself."""
    return w.input(x) if isinstance(w, BlockFp8) else x


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
    return reference_loop(self, inner)(self, *args, **kwargs)


def reference_loop(experts: nn.Module, loop):
    """`loop` (an HF experts forward: (experts, hidden [T, D], top_k_index [T, K], top_k_weights [T, K]) -> [T, D]) as
    the format's reference runs it: on the dequantized weights; with fp8_dynamic activations moecg's copy of HF's
    eager loop instead (`act_experts_loop`), since HF's loops compute act(gate) * up inline and cannot quantize the
    down projection's input."""
    if getattr(experts, "_moecg_act", "full") == "fp8_dynamic":
        return act_experts_loop

    def run(self, *args, **kwargs):
        with dequantized(self):
            return loop(self, *args, **kwargs)

    return run


def act_experts_loop(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's eager experts loop (its signature, its operations in its order and dtypes) on block-FP8 experts, each GEMM
    `F.linear(w.input(x), w.dense()[e])`: the reference of `model.activations=fp8_dynamic` for HF's own experts and
    dispatch=dynamic. hidden_states [T, D], top_k_index [T, K], top_k_weights [T, K] -> [T, D]."""
    gate_up, down = stored(self, "gate_up_proj"), stored(self, "down_proj")
    w_gate_up, w_down = gate_up.dense(), down.dense()  # [E, 2I, D], [E, D, I]: block-FP8 is never transposed
    bias = getattr(self, "has_bias", False)
    E = self.num_experts
    out = torch.zeros_like(hidden_states)  # [T, D]
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=E + 1).permute(2, 1, 0)  # [E + 1, K, T]; E: HF's EP sentinel
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        if e == E:
            continue
        pos, tok = torch.where(mask[e])
        h = F.linear(gate_up.input(hidden_states[tok]), w_gate_up[e], self.gate_up_proj_bias[e] if bias else None)
        h = self._apply_gate(h)  # [n, I]
        y = F.linear(down.input(h), w_down[e], self.down_proj_bias[e] if bias else None)  # [n, D]
        if getattr(self, "has_post_expert_norm", False):
            y = self.post_expert_norm(y)
        y = y * top_k_weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


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
            experts.__dict__.pop("_moecg_act", None)
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
    model.__dict__.pop("_moecg_act", None)


def weight_format(model) -> str:
    return getattr(model, "_moecg_weights", "full")


def check_activations(act: str, fmt: str) -> None:
    """model.activations against the weight format `fmt` the model is (or will be) stored in; the plan runs it too."""
    if act not in ACTIVATIONS:
        raise WeightFormatError(f"model.activations={act!r}: choose one of {', '.join(ACTIVATIONS)}")
    if act != "full" and fmt != "fp8_block":
        raise WeightFormatError(f"model.activations={act} quantizes the inputs of block-FP8 GEMMs, and the weights "
                                f"here are {fmt}: add model.weights=fp8_block, or use model.activations=full")


def set_activations(model, adapter, act: str) -> None:
    """Mark how every block-FP8 GEMM of a block-FP8 model takes its input (formats.ACTIVATIONS, in place): each
    Fp8Linear's `act` and each experts module's `_moecg_act`. MLA's kv_b_proj stays `full`: the absorbed step multiplies
    its dequantized weight into q and the output per head, as DeepSeek's own inference code does, so its input is
    never a GEMM input to quantize. dequantize_model drops the marks with the formats (plain modules, full inputs)."""
    check_activations(act, weight_format(model))
    keep = set()
    if adapter.attention == "mla":
        keep = {id(getattr(layer, adapter.attn).kv_b_proj) for layer in adapter.layers(model)}
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.act = "full" if id(module) in keep else act
    for _, experts in adapter.moe_layers(model):
        if any(how != "mxfp4" for how in getattr(experts, "_moecg_quant", {}).values()):
            experts._moecg_act = act
    model._moecg_act = act


def activations(model) -> str:
    """How the model's block-FP8 GEMMs take their inputs (set_activations; `full` where never set)."""
    return getattr(model, "_moecg_act", "full")


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
