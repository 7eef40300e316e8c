"""moecg.parallel on CPU with gloo: expert-parallel decode against one process, counters, the torchrun job (rank 0
writes, a failing rank ends the job with its error), the plan's checks, and parallel.ep=1 as today.

Dims: B rows per rank, R ranks, E experts, El = E/R, K top-k, D hidden.
2 and 4 ranks are spawned from pytest (torch.multiprocessing, one spawn per size running every case: the imports
dominate), torchrun jobs are subprocesses with --standalone (a free port each); every wait has a timeout.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import ep_projection_worker as epw
import ep_worker
from moecg.dispatch import Capacity, DispatchState
from moecg.dispatch.dropless import Dropless
from moecg.parallel import EPCapacity, EPDropless, EPGroup, parallelize
from moecg.plan import PlanError, resolve_plan

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "moecg" / "conf")
QUICK = ["new_tokens=5", "prompt_len=5", "measure.repeats=1", "measure.skip_steps=0"]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
       "HYDRA_FULL_ERROR": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, which: str, out: Path, timeout: float = 240) -> dict[int, dict]:
    """Run ep_worker.run on `world` gloo ranks; returns each rank's results. Never waits past `timeout`."""
    return _spawn_on(world, which, out, "cpu", timeout)


def _spawn_on(world: int, which: str, out: Path, device: str, timeout: float = 240) -> dict[int, dict]:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(ep_worker.run, args=(world, _free_port(), str(out), which, device), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks still running after {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    return _spawn(2, "2", tmp_path_factory.mktemp("ep2"))


@pytest.fixture(scope="module")
def ep4(tmp_path_factory):
    return _spawn(4, "4", tmp_path_factory.mktemp("ep4"))


def _check(results: dict[int, dict], case, world: int):
    cid = ep_worker.case_id(case)
    for rank, res in results.items():
        assert "error" not in res, f"rank {rank}: {res['error']}"
        r = res[cid]
        assert r["tokens_equal"], f"rank {rank} {cid}: tokens differ from one process"
        assert r["max_logit_diff"] < 1e-4, f"rank {rank} {cid}: logits differ by {r['max_logit_diff']}"
        assert not r["counters_differ"], f"rank {rank} {cid}: counters {r['counters_differ']} differ"
        assert r["routed"] > 0
        E = {"mixtral_tiny": 8}.get(case[0], 16)
        assert r["experts_held"] == E // world  # the rank really held only its slice
        if "capacity" in case[1]:
            assert r["ref_dropped"] > 0, f"{cid}: the reference dropped nothing, so the comparison proves little"


# -- 2 and 4 gloo ranks spawned from pytest: decode and counters equal one process -------------------------------
@pytest.mark.parametrize("case", ep_worker.CASES_2, ids=ep_worker.case_id)
def test_ep2_decode_and_counters_equal_one_process(ep2, case):
    _check(ep2, case, 2)


@pytest.mark.slow
@pytest.mark.parametrize("case", ep_worker.CASES_4, ids=ep_worker.case_id)
def test_ep4_decode_and_counters_equal_one_process(ep4, case):
    _check(ep4, case, 4)


# -- one rank: the expert-parallel code equals today's dispatchers bit for bit ---------------------------------------
def _routing(T, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    w, idx = torch.randn(T, E, generator=g).softmax(-1).topk(K, dim=-1)
    return idx, w


@pytest.mark.parametrize("ep_cls,base,kw", [(EPDropless, Dropless, {}), (EPCapacity, Capacity, {"capacity_factor": 0.5}),
                                            (EPCapacity, Capacity, {"drop_policy": "position"})])
def test_one_rank_variants_equal_single_process_bitwise(ep_cls, base, kw):
    from test_dispatch import make_experts

    experts = make_experts(8)
    T, K = 6, 2
    hidden = torch.randn(T, 16, generator=torch.Generator().manual_seed(3))
    idx, w = _routing(T, 8, K, 1)
    valid = torch.tensor([True] * 5 + [False])  # one pad row
    outs = []
    for d in (base(**kw), ep_cls(**kw).bind(EPGroup())):
        state = DispatchState(d, [0], 8, max_rows=8, device="cpu")
        with torch.no_grad():
            outs.append((d.forward(experts, hidden, idx, w, valid, state.layer(0)), state.save()))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))
    assert parallelize(base(**kw), EPGroup()).__class__ is base  # ep=1 keeps today's dispatcher itself


def test_megatron_dispatchers_need_cuda_and_which_capture():
    """What the README and bench_ep.py say of megatron-core's dispatchers: constructing them needs CUDA here; moecg
    refuses to capture the dropless ones (strategy=partial keeps them eager, between attention graphs) and captures the
    drop-and-pad one (fixed shapes) with the capacity strategy."""
    from moecg.capture import StrategyError, validate
    from moecg.parallel.megatron import MEGATRON

    d = MEGATRON["megatron_alltoall"]().bind(EPGroup())
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError), match="CUDA"):
            d._dispatcher(8, 2, 16, torch.float32)
    for name in ("megatron_alltoall", "megatron_allgather"):
        for strategy in ("full", "layer"):
            with pytest.raises(StrategyError, match="not graph-safe"):
                validate(strategy, MEGATRON[name](), 2)
        validate("partial", MEGATRON[name](), 2)
    validate("capacity", MEGATRON["megatron_alltoall_capacity"](), 2)


class CountingExchange:
    """R ranks' worth of all-to-all calls in one process: records the bytes, returns the input (wrong math, right
    shapes), to check exchange_bytes (the floor's all-to-all bytes) against the buffers the dispatcher really sends."""

    def __init__(self, size):
        self.size, self.rank, self.sent = size, 0, 0

    def all_to_all(self, x):
        self.sent += x.numel() * x.element_size() * (self.size - 1) // self.size  # what leaves this rank
        return x


@pytest.mark.parametrize("cls,kw", [(EPDropless, {}), (EPCapacity, {"capacity_factor": 1.25})])
@pytest.mark.parametrize("R,E,K,T", [(2, 8, 2, 5), (4, 16, 4, 3), (8, 8, 2, 1)])
def test_exchange_bytes_are_the_buffers_sent(cls, kw, R, E, K, T):
    from test_dispatch import make_experts

    experts = make_experts(E)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):  # rank 0's slice
            setattr(experts, name, torch.nn.Parameter(getattr(experts, name)[: E // R].clone()))
    ex = CountingExchange(R)
    d = cls(**kw).bind(ex)
    idx, w = _routing(T, E, K, 2)
    with torch.no_grad():
        d.forward(experts, torch.randn(T, 16), idx, w, None, None)
    assert ex.sent == d.exchange_bytes(T, K, E, 16, 4) > 0


# -- experiments/ep_projection.py: its one-GPU rank is a real rank --------------------------------------------------
_proj = epw.load_script()


class Replay:
    """The recorded exchange of one real rank: each all-to-all gets that call's received buffer; the sends are
    compared with the recorded ones."""

    def __init__(self, calls, size, rank):
        self.calls, self.size, self.rank, self.i, self.diff, self.shapes_differ = calls, size, rank, 0, 0.0, []

    def all_to_all(self, x):
        send, recv = self.calls[self.i]
        if x.shape != send.shape:
            self.shapes_differ.append((self.i, list(x.shape), list(send.shape)))
        else:
            self.diff = max(self.diff, float((x.float() - send.float()).abs().max()) if x.numel() else 0.0)
        self.i += 1
        return recv.clone()


@pytest.mark.parametrize("rank", [0, 1])
def test_per_rank_bench_builds_and_computes_what_a_real_rank_does(ep2, rank):
    """experiments/ep_projection.py's rank against the real 2-rank run (tests/ep_projection_worker.py, in the ep2
    spawn): built by the script's `build_rank`, it (1) holds the same experts and slices, (2) replaying the real rank's
    receives, sends the same buffers call for call (the expert outputs sent back included) and decodes the same
    tokens and logits, (3) with the script's stand-in exchange, sends buffers of the real shapes."""
    assert "error" not in ep2[rank], ep2[rank].get("error")
    data = torch.load(ep2[rank]["projection"])
    built, group = _proj.build_rank(epw.PRESET, None, 2, rank, "fp32", "cpu", 0)
    model, adapter = built.model, built.adapter
    E = adapter.num_experts(model.config)
    spans, slices = epw.spans_and_slices(model, adapter)
    assert spans == data["spans"] == [(rank * E // 2, (rank + 1) * E // 2)] * len(spans)  # which experts
    for (gu, dn), (rgu, rdn) in zip(slices, data["slices"]):
        assert gu.shape[0] == E // 2 and torch.equal(gu, rgu) and torch.equal(dn, rdn)
    prompts = _proj.rank_prompts(model.config.vocab_size, 2, epw.B, rank, epw.ARGS.prompt_len)
    for name, strategy in _proj.CASES:
        ref = data[name]
        replay = Replay(ref["calls"], 2, rank)
        m = _proj.measure(model, adapter, _proj.case_dispatcher(name, epw.CF, replay), group, strategy, prompts,
                          epw.ARGS, "emulate", keep=True)
        assert replay.i == len(ref["calls"]) > 0, f"{name}: {replay.i} all-to-alls, the real rank {len(ref['calls'])}"
        assert not replay.shapes_differ, f"{name}: send shapes differ {replay.shapes_differ[:3]}"
        assert replay.diff < 1e-5, f"{name}: sends (incl. the expert outputs sent back) differ by {replay.diff}"
        assert torch.equal(m["result"].tokens, ref["tokens"]), f"{name}: tokens differ from the real rank's"
        assert max(float((a - b).abs().max()) for a, b in zip(m["result"].logits, ref["logits"])) < 1e-4
        # the stand-in exchange: buffers of a real rank's shapes, every all-to-all of one step
        stand_in = _proj.measure(model, adapter, _proj.case_dispatcher(name, epw.CF, group), group, strategy,
                                 prompts, epw.ARGS, "emulate")
        assert stand_in["shapes"] == ref["shapes"]
        per_layer = ref["shapes"][: len(ref["shapes"]) // len(spans)]
        if name == "capacity":  # [R, El, C, D] there and back
            assert [s[:2] for s in per_layer] == [[2, E // 2]] * 2
        else:  # [R, Sm, D] rows, [R, El] counts, [R, Sm, D] back; Sm = B*min(K, El) (one bucket of B rows)
            K = adapter.top_k(model.config)
            assert per_layer == [[2, epw.B * min(K, E // 2), model.config.hidden_size], [2, E // 2],
                                 [2, epw.B * min(K, E // 2), model.config.hidden_size]]


# -- the plan: parallel.* checked before any work, each error with its key and fix ----------------------------------
def _cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _torchrun_env(monkeypatch, rank=0, world=2):
    for k, v in dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=1).items():
        monkeypatch.setenv(k, str(v))


def test_plan_refuses_parallel_misconfigurations(monkeypatch, tmp_path):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    bad = {
        ("parallel.ep=2",): r"parallel.ep=2 needs 2 processes, one per rank: launch with `torchrun --nproc-per-node 2",
        ("parallel.ep=0",): r"parallel.ep=0: must be an integer >= 1",
        ("parallel.backend=gloo",): r"parallel.backend=gloo only applies under torchrun",
        ("parallel.backend=mpi",): r"parallel.backend='mpi': choose one of auto, nccl, gloo",
        ("measure.nvlink_bandwidth_gbps=450",): r"measure.nvlink_bandwidth_gbps=450 .* parallel.ep=1 .* drop it",
    }
    for overrides, msg in bad.items():
        with pytest.raises(PlanError, match=msg):
            resolve_plan(_cfg(*overrides))
    _torchrun_env(monkeypatch, world=2)
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16\n" * 5)  # 5 rows: enough for one rank of 4, not for 2
    bad = {
        ("parallel.ep=4",): r"parallel.ep=4 but torchrun started 2 processes: .* set parallel.ep=2",
        ("parallel.ep=1",): r"parallel.ep=1 but torchrun started 2 processes",
        ("parallel.ep=2", "dispatch=dynamic"): r"dispatch=dynamic has no expert-parallel variant: use "
                                               r"dispatch=dropless or dispatch=capacity with parallel.ep=2",
        ("parallel.ep=2", "dispatch=capacity", "dispatch.prefill=fused"): r"dispatch.prefill=fused has no expert-",
        ("parallel.ep=2", "parallel.backend=nccl"): r"parallel.backend=nccl needs CUDA devices",
        ("parallel.ep=2", "strategy=full", "capture.compile=true"): r"capture.compile=true with parallel.ep=2",
        ("parallel.ep=2", "parallel.timeout_s=0"): r"parallel.timeout_s=0: must be a number of seconds > 0",
        ("parallel.ep=2", "prompts=file", f"prompt_file={ids}"): r"need batch_size=8 rows .* \(parallel.ep=2: "
                                                                 r"batch_size=4 rows on each rank, 8 in all\)",
    }
    for overrides, msg in bad.items():
        with pytest.raises(PlanError, match=msg):
            resolve_plan(_cfg(*overrides))
    _torchrun_env(monkeypatch, world=3)
    with pytest.raises(PlanError, match=r"parallel.ep=3 does not divide the model's 8 experts: choose parallel.ep in "
                                        r"\[1, 2, 4, 8\]"):
        resolve_plan(_cfg("parallel.ep=3"))


def test_plan_gives_each_rank_its_own_rows(monkeypatch):
    from moecg.prompts import make_prompts

    _torchrun_env(monkeypatch, rank=1, world=2)
    plan = resolve_plan(_cfg("parallel.ep=2", "batch_size=3"))
    assert (plan.parallel.ep, plan.parallel.rank, plan.parallel.backend) == (2, 1, "gloo")
    everyone = make_prompts("random", 6, plan.prompt_len, plan.seed, 512)
    assert torch.equal(plan.prompts, everyone[3:6]) and plan.batch_size == 3
    assert "batch 3 per rank x 2 ranks (gloo)" in plan.describe()


# -- the torchrun job --------------------------------------------------------------------------------------------------
def _torchrun(cwd, n, *args, script=("-m", "moecg.run"), timeout=180):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                           *script, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def _in_process(*overrides) -> dict:
    from moecg.harness import Phases, run_experiment

    return run_experiment(_cfg(*overrides), phases=Phases(out=open(os.devnull, "w")))  # noqa: SIM115


DETERMINISTIC = ["routed_assignments", "dropped_assignments", "drop_rate", "per_layer_drop_rate", "per_expert_drop_rate",
                 "expert_load_imbalance", "per_layer_load_imbalance", "token_agreement_vs_eager",
                 "token_agreement_forced_vs_eager", "num_experts", "capacity", "capacity_buffer"]


def test_torchrun_ep2_job_rank0_writes_the_result_of_all_rows(tmp_path):
    """2 ranks of 2 rows each, dropless, whole-step graphs (emulated): the job's counters are those of one process
    decoding all 4 rows (dropless routes each row alike whatever the batch), and only rank 0's directory has results."""
    p = _torchrun(tmp_path, 2, "parallel.ep=2", "batch_size=2", "strategy=full", "capture.backend=emulate", *QUICK,
                  f"hydra.run.dir={tmp_path / 'job'}")
    assert p.returncode == 0, p.stderr[-4000:]
    assert list(tmp_path.rglob("results.json")) == [tmp_path / "job" / "results.json"]
    res = json.loads((tmp_path / "job" / "results.json").read_text())
    assert (res["status"], res["ep"], res["ep_backend"], res["batch_size"], res["bucket"]) == ("ok", 2, "gloo", 2, 2)
    one = _in_process("batch_size=4", "strategy=full", "capture.backend=emulate", *QUICK)
    for k in DETERMINISTIC:
        assert res[k] == (one[k] if one[k] is None else pytest.approx(one[k])), k
    assert res["routed_assignments"] == 4 * (5 - 1) * 2 * 2  # rows x decode steps x K x MoE layers
    assert p.stdout.count("results: ") == 1  # one summary, rank 0's


def test_torchrun_failing_rank_fails_the_job_with_its_error(tmp_path):
    """Rank 1 raises inside its 30th expert-parallel call (the timed phase), while rank 0 waits in the all-to-all:
    the job ends non-zero, promptly, and results.json carries rank 1's error."""
    t0 = time.monotonic()
    p = _torchrun(tmp_path, 2, "parallel.ep=2", "batch_size=2", *QUICK, f"hydra.run.dir={tmp_path / 'job'}",
                  script=(str(ROOT / "tests" / "ep_failing_rank.py"), "1", "30"), timeout=120)
    assert p.returncode != 0
    assert time.monotonic() - t0 < 100  # never parallel.timeout_s (300 s): the peer's exit ends the wait
    res = json.loads((tmp_path / "job" / "results.json").read_text())
    assert res["status"] == "failed" and res["phase"] == "timed" and res["ep"] == 2
    assert res["error"] == "rank 1 of 2: RuntimeError: injected failure on rank 1 at expert-parallel call 30"
    assert "injected failure" in res["traceback"]
    assert "moecg: job failed: rank 1 of 2: RuntimeError: injected failure" in p.stderr
    # rank 0's own line is printed only if it sees the peer's exit before torchrun's agent stops it (a race the
    # launcher decides); when it does, it names the rank that failed first
    if "rank 0 of 2 stopped" in p.stderr:
        assert "rank 1 failed first" in p.stderr


@pytest.mark.parametrize("args,phase,msg", [
    (["dispatch=dynamic"], "plan", "dispatch=dynamic has no expert-parallel variant: use dispatch=dropless or "
                                   "dispatch=capacity with parallel.ep=2"),
    (["--multirun", "batch_size=1,2"], "setup", "a multirun under torchrun (2 processes): each configuration needs "
                                                "every rank"),
], ids=["plan-error", "multirun"])
def test_torchrun_job_refused_before_any_work(tmp_path, args, phase, msg):
    """Every rank refuses the same config before a process group exists: one results.json, the first rank's."""
    p = _torchrun(tmp_path, 2, *args, "parallel.ep=2", *QUICK, f"hydra.run.dir={tmp_path / 'job'}",
                  f"hydra.sweep.dir={tmp_path / 'sweep'}", timeout=120)
    assert p.returncode != 0
    found = list(tmp_path.rglob("results.json"))
    assert len(found) == 1, found
    res = json.loads(found[0].read_text())
    assert res["status"] == "failed" and res["phase"] == phase
    assert res["error"].split(": ", 1)[1].startswith(("PlanError: ", "RuntimeError: ")) and msg in res["error"]
    assert res["error"].startswith(("rank 0 of 2: ", "rank 1 of 2: "))


def test_ep1_matches_todays_path_in_process_and_under_torchrun(tmp_path):
    """parallel.ep=1 without torchrun is today's run (no process group, dispatchers unchanged); under torchrun with one
    process it initialises gloo and megatron-core's groups, and every deterministic field is the same."""
    args = ["dispatch=capacity", "dispatch.capacity_factor=0.5", "strategy=capacity", "capture.backend=emulate",
            "batch_size=3", *QUICK]
    p = _torchrun(tmp_path, 1, "parallel.ep=1", *args, f"hydra.run.dir={tmp_path / 'job'}")
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads((tmp_path / "job" / "results.json").read_text())
    one = _in_process(*args)
    assert one["ep"] == res["ep"] == 1 and one["ep_backend"] is None and res["dropped_assignments"] > 0
    for k in DETERMINISTIC + ["max_logit_diff_vs_eager", "floor_ms", "exchange_floor_ms"]:
        assert res[k] == one[k], k


def test_bench_ep_on_two_gloo_ranks(tmp_path):
    """experiments/bench_ep.py under torchrun on CPU: moecg's rows measured (exchange share, floor with the bandwidths
    given), megatron-core's rows skipped with the reason, one table and one JSON from rank 0."""
    out, js = tmp_path / "ep.md", tmp_path / "ep.json"
    p = _torchrun(tmp_path, 2, "--preset", "mixtral_tiny", "--batch", "2", "--new-tokens", "4", "--prompt-len", "4",
                  "--skip", "1", "--cases", "dropless:full", "capacity:capacity", "megatron_alltoall:partial",
                  "--hbm-gbps", "100", "--nvlink-gbps", "50", "--out", str(out), "--json", str(js),
                  script=(str(ROOT / "experiments" / "bench_ep.py"),))
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(js.read_text())
    assert res["ranks"] == 2 and [(r["dispatch"], r["strategy"]) for r in res["rows"]] == [
        ("dropless", "full"), ("capacity", "capacity")]
    for r in res["rows"]:
        assert r["captured"] and r["ms_per_step"] > 0 and 0 <= r["exchange_share"] <= 1
        assert r["floor_ms"] > 0 and r["floor_ratio"] == pytest.approx(r["ms_per_step"] / r["floor_ms"])
    assert "need CUDA" in res["skipped"]["megatron_alltoall"]
    assert out.read_text().count("| mixtral_tiny |") == 2 and "Skipped on cpu: megatron_alltoall" in out.read_text()
