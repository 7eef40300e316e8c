"""experiments/ep_projection.py end to end on CPU (mixtral_tiny, emulated graphs): its records' arithmetic, the docs
table from its JSON, --measured refused without the GPUs. That its rank is a real rank of moecg.parallel is tested in
tests/test_parallel.py (the 2-rank gloo spawn).
"""
from __future__ import annotations

import json

import pytest
import torch

import ep_projection_worker

proj = ep_projection_worker.load_script()


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
