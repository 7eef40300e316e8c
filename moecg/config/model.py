"""`model=<preset>` | `model=local`: which HF model a run builds, and its HF config resolved without weights.

The options are the zoo's own presets (one per key of moecg.models.zoo.PRESETS) and `local` (any checkpoint
directory of a supported family): a preset added to the zoo is on the CLI with no file to write.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from moecg.config.readers import PlanError, as_float, as_int
from moecg.models import FAMILIES, PRESETS, _attn_implementation, make_config, shipped_checkpoint
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
                config.num_hidden_layers = num_layers
            path = str(p)
        else:
            if preset is None:
                raise PlanError("model.preset is null and no model.pretrained_path: pick model=<preset> "
                                f"({', '.join(sorted(PRESETS))}) or model=local model.pretrained_path=/dir")
            if preset not in PRESETS:
                raise PlanError(f"model.preset={preset!r}: choose one of {', '.join(sorted(PRESETS))}")
            config = make_config(preset, num_layers)
            if shipped_checkpoint(preset):
                path = None  # build_model finds the shipped weights itself
        try:
            family = family_of_config(config)
        except ValueError as e:
            raise PlanError(f"model: {e}") from None
        return ModelPlan(preset, path, num_layers, self.dtype, skew, self.attn_implementation, family, config,
                         int(config.num_hidden_layers))


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
