"""`model=<preset>` | `model=local`: which HF model a run builds, and its HF config resolved without weights.

The options are the zoo's own presets (one per key of moecg.models.zoo.PRESETS) and `local` (any checkpoint
directory of a supported family): a preset added to the zoo is on the CLI with no file to write.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from transformers import AutoConfig
from transformers.utils import (is_flash_attn_2_available, is_flash_attn_3_available, is_flash_attn_4_available,
                                is_kernels_available, is_torch_flex_attn_available)

from moecg.config.readers import PlanError, as_float, as_int
from moecg.models import FAMILIES, PRESETS, _attn_implementation, make_config, shipped_checkpoint
from moecg.models.adapter import ADAPTERS
from moecg.models.formats import FORMATS, MX_BLOCK, WeightFormatError
from moecg.models.checkpoint import checkpoint_format
from moecg.models.weights import check_activations
from moecg.models.zoo import family_of_config


@dataclass
class ModelConfig:
    """`model.*` (values typed by resolve(), see moecg.config.readers)."""

    preset: Any = None  # a key of moecg.models.zoo.PRESETS (set by model=<preset>); null for model=local
    # a local HF checkpoint directory (save_pretrained); overrides the preset's weights and shape
    pretrained_path: Any = None
    # int >= 1: cut the depth (real-shape presets on one GPU); null: the preset's or checkpoint's
    num_layers: Any = None
    dtype: Any = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp16 | fp32
    router_skew: Any = 0.0  # >= 0; 0 = HF router; > 0 biases logits toward a few experts per layer (Zipf-like)
    attn_implementation: Any = "sdpa"  # HF's attention; a preset whose family has no sdpa (GPT-OSS's sinks) gets eager
    # how the weights are stored (moecg.models.formats.FORMATS): full | fp8_block | mxfp4; null: as built (presets,
    # shipped models: full) or as the checkpoint stores them (model=local: its quantization_config)
    weights: Any = None
    # how a block-FP8 GEMM takes its input (moecg.models.formats.ACTIVATIONS): full (as it is: W8A16) | fp8_dynamic
    # (each token's 128-column blocks quantized to e4m3 first, the checkpoints' `activation_scheme: dynamic`: W8A8);
    # fp8_dynamic needs model.weights=fp8_block
    activations: Any = "full"

    def resolve(self) -> ModelPlan:
        """The HF config the model will be built from (no weights), its family and depth."""
        preset, path = self.preset, self.pretrained_path
        num_layers = None if self.num_layers is None else as_int(self.num_layers, "model.num_layers", 1, 2)
        skew = as_float(self.router_skew, "model.router_skew", 0.0, example=0.1)
        if path:
            p = Path(str(path)).expanduser()
            if not (p / "config.json").is_file():
                what = "is not a directory" if not p.is_dir() else "has no config.json"
                raise PlanError(f"model.pretrained_path={path}: {what}; give a local directory written by "
                                "save_pretrained (models cannot be downloaded here)")
            try:
                config = AutoConfig.from_pretrained(str(p), local_files_only=True)
            except Exception as e:  # noqa: BLE001
                raise PlanError(f"model.pretrained_path={path}: cannot read its config.json ({type(e).__name__}: {e})")
            if num_layers is not None:
                _check_depth(num_layers, int(config.num_hidden_layers), f"the checkpoint at {path}")
                config.num_hidden_layers = num_layers
            path = str(p)
        else:
            if preset is None:
                raise PlanError("model.preset is null and no model.pretrained_path: pick model=<preset> "
                                f"({', '.join(sorted(PRESETS))}) or model=local model.pretrained_path=/dir")
            if not isinstance(preset, str) or preset not in PRESETS:
                raise PlanError(f"model.preset={preset!r}: choose one of {', '.join(sorted(PRESETS))}")
            if num_layers is not None:
                _check_depth(num_layers, int(make_config(preset).num_hidden_layers), f"model={preset}")
            config = make_config(preset, num_layers)
            if shipped_checkpoint(preset):
                path = None  # build_model finds the shipped weights itself
        try:
            family = family_of_config(config)
        except ValueError as e:
            raise PlanError(f"model: {e}") from None
        weights = self._weights(config, family, path)
        return ModelPlan(preset, path, num_layers, self.dtype, skew, self.attn_implementation, family, config,
                         int(config.num_hidden_layers), weights, self._activations(weights))

    def _activations(self, weights: str) -> str:
        """How the block-FP8 GEMMs take their inputs: model.activations, refused without block-FP8 weights."""
        try:
            check_activations(self.activations, weights)
        except WeightFormatError as e:
            raise PlanError(str(e)) from None
        return self.activations

    def _weights(self, config, family: str, path: str | None) -> str:
        """The weight format the run builds: model.weights, else the checkpoint's (refused where unknown)."""
        try:
            stored = checkpoint_format(config)
        except WeightFormatError as e:
            raise PlanError(f"model.pretrained_path={path}: its config.json's {e}") from None
        fmt = self.weights if self.weights is not None else stored
        if fmt not in FORMATS:
            raise PlanError(f"model.weights={fmt!r}: choose one of {', '.join(FORMATS)} (null: as the checkpoint "
                            "stores them)")
        if fmt == "fp8_block" and ADAPTERS[family].transposed_experts:
            raise PlanError(f"model.weights=fp8_block: {family} stores its experts transposed ([E, D, 2I]); "
                            "block-FP8 covers the [E, 2I, D] layout of the other families: use model.weights=full "
                            "or mxfp4")
        if fmt == "mxfp4":
            dims = {"hidden_size": config.hidden_size, "expert intermediate size":
                    ADAPTERS[family].expert_intermediate(config)}
            for what, n in dims.items():
                if n % MX_BLOCK:
                    raise PlanError(f"model.weights=mxfp4: the {what} ({n}) is not a multiple of {MX_BLOCK}, the "
                                    "values one mxfp4 scale covers: use model.weights=full or fp8_block")
        return fmt


# HF's flash attention versions and their availability checks (they look for the package, never import it)
FLASH = {"flash_attention_2": is_flash_attn_2_available, "flash_attention_3": is_flash_attn_3_available,
         "flash_attention_4": is_flash_attn_4_available}


def attn_implementations(model_cls, device: torch.device) -> tuple[str, ...]:
    """The attention implementations this install can run for an HF model class on this device (the class's own
    `_supports_*` flags and transformers' availability helpers: nothing heavy is imported)."""
    out = ["eager"]
    if getattr(model_cls, "_supports_sdpa", False):
        out.append("sdpa")
    if getattr(model_cls, "_supports_flex_attn", False) and is_torch_flex_attn_available():
        out.append("flex_attention")
    if getattr(model_cls, "_supports_flash_attn", False) and device.type == "cuda":
        out += [name for name, available in FLASH.items() if available()]
    return tuple(out)


def check_attn_implementation(model: ModelPlan, device: torch.device) -> None:
    """model.attn_implementation against what this install has, before the model is built (HF raises at build)."""
    _, cls = FAMILIES[model.family]
    asked = model.attn_implementation
    if not isinstance(asked, str):
        raise PlanError(f"model.attn_implementation={asked!r}: must be a string (e.g. model.attn_implementation=sdpa)")
    here = attn_implementations(cls, device)
    if _attn_implementation(cls, asked) in here or ("/" in asked and is_kernels_available()):
        return  # a hub kernel (`kernels-community/...`) is resolved by HF's `kernels` package itself
    if asked in FLASH and getattr(cls, "_supports_flash_attn", False):
        why = "needs a CUDA device" if device.type != "cuda" and FLASH[asked]() else \
            f"its package is not installed (pip install {'flash-attn' if asked == 'flash_attention_2' else 'kernels'})"
    elif asked in (*FLASH, "sdpa", "flex_attention"):
        why = f"{cls.__name__} has no {asked} path"
    else:
        why = "not an attention implementation transformers knows"
    raise PlanError(f"model.attn_implementation={asked}: {why}; this install runs {', '.join(here)} for "
                    f"{model.family} on {device.type}: pick one of them")


def _check_depth(num_layers: int, depth: int, what: str) -> None:
    """model.num_layers cuts the depth (the first N decoder layers); it never adds layers the model does not have."""
    if num_layers > depth:
        raise PlanError(f"model.num_layers={num_layers}: {what} has {depth} decoder layers and num_layers only cuts "
                        f"the depth: give 1 to {depth} (or model.num_layers=null for all {depth})")


@dataclass(frozen=True)
class ModelPlan:
    preset: str | None
    pretrained_path: str | None
    num_layers: int | None  # the override (None: the checkpoint's or preset's depth)
    dtype: str
    router_skew: float
    attn_implementation: str
    family: str
    config: object = field(repr=False, compare=False)  # the HF config the model will be built from
    layers: int = 0  # decoder layers the model will have
    weights: str = "full"  # the weight format it is built in (moecg.models.formats.FORMATS)
    activations: str = "full"  # how its block-FP8 GEMMs take their inputs (moecg.models.formats.ACTIVATIONS)


def options() -> dict[str, ModelConfig]:
    """model=<name> -> its node: every zoo preset, then `local`."""
    out = {}
    for name, preset in PRESETS.items():
        _, cls = FAMILIES[preset["family"]]
        # what HF itself runs when no implementation is asked for (the config records it, as it ran)
        attn = _attn_implementation(cls, ModelConfig.attn_implementation)
        out[name] = ModelConfig(preset=name, attn_implementation=attn)
    out["local"] = ModelConfig()  # model=local model.pretrained_path=/dir
    return out
