"""Serving (moecg.serving on moecg.ragged): real-time FCFS joins and leaves without re-capture, every request's
tokens equal to it decoded alone, bounded memory, the sync-free step, metrics arithmetic, the harness record,
transformers' continuous batching as the anchor, and the CLI. CPU, fp32, tiny presets; no timing assertions.
"""
import json

import pytest

from moecg import schema
from moecg.capture import Capture
from moecg.capture.graph import GraphRunner
from moecg.dispatch import attach, detach, make_dispatcher
from moecg.ragged import RaggedEngine
from moecg.serving import (RequestTimes, Step, decode_alone, gpu_idle_share, request_metrics, serve, step_metrics,
                           warm)
from moecg.workload import Request, poisson_requests, request_prompt

L = 48
# 10 requests through 3 slots, arrivals faster than they finish: joins while others decode, leaves in any order;
# together they generate more tokens than one row's cache holds (slots are reused)
REQS = poisson_requests(400.0, 10, [3, 16], [1, 14], seed=5)
PROMPTS = [request_prompt("random", r, 5, 512) for r in REQS]


@pytest.fixture(scope="module")
def model():
    from moecg.models import build_model

    m = build_model("qwen2_moe_tiny", dtype="fp32", device="cpu").model
    attach(m, make_dispatcher("dropless"), max_rows=1)
    alone = decode_alone(m, REQS, PROMPTS, L)
    detach(m)
    return m, alone


def test_workload_outgrows_one_row(model):
    assert sum(r.prompt_len + r.output_len for r in REQS) > L and len(REQS) > 3
    assert any(r.output_len == 1 for r in REQS)  # leaves straight after its prefill


@pytest.mark.parametrize("strategy,dispatch", [("full", "dropless"), ("layer", "dropless"), ("partial", "dynamic")])
def test_served_tokens_equal_each_request_alone_without_recapture(model, strategy, dispatch, monkeypatch):
    m, alone = model
    attach(m, make_dispatcher(dispatch), max_rows=4)
    try:
        eng = RaggedEngine(m, L, 4)
        cap = Capture(eng, strategy, buckets=[1, 2, 4], backend="emulate").apply()
        graphs = cap.stats()["graphs"]
        calls = []
        orig = GraphRunner.capture
        monkeypatch.setattr(GraphRunner, "capture", lambda self, *a, **k: calls.append(a[0]) or orig(self, *a, **k))
        warm(eng, PROMPTS[0])
        tl = serve(eng, REQS, PROMPTS, max_batch=3)
        assert tl.tokens == alone  # every request, whoever shared its steps
        assert not calls and cap.stats()["graphs"] == graphs  # joins and leaves: no re-capture
        replays = sum(e.replays for e in cap.runner.entries.values())
        assert replays >= len(tl.steps) and cap.stats()["layer_fallbacks"] == 0
        assert {s.rows for s in tl.steps} <= {1, 2, 4} and max(s.batch for s in tl.steps) <= 3
        assert len({s.batch for s in tl.steps}) > 1  # the batch grew and shrank
        # memory stays bounded: the same 4 slots, all free again
        assert all(k.shape[0] == 4 for k in eng.cache.keys) and eng.tok_buf.shape == (4, L)
        assert eng.n_live == 0 and int(eng.cache.lengths.sum()) == 0 and int(eng.n_tok.sum()) == 0
        for r in tl.requests:
            assert r.arrival_s <= r.admit_s <= r.first_s <= r.finish_s
        cap.unwrap()
    finally:
        detach(m)


def test_batched_prefills_give_each_request_alone(model):
    """Everything arrives at once: admissions prefill together, right-padded (RaggedEngine.add_many)."""
    from dataclasses import replace

    m, alone = model
    at_once = [replace(r, arrival_s=0.0) for r in REQS]
    attach(m, make_dispatcher("dropless"), max_rows=4)
    try:
        eng = RaggedEngine(m, L, 4)
        Capture(eng, "full", buckets=[1, 2, 4], backend="emulate").apply()
        tl = serve(eng, at_once, PROMPTS, max_batch=4)
        assert tl.tokens == alone
        assert len(tl.prefills) < len(REQS)  # the first four at least shared one forward
        one_by_one = serve(eng, at_once, PROMPTS, max_batch=4, prefill_tokens=0)
        assert one_by_one.tokens == alone and len(one_by_one.prefills) == len(REQS)
    finally:
        detach(m)


def test_prefill_groups_respect_the_token_budget():
    from moecg.serving import prefill_groups

    reqs = [Request(i, 0.0, p, 2) for i, p in enumerate([4, 8, 2, 10, 3])]
    ids = lambda gs: [[r.id for r in g] for g in gs]  # noqa: E731
    assert ids(prefill_groups(reqs, 16)) == [[0, 1], [2], [3], [4]]  # 2 x 8 fits, 3 x 8 does not
    assert ids(prefill_groups(reqs, 30)) == [[0, 1, 2], [3, 4]]
    assert ids(prefill_groups(reqs, 0)) == [[0], [1], [2], [3], [4]]


def test_sync_free_step_gives_the_syncing_steps_tokens(model):
    m, alone = model
    attach(m, make_dispatcher("dropless"), max_rows=3)
    try:
        got = {}
        for sync in (True, False):
            eng = RaggedEngine(m, L, 3)
            out, pending = {}, list(zip(REQS, PROMPTS))
            while pending or eng.n_live:
                while pending and eng.n_live < 3:
                    r, p = pending.pop(0)
                    eng.add(r.id, p, r.output_len, sync=sync)
                for rid in [rid for rid in eng.order if eng.n_generated[rid] >= REQS[rid].output_len]:
                    toks = eng.remove(rid, sync=sync)
                    out[rid] = toks if sync else toks.tolist()
                if eng.n_live:
                    res = eng.step(sync=sync)
                    assert (res is None) == (not sync)
            got[sync] = out
        assert got[True] == got[False] == alone
    finally:
        detach(m)


def test_capacity_drops_per_batch_size(model):
    m, _ = model
    attach(m, make_dispatcher("capacity", capacity_factor=0.5), max_rows=4)
    try:
        eng = RaggedEngine(m, L, 4)
        Capture(eng, "capacity", buckets=[1, 2, 4], backend="emulate").apply()
        tl = serve(eng, REQS, PROMPTS, max_batch=3)
        assert len(tl.prefills) == len(REQS)  # a prefill that drops runs one request at a time (no pad tokens)
        metrics = step_metrics(tl.steps, tl.prefills, tl.drops_by_batch)
        by = metrics["drop_rate_by_batch"]
        assert set(by) == {str(s.batch) for s in tl.steps}
        assert any(v > 0 for v in by.values()) and all(0 <= v <= 1 for v in by.values())
        routed = sum(r for r, _ in tl.drops_by_batch.values())
        from moecg.dispatch import state_of

        assert routed == state_of(m).snapshot()["routed_assignments"]  # decode steps only: prefills not counted
    finally:
        detach(m)


# -- metrics on a hand-built timeline ----------------------------------------------------------------------------
def test_request_metrics_arithmetic():
    reqs = [RequestTimes(0, 0.0, 4, 5, admit_s=0.1, first_s=0.2, finish_s=0.6),   # TPOT 100 ms
            RequestTimes(1, 0.5, 4, 1, admit_s=0.6, first_s=0.7, finish_s=0.7),   # one token: no TPOT
            RequestTimes(2, 1.0, 4, 3, admit_s=1.0, first_s=1.5, finish_s=2.0)]   # TPOT 250 ms
    out = request_metrics(reqs)
    assert out["output_tokens"] == 9 and out["serving_s"] == pytest.approx(2.0)
    assert out["output_tokens_per_s"] == pytest.approx(4.5)
    assert out["tpot_ms_p50"] == pytest.approx(175.0) and out["tpot_ms_p99"] == pytest.approx(248.5)
    assert [r["ttft_ms"] for r in out["requests"]] == pytest.approx([200, 200, 500])
    assert out["ttft_ms_p50"] == pytest.approx(200) and out["ttft_ms_p90"] == pytest.approx(440)
    assert out["e2e_ms_p50"] == pytest.approx(600) and out["e2e_ms_p99"] == pytest.approx(992)
    assert out["requests"][2]["queue_ms"] == pytest.approx(0) and out["requests"][2]["prefill_ms"] == pytest.approx(500)


def test_step_metrics_arithmetic():
    steps = [Step(0.0, 1.0, 3, 4), Step(1.5, 2.5, 2, 2), Step(4.0, 5.0, 1, 1, after_wait=True),
             Step(5.2, 6.2, 5, 8)]
    prefills = [(1.1, 1.3)]  # covers 0.2 s of the 0.5 s gap after step 0
    out = step_metrics(steps, prefills, {3: (10, 5), 1: (4, 0)})
    assert out["padding_waste"] == pytest.approx((1 + 0 + 0 + 3) / 15)
    assert out["batch_size_hist"] == {"1": 1, "2": 1, "3": 1, "5": 1}
    assert out["bucket_hist"] == {"1": 1, "2": 1, "4": 1, "8": 1}
    assert out["drop_rate_by_batch"] == {"1": 0.0, "3": 0.5}
    # idle: 0.3 (gap 0.5 minus the prefill's 0.2) + 0 (the gap before a step after a wait) + 0.2, over 4 s of steps
    assert out["gpu_idle_share"] == pytest.approx(0.5 / 4.0)
    assert gpu_idle_share([], []) is None
    assert out["step_batch"] == [3, 2, 1, 5] and out["step_ms"] == pytest.approx([1000.0] * 4)


# -- the harness and the CLI -----------------------------------------------------------------------------------
def _cfg(*overrides):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    import moecg

    with initialize_config_dir(config_dir=str(Path(moecg.__file__).parent / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


FAST = ["workload=poisson", "workload.rate=500", "workload.n_requests=6", "workload.prompt_len=[3,9]",
        "workload.output_len=[2,6]", "workload.max_batch=3", "capture.backend=emulate", "capture.buckets=[1,2,4]"]


def test_harness_serving_record_and_anchor():
    from moecg.harness import run_experiment

    res = run_experiment(_cfg(*FAST, "strategy=full", "workload.anchor=true", "measure.fidelity_rows=6"))
    assert list(res) == list(schema.NAMES)
    assert res["workload"] == "poisson" and res["workload_rate"] == 500 and res["max_batch"] == 3
    assert res["batch_size"] is None and res["prompt_len"] is None and res["captured"] is True
    assert res["n_requests"] == 6 and len(res["requests"]) == 6 and res["decode_steps"] == len(res["step_ms"])
    assert res["output_tokens"] == sum(r["output_len"] for r in res["requests"])
    assert sum(res["batch_size_hist"].values()) == res["decode_steps"]
    assert set(res["bucket_hist"]) <= {"1", "2", "4"} and 0 <= res["padding_waste"] < 1
    assert res["token_agreement_vs_eager"] == 1.0  # dropless fp32: every request as decoded alone
    for f in schema.SERVING:
        if f not in ("workload_file", "drop_rate_by_batch"):
            assert res[f] is not None, f
    # transformers' continuous batching on the same requests (CPU: no CUDA graphs), the same greedy tokens
    assert res["anchor_token_agreement"] == 1.0 and res["anchor_cuda_graphs"] == [False, False]
    assert res["anchor_output_tokens_per_s"] > 0 and res["anchor_tpot_ms_p90"] is not None


def test_harness_trace_capacity_record(tmp_path):
    from moecg.harness import run_experiment

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_len,output_len\n0,5,4\n0.001,3,6\n0.002,8,1\n0.003,4,5\n")
    res = run_experiment(_cfg("workload=trace", f"workload.file={trace}", "workload.max_batch=2", "strategy=capacity",
                              "dispatch.capacity_factor=0.5", "capture.backend=emulate", "measure.fidelity=false"))
    assert res["workload"] == "trace" and res["workload_file"] == "t.csv" and res["n_requests"] == 4
    assert str(tmp_path) not in json.dumps({k: v for k, v in res.items() if k != "config"})  # no machine paths
    assert res["drop_rate_by_batch"] and res["capacity"] is not None and res["token_agreement_vs_eager"] is None
    assert res["anchor_output_tokens_per_s"] is None
    # the serving record carries the cache's bytes per token too: mixtral_tiny (the default model), 2 layers of K and V
    # for 2 KV heads of 16 dims, fp32
    assert res["model"] == "mixtral_tiny" and res["kv_bytes_per_token"] == 2 * (2 * 2 * 16) * 4


@pytest.mark.slow
def test_cli_serves_poisson_on_cpu(tmp_path):
    from test_experiments import moecg_run

    p = moecg_run(tmp_path, "workload=poisson", "workload.rate=8", "strategy=full", "workload.n_requests=3",
                  "workload.prompt_len=4", "workload.output_len=3", f"hydra.run.dir={tmp_path / 'run'}")
    assert "No CUDA graphs were captured on cpu" in p.stdout
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["status"] == "ok" and res["workload"] == "poisson" and res["n_requests"] == 3
    assert res["captured"] is False and res["output_tokens"] == 9


@pytest.mark.slow
def test_serving_sweep_and_plot(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moecg import analysis
    from test_experiments import job_results, moecg_run

    moecg_run(tmp_path, "experiment=serving_sweep", "model=mixtral_tiny", "workload.n_requests=3",
              "workload.prompt_len=[3,6]", "workload.output_len=3", "workload.max_batch=2", "strategy=full,partial",
              "dispatch=dropless,capacity", "workload.rate=100,400", "measure.fidelity=false",
              f"hydra.sweep.dir={tmp_path / 'sweep'}")
    res = job_results(tmp_path / "sweep")
    assert len(res) == 8 and all(r["status"] == "ok" for r in res)
    assert {(r["strategy"], r["dispatch"], r["workload_rate"]) for r in res} == \
        {(s, d, q) for s in ("full", "partial") for d in ("dropless", "capacity") for q in (100, 400)}
    df = analysis.load_results(tmp_path / "sweep")
    assert "output_tokens_per_s" in analysis.summary_table(df)
    fig = analysis.plot_serving(df)
    assert len(fig.axes[0].lines) == 4  # one per strategy x dispatch
    plt.close(fig)


@pytest.mark.slow
def test_bench_serving_cpu_smoke(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, str(root / "experiments" / "bench_serving.py"), "--preset", "mixtral_tiny",
                        "--device", "cpu", "--backend", "emulate", "--requests", "4", "3", "--max-batch", "4", "2",
                        "--prompt", "3", "9", "--new", "4", "--exact-requests", "3", "--exact-batch", "2",
                        "--variants", "full", "capacity", "full+fused", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads((tmp_path / "serving.json").read_text())["rows"]
    assert data["exactness"]["bit_exact_fraction"] == 1.0 and data["exactness"]["teacher_forced_agreement"] == 1.0
    assert [pair["max_batch"] for pair in data["pairs"]] == [4, 2]
    for pair in data["pairs"]:
        rows = {r["variant"]: r for r in pair["rows"]}
        assert set(rows) == {"transformers CB", "full", "capacity", "full+fused"}
        assert rows["transformers CB"]["output_tokens"] == rows["full"]["output_tokens"] == 4 * pair["requests"]
        assert rows["full"]["anchor_agreement"] == 1.0 and rows["full"]["captured"] is True
        assert rows["capacity"]["drop_rate"] > 0
        assert "error" in rows["full+fused"] or rows["full+fused"]["output_tokens"] == 4 * pair["requests"]
    assert "| transformers CB |" in (tmp_path / "serving.md").read_text()


def test_wandb_gets_the_step_batch_series():
    from types import SimpleNamespace

    from moecg.logger import WandbLogger

    logged = []
    run = SimpleNamespace(log=logged.append, summary={})
    table = lambda **k: k  # noqa: E731
    wb = SimpleNamespace(Table=table, plot=SimpleNamespace(bar=lambda *a, **k: None))
    lg = object.__new__(WandbLogger)
    lg.wandb, lg.run = wb, run
    lg.log_results({"step_ms": [1.5, 2.5, 3.0], "step_batch": [1, 3, 2], "per_layer_drop_rate": [], "workload": "trace"})
    steps = [r for r in logged if "step_ms" in r]
    assert steps == [{"step_ms": 1.5, "decode_step": 0, "batch_size": 1}, {"step_ms": 2.5, "decode_step": 1, "batch_size": 3},
                     {"step_ms": 3.0, "decode_step": 2, "batch_size": 2}]
    assert run.summary["workload"] == "trace"
