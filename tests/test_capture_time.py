"""experiments/capture_time.py on CPU, in process (emulated graphs, no Triton): every bucket timed and the parts add up."""
import argparse
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "capture_time.py"


@pytest.fixture(scope="module")
def ct():
    spec = importlib.util.spec_from_file_location("capture_time", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_measure_times_every_bucket_and_the_parts_add_up(ct, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    args = argparse.Namespace(
        preset="mixtral_tiny", num_layers=None, strategy="full", kernels="fused", dispatch="fused", buckets=[1, 2, 4],
        cache_len=32, warmup=2, device="cpu", dtype="fp32", backend="auto", target_cold=3.0, target_warm=0.5,
        no_precompile=False, profile_out=None, recapture=True)
    row = ct.measure(args)
    assert row["capture_backend"] == "emulate" and row["kernel_backend"] == "torch" and row["graphs"] == 3
    assert list(row["buckets"]) == ["1", "2", "4"]
    parts = row["precompile_s"] + row["first_warmup_s"] + row["steady_warmup_s"] + row["graph_capture_s"] + row["other_s"]
    assert parts == pytest.approx(row["apply_s"]) and row["capture_all_s"] == pytest.approx(row["setup_s"] + parts)
    assert all(0 <= b["jit_s"] <= b["first_warmup_s"] for b in row["buckets"].values())
    text = ct.report([dict(row, run="cold"), dict(row, run="warm")], args)
    assert row["recapture_s"] is not None and row["recapture_s"] > 0 and "re-capture" in text
    assert "| cold | **" in text and "| 4 |" in text and "smoke test" in text
