"""Model zoo, family adapters, router skew, the decode engine and config composition."""
import pytest
import torch
from hydra import compose, initialize_config_dir

import moecg.config

from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import DecodeEngine
from moecg.models import PRESETS, apply_router_skew, build_model, make_config
from moecg.models.zoo import FAMILY_PRESETS

TINY = ["mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny"]


@pytest.mark.parametrize("preset", TINY)
def test_static_cache_loop_matches_hf_generate(preset):
    b = build_model(preset)
    prompts = torch.randint(0, 512, (3, 7), generator=torch.Generator().manual_seed(0))
    got = DecodeEngine(b.model, 7 + 12, 3).generate(prompts, 12, timing=False)
    ref = b.model.generate(prompts, max_new_tokens=12, do_sample=False, pad_token_id=0)[:, 7:]
    assert torch.equal(got.tokens, ref)


def test_adapter_finds_every_part():
    for preset in TINY:
        b = build_model(preset)
        layers = b.adapter.layers(b.model)
        assert len(b.adapter.moe_layers(b.model)) == len(layers)
        for layer in layers:
            assert b.adapter.router_of(layer) is not None and b.adapter.experts_of(layer) is not None
            has_shared = b.adapter.shared_expert_of(layer) is not None
            assert has_shared == (b.family == "qwen2_moe")


def test_qwen2_mlp_only_layers_and_sparse_step_respected():
    b = build_model("qwen2_moe_tiny", config_overrides={"mlp_only_layers": [1], "num_hidden_layers": 3})
    assert [i for i, _ in b.adapter.moe_layers(b.model)] == [0, 2]
    b = build_model("qwen2_moe_tiny", config_overrides={"decoder_sparse_step": 2, "num_hidden_layers": 4})
    assert [i for i, _ in b.adapter.moe_layers(b.model)] == [1, 3]
    state = attach(b.model, make_dispatcher("dropless"))
    assert state.layer_ids == [1, 3]
    b.model(torch.randint(0, 512, (1, 4)))
    detach(b.model)


def test_build_is_seeded_and_cuts_layers():
    a, b = build_model("mixtral_tiny", seed=3), build_model("mixtral_tiny", seed=3)
    c = build_model("mixtral_tiny", seed=4, num_layers=1)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert len(c.adapter.layers(c.model)) == 1
    assert not torch.equal(pa["model.embed_tokens.weight"], dict(c.model.named_parameters())["model.embed_tokens.weight"])
    assert all(p in PRESETS for p in ["mixtral_8x7b", "qwen1_5_moe_a2_7b", "qwen3_30b_a3b", "deepseek_v3", "glm4_5_air",
                                      "deepseek_v2_lite", "olmoe_1b_7b", "gpt_oss_20b"])
    assert make_config("qwen1_5_moe_a2_7b", num_layers=2).num_hidden_layers == 2
    with pytest.raises(ValueError, match="unknown model preset"):
        make_config("nope")


def test_pretrained_path_round_trip(tmp_path):
    b = build_model("qwen2_moe_tiny", seed=5)
    b.model.save_pretrained(tmp_path / "ck")
    loaded = build_model(pretrained_path=str(tmp_path / "ck"))
    assert loaded.family == "qwen2_moe"
    ids = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(loaded.model(ids).logits, b.model(ids).logits, atol=1e-5, rtol=1e-5)


def _imbalance(model, skew):
    apply_router_skew(model, skew, seed=0)
    state = attach(model, make_dispatcher("dropless"))
    model(torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(2)))
    imb = state.snapshot()["expert_load_imbalance"]
    detach(model)
    return imb


@pytest.mark.parametrize("preset", ["mixtral_tiny", "qwen3_moe_tiny", *FAMILY_PRESETS])
def test_router_skew_raises_load_imbalance_monotonically(preset):
    model = build_model(preset).model
    ids = torch.randint(0, 512, (2, 6))
    base = model(ids).logits
    imbs = [_imbalance(model, s) for s in (0.0, 0.05, 0.2)]  # random routers: logits std ~0.15
    assert imbs[0] < imbs[1] < imbs[2]  # the documented direction: more skew, hotter experts
    apply_router_skew(model, 0.0)  # 0 restores HF's router exactly
    torch.testing.assert_close(model(ids).logits, base, atol=0, rtol=0)
    with pytest.raises(ValueError, match="router_skew"):
        apply_router_skew(model, -1.0)


def test_engine_errors_are_clear():
    model = build_model("mixtral_tiny").model
    eng = DecodeEngine(model, 10, 2)
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        eng.generate(torch.zeros(1, 8, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="exceeds the engine's 2"):
        eng.generate(torch.zeros(3, 2, dtype=torch.long), 2)


# every option of every config group, read off conf/ itself, so a new YAML is composed without editing this list
_CONF = __import__("pathlib").Path(__import__("moecg").__file__).parent / "conf"
GROUPS = {**moecg.config.options(),
          **{g: sorted(p.stem for p in (_CONF / g).glob("*.yaml")) for g in ("logger", "experiment")}}


def test_every_config_option_composes():
    from pathlib import Path

    import moecg

    conf = str(Path(moecg.__file__).parent / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        for group, options in GROUPS.items():
            for opt in options:
                cfg = compose(config_name="config", overrides=[f"{group}={opt}"])
                assert cfg.batch_size >= 1 and cfg.strategy.name and cfg.dispatch.name
                if group in ("strategy", "dispatch", "workload", "logger"):
                    assert cfg[group].name == opt
                if group == "model" and opt != "local":
                    assert cfg.model.preset == opt
        assert compose(config_name="config", overrides=["strategy=capacity"]).dispatch.name == "capacity"
        for group in GROUPS:
            if group != "experiment":
                assert compose(config_name="config")[group] is not None


def test_prompts_from_file_and_heldout(tmp_path):
    from moecg.prompts import PromptError, make_prompts

    f = tmp_path / "ids.txt"
    f.write_text("1 2 3 4 5\n6 7 8 9 10\n")
    assert make_prompts("file", 2, 4, 0, 512, str(f)).tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]]
    with pytest.raises(PromptError, match="need batch_size=2 rows of at least prompt_len=6"):
        make_prompts("file", 2, 6, 0, 512, str(f))
    with pytest.raises(PromptError, match=r"token ids must lie in \[0, 8\)"):
        make_prompts("file", 2, 4, 0, 8, str(f))
    words = tmp_path / "words.txt"
    words.write_text("1 2 3\nhello world again\n")
    with pytest.raises(PromptError, match=r"prompt_file=.*words.txt, line 2: 'hello' is not a token id"):
        make_prompts("file", 2, 3, 0, 512, str(words))
    held = make_prompts("heldout", 3, 16, 1, 256)
    assert held.shape == (3, 16) and int(held.max()) < 256

def test_another_transformers_release_is_refused(monkeypatch):
    """moecg passes the KV cache as 5.24's `cache=`; 5.17 would ignore it and decode every row without its prompt.
    The release in the code is pyproject's pin, and build_model and DecodeEngine refuse any other, naming the fix."""
    import tomllib
    from pathlib import Path

    import moecg.models
    from moecg.models import TRANSFORMERS_RELEASE, check_transformers

    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"transformers=={TRANSFORMERS_RELEASE}.*" in deps
    check_transformers()  # the installed one
    check_transformers(TRANSFORMERS_RELEASE + ".3")
    for v in ("5.17.0", "5.2.4", "4.57.1", "6.24.0"):
        with pytest.raises(RuntimeError,
                           match=rf"transformers {v} is installed.*pip install 'transformers==5\.24\.\*'"):
            check_transformers(v)
    model = build_model("mixtral_tiny", dtype="fp32", device="cpu").model
    monkeypatch.setattr(moecg.models.transformers, "__version__", "5.17.0")  # the module object moecg reads
    with pytest.raises(RuntimeError, match="transformers 5.17.0"):
        build_model("mixtral_tiny", dtype="fp32", device="cpu")
    with pytest.raises(RuntimeError, match="transformers 5.17.0"):
        DecodeEngine(model, 32, 2)
