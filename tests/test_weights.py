"""Weight formats (moecg.models.weights): the block-FP8 reference, the quantized model on every path against the same
model with the reference-dequantized weights, checkpoints in the published layout, the floor's bytes, refusals (CPU;
the Triton kernels under the interpreter: tests/triton_interp_weights.py)."""
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors import safe_open
from safetensors.torch import save_file

import moecg
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.engine import DecodeEngine
from moecg.fast import FastDecode
from moecg.floor import expert_bytes, floor_bytes
from moecg.harness import run_experiment
from moecg.models import adapter_for, build_model
from moecg.models.checkpoint import save_checkpoint
from moecg.models.formats import (BLOCK, FP4_VALUES, FP8, FP8_MAX, BlockFp8, Mxfp4, WeightFormatError, dequantize,
                                  fuse_rows, mx_dequantize, mx_quantize, quantize)
from moecg.models.weights import Fp8Linear, dequantize_model, stored, weight_bytes
from moecg.plan import PlanError, resolve_plan
from interp_runner import run_marked  # tests/

CONF_DIR = Path(moecg.__file__).parent / "conf"
FAMILIES = ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny_dense", "deepseek_v3_tiny", "deepseek_v2_tiny",
            "glm4_moe_tiny", "olmoe_tiny"]
# experts and projections over several 128-blocks with ragged tails (gate/up of 192 rows: scale groups of 64)
WIDE = dict(hidden_size=320, moe_intermediate_size=192, intermediate_size=384)


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _pair(preset, seed=0, weights="fp8_block", **overrides):
    """(the quantized model, the same model with its weights replaced by their reference dequantization)."""
    a = build_model(preset, dtype="fp32", device="cpu", seed=seed, weights=weights, config_overrides=overrides)
    b = build_model(preset, dtype="fp32", device="cpu", seed=seed, weights=weights, config_overrides=overrides)
    dequantize_model(b.model, b.adapter)
    return a.model, b.model


# -- the reference --------------------------------------------------------------------------------

def test_block_quantization_is_the_published_format():
    torch.manual_seed(0)
    w = torch.randn(300, 200) * torch.logspace(-3, 1, 200)  # columns of very different scales
    w[:128, 128:] = 0  # an all-zero block
    q, s = quantize(w)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (3, 2)
    assert torch.equal(s[0, 1], torch.tensor(1.0))  # a zero block's scale is 1 (and its values 0)
    blocks = torch.nn.functional.pad(w, (0, 56, 0, 84)).view(3, 128, 2, 128).abs().amax(dim=(1, 3))
    nz = blocks > 0
    torch.testing.assert_close(s[nz], blocks[nz] / FP8_MAX)  # amax / 448 per block
    assert q.float().abs().max() <= FP8_MAX
    d = dequantize(q, s, BLOCK, torch.float32)
    # e4m3 keeps 3 mantissa bits: each value within half a step (1/16 relative) or the subnormal step of its block
    step = torch.maximum(w.abs() / 16, s.repeat_interleave(BLOCK, 0)[:300].repeat_interleave(BLOCK, 1)[:, :200] * 2**-9)
    assert ((d - w).abs() <= step * 1.0001).all()
    # values already on the grid come back exactly
    q2, s2 = quantize(d)
    assert torch.equal(dequantize(q2, s2, BLOCK, torch.float32), d)


def test_fused_rows_dequantize_to_the_parts_stacked():
    torch.manual_seed(1)
    parts = [quantize(torch.randn(4, n, 256)) for n in (96, 192, 40)]
    q, s, rows = fuse_rows([(*p, BLOCK) for p in parts])
    assert rows == 32 and q.shape == (4, 328, 256) and s.shape == (4, 11, 2)
    want = torch.cat([dequantize(*p, BLOCK, torch.float32) for p in parts], dim=1)
    assert torch.equal(dequantize(q, s, rows, torch.float32), want)
    assert fuse_rows([(*parts[1], BLOCK)])[2] == BLOCK  # one part of any length keeps 128-row groups


def test_mx_quantization_in_chunks_gives_the_same_bytes(monkeypatch):
    """A stack larger than MX_CHUNK values (a whole layer's experts) is quantized a few matrices at a time."""
    from moecg.models import formats as W

    torch.manual_seed(0)
    w = torch.randn(5, 2, 24, 64) * torch.logspace(-3, 1, 64)
    whole = mx_quantize(w)
    monkeypatch.setattr(W, "MX_CHUNK", 3 * 24 * 64)  # 3 matrices a chunk: chunks of 3, 3, 3, 1
    chunked = mx_quantize(w)
    for a, b in zip(whole, chunked):
        assert a.shape == b.shape and torch.equal(a, b)
    monkeypatch.setattr(W, "MX_CHUNK", 10 ** 9)
    dense = W.mx_dequantize(*whole, torch.bfloat16)
    monkeypatch.setattr(W, "MX_CHUNK", 3 * 24 * 64)
    assert torch.equal(W.mx_dequantize(*whole, torch.bfloat16), dense)


def test_mx_quantization_is_the_published_format():
    """Scales: the smallest power of two that holds the block's amax (a zero block 2^0, the smallest 2^-126);
    values: the nearest e2m1 value, ties to the even code; packing: the low nibble the even column. HF's own mxfp4
    dequantizer (GPT-OSS's loader) reads the result as moecg's reference does."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    row = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.74, 0.24, 3.0] + [0.0] * 20)
    w = torch.stack([row, row * 2 ** 5, row * 1.01, torch.zeros(32), torch.full((32,), 1e-40)])
    q, s = mx_quantize(w)
    assert q.shape == (5, 16) and s.shape == (5, 1) and q.dtype == s.dtype == torch.uint8
    assert s.flatten().tolist() == [127, 132, 128, 127, 1]  # 6 fits 2^0; 6.06 needs 2^1; zeros 2^0; tiny 2^-126
    lut = torch.tensor(FP4_VALUES)
    codes = torch.stack([q & 15, q >> 4], -1).flatten(-2).long()  # low nibble first
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, -0.5, 0.0, 3.0]  # ties: .25->0 .75->1 1.25->1 1.75->2 ...
    assert lut[codes[0, :12]].tolist() == want and lut[codes[1, :12]].tolist() == want
    assert (codes[3] == 0).all() and (codes[4] == 0).all()
    d = mx_dequantize(q, s, torch.float32)
    assert torch.equal(d[1], torch.tensor(want + [0.0] * 20) * 32)
    torch.manual_seed(0)
    w = torch.randn(4, 48, 96) * torch.logspace(-4, 2, 96)
    q, s = mx_quantize(w)
    d = mx_dequantize(q, s, torch.float32)
    scale = torch.ldexp(torch.ones(s.shape), s.int() - 127).repeat_interleave(32, -1)
    # e2m1 steps are 0.5, 1, 2 per scale unit below 2, 4, 6: each value within half its step
    step = torch.where(w.abs() < 2 * scale, 0.5, torch.where(w.abs() < 4 * scale, 1.0, 2.0)) * scale
    assert ((d - w).abs() <= step / 2).all() and (w.abs().view(4, 48, 3, 32).amax(-1) <= 6 * scale[..., ::32]).all()
    assert torch.equal(mx_dequantize(*mx_quantize(d), torch.float32), d)  # on the grid: exactly back
    hf = convert_moe_packed_tensors(q.view(4, 48, 3, 16), s, dtype=torch.bfloat16)  # [E, K, N]: GPT-OSS's layout
    assert torch.equal(hf, Mxfp4(q, s, torch.bfloat16, transposed=True).dense())


def test_what_the_format_quantizes():
    m = build_model("qwen2_moe_tiny", dtype="fp32", device="cpu", weights="fp8_block").model
    ad = adapter_for(m)
    layer = ad.layers(m)[0]
    assert isinstance(layer.self_attn.q_proj, Fp8Linear) and isinstance(layer.self_attn.o_proj, Fp8Linear)
    assert isinstance(layer.mlp.shared_expert.down_proj, Fp8Linear)
    assert type(layer.mlp.shared_expert_gate) is torch.nn.Linear  # [1, D]: stays in the model dtype
    assert layer.mlp.gate.weight.dtype == torch.float32 and m.lm_head.weight.dtype == torch.float32
    assert m.model.embed_tokens.weight.dtype == torch.float32
    ex = layer.mlp.experts
    assert ex.gate_up_proj.dtype == FP8 and isinstance(stored(ex, "gate_up_proj"), BlockFp8)
    assert m.config._experts_implementation == "moecg_dequantized"
    m = build_model("gpt_oss_tiny", dtype="fp32", device="cpu", weights="mxfp4").model  # experts only, as published
    ex = m.model.layers[0].mlp.experts
    assert ex.gate_up_proj.dtype == torch.uint8 and isinstance(stored(ex, "gate_up_proj"), Mxfp4)
    assert ex.gate_up_proj.shape == (8, 64, 32) and ex.gate_up_proj_scales.shape == (8, 64, 2)  # [E, 2I, D/2]
    assert stored(ex, "gate_up_proj").dense().shape == (8, 64, 64)  # the module's [E, D, 2I] again
    assert ex.gate_up_proj_bias.dtype == torch.float32
    assert all(p.dtype == torch.float32 for n, p in m.named_parameters() if ".experts." not in n)


# -- every path against the dequantized model -------------------------------------------------------

@pytest.mark.parametrize("preset,weights", [(p, "fp8_block") for p in FAMILIES] +
                         [(p, "mxfp4") for p in ("gpt_oss_tiny", "mixtral_tiny", "deepseek_v3_tiny")])
def test_quantized_model_is_its_dequantized_self_on_every_dispatcher(preset, weights):
    """Each HF-module dispatcher, HF's own experts (no dispatcher) and the fused step (torch ops) give the dequantized
    model's logits bit for bit, with the same counters."""
    a, b = _pair(preset, seed=3, weights=weights)
    ids = torch.randint(0, 100, (3, 6))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)  # no dispatcher: HF's experts on dequantized weights
    for disp in ("dynamic", "dropless", "capacity", "fused"):
        out = []
        for m in (a, b):
            attach(m, make_dispatcher(disp, **({"capacity_factor": 0.5} if disp == "capacity" else {})))
            with torch.no_grad():
                out.append((m(ids).logits, state_of(m).snapshot()))
            detach(m)
        assert torch.equal(out[0][0], out[1][0]), disp
        assert out[0][1]["routed"] == out[1][1]["routed"] and out[0][1]["dropped"] == out[1][1]["dropped"], disp
    prompts = torch.randint(0, 100, (2, 5))
    runs = []
    for m in (a, b):
        attach(m, make_dispatcher("fused"), max_rows=4)
        eng = DecodeEngine(m, 24, 4)
        eng.decode_forward = FastDecode(m, "torch")
        runs.append(eng.generate(prompts, 4, keep_logits=True, timing=False))
        detach(m)
    assert torch.equal(torch.stack(runs[0].logits), torch.stack(runs[1].logits))


def test_quantized_differs_from_full_precision_by_the_rounding_only():
    """The format changes the model (this is what fidelity measures), by about e4m3's rounding, not more."""
    full = build_model("qwen3_moe_tiny", dtype="fp32", device="cpu", seed=5).model
    q = build_model("qwen3_moe_tiny", dtype="fp32", device="cpu", seed=5, weights="fp8_block").model
    ids = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        lf, lq = full(ids).logits, q(ids).logits
    assert not torch.equal(lf, lq)
    assert (lf - lq).abs().max() < 0.1 * lf.abs().max()


# -- checkpoints ----------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["mixtral_tiny", "qwen2_moe_tiny", "deepseek_v3_tiny"])
def test_checkpoint_round_trip_in_the_published_layout(preset, tmp_path):
    a = build_model(preset, dtype="fp32", device="cpu", seed=1, weights="fp8_block", config_overrides=WIDE)
    save_checkpoint(a.model, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    f = safe_open(str(tmp_path / "model.safetensors"), "pt")
    keys = set(f.keys())
    experts = "block_sparse_moe.experts.3.w1" if preset == "mixtral_tiny" else "mlp.experts.3.gate_proj"
    inter = a.model.config.intermediate_size if preset == "mixtral_tiny" else 192
    gate = f"model.layers.1.{experts}.weight"
    assert f.get_slice(gate).get_dtype() == "F8_E4M3" and f.get_slice(gate).get_shape() == [inter, 320]
    assert f.get_slice(gate + "_scale_inv").get_shape() == [-(-inter // 128), 3]
    assert "model.layers.1.self_attn.o_proj.weight_scale_inv" in keys
    assert not any(k.endswith("gate.weight_scale_inv") and ".experts." not in k and "gate_proj" not in k
                   for k in keys)  # the router stays in the model dtype
    b = build_model(pretrained_path=str(tmp_path), dtype="fp32", device="cpu", seed=9)
    assert b.weights == "fp8_block"
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k].float(), sb[k].float()) for k in sa)
    full = build_model(pretrained_path=str(tmp_path), dtype="fp32", device="cpu", weights="full")
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        assert torch.equal(a.model(ids).logits, full.model(ids).logits)  # read back dequantized: the same model


@pytest.mark.parametrize("preset", ["gpt_oss_tiny", "qwen2_moe_tiny"])
def test_mxfp4_checkpoint_round_trip_in_the_published_layout(preset, tmp_path):
    """GPT-OSS's layout: `<experts>.gate_up_proj_blocks` [E, 2I, D/32, 16] and `_scales` [E, 2I, D/32] uint8 (for
    every family, under its experts module's name), everything else in the model dtype under HF's names."""
    wide = dict(hidden_size=320, intermediate_size=192) if preset == "gpt_oss_tiny" else WIDE
    a = build_model(preset, dtype="fp32", device="cpu", seed=1, weights="mxfp4", config_overrides=wide)
    save_checkpoint(a.model, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"] == {"quant_method": "mxfp4"}
    f = safe_open(str(tmp_path / "model.safetensors"), "pt")
    ex = "model.layers.1.mlp.experts."
    E = a.adapter.num_experts(a.model.config)
    inter = a.adapter.expert_intermediate(a.model.config)
    assert f.get_slice(ex + "gate_up_proj_blocks").get_shape() == [E, 2 * inter, 10, 16]
    assert f.get_slice(ex + "gate_up_proj_scales").get_shape() == [E, 2 * inter, 10]
    assert f.get_slice(ex + "down_proj_blocks").get_dtype() == "U8"
    assert f.get_slice(ex + "down_proj_scales").get_shape() == [E, 320, inter // 32]
    assert f.get_slice("model.layers.1.self_attn.o_proj.weight").get_dtype() == "F32"
    b = build_model(pretrained_path=str(tmp_path), dtype="fp32", device="cpu", seed=9)
    assert b.weights == "mxfp4"
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    full = build_model(pretrained_path=str(tmp_path), dtype="fp32", device="cpu", weights="full")
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        assert torch.equal(a.model(ids).logits, full.model(ids).logits)
    tensors = {k: f.get_tensor(k) for k in f.keys()}
    for byte, what in ((255, r"scale byte 255 \(NaN in e8m0\)"), (241, r"scale byte 241 \(2\^114\)")):
        bad = tensors[ex + "down_proj_scales"].clone()
        bad[0, 3, 0] = byte  # beyond what the kernels' one-row product takes (formats.MX_SCALE_MAX)
        save_file({**tensors, ex + "down_proj_scales": bad}, str(tmp_path / "model.safetensors"))
        with pytest.raises(WeightFormatError, match=rf"down_proj_scales holds {what}: moecg's kernels take scale "
                                                    r"bytes up to 240"):
            build_model(pretrained_path=str(tmp_path), dtype="fp32", device="cpu")
    tensors[ex + "down_proj_scales"] = tensors[ex + "down_proj_scales"][:, :, :1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightFormatError, match=r"down_proj_scales is torch.uint8 \(.*\), the model expects"):
        build_model(pretrained_path=str(tmp_path), dtype="fp32", device="cpu")
    del tensors[ex + "down_proj_scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightFormatError, match=r"no tensor model.layers.1.mlp.experts.down_proj_scales"):
        build_model(pretrained_path=str(tmp_path), dtype="fp32", device="cpu")


def test_checkpoints_moecg_cannot_read_are_refused_naming_the_field(tmp_path):
    a = build_model("qwen3_moe_tiny", dtype="fp32", device="cpu", weights="fp8_block")
    save_checkpoint(a.model, str(tmp_path))
    cfg_path = tmp_path / "config.json"
    good = json.loads(cfg_path.read_text())
    for qc, match in (({"quant_method": "awq"}, r"quantization_config.quant_method='awq'"),
                      ({"quant_method": "mxfp4", "group_size": 64}, r"quantization_config.group_size=64"),
                      ({**good["quantization_config"], "weight_block_size": [64, 64]},
                       r"quantization_config.weight_block_size=\[64, 64\]"),
                      ({**good["quantization_config"], "activation_scheme": "static"},
                       r"quantization_config.activation_scheme='static'"),
                      ({"quant_method": "fp8"}, r"quantization_config.weight_block_size is missing")):
        cfg_path.write_text(json.dumps({**good, "quantization_config": qc}))
        with pytest.raises(PlanError, match=match):
            resolve_plan(_cfg("model=local", f"model.pretrained_path={tmp_path}"))
    cfg_path.write_text(json.dumps(good))
    f = safe_open(str(tmp_path / "model.safetensors"), "pt")
    tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.0.self_attn.q_proj.weight_scale_inv"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightFormatError, match=r"q_proj.weight has no model.layers.0.self_attn.q_proj.weight_scale"):
        build_model(pretrained_path=str(tmp_path), dtype="fp32", device="cpu")


def test_formats_are_validated_before_the_build():
    with pytest.raises(PlanError, match=r"model.weights='int4': choose one of full, fp8_block"):
        resolve_plan(_cfg("model=qwen3_moe_tiny", "model.weights=int4"))
    with pytest.raises(PlanError, match=r"model.weights=fp8_block: gpt_oss stores its experts transposed"):
        resolve_plan(_cfg("model=gpt_oss_tiny", "model.weights=fp8_block"))
    assert resolve_plan(_cfg("model=qwen3_moe_tiny", "model.weights=fp8_block")).model.weights == "fp8_block"
    assert resolve_plan(_cfg("model=gpt_oss_tiny", "model.weights=mxfp4")).model.weights == "mxfp4"
    assert resolve_plan(_cfg("model=qwen3_moe_tiny")).model.weights == "full"


def test_mxfp4_refuses_blocks_beyond_the_kernels_scales():
    """A block whose scale byte would pass 240 (values of 6 x 2^113 and more) is refused when quantized; 240 itself
    is quantized and read back exactly."""
    w = torch.zeros(2, 64)
    w[0, 0] = 6 * 2.0**113  # scale byte 240
    q, s = mx_quantize(w)
    assert int(s.max()) == 240 and torch.equal(mx_dequantize(q, s, torch.float32), w)
    w[1, 40] = 6 * 2.0**114
    with pytest.raises(WeightFormatError, match=r"model.weights=mxfp4: a 32-value block reaches 1.25e\+35, above the "
                                                r"scale byte 240 the kernels take"):
        mx_quantize(w)


def test_mxfp4_needs_whole_scale_blocks(tmp_path):
    build_model("mixtral_tiny", dtype="fp32", device="cpu", config_overrides={"intermediate_size": 48}) \
        .model.save_pretrained(str(tmp_path))
    with pytest.raises(PlanError, match=r"model.weights=mxfp4: the expert intermediate size \(48\) is not a multiple "
                                        r"of 32"):
        resolve_plan(_cfg("model=local", f"model.pretrained_path={tmp_path}", "model.weights=mxfp4"))
    assert resolve_plan(_cfg("model=local", f"model.pretrained_path={tmp_path}")).model.weights == "full"
    # and the kernels' own check, for weights that reach them some other way (their K masks count whole groups)
    from moecg.kernels.moe_gemm import ExpertArgs
    up = Mxfp4(torch.zeros(2, 96, 32, dtype=torch.uint8), torch.full((2, 96, 2), 127, dtype=torch.uint8),
               torch.bfloat16)  # [E, 2I, D / 2]: D 64, whole groups
    q, s = torch.zeros(2, 64, 24, dtype=torch.uint8), torch.full((2, 64, 2), 127, dtype=torch.uint8)  # [E, D, I / 2]
    with pytest.raises(ValueError, match=r"mxfp4 experts: K \(48\) must be whole 32-column scale groups"):
        ExpertArgs(up, Mxfp4(q, s, torch.bfloat16))


# -- bytes, floor, record -------------------------------------------------------------------------

def test_floor_counts_the_bytes_as_stored():
    full = build_model("qwen3_moe_tiny", dtype="bf16", device="cpu", config_overrides=WIDE).model
    q = build_model("qwen3_moe_tiny", dtype="bf16", device="cpu", weights="fp8_block", config_overrides=WIDE).model
    ex_f, ex_q = adapter_for(full).experts_of(full.model.layers[0]), adapter_for(q).experts_of(q.model.layers[0])
    # one expert: gate|up [384, 320] and down [320, 192] at 1 byte, scales [6, 3] and [3, 2] fp32 (gate|up: 64-row
    # groups, 192 = 1.5 blocks)
    assert expert_bytes(ex_f) == (384 * 320 + 320 * 192) * 2
    assert expert_bytes(ex_q) == 384 * 320 + 320 * 192 + (6 * 3 + 3 * 2) * 4
    hits = [4] * len(adapter_for(q).moe_layers(q))
    bf, bq = floor_bytes(full, adapter_for(full), hits, 1, 16), floor_bytes(q, adapter_for(q), hits, 1, 16)
    assert 0.5 < bq / bf < 0.75  # projections halve; embeddings, lm_head, norms, routers and KV stay bf16
    assert weight_bytes(q) < weight_bytes(full)
    mx = build_model("qwen3_moe_tiny", dtype="bf16", device="cpu", weights="mxfp4", config_overrides=WIDE).model
    ex_m = adapter_for(mx).experts_of(mx.model.layers[0])
    # 4.25 bits a value: half a byte, and a byte of scale per 32
    assert expert_bytes(ex_m) == (384 * 320 + 320 * 192) // 2 + (384 * 320 + 320 * 192) // 32


def test_results_record_the_format_and_its_bytes():
    r = run_experiment(_cfg("model=qwen3_moe_tiny", "model.weights=fp8_block", "strategy=partial",
                            "new_tokens=5", "measure.repeats=1"))
    assert r["weights"] == "fp8_block" and r["token_agreement_forced_vs_eager"] == 1.0
    full = run_experiment(_cfg("model=qwen3_moe_tiny", "strategy=partial", "new_tokens=5",
                               "measure.repeats=1"))
    assert full["weights"] == "full" and r["weight_bytes"] < full["weight_bytes"]


@pytest.mark.interp("triton_interp_weights.py", timeout=900)
def test_triton_kernels_on_quantized_weights_under_interpreter(request):
    run_marked(request)


def test_quantized_runs_on_every_strategy_and_kernel_path(preset="deepseek_v3_tiny"):
    """Through the plan and the harness (emulated capture, 3 rows in bucket 4; MLA, shared experts and a dense first
    layer, all quantized): dropless HF-module paths give eager's
    tokens, the fused step its teacher-forced tokens; capacity drops the same assignments on every path (its tokens
    differ from dropless eager's by what it drops)."""
    base = [f"model={preset}", "model.weights=fp8_block", "capture.backend=emulate", "batch_size=3", "prompt_len=5",
            "new_tokens=6", "measure.repeats=1", "measure.skip_steps=0", "measure.eager_baseline=false",
            "capture.warmup=1"]
    drops = set()
    for strategy, dispatch in (("full", "fused"), ("capacity", "capacity")):
        for kernels in ("hf", "fused"):
            ov = [*base, f"strategy={strategy}", f"dispatch={dispatch}", f"capture.kernels={kernels}"]
            if dispatch == "capacity":
                ov.append("dispatch.capacity_factor=1.0")
            r = run_experiment(_cfg(*ov))
            assert r["status"] == "ok" and r["weights"] == "fp8_block", (strategy, kernels, r.get("error"))
            if dispatch == "capacity":
                drops.add(r["dropped_assignments"])
            else:
                assert r["token_agreement_forced_vs_eager"] >= (1.0 if kernels == "hf" else 0.99), kernels
    assert len(drops) == 1


def test_local_checkpoints_convert_and_cut_at_load(tmp_path):
    """A bf16 checkpoint quantized at load equals the preset quantized in place; an FP8 checkpoint cut in depth loads
    its first layers only, the same tensors as the whole one's."""
    full = build_model("qwen2_moe_tiny", dtype="fp32", device="cpu", seed=2).model
    full.save_pretrained(str(tmp_path / "full"))
    a = build_model(pretrained_path=str(tmp_path / "full"), dtype="fp32", device="cpu", weights="fp8_block")
    b = build_model("qwen2_moe_tiny", dtype="fp32", device="cpu", seed=2, weights="fp8_block")
    assert a.weights == "fp8_block"
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k].float(), sb[k].float()) for k in sa)
    save_checkpoint(b.model, str(tmp_path / "fp8"))
    cut = build_model(pretrained_path=str(tmp_path / "fp8"), dtype="fp32", device="cpu", num_layers=1)
    sc = cut.model.state_dict()
    assert len(cut.adapter.layers(cut.model)) == 1 and sc.keys() < sb.keys()
    assert all(torch.equal(sc[k].float(), sb[k].float()) for k in sc)
