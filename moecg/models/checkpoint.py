"""Checkpoints of a quantized model in the published layouts (HF's per-expert tensor names; block-FP8:
`<weight>_scale_inv` beside each e4m3 weight, mxfp4: GPT-OSS's `<name>_blocks` / `<name>_scales`), saved and loaded,
and the weight format a checkpoint's config says (`quantization_config`), refused where moecg does not know it.
"""
from __future__ import annotations

import bisect
import copy
import math
from pathlib import Path

import torch

from moecg.models.formats import BLOCK, FP8, MX_BLOCK, MX_SCALE_MAX, MX_SCALES, SCALE, WeightFormatError
from moecg.models.weights import Fp8Linear, weight_format

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
                if key.endswith(MX_SCALES) and bool((src > MX_SCALE_MAX).any()):
                    top = int(src.max())
                    raise WeightFormatError(f"model.pretrained_path={path}: {key} holds scale byte {top} "
                                            f"({'NaN in e8m0' if top == 255 else f'2^{top - 127}'}): moecg's kernels "
                                            f"take scale bytes up to {MX_SCALE_MAX} (blocks under 6 x 2^113)")
                dst.copy_(src.reshape(dst.shape))
    missing = sorted(set(state) - filled - {n + SCALE for n in quant})
    if missing:
        raise WeightFormatError(f"model.pretrained_path={path}: the model's {missing[0]} was not in the checkpoint")
