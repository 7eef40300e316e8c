"""One results schema: results.json, the summary, moecg.analysis and the docs/schema.md table all come from
moecg.schema."""
from pathlib import Path

import pytest

from moecg import analysis, schema

SCHEMA_DOC = Path(__file__).resolve().parent.parent / "docs" / "schema.md"


def test_docs_table_is_the_schema():
    text = SCHEMA_DOC.read_text()
    body = text.split("<!-- schema:begin -->\n", 1)[1].split("\n<!-- schema:end -->", 1)[0]
    assert body == schema.markdown_table(), \
        "docs/schema.md results table differs: paste `python -m moecg.schema` output"


def test_every_consumer_reads_the_schema():
    import moecg.run as run

    assert run.SUMMARY is schema.SUMMARY
    assert analysis.TABLE == list(schema.ANALYSIS) and analysis.AXES == list(schema.AXES)
    assert set(schema.SUMMARY) <= set(schema.NAMES) and set(schema.AXES) <= set(schema.NAMES)
    assert len(set(schema.NAMES)) == len(schema.NAMES)


def test_axes_and_percentiles_are_read_from_the_schema():
    """Failed jobs' axes come from the config keys each axis names (run.py and analysis.py both), and every such key
    exists in the composed config; per-request latencies are recorded at schema.PERCENTILES."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import moecg

    axes = [f for f in schema.FIELDS if f.axis]
    assert axes and all(f.config for f in axes)
    with initialize_config_dir(config_dir=str(Path(moecg.__file__).parent / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["workload=poisson", "dispatch=capacity"])  # every axis applies
    for f in axes:
        assert OmegaConf.select(cfg, f.config[0], default="<absent>") != "<absent>", f
    got = schema.axes_from_config(OmegaConf.to_container(cfg))
    assert (got["workload"], got["dispatch"], got["capacity_factor"], got["workload_rate"]) == \
        ("poisson", "capacity", 1.25, 4.0)
    assert {"ttft_ms_p99", "anchor_e2e_ms_p90"} <= set(schema.NAMES)



def test_records_must_match_the_schema():
    full = {n: None for n in schema.NAMES}
    assert list(schema.ok_record(full)) == list(schema.NAMES)
    with pytest.raises(schema.SchemaError, match="missing.*'drop_rate'"):
        schema.ok_record({k: v for k, v in full.items() if k != "drop_rate"})
    with pytest.raises(schema.SchemaError, match="unknown.*'drop_ratio'"):
        schema.ok_record({**full, "drop_ratio": 0.1})


def test_harness_record_has_every_field_and_honest_cpu_numbers():
    from hydra import compose, initialize_config_dir

    import moecg
    from moecg.harness import run_experiment

    with initialize_config_dir(config_dir=str(Path(moecg.__file__).parent / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["new_tokens=4", "prompt_len=4", "measure.repeats=1",
                                                        "measure.skip_steps=0", "strategy=partial"])
    res = run_experiment(cfg)
    assert list(res) == list(schema.NAMES)
    # CPU: no measured bandwidth, so no floor; the same eager path as its baseline, so no speedup
    assert res["hbm_bandwidth_gbps"] is None and res["floor_ms"] is None and res["floor_ratio"] is None
    assert res["bandwidth_source"] == "unknown"
    assert res["captured"] is False and res["speedup_vs_eager"] is None
    assert res["peak_mem_kind"] == "process_rss" and res["peak_mem_mib"] > 0
    assert isinstance(res["latency_noisy"], bool) and res["latency_spread"] >= 1.0
    assert res["capacity"] is None and res["capacity_buffer"] is None
