"""moecg.dispatch on CPU (fp32): every fast path against a reference.

Dims: B batch rows, S tokens per row, T = B*S tokens, K top-k, E experts, C capacity, D hidden, L MoE layers.
References: `dynamic` (HF's own experts loop) for outputs, Megatron-core's `apply_router_token_dropping` for the
`probs` drop map, a plain-Python earliest-first loop for `position`, and closed forms for the counters.
"""
import math
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

import moecg.dispatch.base as dispatch_base
from moecg.dispatch import Capacity, DispatchState, attach, capacity_slots, detach, make_dispatcher, state_of
from moecg.models import adapter_for, build_model, make_config

PRESETS = ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny"]
GRAPH_SAFE = [("dropless", {}), ("capacity", {"capacity_factor": 1e3})]


# -- helpers -----------------------------------------------------------------------------------------------
def make_experts(E: int, D: int = 16, I: int = 16, seed: int = 0) -> MixtralExperts:  # noqa: E741
    """A standalone HF experts module (Mixtral layout) with E experts and small random weights."""
    cfg = make_config("mixtral_tiny", overrides={"num_local_experts": E, "hidden_size": D, "intermediate_size": I})
    experts = MixtralExperts(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (experts.gate_up_proj, experts.down_proj):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)  # torch.empty would leave garbage (even NaN)
    return experts.eval()


def random_routing(T: int, E: int, K: int, seed: int, normalize: bool = False):
    """idx [T, K], w [T, K] from a random softmax router: distinct probabilities, so no ties in any ranking."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.randn(T, E, generator=g).mul(2).softmax(-1)  # [T, E]
    w, idx = probs.topk(K, dim=-1)  # [T, K]
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return idx, w


def dense_routing(idx, w, E: int):
    """(routing_probs [T, E] fp32, routing_map [T, E] bool) in Megatron's layout."""
    probs = torch.zeros(idx.shape[0], E).scatter(1, idx, w.float())  # [T, E]
    routed = torch.zeros(idx.shape[0], E, dtype=torch.bool).scatter(1, idx, True)  # [T, E]
    return probs, routed


def earliest_first(idx, E: int, cap: int) -> torch.Tensor:
    """`position` reference: each expert keeps the first `cap` tokens (lowest index) routed to it. -> [T, E] bool."""
    kept = torch.zeros(idx.shape[0], E, dtype=torch.bool)
    fill = [0] * E
    for t, experts in enumerate(idx.tolist()):
        for e in experts:
            if fill[e] < cap:
                kept[t, e] = True
                fill[e] += 1
    return kept


def run(dispatcher, experts, hidden, idx, w, valid=None):
    """One dispatcher call with fresh counters -> (out [T, D], state)."""
    state = DispatchState(dispatcher, [0], experts.num_experts, max_rows=64, device="cpu")
    with torch.no_grad():
        out = dispatcher.forward(experts, hidden, idx, w, valid, state.layer(0))
    return out, state


def moe_layers(model):
    return adapter_for(model).moe_layers(model)


def counters(state: DispatchState) -> dict:
    return {k: getattr(state, k).clone() for k in ("routed", "dropped", "routed_mass", "dropped_mass", "tokens",
                                                   "lost_all")}


def assert_counters_equal(a: dict, b: dict):
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6, msg=lambda m, k=k: f"counter {k}: {m}")


@pytest.fixture(scope="module")
def megatron_moe_utils():
    # ~5 s import (it pulls in megatron.core.optimizer); once per module, and only when these tests run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.transformer.moe.moe_utils")


# -- 1. whole-model equivalence ----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=PRESETS)
def family(request):
    model = build_model(request.param, dtype="fp32", device="cpu").model
    ids = torch.randint(0, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))  # [B, S]
    with torch.no_grad():
        hf_logits = model(ids).logits  # [B, S, V] with HF's default experts implementation
    return model, ids, hf_logits


def _logits_with(model, ids, name, **kw):
    state = attach(model, make_dispatcher(name, **kw))
    try:
        with torch.no_grad():
            return model(ids).logits, state.snapshot()
    finally:
        detach(model)


def test_graph_safe_dispatchers_match_dynamic(family):
    model, ids, hf_logits = family
    ref, ref_snap = _logits_with(model, ids, "dynamic")
    assert ref.std() > 1e-2  # a model whose logits ignore the experts would make this test vacuous
    torch.testing.assert_close(ref, hf_logits, atol=1e-5, rtol=1e-5)
    L = len(moe_layers(model))
    T, K = ids.numel(), model.config.num_experts_per_tok
    assert ref_snap["routed_assignments"] == L * T * K and ref_snap["tokens"] == L * T
    for name, kw in GRAPH_SAFE:
        logits, snap = _logits_with(model, ids, name, **kw)
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        assert snap["routed"] == ref_snap["routed"], name  # same routing, same per-expert counts
        assert snap["dropped_assignments"] == 0 and snap["drop_rate"] == 0.0, name


def test_detach_restores_hf_default(family):
    model, ids, hf_logits = family
    impl = model.config._experts_implementation
    for name, kw in GRAPH_SAFE + [("dynamic", {})]:
        attach(model, make_dispatcher(name, **kw))
        assert model.config._experts_implementation == f"moecg_{name}"
        detach(model)
        assert model.config._experts_implementation == impl and state_of(model) is None
        assert not any(hasattr(e, "_moecg_state") for _, e in moe_layers(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, hf_logits)


# -- 2. drop map and counters vs Megatron / earliest-first --------------------------------------------------
COMBOS = [  # T, E, K, capacity_factor
    (1, 8, 2, 1.0), (7, 8, 2, 1.0), (16, 8, 2, 0.5), (33, 16, 4, 1.25), (64, 60, 4, 1.0), (5, 4, 1, 2.0),
    (128, 128, 8, 1.0), (10, 8, 2, 0.1), (40, 8, 2, 4.0), (40, 8, 2, 5.0), (24, 4, 1, 1.0),
]


@pytest.mark.parametrize("drop_policy", ["probs", "position"])
@pytest.mark.parametrize("T,E,K,cf", COMBOS, ids=[f"T{t}-E{e}-K{k}-cf{c}" for t, e, k, c in COMBOS])
def test_drop_map_and_counters_match_reference(megatron_moe_utils, T, E, K, cf, drop_policy):
    mu = megatron_moe_utils
    disp = Capacity(capacity_factor=cf, drop_policy=drop_policy)
    C = disp.capacity_for(T, K, E)
    c_meg = mu.get_capacity(num_tokens=T * K, num_experts=E, capacity_factor=cf)
    # moecg clamps C to T; Megatron keeps C and skips dropping when C > T: the same drop map either way
    assert C == min(c_meg, T)
    experts = make_experts(E)
    hidden = torch.randn(T, 16, generator=torch.Generator().manual_seed(T))  # [T, D]
    drops = 0
    for seed in range(3):
        idx, w = random_routing(T, E, K, seed)
        probs, routed = dense_routing(idx, w, E)  # [T, E]
        if drop_policy == "probs":
            _, ref = mu.apply_router_token_dropping(probs, routed, K, cf, drop_policy="probs")  # [T, E]
        else:
            ref = earliest_first(idx, E, C)  # [T, E]
        _, _, routed_m, kept, _ = capacity_slots(idx, w, None, E, C, drop_policy)
        assert torch.equal(routed_m, routed)
        assert torch.equal(kept, ref), f"seed {seed}: {(kept != ref).sum()} assignments differ"

        _, state = run(disp, experts, hidden, idx, w)
        dropped = routed & ~ref  # [T, E]
        drops += int(dropped.sum())
        expect = {
            "routed": routed.sum(0)[None], "dropped": dropped.sum(0)[None],
            "routed_mass": (probs * routed).sum(0)[None], "dropped_mass": (probs * dropped).sum(0)[None],
            "tokens": torch.tensor([T]), "lost_all": (routed.any(1) & ~ref.any(1)).sum()[None],
        }
        assert_counters_equal(counters(state), expect)
    if T * K * cf <= E * (T // 2) and T >= 16:  # C well under T: random routings must overflow somewhere
        assert drops > 0


# -- 3. pad rows ---------------------------------------------------------------------------------------------
DISPATCHERS = [("dynamic", {}), ("dropless", {}), ("capacity", {"drop_policy": "probs"}),
               ("capacity", {"drop_policy": "position"})]
D_IDS = ["dynamic", "dropless", "capacity-probs", "capacity-position"]


def _matched_pair(name, kw, T_pad, T_real, K, E, cf_pad=1.0):
    """(padded, unpadded) dispatchers with the same options: padding must not change what is kept.

    The padded buffers hold C(T_pad) slots, the threshold is C(T_real) computed on the device from the mask, so the
    same capacity factor keeps the same assignments padded or not.
    """
    if name != "capacity":
        return make_dispatcher(name, **kw), make_dispatcher(name, **kw)
    return make_dispatcher(name, capacity_factor=cf_pad, **kw), make_dispatcher(name, capacity_factor=cf_pad, **kw)


@pytest.mark.parametrize("name,kw", DISPATCHERS, ids=D_IDS)
def test_pad_rows_take_no_capacity_and_are_not_counted(name, kw):
    E, K, n_valid, n_rows = 4, 1, 3, 8  # decode: one token per row
    experts = make_experts(E)
    hidden_real = torch.randn(n_valid, 16, generator=torch.Generator().manual_seed(1))  # [3, D]
    idx_real = torch.zeros(n_valid, K, dtype=torch.long)  # every real row -> expert 0
    w_real = torch.tensor([[0.5], [0.6], [0.7]])
    # pad rows repeat the real rows and route to the same expert with a higher weight: if they took slots they
    # would win every one of them under `probs`
    hidden = torch.cat([hidden_real, hidden_real[torch.arange(n_rows - n_valid) % n_valid]])  # [8, D]
    idx = torch.zeros(n_rows, K, dtype=torch.long)
    w = torch.cat([w_real, torch.full((n_rows - n_valid, K), 0.99)])
    if name == "capacity":
        # the same capacity factor padded or not: the buffers hold C(8 rows) = 3 slots, but the threshold is the
        # real batch's C(3 rows) = ceil(3/4 * 4) = 3, so padded and unpadded keep the same assignments
        pad, real = make_dispatcher(name, capacity_factor=4.0, **kw), make_dispatcher(name, capacity_factor=4.0, **kw)
        assert pad.capacity_for(n_rows, K, E) == 8 and real.capacity_for(n_valid, K, E) == 3
    else:
        pad, real = make_dispatcher(name, **kw), make_dispatcher(name, **kw)

    state = DispatchState(pad, [0], E, max_rows=16, device="cpu")
    state.set_rows(n_valid, n_rows)
    valid = state.token_valid(n_rows)  # [8]
    assert valid.tolist() == [True] * n_valid + [False] * (n_rows - n_valid)
    with torch.no_grad():
        out = pad.forward(experts, hidden, idx, w, valid, state.layer(0))  # [8, D]
    ref, ref_state = run(real, experts, hidden_real, idx_real, w_real)
    assert torch.equal(out[n_valid:], torch.zeros_like(out[n_valid:]))
    torch.testing.assert_close(out[:n_valid], ref, atol=1e-6, rtol=1e-6)
    assert ref.abs().min(1).values.gt(0).all()  # every real row kept its expert
    assert_counters_equal(counters(state), counters(ref_state))
    assert int(state.dropped.sum()) == 0 and int(state.tokens.sum()) == n_valid

    if name == "capacity":  # the same batch without the mask: pad rows steal slots, so the check above has teeth
        tight = make_dispatcher(name, capacity_factor=1.5, **kw)  # C(8 rows) = 3: room for exactly the real rows
        out_nomask, nomask = run(tight, experts, hidden, idx, w)
        assert int(nomask.dropped.sum()) > 0
        if kw["drop_policy"] == "probs":
            assert torch.equal(out_nomask[:n_valid], torch.zeros_like(ref))


@pytest.mark.parametrize("name,kw", DISPATCHERS, ids=D_IDS)
def test_capacity_threshold_is_the_real_batch_not_the_bucket(name, kw):
    """A past defect: C was computed from the padded row count, so a bucket dropped less than the batch."""
    if name != "capacity":
        pytest.skip("capacity only")
    E, K = 8, 2
    experts = make_experts(E)
    for n_valid, n_rows in [(5, 8), (3, 4), (9, 16), (1, 2)]:
        hidden = torch.randn(n_rows, 16, generator=torch.Generator().manual_seed(n_valid))
        idx, w = random_routing(n_rows, E, K, seed=n_valid, normalize=True)
        disp = make_dispatcher(name, capacity_factor=1.25, **kw)
        state = DispatchState(disp, [0], E, max_rows=16, device="cpu")
        state.set_rows(n_valid, n_rows)
        with torch.no_grad():
            out = disp.forward(experts, hidden, idx, w, state.token_valid(n_rows), state.layer(0))
        ref, ref_state = run(disp, experts, hidden[:n_valid], idx[:n_valid], w[:n_valid])
        torch.testing.assert_close(out[:n_valid], ref, atol=1e-6, rtol=1e-6)
        assert_counters_equal(counters(state), counters(ref_state))
        assert state.snapshot()["capacity_used"] == disp.capacity_for(n_valid, K, E)


def test_device_capacity_equals_host_formula():
    from moecg.moe_math import capacity, capacity_on_device

    for T in range(1, 300):
        for K, E in [(1, 4), (2, 8), (4, 60), (8, 128), (4, 16)]:
            for cf in (0.1, 0.5, 1.0, 1.1, 1.25, 1.5, 2.0, 3.3):
                for mc in (1, 4):
                    want = capacity(T, K, E, cf, mc)
                    got = int(capacity_on_device(torch.tensor(T), K, E, cf, mc))
                    assert got == want, (T, K, E, cf, mc)


@pytest.mark.parametrize("name,kw", DISPATCHERS, ids=D_IDS)
def test_pad_rows_random_prefill(name, kw):
    E, K, S, n_valid, n_rows = 8, 2, 5, 2, 4
    T_real, T_pad = n_valid * S, n_rows * S
    experts = make_experts(E)
    hidden_real = torch.randn(T_real, 16, generator=torch.Generator().manual_seed(2))  # [T_real, D]
    idx_real, w_real = random_routing(T_real, E, K, seed=3, normalize=True)  # [T_real, K]
    # pad rows copy real rows, so they route to exactly the experts the real rows use
    src = torch.arange(T_pad) % T_real
    hidden, idx, w = hidden_real[src], idx_real[src], w_real[src]  # [T_pad, ...]
    pad, real = _matched_pair(name, kw, T_pad, T_real, K, E)
    state = DispatchState(pad, [0], E, max_rows=16, device="cpu")
    state.set_rows(n_valid, n_rows)
    with torch.no_grad():
        out = pad.forward(experts, hidden, idx, w, state.token_valid(T_pad), state.layer(0))
    ref, ref_state = run(real, experts, hidden_real, idx_real, w_real)
    assert torch.equal(out[T_real:], torch.zeros_like(out[T_real:]))
    torch.testing.assert_close(out[:T_real], ref, atol=1e-6, rtol=1e-6)
    assert_counters_equal(counters(state), counters(ref_state))


def test_pad_rows_through_the_model():
    """attach + set_rows on a whole model: real-row logits and counters equal the unpadded batch's."""
    model = build_model("mixtral_tiny", dtype="fp32", device="cpu").model
    E, K = model.config.num_local_experts, model.config.num_experts_per_tok
    real_ids = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(4))  # [2, S]
    padded_ids = torch.cat([real_ids, real_ids])  # [4, S]: pad rows duplicate the real ones
    pad, real = _matched_pair("capacity", {}, padded_ids.numel(), real_ids.numel(), K, E, cf_pad=0.5)
    state = attach(model, real, max_rows=4)
    with torch.no_grad():
        ref = model(real_ids).logits
    ref_counters = counters(state)
    detach(model)
    assert int(ref_counters["dropped"].sum()) > 0  # C is tight enough to drop: pads would change who drops
    state = attach(model, pad, max_rows=4)
    try:
        state.set_rows(2, 4)
        with torch.no_grad():
            out = model(padded_ids).logits
        torch.testing.assert_close(out[:2], ref, atol=1e-5, rtol=1e-5)
        assert_counters_equal(counters(state), ref_counters)
        state.reset()
        state.n_rows = None  # control: the same padded batch unmasked counts the pads and drops differently
        with torch.no_grad():
            model(padded_ids)
        assert int(state.tokens.sum()) == 2 * int(ref_counters["tokens"].sum())
        assert int(state.dropped.sum()) > int(ref_counters["dropped"].sum())
    finally:
        detach(model)


# -- 4. counters: closed forms, accumulation, reset --------------------------------------------------------
@pytest.mark.parametrize("drop_policy", ["probs", "position"])
def test_counters_closed_form_one_hot_expert(drop_policy):
    T, E, K, L, cf = 16, 8, 1, 3, 1.0
    disp = Capacity(capacity_factor=cf, drop_policy=drop_policy)
    C = disp.capacity_for(T, K, E)
    assert C == 2
    experts = make_experts(E)
    hidden = torch.randn(T, 16, generator=torch.Generator().manual_seed(5))
    idx = torch.zeros(T, K, dtype=torch.long)  # every token -> expert 0
    w = torch.randperm(T, generator=torch.Generator().manual_seed(6)).add(1).float().div(T + 1)[:, None]  # [T, 1]
    kept = w[:, 0].topk(C).indices if drop_policy == "probs" else torch.arange(C)
    kept_mass = float(w[kept].sum())
    state = DispatchState(disp, list(range(L)), E, max_rows=T, device="cpu")
    with torch.no_grad():
        for rep in (1, 2):  # counters accumulate over forwards; rates do not change
            for slot in range(L):
                out = disp.forward(experts, hidden, idx, w, None, state.layer(slot))
            snap = state.snapshot()
            assert snap["routed_assignments"] == rep * L * T
            assert snap["dropped_assignments"] == rep * L * (T - C)
            assert snap["tokens"] == rep * L * T and snap["tokens_lost_all"] == rep * L * (T - C)
            assert snap["dropped"] == [[rep * (T - C)] + [0] * (E - 1)] * L
            assert snap["drop_rate"] == pytest.approx((T - C) / T)
            assert snap["tokens_lost_all_rate"] == pytest.approx((T - C) / T)
            assert snap["per_layer_drop_rate"] == pytest.approx([(T - C) / T] * L)
            assert snap["dropped_prob_mass"] == pytest.approx(1 - kept_mass / float(w.sum()), rel=1e-6)
            assert snap["expert_load_imbalance"] == pytest.approx(E)  # max/mean load with one hot expert
            assert snap["experts_hit_per_layer"] == [1] * L
    # the kept tokens are the ones the policy names, and only they have output
    assert out.abs().sum(1).gt(0).nonzero().flatten().sort().values.tolist() == sorted(kept.tolist())
    state.reset()
    assert all(int(t.abs().sum()) == 0 for t in counters(state).values())
    assert state.snapshot()["drop_rate"] == 0.0


@pytest.mark.parametrize("drop_policy", ["probs", "position"])
def test_counters_closed_form_two_hot_experts(drop_policy):
    T, E, K, L = 16, 8, 2, 2
    disp = Capacity(capacity_factor=0.5, drop_policy=drop_policy)
    C = disp.capacity_for(T, K, E)  # ceil(16*2/8*0.5) = 2
    assert C == 2
    experts = make_experts(E)
    hidden = torch.randn(T, 16, generator=torch.Generator().manual_seed(7))
    p = 0.5 + torch.randperm(T, generator=torch.Generator().manual_seed(8)).float().add(1) / (2 * T + 2)  # [T]
    idx = torch.tensor([[0, 1]]).expand(T, K).contiguous()  # every token -> experts 0 and 1
    w = torch.stack([p, 1 - p], 1)  # [T, 2]
    state = DispatchState(disp, list(range(L)), E, max_rows=T, device="cpu")
    with torch.no_grad():
        for slot in range(L):
            disp.forward(experts, hidden, idx, w, None, state.layer(slot))
    snap = state.snapshot()
    assert snap["dropped_assignments"] == L * 2 * (T - C)
    # probs: expert 0 keeps the C highest p, expert 1 the C lowest: disjoint, 2C tokens survive.
    # position: both keep the first C tokens, so only C survive.
    survivors = 2 * C if drop_policy == "probs" else C
    assert snap["tokens_lost_all"] == L * (T - survivors)
    assert snap["expert_load_imbalance"] == pytest.approx(E / 2)


# -- 5. no host sync: FakeTensorMode ------------------------------------------------------------------------
# Fake tensors carry shapes, never values: an output shape that depends on data (nonzero, bool masks,
# bincount, unique) raises DynamicOutputShapeException and .item()/.tolist()/bool() raise
# DataDependentOutputException. Those are exactly the host reads a CUDA graph cannot capture. What this cannot
# see is a sync hidden inside a real kernel (e.g. ATen's grouped_mm fallback copying offsets to the host):
# tests/test_dispatch_gpu.py covers that with torch.cuda.set_sync_debug_mode("error").
SYNC_ERRORS = (DynamicOutputShapeException, DataDependentOutputException)


def _fake_forward(name, kw, dtype):
    cfg = make_config("mixtral_tiny")
    disp = make_dispatcher(name, **kw)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with FakeTensorMode():
            experts = MixtralExperts(cfg)  # parameters created in the mode are fake (no storage, no values)
    finally:
        torch.set_default_dtype(prev)
    with experts.gate_up_proj.fake_mode, torch.no_grad():
        T, E, K = 12, cfg.num_local_experts, cfg.num_experts_per_tok
        state = DispatchState(disp, [0], E, max_rows=8, device="cpu")
        state.set_rows(2, 4)  # 4 rows of 3 tokens, the last 2 rows padding
        hidden = torch.randn(T, cfg.hidden_size, dtype=dtype)
        idx = torch.randint(0, E, (T, K))
        w = torch.rand(T, K, dtype=dtype)
        out = disp.forward(experts, hidden, idx, w, state.token_valid(T), state.layer(0))
    return out, state, (T, cfg.hidden_size), dtype


def _assert_traced_without_host_reads(out, state, shape, dtype):
    """The whole forward ran under FakeTensorMode (no value was ever read on the host: a read raises there), it
    produced the real output's shape and dtype, and it updated the device counters rather than skipping them."""
    from torch._subclasses.fake_tensor import FakeTensor

    assert isinstance(out, FakeTensor), "the output was computed outside fake mode: the check saw no values"
    assert tuple(out.shape) == shape and out.dtype == dtype
    # the counters were real zeros before; an in-place add of a fake tensor turns nothing fake, so check the
    # counter update ran by its effect on the version counter of each counter tensor
    assert state.routed._version > 0 and state.tokens._version > 0, "the dispatcher never updated its counters"


# bf16: the meta kernel of aten._grouped_mm (what fake mode runs) accepts only bf16, as the CUDA fast path does
@pytest.mark.parametrize("name,kw", [("dropless", {}), ("capacity", {"capacity_factor": 1.0}),
                                     ("capacity", {"drop_policy": "position", "renormalize": True})],
                         ids=["dropless", "capacity-probs", "capacity-position-renorm"])
def test_graph_safe_dispatchers_run_on_fake_tensors(name, kw):
    _assert_traced_without_host_reads(*_fake_forward(name, kw, torch.bfloat16))


def test_grouped_mm_fallback_runs_on_fake_tensors(monkeypatch):
    monkeypatch.setattr(dispatch_base, "_grouped_ok", lambda x, w: False)  # the searchsorted + bmm path
    calls = []
    real_fallback = dispatch_base.torch.searchsorted
    monkeypatch.setattr(dispatch_base.torch, "searchsorted", lambda *a, **k: calls.append(1) or real_fallback(*a, **k))
    _assert_traced_without_host_reads(*_fake_forward("dropless", {}, torch.float32))
    assert calls, "the grouped_mm fallback (searchsorted + bmm) did not run"


def test_fake_tensor_check_rejects_dynamic():
    with pytest.raises(SYNC_ERRORS):
        _fake_forward("dynamic", {}, torch.bfloat16)


def test_grouped_mm_fallback_matches_grouped_mm(monkeypatch):
    experts = make_experts(8)
    hidden = torch.randn(9, 16, generator=torch.Generator().manual_seed(9))
    idx, w = random_routing(9, 8, 2, seed=10)
    fast, _ = run(make_dispatcher("dropless"), experts, hidden, idx, w)
    monkeypatch.setattr(dispatch_base, "_grouped_ok", lambda x, w: False)
    slow, _ = run(make_dispatcher("dropless"), experts, hidden, idx, w)
    torch.testing.assert_close(slow, fast, atol=1e-6, rtol=1e-6)


# -- 6. renormalize -----------------------------------------------------------------------------------------
def test_renormalize_restores_each_survivors_weight_sum():
    T, E, K = 32, 8, 2
    experts = make_experts(E)
    with torch.no_grad():  # identical experts: out[t] = (sum of t's surviving weights) * f(x[t])
        experts.gate_up_proj.copy_(experts.gate_up_proj[:1].expand_as(experts.gate_up_proj))
        experts.down_proj.copy_(experts.down_proj[:1].expand_as(experts.down_proj))
    hidden = torch.randn(T, 16, generator=torch.Generator().manual_seed(11))
    idx, w = random_routing(T, E, K, seed=12)  # un-normalised (as Qwen2-MoE): per-token sums differ from 1
    full, _ = run(make_dispatcher("capacity", capacity_factor=1e3), experts, hidden, idx, w)  # [T, D] no drops
    disp = make_dispatcher("capacity", capacity_factor=0.5, renormalize=True)
    _, _, _, kept, _ = capacity_slots(idx, w, None, E, disp.capacity_for(T, K, E), "probs")
    n_kept = kept.sum(1)  # [T]
    assert (n_kept == 1).any() and (n_kept == 0).any()  # partial and total losses both occur
    out, _ = run(disp, experts, hidden, idx, w)
    survived = n_kept > 0
    torch.testing.assert_close(out[survived], full[survived], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[~survived], torch.zeros_like(out[~survived]))
    # without renormalize a partly dropped token keeps only its surviving share
    plain, _ = run(make_dispatcher("capacity", capacity_factor=0.5), experts, hidden, idx, w)
    probs, _ = dense_routing(idx, w, E)
    share = (probs * kept).sum(1) / w.sum(1)  # [T]
    torch.testing.assert_close(plain, full * share[:, None], atol=1e-5, rtol=1e-5)


# -- 7. errors ----------------------------------------------------------------------------------------------
def test_make_dispatcher_errors_name_the_fix():
    choices = r"\['capacity', 'dropless', 'dynamic', 'fused'\]"
    with pytest.raises(ValueError, match=r"unknown dispatch 'nope': choose one of " + choices):
        make_dispatcher("nope")
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match=r"capacity_factor=.*must be > 0"):
            make_dispatcher("capacity", capacity_factor=bad)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"capacity_factor=(nan|inf): dispatch=capacity needs a finite number"):
            make_dispatcher("capacity", capacity_factor=bad)
    with pytest.raises(ValueError, match=r"drop_policy='random': choose one of \('probs', 'position'\)"):
        make_dispatcher("capacity", drop_policy="random")
    with pytest.raises(ValueError, match=r"dispatch.kernels='cuda': choose auto, triton or torch"):
        make_dispatcher("fused", kernels="cuda")
    with pytest.raises(ValueError, match=r"min_capacity=0: must be >= 1"):
        make_dispatcher("capacity", min_capacity=0)
    assert make_dispatcher("capacity", capacity_factor=2.0).describe()["capacity_factor"] == 2.0
    assert math.isclose(make_dispatcher("capacity").capacity_factor, 1.25)
