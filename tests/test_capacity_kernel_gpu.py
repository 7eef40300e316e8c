"""The Triton capacity kernels on a real GPU (bf16), at the three original families' shapes: against their reference,
the in-kernel capacity for every real-token count, capture and replay at other row counts, and whole models.

Dims: T tokens (= rows), K top-k, E experts, C capacity, D hidden, I expert intermediate.
Skipped without CUDA. Run on the H200: `pytest -m gpu -s tests/test_capacity_kernel_gpu.py`.
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytestmark = pytest.mark.gpu

from moecg.capture import Capture  # noqa: E402
from moecg.dispatch import attach, detach, make_dispatcher, state_of  # noqa: E402
from moecg.dispatch.capacity import capacity  # noqa: E402
from moecg.dispatch.state import LayerCounters  # noqa: E402
from moecg.engine import DecodeEngine  # noqa: E402
from moecg.kernels import capacity as cap, ref, triton_ops as tri  # noqa: E402
from moecg.models import build_model  # noqa: E402

BF = torch.bfloat16
SHAPES = {"qwen1.5": (60, 4, 2048, 1408), "mixtral": (8, 2, 4096, 14336), "qwen3": (128, 8, 2048, 768)}  # E K D I
COUNTS = ("routed", "dropped", "tokens", "lost_all", "capacity", "calls")


def _same_counters(c1, c2):
    for f in COUNTS:
        assert torch.equal(getattr(c1, f), getattr(c2, f)), (f, getattr(c1, f), getattr(c2, f))
    for f in ("routed_mass", "dropped_mass"):
        torch.testing.assert_close(getattr(c1, f), getattr(c2, f), atol=1e-4, rtol=1e-5)


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request):
    E, K, D, inter = SHAPES[request.param]
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(E, 2 * inter, D, device="cuda", generator=g) / D ** 0.5).to(BF)
    down = (torch.randn(E, D, inter, device="cuda", generator=g) / inter ** 0.5).to(BF)
    yield request.param, E, K, D, gate_up, down
    del gate_up, down
    torch.cuda.empty_cache()


def _inputs(T, E, K, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, device="cuda", generator=g).to(BF)
    idx, w = ref.route(torch.randn(T, E, device="cuda", generator=g), K, True, BF)  # bf16 weights: ties happen
    return x, idx, w


@pytest.mark.parametrize("T,n_valid", [(1, 1), (4, 3), (8, None), (17, 13), (64, 61)])
@pytest.mark.parametrize("cf,policy,renorm", [(1.0, "probs", False), (1.25, "position", False),
                                              (0.5, "probs", True), (1e3, "position", False)])
def test_capacity_kernel_matches_reference(shape, T, n_valid, cf, policy, renorm):
    """Kept assignments, counters (exact; weight sums to fp32 rounding) and outputs against ref.capacity_experts,
    pad rows zero; a factor that drops nothing equals the dropless kernel."""
    name, E, K, D, gate_up, down = shape
    x, idx, w = _inputs(T, E, K, D, seed=T)
    valid = None if n_valid is None else torch.arange(T, device="cuda") < n_valid
    kw = dict(capacity_factor=cf, drop_policy=policy, renormalize=renorm)
    c1, c2 = LayerCounters.zeros(E, "cuda", capacity=True), LayerCounters.zeros(E, "cuda", capacity=True)
    want = ref.capacity_experts(x, idx, w, gate_up, down, valid, c1, **kw)
    got = cap.capacity_experts(x, idx, w, gate_up, down, valid, c2, **kw)
    _same_counters(c1, c2)
    assert torch.equal(want.abs().amax(-1) == 0, got.abs().amax(-1) == 0), "kept assignments differ"
    torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-3)
    n = T if n_valid is None else n_valid
    assert int(c2.tokens) == n and int(c2.capacity) == capacity(n, K, E, cf)
    if n_valid is not None:
        assert torch.equal(got[n_valid:], torch.zeros_like(got[n_valid:]))
    if cf >= 1e3:
        assert int(c2.dropped.sum()) == 0
        torch.testing.assert_close(got, tri.moe_experts(x, idx, w, gate_up, down, valid), rtol=1e-2, atol=1e-3)
    print(f"{name} T={T} cf={cf} {policy}: dropped {int(c2.dropped.sum())}/{int(c2.routed.sum())}, "
          f"lost {int(c2.lost_all)}")


@pytest.mark.parametrize("name", list(SHAPES))
def test_device_capacity_for_every_real_count(name):
    """The C the kernels apply (counters.capacity) is the host formula's for every real-token count of bucket 64."""
    E, K, _, _ = SHAPES[name]
    D, inter = 64, 64  # the threshold does not depend on the expert sizes
    gate_up = torch.randn(E, 2 * inter, D, device="cuda").to(BF) / 8
    down = torch.randn(E, D, inter, device="cuda").to(BF) / 8
    x, idx, w = _inputs(64, E, K, D, seed=1)
    for cf in (0.1, 1.0, 1.1, 1.25, 2.0, 3.3):
        for n in range(1, 65):
            c = LayerCounters.zeros(E, "cuda", capacity=True)
            cap.capacity_experts(x, idx, w, gate_up, down, torch.arange(64, device="cuda") < n, c, capacity_factor=cf)
            assert int(c.capacity) == capacity(n, K, E, cf), (name, cf, n)
            assert int(c.routed.sum()) == n * K and int(c.tokens) == n


@pytest.mark.parametrize("name", list(SHAPES))
def test_captured_once_right_for_every_row_count(name):
    """No host sync (sync debug mode 'error'), and one CUDA graph of a bucket of 8 replays correctly for 8, 5 and 1
    real rows: the threshold and the counters follow the mask on the device."""
    E, K, D, inter = SHAPES[name]
    D, inter = min(D, 2048), min(inter, 1408)  # the threshold logic, not the GEMM size, is under test here
    g = torch.Generator(device="cuda").manual_seed(3)
    gate_up = (torch.randn(E, 2 * inter, D, device="cuda", generator=g) / D ** 0.5).to(BF)
    down = (torch.randn(E, D, inter, device="cuda", generator=g) / inter ** 0.5).to(BF)
    x, idx, w = _inputs(8, E, K, D, seed=4)
    valid = torch.ones(8, dtype=torch.bool, device="cuda")
    c = LayerCounters.zeros(E, "cuda", capacity=True)
    kw = dict(capacity_factor=1.0, drop_policy="probs")

    def fn():
        return cap.capacity_experts(x, idx, w, gate_up, down, valid, c, **kw)

    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for n in (8, 5, 1):
        valid.copy_(torch.arange(8, device="cuda") < n)
        for t in (c.routed, c.dropped, c.routed_mass, c.dropped_mass, c.tokens, c.lost_all, c.capacity, c.calls):
            t.zero_()
        graph.replay()
        c_ref = LayerCounters.zeros(E, "cuda", capacity=True)
        want = ref.capacity_experts(x, idx, w, gate_up, down, valid, c_ref, **kw)
        _same_counters(c_ref, c)
        torch.testing.assert_close(out, want, rtol=2e-2, atol=5e-3)
        assert int(c.capacity) == capacity(n, K, E, 1.0)


@pytest.mark.parametrize("preset,layers", [("qwen1_5_moe_a2_7b", 2), ("mixtral_8x7b", 2), ("qwen3_30b_a3b", 2),
                                           ("deepseek_v3", 4), ("deepseek_v2_lite", 2)])
def test_fused_step_capacity_kernel_whole_model(preset, layers):
    """dispatch=capacity under capture.kernels=fused, captured (3 real rows in bucket 4): the Triton kernels against
    the same step with the padded PyTorch path (dispatch.kernels=torch), teacher-forced. Layer 0 sees identical
    inputs in both, so its drops are equal exactly; later layers to near ties of bf16 routing. A factor that drops
    nothing gives dispatch=fused's tokens."""
    b = build_model(preset, num_layers=layers, dtype="bf16", device="cuda", seed=1)
    m = b.model
    prompts = torch.randint(0, m.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    runs = {}
    for label, dispatch, kw in (("torch", "capacity", dict(capacity_factor=1.0, kernels="torch")),
                                ("triton", "capacity", dict(capacity_factor=1.0)),
                                ("huge", "capacity", dict(capacity_factor=1e3)), ("fused", "fused", {})):
        disp = make_dispatcher(dispatch, **kw)
        attach(m, disp, max_rows=8)
        eng = DecodeEngine(m, 64, 8)
        capt = Capture(eng, "capacity" if dispatch == "capacity" else "full", buckets=(1, 2, 4, 8),
                       kernels="fused").apply()
        assert capt.captured and capt.stats()["kernel_backend"] == "triton"
        if label == "huge":  # the prefill as dispatch=fused's, so the two decodes start from the same cache
            state_of(m).prefill_dispatcher = make_dispatcher("fused")
        experts = b.adapter.moe_layers(m)[0][1]
        one = torch.zeros(1, 1, dtype=torch.long, device="cuda")
        assert disp.use_triton(experts, one, one) == (label != "torch")  # the Triton path runs, or the padded one
        force = runs["torch"][0].tokens if label == "triton" else None
        r = eng.generate(prompts, 16, keep_logits=True, timing=False, force_tokens=force, count_prefill=False)
        runs[label] = (r, state_of(m).snapshot())
        capt.unwrap()
        detach(m)
    (want, ws), (got, gs) = runs["torch"], runs["triton"]
    agree = float((got.tokens == want.tokens).float().mean())
    print(f"{preset}: forced agreement {agree:.3f}, dropped {gs['dropped_assignments']} vs "
          f"{ws['dropped_assignments']} of {ws['routed_assignments']}")
    assert agree >= 0.95
    assert gs["routed_assignments"] == ws["routed_assignments"] and gs["tokens"] == ws["tokens"]
    assert ws["dropped_assignments"] > 0
    assert gs["dropped"][0] == ws["dropped"][0] and gs["tokens_lost_all"] >= 0
    assert gs["capacity_used"] == ws["capacity_used"]
    (hr, hs), (fr, fs) = runs["huge"], runs["fused"]
    # the same GEMM tiles on the same rows (only their order in a tile differs): the same numbers expected
    diff = max(float((a - c).abs().max()) for a, c in zip(hr.logits, fr.logits))
    print(f"{preset}: capacity 1e3 vs fused, max logit diff {diff:.4g}")
    assert hs["dropped_assignments"] == 0 and hs["routed"] == fs["routed"]
    assert torch.equal(hr.tokens, fr.tokens)
