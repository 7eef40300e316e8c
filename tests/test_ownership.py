"""The model is not edited behind its back: dispatcher, router skew, the fused step and capture attach from outside
and leave the model as they found it (parameters' data pointers and values, buffers, every module's forward and
hooks, instance attributes, state_dict, config); and the knobs that change what the fused step runs are constructor
arguments, validated and recorded.

Dims: B rows, S prompt tokens, V vocab, E experts.
"""
import pytest
import torch

from moecg.capture import Capture, StrategyError
from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import DecodeEngine, EagerPolicy
from moecg.fast import FastDecode
from moecg.kernels import ref
from moecg.models import apply_router_skew, build_model, remove_router_skew
from moecg.models.skew import SkewHook, router_logit_bias

S, NEW, LEN = 6, 6, 32
# a shared expert (router + shared gate/up in one concatenated GEMM), a lone router (read in place), a router bias
# (GPT-OSS), a sigmoid_group router with its fp32 GEMM apart (GLM-4-MoE)
PRESETS = ["mixtral_tiny", "qwen2_moe_tiny", "gpt_oss_tiny", "glm4_moe_tiny"]


def _prompts(model, n=3, seed=0):
    return torch.randint(0, model.config.vocab_size, (n, S), generator=torch.Generator().manual_seed(seed))


def _model(preset):
    model = build_model(preset, dtype="fp32", device="cpu", seed=2).model
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # HF initialises biases to zero, which would hide one that a path drops or moves
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        model(_prompts(model, 1))  # HF installs its output-recording hooks at the first forward: before the snapshot
    return model


def _snapshot(model) -> dict:
    """Everything of the model that a path attached from outside could leave changed."""
    def tensors(named):
        return {n: (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.detach().clone()) for n, t in named}

    mods = dict(model.named_modules())
    return {
        "params": tensors(model.named_parameters()),
        "buffers": tensors(model.named_buffers()),
        "state_dict": tensors(model.state_dict().items()),
        "forward": {n: (m.__dict__.get("forward"), type(m).forward) for n, m in mods.items()},
        "hooks": {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in mods.items()},
        "attrs": {n: sorted(m.__dict__) for n, m in mods.items()},
        "config": model.config.to_dict(),
    }


def _assert_same(before: dict, after: dict, skip=()) -> None:
    for part, want in before.items():
        if part in skip:
            continue
        got = after[part]
        assert got.keys() == want.keys(), (part, set(got) ^ set(want))
        for k, w in want.items():
            g = got[k]
            if isinstance(w, tuple) and w and isinstance(w[-1], torch.Tensor):
                assert g[:-1] == w[:-1] and torch.equal(g[-1], w[-1]), (part, k)
            else:
                assert g == w, (part, k)


@pytest.mark.parametrize("preset", PRESETS)
def test_attach_skew_fused_capture_unwrap_leave_the_model_as_it_was(preset):
    """dispatcher + router skew + Capture(kernels=fused, emulated graphs), a few steps, then undone: the model is
    exactly what it was; while attached its parameters and state_dict never moved; the fused step's tokens are HF's."""
    model = _model(preset)
    prompts = _prompts(model)
    before = _snapshot(model)
    apply_router_skew(model, 0.4, seed=1)
    try:
        attach(model, make_dispatcher("dropless"), max_rows=4)
        want = DecodeEngine(model, LEN, 4).generate(prompts, NEW, keep_logits=True, timing=False)
        detach(model)
        attach(model, make_dispatcher("fused"), max_rows=4)
        eng = DecodeEngine(model, LEN, 4)
        cap = Capture(eng, "full", buckets=(1, 2, 4), backend="emulate", kernels="fused", kernel_backend="torch")
        cap.apply()
        assert eng.policy is cap and eng.decode_forward is cap.fast
        got = eng.generate(prompts, NEW, keep_logits=True, timing=False, force_tokens=want.tokens)
        assert cap.stats()["graphs"] == 3
        # while attached: the HF parameters, buffers and state_dict are untouched (hooks and attributes are not)
        _assert_same(before, _snapshot(model), skip=("hooks", "attrs", "config", "forward"))
        assert cap.fast.owned_bytes > 0
        cap.unwrap()
        assert type(eng.policy) is EagerPolicy and eng.decode_forward is None
    finally:
        remove_router_skew(model)
        detach(model)
    agree = float((got.tokens == want.tokens).float().mean())
    diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits))
    assert agree >= 0.99 and diff < 1e-4, (agree, diff)  # fp32: other GEMM shapes than HF's modules
    _assert_same(before, _snapshot(model))


@pytest.mark.parametrize("strategy,layers", [("partial", None), ("mixed", "0-0:layer,1-1:attn")])
def test_per_layer_capture_unwrap_restores_forwards(strategy, layers):
    """Per-layer graphs wrap decoder layers' forwards on the instance while applied; unwrap leaves none behind."""
    model = _model("qwen2_moe_tiny")
    before = _snapshot(model)
    attach(model, make_dispatcher("dropless"), max_rows=2)
    try:
        eng = DecodeEngine(model, LEN, 2)
        cap = Capture(eng, strategy, layers=layers, buckets=(1, 2), backend="emulate").apply()
        eng.generate(_prompts(model, 2), 4, timing=False)
        cap.unwrap()
    finally:
        detach(model)
    _assert_same(before, _snapshot(model))


def test_fused_buffers_are_copies_or_read_in_place():
    """FastDecode's concatenated weights share no storage with the model (a lone router weight is the parameter
    itself, read only); owned_bytes counts exactly the copies."""
    for preset in ("mixtral_tiny", "qwen2_moe_tiny"):
        model = _model(preset)
        fast = FastDecode(model, "torch")
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        owned = 0
        for L in fast.layers:
            assert L.wqkv.untyped_storage().data_ptr() not in params
            owned += L.wqkv.numel() * L.wqkv.element_size()
            if L.bqkv is not None:
                owned += L.bqkv.numel() * L.bqkv.element_size()
            if L.wcat is not None:
                if L.wcat.untyped_storage().data_ptr() in params:  # read in place: the router's weight as it is
                    assert L.r0 == 0 and L.wcat.data_ptr() == L.router.weight.data_ptr()
                else:
                    owned += L.wcat.numel() * L.wcat.element_size()
            if L.bcat is not None:
                owned += L.bcat.numel() * L.bcat.element_size()
        assert fast.owned_bytes == owned > 0


def test_skew_hook_with_zero_bias_is_hf_router_and_removes_cleanly():
    """SkewHook on a router with a zero bias gives HF's router outputs bit for bit; apply/remove leaves no hook."""
    model = _model("qwen2_moe_tiny")
    router = model.model.layers[0].mlp.gate
    h = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))  # [T, D]
    with torch.no_grad():
        want = router(h)
        from moecg.models.adapter import adapter_for
        hook = SkewHook("softmax_topk", torch.zeros(router.num_experts), adapter_for(model).router_spec(router))
        hook.handle = router.register_forward_hook(hook, prepend=True)
        try:
            got = router(h)
            assert router_logit_bias(router) is hook.bias
        finally:
            hook.handle.remove()
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
    before = dict(router._forward_hooks)
    apply_router_skew(model, 0.3)
    assert router_logit_bias(router) is not None and "forward" not in router.__dict__
    apply_router_skew(model, 0.0)  # 0: off, HF's router as it was
    assert router_logit_bias(router) is None and dict(router._forward_hooks) == before


# -- the knobs ---------------------------------------------------------------------------------------------------
def test_knobs_validated_and_recorded():
    model = _model("mixtral_tiny")
    for bad, match in [({"pdl": 3}, "capture.pdl=3"), ({"pdl": True}, "capture.pdl=True"),
                       ({"overlap_shared": "yes"}, "capture.overlap_shared"),
                       ({"fuse_router": 1}, "capture.fuse_router"), ({"preload": "no"}, "capture.preload")]:
        with pytest.raises(ValueError, match=match):
            FastDecode(model, "torch", **bad)
    attach(model, make_dispatcher("fused"), max_rows=2)
    try:
        eng = DecodeEngine(model, LEN, 2)
        for kw in ({"pdl": 1}, {"preload": False}, {"overlap_shared": False}, {"fuse_router": False}):
            with pytest.raises(StrategyError, match="only applies with capture.kernels=fused"):
                Capture(eng, "full", buckets=(1, 2), backend="emulate", **kw)
        with pytest.raises(StrategyError, match="capture.precompile"):
            Capture(eng, "full", buckets=(1, 2), backend="emulate", precompile="no")
        hf = Capture(eng, "full", buckets=(1, 2), backend="emulate").describe()
        assert hf == {"pdl": None, "pdl_mode": None, "preload": None, "overlap_shared": None, "fuse_router": None,
                      "precompile": None, "fused_weight_mib": None}
        cap = Capture(eng, "full", buckets=(1, 2), backend="emulate", kernels="fused", kernel_backend="torch", pdl=1,
                      preload=False, overlap_shared=False, fuse_router=False, precompile=False)
        st = cap.stats()
        assert {k: st[k] for k in ("pdl", "pdl_mode", "preload", "overlap_shared", "fuse_router", "precompile")} == \
            {"pdl": 1, "pdl_mode": None, "preload": False, "overlap_shared": False, "fuse_router": False,
             "precompile": False}
        assert st["fused_weight_mib"] == cap.fast.owned_bytes / 2**20 > 0
        assert not any(L.norm_route for L in cap.fast.layers)  # fuse_router=False
        assert any(L.norm_route for L in FastDecode(model, "torch").layers)  # Mixtral's lone router, by default
    finally:
        detach(model)


@pytest.mark.parametrize("preset", ["mixtral_tiny", "gpt_oss_tiny"])
def test_fuse_router_off_same_tokens(preset):
    """norm_route (Mixtral's softmax_topk; GPT-OSS's router with its bias, top-k then softmax) against add_rmsnorm +
    the router GEMM + the router kernel: the same tokens and logits (the same torch ops, composed)."""
    model = _model(preset)
    prompts = _prompts(model)
    outs = []
    attach(model, make_dispatcher("fused"), max_rows=4)
    try:
        for fuse in (True, False):
            eng = DecodeEngine(model, LEN, 4)
            eng.decode_forward = FastDecode(model, "torch", fuse_router=fuse)
            assert all(L.norm_route == fuse for L in eng.decode_forward.layers)
            outs.append(eng.generate(prompts, NEW, timing=False, keep_logits=True))
    finally:
        detach(model)
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert max(float((a - b).abs().max()) for a, b in zip(outs[0].logits, outs[1].logits)) < 1e-5


def test_pdl_set_for_the_fused_step_only(monkeypatch):
    """pdl=m: the launch helpers' mode is m while the fused step runs (its captures and its dry pass included) and
    back to its default (None: auto) after; pdl=None leaves the default."""
    triton_ops = pytest.importorskip("moecg.kernels.triton_ops")
    model = _model("qwen2_moe_tiny")
    seen = []
    real = ref.linear
    monkeypatch.setattr(ref, "linear", lambda *a, **k: (seen.append(triton_ops.PDL), real(*a, **k))[1])
    attach(model, make_dispatcher("fused"), max_rows=2)
    try:
        for mode in (1, None):
            seen.clear()
            eng = DecodeEngine(model, LEN, 2)
            cap = Capture(eng, "full", buckets=(1, 2), backend="emulate", kernels="fused", kernel_backend="torch",
                          pdl=mode).apply()
            eng.generate(_prompts(model, 2), 3, timing=False)
            cap.unwrap()
            assert seen and set(seen) == {mode} and triton_ops.PDL is None
        # the precompile pass runs the step dry under the same mode
        eng = DecodeEngine(model, LEN, 2)
        cap = Capture(eng, "full", buckets=(1, 2), backend="emulate", kernels="fused", pdl=0)
        cap.fast.ops, cap.fast.backend = triton_ops, "triton"
        launched = []
        from moecg.kernels import launch

        monkeypatch.setattr(launch, "_build", lambda *a: None)
        real_launch = launch.launch
        for mod in triton_ops.MODULES:  # every kernel module's launches
            monkeypatch.setattr(mod, "launch", lambda k, g, *a, **kw: (launched.append(launch.PDL),
                                                                       real_launch(k, g, *a, **kw)))
        cap.decode_forward = cap.fast  # as apply() sets it, without capturing
        eng.set_policy(cap)
        cap._precompile([2, 1])
        assert launched and set(launched) == {0} and triton_ops.PDL is None
        assert cap.stats()["pdl"] == 0 and cap.stats()["pdl_mode"] == 0  # the CPU has no PDL
    finally:
        eng.set_policy(None)
        detach(model)
