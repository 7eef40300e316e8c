"""Workloads (moecg.workload, resolved in the run plan): a seeded Poisson process replays exactly, traces parse from
JSONL and CSV, every bad trace or key is refused before any model is built with the file, line, field and fix, and
workload=fixed (the default) gives today's results."""
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import moecg
from moecg import schema
from moecg.plan import PlanError, resolve_plan
from moecg.workload import SAMPLE_TRACE, poisson_requests

CONF_DIR = Path(moecg.__file__).parent / "conf"
GOLDEN = Path(__file__).parent / "data" / "fixed_golden.json"


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _plan(*overrides):
    return resolve_plan(_cfg(*overrides))


def _refused(match, *overrides):
    with pytest.raises(PlanError, match=match) as e:
        _plan(*overrides)
    assert "\n" not in str(e.value), "errors are one line"
    return str(e.value)


# -- poisson ---------------------------------------------------------------------------------------------------
def test_seeded_poisson_replays_exactly():
    a = _plan("workload=poisson", "workload.rate=8", "workload.seed=3").workload
    b = _plan("workload=poisson", "workload.rate=8", "workload.seed=3").workload
    c = _plan("workload=poisson", "workload.rate=8", "workload.seed=4").workload
    assert a.requests == b.requests and a.requests != c.requests
    assert all(torch.equal(x, y) for x, y in zip(a.prompts, b.prompts))
    times = [r.arrival_s for r in a.requests]
    assert times == sorted(times) and times[0] > 0 and len(times) == 32
    assert all(16 <= r.prompt_len <= 64 and 16 <= r.output_len <= 64 for r in a.requests)
    assert [p.numel() for p in a.prompts] == [r.prompt_len for r in a.requests]
    # the mean gap is 1/rate: 2000 arrivals at 8/s span about 250 s
    many = poisson_requests(8.0, 2000, 4, {"choices": [2, 5]}, seed=0)
    assert 225 < many[-1].arrival_s < 275 and {r.output_len for r in many} == {2, 5}


def test_serving_plan_sizes_the_cache_and_rows():
    plan = _plan("workload=poisson", "workload.max_batch=5", "strategy=full", "capture.backend=emulate")
    need = max(r.prompt_len + r.output_len for r in plan.workload.requests)
    assert plan.serving and plan.max_cache_len == need and plan.bucket == 8 and plan.max_rows == 8
    assert plan.prompts.numel() == 0 and not plan.needs_baseline
    assert "workload=poisson (4 req/s): 32 requests" in plan.describe()
    assert _plan("workload=poisson", "max_cache_len=200").max_cache_len == 200
    assert not _plan().serving and _plan().workload.name == "fixed"


# -- traces ----------------------------------------------------------------------------------------------------
def test_shipped_sample_trace_parses():
    plan = _plan("workload=trace")
    w = plan.workload
    assert w.file == "sample_trace.jsonl" and w.n_requests == len(SAMPLE_TRACE.read_text().splitlines()) == 24
    assert SAMPLE_TRACE.parent.name == "data" and SAMPLE_TRACE.parent.parent == Path(moecg.__file__).parent
    times = [r.arrival_s for r in w.requests]
    assert times == sorted(times) and w.requests[0].line == 1


def test_jsonl_and_csv_traces_agree(tmp_path):
    rows = [(0.0, 5, 3), (0.5, 7, 1), (0.5, 2, 9)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(dict(zip(("arrival_s", "prompt_len", "output_len"), r)))
                                               for r in rows) + "\n\n")
    (tmp_path / "t.csv").write_text("prompt_len, arrival_s ,output_len\n" + "".join(f"{p},{a},{o}\n" for a, p, o in rows))
    a = _plan("workload=trace", f"workload.file={tmp_path / 't.jsonl'}").workload
    b = _plan("workload=trace", f"workload.file={tmp_path / 't.csv'}").workload
    got = [(r.arrival_s, r.prompt_len, r.output_len) for r in a.requests]
    assert got == rows == [(r.arrival_s, r.prompt_len, r.output_len) for r in b.requests]
    assert a.file == "t.jsonl" and b.file == "t.csv"


GOOD = '{"arrival_s": 0.1, "prompt_len": 4, "output_len": 4}'
BAD_TRACES = [
    # (file name, text, regex the error must match)
    ("t.jsonl", GOOD + '\n{"arrival_s": 0.2, "prompt_len": 4}\n', r"t\.jsonl, line 2: field 'output_len' missing"),
    ("t.jsonl", GOOD + '\n{"arrival_s": 0.2, "prompt_len": -3, "output_len": 4}\n',
     r"line 2: prompt_len=-3 must be >= 1 token"),
    ("t.jsonl", '{"arrival_s": 0.2, "prompt_len": 4, "output_len": 0}\n', r"line 1: output_len=0 must be >= 1"),
    ("t.jsonl", '{"arrival_s": 0.2, "prompt_len": 4.5, "output_len": 2}\n', r"line 1: prompt_len=4\.5 is not an integer"),
    ("t.jsonl", GOOD + '\n{"arrival_s": 0.05, "prompt_len": 4, "output_len": 4}\n',
     r"line 2: arrival_s=0\.05 is earlier than line 1's 0\.1: sort the trace by arrival_s"),
    ("t.jsonl", '{"arrival_s": -1, "prompt_len": 4, "output_len": 4}\n', r"line 1: arrival_s=-1 is negative"),
    ("t.jsonl", '{"arrival_s": "soon", "prompt_len": 4, "output_len": 4}\n', r"arrival_s='soon' is not a finite"),
    ("t.jsonl", '{"arrival_s": 0, "prompt_len": 4, "output_len": 4, "promt": 1}\n', r"line 1: unknown field 'promt'"),
    ("t.jsonl", GOOD + "\n[1, 2, 3]\n", r"line 2: a JSON object per line is needed"),
    ("t.jsonl", GOOD + "\n{oops\n", r"line 2: not JSON"),
    ("t.jsonl", "\n", r"no requests in the file"),
    ("t.csv", "arrival_s,prompt_len\n0,4\n", r"t\.csv, line 1: the CSV header lacks output_len"),
    ("t.csv", "arrival_s,prompt_len,output_len\n0,4,4\n1,,4\n", r"t\.csv, line 3: field 'prompt_len' missing"),
    ("t.txt", GOOD, r"unknown trace format '\.txt': name it \.jsonl"),
    # longer than the model's positions (mixtral_tiny: 1024) with the cache left to the requests
    ("t.jsonl", GOOD + '\n{"arrival_s": 1, "prompt_len": 1000, "output_len": 100}\n',
     r"line 2: prompt_len \+ output_len = 1100 exceeds the model's max_position_embeddings=1024: shorten the request"),
]


@pytest.mark.parametrize("name,text,match", BAD_TRACES)
def test_bad_traces_refused_with_file_line_and_fix(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    msg = _refused(match, "workload=trace", f"workload.file={path}")
    assert msg.startswith(f"workload.file={path}")


def test_request_longer_than_the_cache_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + '\n{"arrival_s": 1, "prompt_len": 30, "output_len": 20}\n')
    _refused(r"line 2: prompt_len \+ output_len = 50 exceeds max_cache_len=40 \(the KV cache per row\): raise "
             r"max_cache_len", "workload=trace", f"workload.file={path}", "max_cache_len=40")
    _refused(r"workload.prompt_len/output_len: prompt_len \+ output_len = \d+ exceeds max_cache_len=20",
             "workload=poisson", "max_cache_len=20")
    _refused(r"workload.file=/no/such.jsonl: no such file", "workload=trace", "workload.file=/no/such.jsonl")


@pytest.mark.parametrize("overrides,match", [
    (["workload=poisson", "+workload.rat=3"], r"workload\.rat: not a key of workload=poisson \(its keys: rate, "),
    (["workload=trace", "+workload.rate=3"], r"workload\.rate: not a key of workload=trace"),
    (["+workload.rate=3"], r"workload\.rate does not apply to workload=fixed"),
    (["workload=poisson", "workload.rate=0"], r"workload\.rate=0\.0: must be a finite number > 0"),
    (["workload=poisson", "workload.n_requests=0"], r"workload\.n_requests=0: must be an integer >= 1"),
    (["workload=poisson", "workload.max_batch=0"], r"workload\.max_batch=0: must be an integer >= 1"),
    (["workload=poisson", "workload.prompt_len=[9,3]"], r"workload\.prompt_len=\[9, 3\]: give an integer, \[low, high\]"),
    (["workload=poisson", "workload.output_len=-2"], r"workload\.output_len=-2: give an integer"),
    (["workload=poisson", "workload.anchor=maybe"], r"workload\.anchor='maybe': must be true or false"),
    (["workload=poisson", "prompts=file", "prompt_file=/x"], r"prompts=file gives fixed-length rows"),
    (["workload=poisson", "prompts=heldout"], r"prompts=heldout gives byte ids"),
    (["workload=poisson", "strategy=full", "capture.compile=true"], r"capture\.compile=true with workload=poisson"),
])
def test_bad_workload_keys_refused(overrides, match):
    _refused(match, *overrides)


def test_fused_step_serves_every_attention_kind():
    for model in ("qwen3_moe_tiny", "deepseek_v3_tiny", "deepseek_v2_tiny"):
        plan = _plan("workload=poisson", f"model={model}", "strategy=full", "capture.kernels=fused", "dispatch=fused")
        assert plan.capture.kernels == "fused" and plan.serving


# -- workload=fixed is today's run -----------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["default", "capacity"])
def test_fixed_workload_results_unchanged(case):
    """A default (workload=fixed) run gives the record tests/data/fixed_golden.json holds, field for field, apart
    from timing, memory and environment; the serving fields are null."""
    from moecg.harness import run_experiment

    golden = json.loads(GOLDEN.read_text())
    want = golden[case]["record"]
    res = run_experiment(_cfg(*golden[case]["overrides"]))
    assert res["workload"] == "fixed" and all(res[f] is None for f in schema.SERVING)
    new = set(schema.NAMES) - set(want) - set(golden["volatile"])
    ep_fields = {"ep", "ep_backend", "exchange_floor_ms", "nvlink_bandwidth_gbps"}  # expert parallelism
    knobs = {"pdl", "preload", "overlap_shared", "fuse_router", "precompile"}  # capture.*, recorded as config
    knobs.add("warmup")  # the eager runs before each capture, recorded since capture.warmup=auto picks them
    kv = {"kv_bytes_per_token"}  # the KV cache's bytes per token, recorded since the floor prices MLA's latent cache
    fmt = {"weights", "activations", "weight_bytes"}  # the weight format, its GEMMs' inputs and its bytes
    assert new == {"workload", *schema.SERVING, *ep_fields, "prefill_chunk", "attn_implementation", *knobs, *kv,
                   *fmt}, "a field was added outside the serving and EP groups, prefill_chunk, attn_implementation, " \
        "the capture knobs, kv_bytes_per_token and the weight format"
    assert res["weights"] == "full" and res["activations"] == "full" and res["weight_bytes"] > 0  # today's path
    assert (res["pdl"], res["preload"], res["overlap_shared"], res["fuse_router"], res["precompile"]) == \
        ("auto", True, True, True, True)
    assert res["attn_implementation"] == "sdpa"
    assert res["warmup"] == (None if not res["captured"] and res["capture_backend"] == "none" else 3)  # HF modules
    assert res["ep"] == 1 and all(res[f] is None for f in ep_fields - {"ep"})  # one process: today's path
    assert res["prefill_chunk"] is None  # one prefill forward: today's path
    for f, v in want.items():
        if isinstance(v, float):
            assert res[f] == pytest.approx(v, rel=1e-5, abs=1e-7), f
        elif isinstance(v, list) and v and isinstance(v[0], float):
            assert res[f] == pytest.approx(v, rel=1e-5, abs=1e-7), f
        else:
            assert res[f] == v, f
