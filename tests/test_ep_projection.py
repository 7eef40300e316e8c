"""experiments/ep_projection.py on CPU: the per-rank benchmark builds and runs what a real rank of moecg.parallel does
(2 gloo ranks, mixtral_tiny, emulated graphs), and the script itself runs end to end on a tiny preset.

Dims: R ranks, B rows per rank, E experts, El = E/R, L MoE layers, C capacity, D hidden, Sm = B*min(K, El).
The real 2-rank run (tests/ep_projection_worker.py) records each rank's expert slices and every all-to-all it sends
and receives. One process then builds each rank with the script's `build_rank` and (1) finds the same experts and
slices, (2) replaying the recorded receives, sends the same buffers call for call and decodes the same tokens and
logits: given the exchange's inputs, the benchmark's rank computes the real rank's outputs, (3) with the script's
stand-in exchange, sends buffers of the real shapes.
"""
from __future__ import annotations

import json

import pytest
import torch

import ep_projection_worker as w
from test_parallel import _spawn_on

proj = w.load_script()


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


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_projection")
    res = _spawn_on(2, "projection", out, "cpu", timeout=180, worker=w.run)
    for r, status in res.items():
        assert "error" not in status, f"rank {r}: {status['error']}"
    return {r: torch.load(out / f"rank{r}.pt") for r in range(2)}


@pytest.mark.parametrize("rank", [0, 1])
def test_per_rank_bench_builds_and_computes_what_a_real_rank_does(real, rank):
    data = real[rank]
    built, group = proj.build_rank(w.PRESET, None, 2, rank, "fp32", "cpu", 0)
    model, adapter = built.model, built.adapter
    E = adapter.num_experts(model.config)
    spans, slices = w.spans_and_slices(model, adapter)
    assert spans == data["spans"] == [(rank * E // 2, (rank + 1) * E // 2)] * len(spans)  # which experts
    for (gu, dn), (rgu, rdn) in zip(slices, data["slices"]):
        assert gu.shape[0] == E // 2 and torch.equal(gu, rgu) and torch.equal(dn, rdn)
    prompts = proj.rank_prompts(model.config.vocab_size, 2, w.B, rank, w.ARGS.prompt_len)
    for name, strategy in proj.CASES:
        ref = data[name]
        replay = Replay(ref["calls"], 2, rank)
        m = proj.measure(model, adapter, proj.case_dispatcher(name, w.CF, replay), group, strategy, prompts, w.ARGS,
                         "emulate", keep=True)
        assert replay.i == len(ref["calls"]) > 0, f"{name}: {replay.i} all-to-alls, the real rank ran {len(ref['calls'])}"
        assert not replay.shapes_differ, f"{name}: send shapes differ {replay.shapes_differ[:3]}"
        assert replay.diff < 1e-5, f"{name}: sends (incl. the expert outputs sent back) differ by {replay.diff}"
        assert torch.equal(m["result"].tokens, ref["tokens"]), f"{name}: tokens differ from the real rank's"
        assert max(float((a - b).abs().max()) for a, b in zip(m["result"].logits, ref["logits"])) < 1e-4
        # the stand-in exchange: buffers of a real rank's shapes, every all-to-all of one step
        stand_in = proj.measure(model, adapter, proj.case_dispatcher(name, w.CF, group), group, strategy, prompts,
                                w.ARGS, "emulate")
        assert stand_in["shapes"] == ref["shapes"]
        per_layer = ref["shapes"][: len(ref["shapes"]) // len(spans)]
        if name == "capacity":  # [R, El, C, D] there and back
            assert [s[:2] for s in per_layer] == [[2, E // 2]] * 2
        else:  # [R, Sm, D] rows, [R, El] counts, [R, Sm, D] back; Sm = B*min(K, El) (one bucket of B rows)
            K = adapter.top_k(model.config)
            assert per_layer == [[2, w.B * min(K, E // 2), model.config.hidden_size], [2, E // 2],
                                 [2, w.B * min(K, E // 2), model.config.hidden_size]]


def test_script_runs_on_cpu_and_tabulates_its_records(tmp_path, capsys):
    """The script end to end on mixtral_tiny (R 1 and 2, emulated graphs), its records' arithmetic, the docs table
    from the JSON, and --measured refused without the GPUs."""
    js, md = tmp_path / "records.json", tmp_path / "table.md"
    proj.main(["--preset", "mixtral_tiny", "--ranks", "1", "2", "--batch", "2", "--new-tokens", "4", "--prompt-len",
               "4", "--skip", "1", "--warmup", "1", "--hbm-gbps", "100", "--out", str(md), "--json", str(js)])
    doc = json.loads(js.read_text())
    recs = doc["records"]
    assert [(r["ranks"], r["dispatch"], r["strategy"]) for r in recs] == [
        (1, "dropless", "full"), (1, "capacity", "capacity"), (2, "dropless", "full"), (2, "capacity", "capacity")]
    a = doc["assumptions"]
    assert a["nvlink_gbps"] == proj.NVLINK_EFFECTIVE_GBPS and a["latency_us"] == proj.A2A_LATENCY_US
    for r in recs:
        assert r["captured"] and r["rank_ms"] > 0 and r["floor_ms"] > 0
        L = r["moe_layers"]
        assert r["collectives"] == (0 if r["ranks"] == 1 else {"dropless": 3, "capacity": 2}[r["dispatch"]] * L)
        assert (r["exchange_bytes"] > 0) == (r["ranks"] > 1)
        x = r["exchange_bytes"] / (a["nvlink_gbps"] * 1e9) * 1e3 + r["collectives"] * a["latency_us"] * 1e-3
        assert r["exchange_ms"] == pytest.approx(x) and r["step_ms"] == pytest.approx(r["rank_ms"] + x)
        assert r["tokens_per_s"] == pytest.approx(r["ranks"] * r["batch_per_rank"] / r["step_ms"] * 1e3)
        assert r["step_ms_overlap"] == pytest.approx(max(r["rank_ms"], x))  # --overlap 1: the bound
        assert r["floor_ratio"] == pytest.approx(r["step_ms"] / r["floor_ms"])
    capsys.readouterr()
    proj.main(["--md", str(js)])
    printed = capsys.readouterr().out
    assert printed.strip() == md.read_text().strip() and printed.count("| mixtral_tiny |") == 4
    assert "pplx-kernels" in printed and "nccl-tests/issues/212" in printed
    with pytest.raises(SystemExit, match=r"--measured runs EP-2 as a torchrun job of 2 processes .* GPU\(s\) are "
                                         r"visible here"):
        if torch.cuda.device_count() >= 2:
            pytest.skip("this host has the GPUs --measured needs")
        proj.main(["--measured", "--ranks", "1", "2"])
