"""Run by tests/test_capacity_kernel.py under TRITON_INTERPRET=1: the Triton capacity kernels on CPU tensors (fp32).

  TRITON_INTERPRET=1 python tests/capacity_interp_check.py ops|dispatch|families

Dims: T tokens, K top-k, E experts, C capacity, D hidden, I expert intermediate, B rows.
ops:      capacity.capacity_experts against ref.capacity_experts: the same kept assignments, the same counters,
          outputs to fp32 rounding; ties, pad rows, several token chunks and slot blocks, both layouts, the capacity
          formula for every real-token count.
dispatch: `capacity` with kernels=triton against kernels=torch (the padded PyTorch path) on each family's experts;
          a huge factor against `fused` (dropless).
families: the fused decode step of each family, 3 rows run as 4 (a bucket's padding), kernels=triton against torch.
Prints ALL OK when every check passes; any mismatch raises. Kept out of pytest collection (no test_ prefix)
because TRITON_INTERPRET must be set before triton is imported.
"""
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moecg.dispatch.capacity import capacity  # noqa: E402
from moecg.dispatch.state import LayerCounters  # noqa: E402
from moecg.kernels import capacity as cap  # noqa: E402
from moecg.kernels import ref  # noqa: E402
from moecg.kernels.tiles import MoeTiles  # noqa: E402
from moecg.models.adapter import ExpertSpec  # noqa: E402

COUNTS = ("routed", "dropped", "tokens", "lost_all", "capacity", "calls")
MASSES = ("routed_mass", "dropped_mass")


def same(c1, c2, y1, y2, tol=1e-5):
    """Two calls agree: the same counters, the same zero (dropped or pad) assignments, outputs within tol."""
    for f in COUNTS:
        assert torch.equal(getattr(c1, f), getattr(c2, f)), (f, getattr(c1, f), getattr(c2, f))
    for f in MASSES:
        torch.testing.assert_close(getattr(c1, f), getattr(c2, f), atol=1e-6, rtol=1e-6)
    z1, z2 = y1.abs().amax(-1) == 0, y2.abs().amax(-1) == 0  # [T, K] assignments with no output
    assert torch.equal(z1, z2), f"kept sets differ at {(z1 != z2).nonzero().tolist()}"
    err = float((y1 - y2).abs().max())
    assert err <= tol, err


def routing(T, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, K]
    return idx, torch.rand(T, K, generator=g)


def check_ops():
    D, I = 64, 32  # noqa: E741
    g = torch.Generator().manual_seed(0)
    plain = (torch.randn(8, 2 * I, D, generator=g) / 8, torch.randn(8, D, I, generator=g) / 6, {})
    oss = ExpertSpec("swiglu_clamp", interleaved=True, transposed=True, has_bias=True, alpha=1.702, limit=0.5)
    gpt = (torch.randn(8, D, 2 * I, generator=g) / 8, torch.randn(8, I, D, generator=g) / 6,
           dict(spec=oss, gate_up_bias=torch.randn(8, 2 * I, generator=g), down_bias=torch.randn(8, D, generator=g)))
    cases = [  # T, E, K, cf, policy, renormalize, real tokens (None: no mask), min_capacity, weights
        (4, 8, 2, 1.0, "probs", False, 3, 1, plain),  # batch 3 in bucket 4
        (4, 8, 2, 0.5, "position", False, 3, 1, plain),
        (20, 8, 2, 0.7, "probs", True, 17, 1, plain),  # renormalised survivors
        (40, 2, 1, 1.0, "position", False, 33, 1, plain),  # C = 20 > BLOCK_M: two slot blocks
        (70, 4, 1, 1.0, "probs", False, 65, 1, plain),  # T > BLOCK_T: chunked ranking
        (8, 8, 2, 0.25, "probs", False, None, 3, plain),  # min_capacity above the formula
        (8, 8, 2, 1e3, "position", False, 6, 1, plain),  # a factor that drops nothing
        (6, 8, 2, 0.5, "probs", True, 5, 1, gpt),  # GPT-OSS layout: transposed, interleaved, biases, clamp
        (6, 8, 2, 1.0, "position", False, None, 1, gpt),
    ]
    drops = 0
    for T, E, K, cf, pol, ren, nv, mc, (gu, dn, extra) in cases:
        gu, dn = gu[:E], dn[:E]
        extra = {k: (v[:E] if torch.is_tensor(v) else v) for k, v in extra.items()}
        x = torch.randn(T, D, generator=g)
        idx, w = routing(T, E, K, seed=T + E)
        w[1], idx[1] = w[0], idx[0]  # an exact tie: the earlier token must win it
        valid = None if nv is None else torch.arange(T) < nv
        kw = dict(capacity_factor=cf, drop_policy=pol, renormalize=ren, min_capacity=mc, **extra)
        c1, c2 = LayerCounters.zeros(E, capacity=True), LayerCounters.zeros(E, capacity=True)
        want = ref.capacity_experts(x, idx, w, gu, dn, valid, c1, **kw)
        got = cap.capacity_experts(x, idx, w, gu, dn, valid, c2, **kw)
        same(c1, c2, want, got)
        drops += int(c1.dropped.sum())
        if cf >= 1e3:
            assert int(c1.dropped.sum()) == 0
            dropless = ref.moe_experts(x, idx, w, gu, dn, valid, **{k: v for k, v in extra.items()})
            torch.testing.assert_close(got, dropless, atol=1e-5, rtol=1e-5)
        if nv is not None:
            assert torch.equal(got[nv:], torch.zeros_like(got[nv:]))  # pad rows: zeros, never counted
            assert int(c2.tokens) == nv
        # no counters: the same output
        torch.testing.assert_close(cap.capacity_experts(x, idx, w, gu, dn, valid, None, **kw), got, atol=0, rtol=0)
    assert drops > 20, drops  # the comparisons covered real drops

    # ties and pad rows: every token -> expert 0 with one weight; pad rows carry a higher one
    T, E, K = 8, 4, 1
    idx = torch.zeros(T, K, dtype=torch.long)
    w = torch.full((T, K), 0.5)
    w[5:] = 0.9  # pad rows
    valid = torch.arange(T) < 5
    x = torch.randn(T, D, generator=g)
    for pol in ("probs", "position"):
        c = LayerCounters.zeros(E, capacity=True)
        y = cap.capacity_experts(x, idx, w, plain[0][:E], plain[1][:E], valid, c, capacity_factor=1.6,
                                 drop_policy=pol)
        C = capacity(5, K, E, 1.6)  # of the 5 real tokens: 2
        kept = (y.abs().amax(-1) > 0)[:, 0]
        assert kept.tolist() == [True] * C + [False] * (T - C), (pol, kept.tolist())  # the earliest, no pad row
        assert int(c.dropped[0]) == 5 - C and int(c.lost_all) == 5 - C and int(c.capacity) == C

    # explicit tiles (the table's values passed as arguments): the same output
    x = torch.randn(20, D, generator=g)
    idx, w = routing(20, 8, 2, seed=1)
    a = cap.capacity_experts(x, idx, w, plain[0], plain[1], None, None, capacity_factor=0.8)
    b = cap.capacity_experts(x, idx, w, plain[0], plain[1], None, None, capacity_factor=0.8,
                             tiles=MoeTiles(up_n=32, up_k=32, down_n=16, down_k=16, stages=2))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    # the in-kernel capacity equals the host formula for every real-token count 0..T (one program per count)
    T = 100

    @triton.jit
    def probe(valid_ptr, out_ptr, T, E, cf_bits, min_cap, K: tl.constexpr, BLOCK_T: tl.constexpr):
        i = tl.program_id(0)
        n, c = cap._capacity(valid_ptr + i * T, T, E, cf_bits, min_cap, K, True, BLOCK_T)
        tl.store(out_ptr + 2 * i, n)
        tl.store(out_ptr + 2 * i + 1, c)

    valid = torch.arange(T)[None, :] < torch.arange(T + 1)[:, None]  # [T+1, T]: row n has n real tokens
    for K, E, cf, mc in ((1, 4, 1.0, 1), (2, 8, 1.1, 1), (4, 60, 1.25, 1), (8, 128, 3.3, 1), (4, 16, 0.1, 4),
                         (2, 8, 0.5, 1)):
        out = torch.zeros(T + 1, 2, dtype=torch.int32)
        probe[(T + 1,)](valid, out, T, E, cap.capacity_factor_bits(cf), mc, K=K, BLOCK_T=64)
        want = [capacity(n, K, E, cf, mc) if n else 1 for n in range(T + 1)]  # capacity_on_device(0) = 1
        assert out[:, 0].tolist() == list(range(T + 1))
        assert out[:, 1].tolist() == want, (K, E, cf, mc)


def _family(preset, seed=0):
    from moecg.models import build_model

    b = build_model(preset, dtype="fp32", device="cpu", seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random biases (HF zeros them, which would hide a dropped term)
        for name, p in b.model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return b


FAMILIES = ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny", "glm4_moe_tiny", "olmoe_tiny", "gpt_oss_tiny"]


def check_dispatch():
    """Each family's first MoE layer: its router's routing of 8 tokens, 6 real."""
    from moecg.dispatch import DispatchState, make_dispatcher

    for i, preset in enumerate(FAMILIES):
        b = _family(preset)
        layer = next(lay for lay in b.adapter.layers(b.model) if b.adapter.moe_block(lay) is not None)
        experts = b.adapter.experts_of(layer)
        router = b.adapter.router_of(layer)
        x = torch.randn(8, b.model.config.hidden_size, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            out = router(x)
        w, idx = out[-2], out[-1]  # routers return (logits, weights, ids)
        E = experts.num_experts
        runs = {}
        for cf, pol, ren in ((0.5, "probs", False), (1.0, "position", i % 2 == 0), (1e3, "probs", False)):
            for kernels in ("triton", "torch"):
                disp = make_dispatcher("capacity", capacity_factor=cf, drop_policy=pol, renormalize=ren,
                                       kernels=kernels)
                st = DispatchState(disp, [0], E, max_rows=8, device="cpu")
                st.set_rows(6, 8)
                with torch.no_grad():
                    y = disp.unreduced(experts, x, idx, w, st.token_valid(8), st.layer(0))
                runs[kernels] = (y, st.layer(0))
            same(runs["torch"][1], runs["triton"][1], runs["torch"][0], runs["triton"][0])
            if cf == 0.5:
                assert int(runs["torch"][1].dropped.sum()) > 0, preset
        # a factor that drops nothing equals `fused` (dropless), both through Triton
        st = DispatchState(make_dispatcher("fused"), [0], E, max_rows=8, device="cpu")
        st.set_rows(6, 8)
        with torch.no_grad():
            y = make_dispatcher("fused", kernels="triton").unreduced(experts, x, idx, w, st.token_valid(8),
                                                                     st.layer(0))
        torch.testing.assert_close(runs["triton"][0], y, atol=1e-5, rtol=1e-5)
        assert torch.equal(runs["triton"][1].routed, st.layer(0).routed)
        print(preset, "dispatch ok", flush=True)


# (preset, capacity options) for the fused step: every family drops, in one policy or the other
STEP_CASES = [
    ("mixtral_tiny", dict(capacity_factor=0.5)),
    ("qwen2_moe_tiny", dict(capacity_factor=0.75, drop_policy="position")),
    ("qwen3_moe_tiny", dict(capacity_factor=1.0, renormalize=True)),
    ("glm4_moe_tiny", dict(capacity_factor=0.5, drop_policy="position")),
    ("olmoe_tiny", dict(capacity_factor=0.75)),
    ("gpt_oss_tiny", dict(capacity_factor=0.5)),
    ("mixtral_tiny", dict(capacity_factor=1e3)),  # drops nothing: equals dispatch=fused
]


def check_families(cases):
    """The step padded as a captured bucket pads it (rows_for: 3 rows run as 4, the mask on the device), run eagerly:
    an emulated capture would only add warmup runs of the same function (tests/test_capacity_kernel.py has one)."""
    from moecg.dispatch import attach, detach, make_dispatcher, state_of
    from moecg.engine import DecodeEngine, EagerPolicy
    from moecg.fast import FastDecode

    class Pad4(EagerPolicy):  # eager steps on the 4 rows a captured bucket would run
        def rows_for(self, n):
            return 4

    prompts = torch.randint(0, 512, (3, 5), generator=torch.Generator().manual_seed(0))
    for preset, kw in cases:
        model = _family(preset, seed=1).model
        runs = {}
        for name, opts in (("torch", dict(kernels="torch")), ("triton", dict(kernels="triton")), ("fused", None)):
            if opts is None and kw["capacity_factor"] < 1e3:
                continue
            disp = make_dispatcher("fused", kernels="triton") if opts is None else \
                make_dispatcher("capacity", **kw, **opts)
            attach(model, disp, max_rows=4)
            eng = DecodeEngine(model, 16, 4)
            eng.set_policy(Pad4(eng))
            eng.decode_forward = FastDecode(model, "torch")  # torch ops: only the experts run in the interpreter
            force = runs["torch"][0].tokens if runs else None
            r = eng.generate(prompts, 3, keep_logits=True, timing=False, count_prefill=False, force_tokens=force)
            assert set(r.step_rows) == {4}  # 3 rows padded to 4
            runs[name] = (r, state_of(model).snapshot())
            detach(model)
        (want, ws), (got, gs) = runs["torch"], runs["triton"]
        assert torch.equal(got.tokens, want.tokens), preset
        diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits))
        assert diff < 1e-4, (preset, diff)
        for k in ("routed", "dropped", "tokens", "tokens_lost_all", "capacity_used"):
            assert gs[k] == ws[k], (preset, k, gs[k], ws[k])
        assert abs(gs["dropped_prob_mass"] - ws["dropped_prob_mass"]) < 1e-6
        if kw["capacity_factor"] < 1e3:
            assert ws["dropped_assignments"] > 0, preset  # the decode steps dropped: the comparison has teeth
        else:
            fr, fs = runs["fused"]
            assert ws["dropped_assignments"] == 0 and fs["routed"] == gs["routed"]
            assert torch.equal(fr.tokens, got.tokens)
            assert max(float((a - b).abs().max()) for a, b in zip(fr.logits, got.logits)) < 1e-4
        print(preset, kw, "step ok", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    what = sys.argv[1:] or ["ops", "dispatch", "families"]
    for w in what:
        if w == "ops":
            check_ops()
        elif w == "dispatch":
            check_dispatch()
        elif w == "families":
            check_families(STEP_CASES)
        else:
            raise SystemExit(f"unknown section {w!r}: ops, dispatch or families")
    print("ALL OK")
