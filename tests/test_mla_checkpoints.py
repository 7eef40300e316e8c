"""DeepSeek-V2/V3 checkpoints as transformers writes them, with config fields HF's MLA attention and routers read set
unlike moecg's presets: saved with save_pretrained, run as `model=local model.pretrained_path=...` would run them.

  - a config HF's own generate runs (eager and sdpa) passes the plan and decodes on HF's modules under strategy=eager
    and strategy=full (emulated capture, 3 rows in bucket 4) to HF's own greedy tokens, step logits within fp32 noise;
  - a config HF's modules fail on is refused by the plan, before any model is built, naming the field and the fix,
    and the engine refuses it the same way (never a raw shape error from inside HF's attention).

Dims: B rows, S prompt tokens, V vocab.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import moecg
from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import DecodeEngine
from moecg.models import build_model
from moecg.models.adapter import UnsupportedConfigError
from moecg.plan import PlanError, resolve_plan

CONF = str(Path(moecg.__file__).parent / "conf")
S, NEW, ROWS, BATCH = 5, 4, 4, 3
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}  # S + NEW > 4: yarn's range

# configs HF runs: (preset, overrides[, the attn_implementations it runs under: both when not given])
RUNS = {
    "v3_no_q_lora": ("deepseek_v3_tiny", {"q_lora_rank": None}),
    "v3_rope_not_interleaved_bias": ("deepseek_v3_tiny", {"rope_interleave": False, "attention_bias": True}),
    "v3_head_dims_unequal_yarn": ("deepseek_v3_tiny", {"qk_nope_head_dim": 12, "qk_rope_head_dim": 4,
                                                        "v_head_dim": 20, "rope_parameters": YARN}),
    "v3_no_dense_layer_one_group": ("deepseek_v3_tiny", {"first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
                                                          "norm_topk_prob": False}),
    "v3_two_dense_layers_8_groups": ("deepseek_v3_tiny", {"first_k_dense_replace": 2, "n_group": 8, "topk_group": 3}),
    # more KV heads than heads (DeepseekV3Config's default 128 under a small num_attention_heads): sdpa never reads
    # the ratio
    "v3_kv_heads_above_heads_sdpa": ("deepseek_v3_tiny", {"num_key_value_heads": 8}, ("sdpa",)),
    "v2_group_limited_q_lora_yarn": ("deepseek_v2_tiny", {"topk_method": "group_limited_greedy", "n_group": 4,
                                                          "topk_group": 2, "q_lora_rank": 48, "rope_parameters": YARN}),
    # DeepSeek-V2's router never renormalises (HF's reads no norm_topk_prob)
    "v2_norm_topk_prob_bias": ("deepseek_v2_tiny", {"norm_topk_prob": True, "attention_bias": True}),
}
# configs HF's modules fail on: (preset, overrides, attn_implementation, field)
REFUSED = {
    "v3_kv_heads_2": ("deepseek_v3_tiny", {"num_key_value_heads": 2}, "sdpa", "num_key_value_heads"),
    "v2_kv_heads_2_eager": ("deepseek_v2_tiny", {"num_key_value_heads": 2}, "eager", "num_key_value_heads"),
    "v3_kv_heads_above_heads_eager": ("deepseek_v3_tiny", {"num_key_value_heads": 8}, "eager", "num_key_value_heads"),
    "v3_n_group_unset": ("deepseek_v3_tiny", {"n_group": None, "topk_group": None}, "sdpa", "n_group"),
    "v2_group_limited_n_group_unset": ("deepseek_v2_tiny", {"topk_method": "group_limited_greedy", "n_group": None,
                                                            "topk_group": None}, "sdpa", "n_group"),
    "v2_topk_method_unknown": ("deepseek_v2_tiny", {"topk_method": "noaux_tc"}, "sdpa", "topk_method"),
}


def _save(preset, overrides, path: Path, attn="sdpa") -> torch.nn.Module:
    """A random checkpoint of `preset` with `overrides`, biases (attention, e_score_correction) random too."""
    b = build_model(preset, dtype="fp32", device="cpu", attn_implementation=attn, config_overrides=overrides)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in [*b.model.named_parameters(), *b.model.named_buffers()]:
            if name.endswith("bias"):
                t.copy_(torch.randn(t.shape, generator=g) * (0.2 if "e_score" in name else 1.0))
    b.model.save_pretrained(path)
    return b.model


def _plan(path: Path, attn="sdpa", strategy="full"):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=local", f"model.pretrained_path={path}", f"model.attn_implementation={attn}",
            f"strategy={strategy}", "dispatch=dropless", "capture.backend=emulate", "device=cpu",
            f"batch_size={BATCH}", f"prompt_len={S}", f"new_tokens={NEW}"])
    return resolve_plan(cfg)


def _prompts():
    return torch.randint(0, 512, (BATCH, S), generator=torch.Generator().manual_seed(0))  # [B, S]


def _hf_generate(model, ids):
    """HF's own greedy decode: (tokens [B, NEW], step logits [NEW][B, V])."""
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences[:, S:], list(out.logits)


def _moecg_generate(model, ids, strategy):
    """moecg's decode on HF's modules (dropless experts, `strategy` captured emulated): (tokens, step logits)."""
    attach(model, make_dispatcher("dropless"), max_rows=ROWS)
    try:
        eng = DecodeEngine(model, S + NEW, ROWS)
        cap = Capture(eng, strategy, buckets=[1, 2, 4], backend="emulate", warmup=1).apply()
        assert cap.captured == (strategy != "eager")
        res = eng.generate(ids, NEW, keep_logits=True, timing=False)
        assert set(res.step_rows) == {ROWS if cap.captured else BATCH}  # captured: the 3 rows ran in bucket 4
        cap.unwrap()
    finally:
        detach(model)
    return res.tokens, res.logits


@pytest.mark.parametrize("name", list(RUNS))
def test_checkpoint_hf_runs_moecg_runs(name, tmp_path):
    preset, ov, *attns = RUNS[name]
    _save(preset, ov, tmp_path / "ck")
    ids = _prompts()
    for attn in attns[0] if attns else ("sdpa", "eager"):
        plan = _plan(tmp_path / "ck", attn)
        model = build_model(pretrained_path=plan.model.pretrained_path, dtype="fp32", device="cpu",
                            attn_implementation=plan.model.attn_implementation).model
        for k, v in ov.items():  # the checkpoint round-trips the fields under test
            assert getattr(model.config, k) == v, (name, k)
        want, want_logits = _hf_generate(model, ids)
        for strategy in ("eager", "full"):
            got, logits = _moecg_generate(model, ids, strategy)
            cell = f"{name} attn={attn} strategy={strategy}"
            assert torch.equal(got, want), cell
            assert max(float((x - y).abs().max()) for x, y in zip(logits, want_logits)) <= 1e-4, cell


@pytest.mark.parametrize("name", list(REFUSED))
def test_checkpoint_hf_fails_moecg_refuses_in_the_plan(name, tmp_path):
    preset, ov, attn, field = REFUSED[name]
    model = _save(preset, ov, tmp_path / "ck", attn)
    with pytest.raises((RuntimeError, TypeError, UnboundLocalError)):  # HF's own decode fails inside its modules
        _hf_generate(model, _prompts())
    with pytest.raises(PlanError, match=rf"Config\.{field}: .*; (set|use) "):
        _plan(tmp_path / "ck", attn)
    with pytest.raises(UnsupportedConfigError, match=rf"Config\.{field}: "):  # a model built outside the plan
        DecodeEngine(model, S + NEW, ROWS)


def test_kv_heads_refusal_names_the_exact_fix(tmp_path):
    """The reported checkpoint: 2 KV heads under 4 heads, qk_head_dim == v_head_dim, which HF's generate runs (sdpa,
    no mask: enable_gqa over K/V that already have every head) and moecg's masked static cache cannot. The plan refuses
    it; the fix it names (num_key_value_heads = num_attention_heads in config.json, the same weights) decodes to what
    HF's own generate gave for the checkpoint as written."""
    ov = {"num_key_value_heads": 2, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16}
    model = _save("deepseek_v3_tiny", ov, tmp_path / "ck")
    ids = _prompts()
    want, want_logits = _hf_generate(model, ids)
    with pytest.raises(PlanError, match=r"num_key_value_heads=2 with num_attention_heads=4: .*set "
                                        r"num_key_value_heads=4 in the config \(config\.json\)"):
        _plan(tmp_path / "ck", strategy="eager")
    cfg_file = tmp_path / "ck" / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "num_key_value_heads": 4}))
    plan = _plan(tmp_path / "ck")
    fixed = build_model(pretrained_path=plan.model.pretrained_path, dtype="fp32", device="cpu").model
    got, logits = _moecg_generate(fixed, ids, "full")
    assert torch.equal(got, want)
    assert max(float((x - y).abs().max()) for x, y in zip(logits, want_logits)) <= 1e-4
