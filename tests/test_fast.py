"""capture.kernels=fused on CPU: the fused decode step (PyTorch reference ops) against HF's modules, its capture
with emulated graphs, its validation, and the Triton kernels under Triton's CPU interpreter.

Dims: B rows, V vocab, E experts, K top-k.
"""
import os

import pytest
import torch

from moecg.capture import Capture, StrategyError
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.engine import DecodeEngine
from moecg.fast import FastDecode, FastPathError, check_supported
from moecg.kernels import get_ops, ref
from moecg.models import build_model
from interp_runner import needs_triton, run_marked  # tests/

PRESETS = ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny"]


def _prompts(model, n=3, s=7, seed=0):
    return torch.randint(0, model.config.vocab_size, (n, s), generator=torch.Generator().manual_seed(seed))


def _reference(model, prompts, new_tokens, dispatch="dropless", **kw):
    attach(model, make_dispatcher(dispatch, **kw), max_rows=8)
    try:
        r = DecodeEngine(model, 64, 8).generate(prompts, new_tokens, keep_logits=True, timing=False)
        return r, state_of(model).snapshot()
    finally:
        detach(model)


@pytest.mark.parametrize("preset", PRESETS)
def test_fused_step_matches_hf_modules(preset):
    """fp32: same tokens, logits to rounding, same per-expert routing counts as HF's modules (dropless)."""
    model = build_model(preset, dtype="fp32", device="cpu", seed=3).model
    prompts = _prompts(model)
    want, want_counts = _reference(model, prompts, 10)
    attach(model, make_dispatcher("fused"), max_rows=8)
    eng = DecodeEngine(model, 64, 8)
    eng.decode_forward = FastDecode(model, "torch")
    got = eng.generate(prompts, 10, keep_logits=True, timing=False)
    counts = state_of(model).snapshot()
    detach(model)
    assert torch.equal(got.tokens, want.tokens)
    assert max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits)) < 1e-4
    assert counts["routed"] == want_counts["routed"] and counts["tokens"] == want_counts["tokens"]


@pytest.mark.parametrize("preset", ["qwen2_moe_tiny", "qwen3_moe_tiny"])
def test_fused_capture_emulated_padding_shrinking(preset):
    """Emulated graphs per bucket: 3 real rows in bucket 4, rows leaving mid-decode, same tokens as HF eager."""
    model = build_model(preset, dtype="fp32", device="cpu", seed=1).model
    prompts = _prompts(model, n=3)
    lengths = [10, 4, 7]
    attach(model, make_dispatcher("dropless"), max_rows=4)
    want = DecodeEngine(model, 64, 4).generate(prompts, 10, lengths=lengths, timing=False)
    detach(model)
    attach(model, make_dispatcher("fused"), max_rows=4)
    eng = DecodeEngine(model, 64, 4)
    cap = Capture(eng, "full", buckets=(1, 2, 4), backend="emulate", kernels="fused").apply()
    got = eng.generate(prompts, 10, lengths=lengths, timing=False)
    st = cap.stats()
    assert st["kernels"] == "fused" and st["kernel_backend"] == "torch" and st["graphs"] == 3
    assert torch.equal(got.tokens, want.tokens)
    assert set(got.step_rows) == {4, 2, 1}
    cap.unwrap()
    assert eng.decode_forward is None
    detach(model)


def test_dense_layers_and_capacity_dispatch_through_fused_path():
    """Qwen2-MoE with a dense (mlp_only) layer; dispatch=capacity inside the fused step drops exactly as in HF's."""
    model = build_model("qwen2_moe_tiny", dtype="fp32", device="cpu", seed=2,
                        config_overrides={"mlp_only_layers": [1]}).model
    prompts = _prompts(model, n=5)
    kw = {"capacity_factor": 0.5}
    runs = []
    for kernels in ("hf", "fused"):  # same bucket (8 rows, 3 padding): capacity depends on the rows run
        attach(model, make_dispatcher("capacity", **kw), max_rows=8)
        eng = DecodeEngine(model, 64, 8)
        cap = Capture(eng, "capacity", buckets=(8,), backend="emulate", kernels=kernels).apply()
        runs.append((eng.generate(prompts, 8, timing=False).tokens, state_of(model).snapshot()))
        cap.unwrap()
        detach(model)
    (want, want_counts), (got, counts) = runs
    assert want_counts["dropped_assignments"] > 0  # the comparison covers real drops
    assert torch.equal(got, want)
    assert counts["dropped"] == want_counts["dropped"] and counts["routed"] == want_counts["routed"]


def test_concatenated_weights_leave_hf_forward_unchanged():
    """FastDecode concatenates q/k/v and router/shared weights into its own buffers: the HF parameters stay where
    they were and HF's prefill is unchanged (tests/test_ownership.py checks the whole model)."""
    model = build_model("qwen2_moe_tiny", dtype="fp32", device="cpu", seed=4).model
    ids = _prompts(model, n=2, s=5)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        ptrs = [p.data_ptr() for p in model.parameters()]
        fast = FastDecode(model, "torch")
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    at = model.model.layers[0].self_attn
    assert torch.equal(fast.layers[0].wqkv, torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]))


def test_fused_validation_before_cuda_work():
    model = build_model("mixtral_tiny", dtype="fp32", device="cpu").model
    attach(model, make_dispatcher("fused"), max_rows=2)
    eng = DecodeEngine(model, 32, 2)
    with pytest.raises(StrategyError, match="strategy=full, capacity or eager"):
        Capture(eng, "partial", backend="emulate", kernels="fused")
    with pytest.raises(StrategyError, match="exclude each other"):
        Capture(eng, "full", backend="emulate", kernels="fused", compile=True)
    with pytest.raises(StrategyError, match="capture.kernels"):
        Capture(eng, "full", backend="emulate", kernels="bogus")
    with pytest.raises(ValueError, match="kernel backend"):
        get_ops("cuda-please", torch.device("cpu"))
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="Triton cannot run"):
            get_ops("triton", torch.device("cpu"))
    detach(model)
    model.config.hidden_act = "gelu"
    with pytest.raises(FastPathError, match="SiLU"):
        check_supported(model)


def test_fused_dispatcher_equals_dropless_on_cpu():
    """On CPU `fused` takes dropless's sort + grouped GEMM: identical output and counters."""
    b = build_model("qwen3_moe_tiny", dtype="fp32", device="cpu", seed=5)
    experts = b.adapter.moe_layers(b.model)[0][1]
    router = b.adapter.router_of(b.adapter.layers(b.model)[0])
    x = torch.randn(6, b.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    _, w, idx = router(x)
    outs = []
    for name in ("dropless", "fused"):
        state = attach(b.model, make_dispatcher(name), max_rows=6)
        state.set_rows(4, 6)
        with state.rows(6), torch.no_grad():
            outs.append((experts(x, idx, w), state.snapshot()))
        detach(b.model)
    assert torch.equal(outs[0][0], outs[1][0])
    assert outs[0][1]["routed"] == outs[1][1]["routed"] and outs[1][1]["tokens"] == 4
    assert torch.equal(outs[1][0][4:], torch.zeros_like(outs[1][0][4:]))


def test_teacher_forcing_feeds_the_given_tokens():
    model = build_model("mixtral_tiny", dtype="fp32", device="cpu").model
    prompts = _prompts(model, n=2)
    attach(model, make_dispatcher("dropless"), max_rows=2)
    eng = DecodeEngine(model, 64, 2)
    free = eng.generate(prompts, 8, timing=False)
    assert torch.equal(eng.generate(prompts, 8, timing=False, force_tokens=free.tokens).tokens, free.tokens)
    other = (free.tokens + 1) % model.config.vocab_size
    forced = eng.generate(prompts, 8, timing=False, force_tokens=other)
    assert forced.tokens[:, 0].equal(free.tokens[:, 0])  # the prefill's token is its own argmax
    assert not torch.equal(forced.tokens, free.tokens)  # later steps saw the forced inputs
    with pytest.raises(ValueError, match="force_tokens"):
        eng.generate(prompts, 8, timing=False, force_tokens=free.tokens[:, :4])
    detach(model)


def test_reference_ops_round_like_hf_rmsnorm_and_router():
    torch.manual_seed(0)
    x = torch.randn(3, 64).to(torch.bfloat16)
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeRMSNorm

    hf = Qwen2MoeRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.normal_()
    _, mine = ref.add_rmsnorm(x[:, None].float(), None, hf.weight, 1e-6)
    assert torch.equal(mine, hf(x))
    logits = torch.randn(5, 16)
    idx, w = ref.route(logits, 4, True, torch.bfloat16)
    p = torch.softmax(logits, -1)
    top = p.topk(4, -1)
    assert torch.equal(idx, top.indices)
    assert torch.equal(w, (top.values / top.values.sum(-1, keepdim=True)).to(torch.bfloat16))


@needs_triton
@pytest.mark.interp("triton_interp_check.py")
def test_triton_kernels_under_interpreter(request):
    """The Triton kernels themselves, on CPU through TRITON_INTERPRET=1 (fp32): every op against its reference,
    the MoE kernel with pad rows and counters, and a whole model's fused decode against the torch backend."""
    run_marked(request)
