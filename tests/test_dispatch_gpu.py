"""moecg.dispatch on a real GPU (bf16): each graph-safe dispatcher's experts forward, captured alone in a CUDA graph,
replays new routings as eager does, advances its counters on replay, and never syncs with the host.

Dims: T tokens, K top-k, E experts, D hidden.
Skipped without CUDA. Run on the H200: `pytest -m gpu -s tests/test_dispatch_gpu.py` (one summary line per case).
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytestmark = pytest.mark.gpu

from moecg.dispatch import attach, detach, make_dispatcher  # noqa: E402
from moecg.models import build_model  # noqa: E402

MODELS = [("mixtral_tiny", None), ("qwen3_moe_tiny", None), ("qwen1_5_moe_a2_7b", 1)]
DISPATCHERS = {  # label -> (name, kwargs); capacity-inf never drops, so it must also match `dynamic`
    "dropless": ("dropless", {}),
    "capacity-inf": ("capacity", {"capacity_factor": 1e3}),
    "capacity-1.0": ("capacity", {"capacity_factor": 1.0}),
    "capacity-1.25-position": ("capacity", {"capacity_factor": 1.25, "drop_policy": "position"}),
}
NO_DROP = ("dropless", "capacity-inf")
TOKENS = [1, 8, 64]
COUNTERS = ("routed", "dropped", "routed_mass", "dropped_mass", "tokens", "lost_all")


@pytest.fixture(scope="module", params=MODELS, ids=[m for m, _ in MODELS])
def built(request):
    preset, layers = request.param
    b = build_model(preset, num_layers=layers, dtype="bf16", device="cuda")
    layer_idx, experts = b.adapter.moe_layers(b.model)[0]
    b.experts = experts
    b.router = b.adapter.router_of(b.adapter.layers(b.model)[layer_idx])
    yield b
    del b
    torch.cuda.empty_cache()


def routing(b, T: int, seed: int):
    """hidden [T, D] bf16 and the model's own router's (idx [T, K], w [T, K]) for it."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(T, b.model.config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
    with torch.no_grad():
        _, w, idx = b.router(hidden)
    return hidden, idx, w


def snap(state) -> dict:
    return {k: getattr(state, k).clone() for k in COUNTERS}


def close(a, b) -> float:
    """max |a - b| relative to max |b|: one number that bf16 rounding keeps well under 1e-2."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def capture(experts, static):
    """Warm up 3x on a side stream, then capture `experts(*static)` alone; -> (graph, static output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            experts(*static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        out = experts(*static)
    return g, out


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("label", list(DISPATCHERS))
def test_graph_replay_matches_eager(built, label, T):
    name, kw = DISPATCHERS[label]
    model, experts = built.model, built.experts
    state = attach(model, make_dispatcher(name, **kw), max_rows=64)
    dynamic = make_dispatcher("dynamic")
    try:
        static = [t.clone() for t in routing(built, T, seed=0)]  # hidden, idx, w at fixed addresses
        g, static_out = capture(experts, static)
        worst, worst_dyn, drops = 0.0, 0.0, 0
        for seed in (1, 2, 3):  # new routings copied into the captured inputs
            new = routing(built, T, seed)
            for dst, src in zip(static, new):
                dst.copy_(src)
            state.reset()
            g.replay()
            replayed, replay_counters = static_out.clone(), snap(state)
            state.reset()
            with torch.no_grad():
                eager = experts(*new)
            eager_counters = snap(state)
            worst = max(worst, close(replayed, eager))
            for k in COUNTERS:
                torch.testing.assert_close(replay_counters[k], eager_counters[k], atol=1e-3, rtol=1e-3,
                                           msg=lambda m, k=k: f"{label} T={T} counter {k}: {m}")
            assert int(replay_counters["tokens"].sum()) == T
            drops += int(replay_counters["dropped"].sum())
            if label in NO_DROP:
                with torch.no_grad():
                    ref = dynamic.forward(experts, *new, None, None)
                worst_dyn = max(worst_dyn, close(replayed, ref))
        state.reset()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        K = static[1].shape[1]
        advanced = (int(state.tokens.sum()), int(state.routed.sum()))
        print(f"\n[dispatch-gpu] {built.name} {label} T={T}: graph vs eager rel max|d| {worst:.2e}"
              + (f", vs dynamic {worst_dyn:.2e}" if label in NO_DROP else "")
              + f", dropped {drops} of {3 * T * K}, counters after 3 replays tokens={advanced[0]} "
              f"routed={advanced[1]}", flush=True)
        assert worst <= 1e-2  # same kernels on the same inputs; a stale or aliased buffer would be O(1)
        assert advanced == (3 * T, 3 * T * K)
        if label in NO_DROP:
            assert drops == 0 and worst_dyn <= 2e-2
        del g
    finally:
        detach(model)


@pytest.mark.parametrize("label", ["dropless", "capacity-1.0"])
def test_graph_replay_follows_row_mask(built, label):
    """The row mask is read by the graph: shrinking the real rows between replays zeroes the new pad rows."""
    name, kw = DISPATCHERS[label]
    model, experts = built.model, built.experts
    T = 8
    state = attach(model, make_dispatcher(name, **kw), max_rows=T)
    try:
        state.mask_in_graphs = True  # as Capture sets it: one graph serves every real-row count of its bucket
        state.set_rows(T, T)  # captured with a mask tensor in the graph (all rows real)
        static = [t.clone() for t in routing(built, T, seed=4)]
        g, static_out = capture(experts, static)
        for n_valid in (T, 5, 1):
            state.set_rows(n_valid, T)
            state.reset()
            g.replay()
            replayed, replay_counters = static_out.clone(), snap(state)
            state.reset()
            with torch.no_grad():
                eager = experts(*static)
            assert torch.equal(replayed[n_valid:], torch.zeros_like(replayed[n_valid:]))
            assert close(replayed[:n_valid], eager[:n_valid]) <= 1e-2
            assert int(replay_counters["tokens"].sum()) == n_valid
            assert torch.equal(replay_counters["routed"], snap(state)["routed"])
        print(f"\n[dispatch-gpu] {built.name} {label}: replay follows set_rows (8, 5, 1 real rows of 8)", flush=True)
        del g
    finally:
        detach(model)


@pytest.mark.parametrize("label", list(DISPATCHERS))
def test_no_host_sync(built, label):
    name, kw = DISPATCHERS[label]
    model, experts = built.model, built.experts
    attach(model, make_dispatcher(name, **kw), max_rows=64)
    try:
        inputs = {T: routing(built, T, seed=T) for T in TOKENS}
        with torch.no_grad():
            for T in TOKENS:  # warm-up: lazy library init (cuBLAS handles, workspaces) is not under test
                experts(*inputs[T])
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for T in TOKENS:
                    experts(*inputs[T])
            finally:
                torch.cuda.set_sync_debug_mode(0)
        print(f"\n[dispatch-gpu] {built.name} {label}: no host sync at T={TOKENS}", flush=True)
    finally:
        detach(model)


def test_sync_check_rejects_dynamic(built):
    """The check above has teeth: HF's loop (`nonzero` + Python loop over hit experts) syncs and is caught."""
    model, experts = built.model, built.experts
    attach(model, make_dispatcher("dynamic"), max_rows=64)
    try:
        inputs = routing(built, 8, seed=0)
        with torch.no_grad():
            experts(*inputs)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    experts(*inputs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        print(f"\n[dispatch-gpu] {built.name} dynamic: host sync detected, as expected", flush=True)
    finally:
        detach(model)
