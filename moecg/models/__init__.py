"""Model zoo: HF MoE models built from presets (random weights, seeded) or loaded from a local directory."""
from __future__ import annotations

import time
from pathlib import Path
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from moecg.models.adapter import ADAPTERS, FamilyAdapter, adapter_for
from moecg.models.checkpoint import checkpoint_format, load_checkpoint
from moecg.models.skew import apply_router_skew, remove_router_skew
from moecg.models.weights import (activations as activations_of, dequantize_model, mark_quantized, quantize_layer,
                                  quantize_model, set_activations, weight_format)
from moecg.models.zoo import FAMILIES, PRESETS, family_of_config, make_config

__all__ = ["ADAPTERS", "FAMILIES", "PRESETS", "TRANSFORMERS_RELEASE", "FamilyAdapter", "adapter_for",
           "apply_router_skew", "check_transformers", "remove_router_skew", "build_model", "make_config",
           "resolve_dtype", "resolve_device", "BuiltModel"]

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"


def shipped_checkpoint(preset: str) -> str | None:
    path = CHECKPOINTS / preset
    return str(path) if (path / "config.json").exists() else None


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but CUDA is not available here: use device=auto or device=cpu")
    return dev


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype={dtype!r}: choose one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


@dataclass
class BuiltModel:
    model: torch.nn.Module
    adapter: FamilyAdapter
    name: str
    family: str
    device: torch.device
    dtype: torch.dtype
    build_s: float
    weights: str = "full"  # the weight format (moecg.models.formats.FORMATS)
    activations: str = "full"  # how its block-FP8 GEMMs take their inputs (moecg.models.formats.ACTIVATIONS)


LAYER_SEED = 1_000_003  # layer i of a build seeded `seed` draws its values from seed * LAYER_SEED + i + 1


def _construct(model_cls, config, dt: torch.dtype, dev: torch.device, seed: int, weights: str = "full",
               values: bool = True):
    """The model built layer by layer on the target device in the target dtype, each decoder layer stored in format
    `weights` as soon as HF's init has filled it: the peak is the stored model and one layer in the model dtype, so a
    model whose bf16 weights do not fit (GPT-OSS-120B, GLM-4.5-Air on one H200) builds in its low-precision format.
    Values: HF's init, the modules outside the decoder layers seeded by `seed`, each layer by its own seed, so a
    config and seed give the same weights in every format (before it rounds them) and at every depth (a cut model
    is the whole one's first layers). values=False: no init (a checkpoint fills every tensor)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device("meta"):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(prev)
    adapter = adapter_for(model)
    inner = model.model
    layers = adapter.layers(model)
    inner.layers = torch.nn.ModuleList()
    model.to_empty(device=dev)
    torch.manual_seed(seed)
    model.initialize_weights()  # marks what it filled: the calls below fill only the layer put in
    for i, layer in enumerate(layers):
        layer.to_empty(device=dev)
        inner.layers = torch.nn.ModuleList([layer])
        torch.manual_seed(seed * LAYER_SEED + i + 1)
        model.initialize_weights()
        quantize_layer(model, adapter, layer, weights, values)
    inner.layers = layers
    model.tie_weights()  # to_empty gave the tied weights their own storage
    mark_quantized(model, adapter, weights)
    return model


def _attn_implementation(model_cls, requested: str) -> str:
    """sdpa is moecg's default, as it is HF's; a class without it (GPT-OSS: its attention sinks need the eager kernel)
    runs eager, as HF does when no implementation is asked for."""
    if requested == "sdpa" and not getattr(model_cls, "_supports_sdpa", True):
        return "eager"
    return requested


# The transformers release moecg runs on (pyproject.toml pins the same; tests/test_models.py checks they agree). Others
# are refused, not tolerated: 5.17 takes the cache as `past_key_values=` and silently drops moecg's `cache=`, so every
# row then decodes without its prompt (a bs-8 step routes all rows to one row's experts) and nothing fails.
TRANSFORMERS_RELEASE = "5.24"


def check_transformers(version: str | None = None) -> None:
    """Raise (before any model or CUDA work) unless transformers is the release moecg runs on (TRANSFORMERS_RELEASE)."""
    v = transformers.__version__ if version is None else version
    if v.split(".")[:2] != TRANSFORMERS_RELEASE.split("."):
        raise RuntimeError(f"transformers {v} is installed; moecg runs on transformers {TRANSFORMERS_RELEASE}.* only "
                           "(other releases take the KV cache under another argument name and would decode every "
                           f"row without its prompt). Fix: pip install 'transformers=={TRANSFORMERS_RELEASE}.*'")


def build_model(preset: str | None = None, *, pretrained_path: str | None = None, num_layers: int | None = None,
                dtype: str | None = "auto", device: str | None = "auto", seed: int = 0, router_skew: float = 0.0,
                attn_implementation: str = "sdpa", config_overrides: dict | None = None,
                weights: str | None = None, activations: str = "full") -> BuiltModel:
    """Build an HF MoE model in eval mode, weights created directly on `device` in `dtype`, then stored in format
    `weights` (moecg.models.formats.FORMATS; None: as built or as the checkpoint stores them), its block-FP8 GEMMs
    taking their inputs as `activations` says (moecg.models.formats.ACTIVATIONS; fp8_dynamic needs fp8_block)."""
    check_transformers()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    if not pretrained_path and preset is not None and shipped_checkpoint(preset) is not None:
        pretrained_path = shipped_checkpoint(preset)  # models trained by moecg ship with it (model=*_stdlib)
    stored = "full"
    if pretrained_path:
        ckpt = AutoConfig.from_pretrained(pretrained_path, local_files_only=True)
        stored = checkpoint_format(ckpt)
        _, model_cls = FAMILIES[family_of_config(ckpt)]
        attn = _attn_implementation(model_cls, attn_implementation)
        if stored == "full":
            kwargs = {} if num_layers is None else {"num_hidden_layers": num_layers}
            # no device_map: that path needs `accelerate`; a small checkpoint loads on CPU, then moves once
            model = AutoModelForCausalLM.from_pretrained(pretrained_path, dtype=dt, attn_implementation=attn,
                                                         **kwargs).to(dev)
        else:  # moecg reads the published quantized layout itself (HF's FP8 loader needs hub kernels)
            del ckpt.quantization_config
            if num_layers is not None:
                ckpt.num_hidden_layers = num_layers
            ckpt._attn_implementation = attn
            model = _construct(model_cls, ckpt, dt, dev, seed, stored, values=False)  # the checkpoint fills it
            load_checkpoint(model, pretrained_path)
        name = preset or str(pretrained_path).rstrip("/").split("/")[-1]
    else:
        if preset is None:
            raise ValueError("give model.preset (e.g. mixtral_tiny) or model.pretrained_path=/dir/with/config.json")
        config = make_config(preset, num_layers, config_overrides)
        _, model_cls = FAMILIES[family_of_config(config)]
        config._attn_implementation = _attn_implementation(model_cls, attn_implementation)
        model = _construct(model_cls, config, dt, dev, seed, weights or "full")
        name = preset
    model.eval()
    family = family_of_config(model.config)
    if weights is not None and weights != weight_format(model):
        if weight_format(model) != "full":
            dequantize_model(model, adapter_for(model))
        quantize_model(model, adapter_for(model), weights)
    set_activations(model, adapter_for(model), activations)
    apply_router_skew(model, router_skew, seed)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return BuiltModel(model, adapter_for(model), name, family, dev, dt, time.perf_counter() - t0, weight_format(model),
                      activations_of(model))
