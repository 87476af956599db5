import json

import pytest

from core.config import PRESETS, ConfigError, TrainConfig, available_presets, preset


@pytest.mark.parametrize("name", list(available_presets()))
def test_every_preset_validates_and_round_trips_through_json(name):
    cfg = preset(name)
    again = TrainConfig.from_json(cfg.to_json())
    assert again == cfg
    assert json.loads(again.to_json()) == json.loads(cfg.to_json())


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError, match="valid choices: .*tiny"):
        preset("nope")


@pytest.mark.parametrize("key,value,pattern", [
    ("balance.strategy", "magic", r"balance.strategy='magic': valid choices: .*marble.*weighted_sum"),
    ("balance.ema_rho", 1.5, r"balance.ema_rho=1.5: must be a number in \[0, 1\)"),
    ("balance.harmonize_every", 0, r"balance.harmonize_every=0: must be an integer >= 1"),
    ("advantage.std_mode", "local", r"advantage.std_mode='local': valid choices: global, group"),
    ("sampling.images_per_prompt", 1, r"images_per_prompt=1: must be an integer in \[2, 256\]"),
    ("sampling.resolution", 50, r"sampling.resolution=50: must be a multiple of 16"),
    ("nft.nft_beta", 0, r"nft.nft_beta=0.0: must be a number in \(0, 1\]"),
    ("model.dtype", "float8", r"model.dtype='float8': valid choices: float32, bfloat16, float16"),
    ("prompts.sources", ["nowhere"], r"prompts.sources='nowhere': valid choices: .*tiny"),
    ("steps", -3, r"steps=-3: must be an integer in \[1, 10000000\]"),
    ("balance.amortized_combination", "sum", r"balance.amortized_combination='sum': valid choices: masked, authors"),
    ("nft.micro_batch_size", 12, r"nft.micro_batch_size=12: micro-batches must be of equal size .* the batch of 16 "
                                 r"samples \(4 prompts × 4 images\) splits evenly into micro-batches of 1, 2, 4, 8, 16"),
])
def test_bad_values_name_field_value_and_rule(key, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        preset("tiny").with_overrides({key: value})


def test_bad_reward_name_and_duplicate_reward():
    data = preset("tiny").to_dict()
    data["rewards"][0]["name"] = "aesthetics_v9"
    with pytest.raises(ConfigError, match=r"rewards\[0\].name='aesthetics_v9': valid choices: .*brightness"):
        TrainConfig.from_dict(data)
    data = preset("tiny").to_dict()
    data["rewards"].append(dict(data["rewards"][0]))
    with pytest.raises(ConfigError, match="repeated: jpeg_compressibility"):
        TrainConfig.from_dict(data)


def test_strategy_specific_rules():
    with pytest.raises(ConfigError, match=r"balance.single_reward=None: strategy 'single' needs one of"):
        preset("tiny").with_overrides({"balance.strategy": "single"})
    with pytest.raises(ConfigError, match=r"balance.stages\[0\].rewards=\['ocr'\]: must be a non-empty subset"):
        preset("tiny").with_overrides({"balance.strategy": "sequential",
                                       "balance.stages": [{"rewards": ["ocr"], "steps": 3}]})
    with pytest.raises(ConfigError, match="needs at least one stage"):
        preset("tiny").with_overrides({"balance.strategy": "sequential", "balance.stages": []})


def test_unknown_keys_are_rejected_by_name():
    data = preset("tiny").to_dict()
    data["balance"]["rho"] = 0.5
    with pytest.raises(ConfigError, match=r"balance.rho=0.5: unknown key; valid keys: strategy"):
        TrainConfig.from_dict(data)
    with pytest.raises(ConfigError, match="unknown key 'lr_max'"):
        preset("tiny").with_overrides(["optim.lr_max=3"])


def test_overrides_parse_json_values_and_keep_strings():
    cfg = preset("tiny").with_overrides(["balance.ema_rho=0.5", "balance.normalize=false",
                                         "model.name=tiny", "steps=7"])
    assert cfg.balance.ema_rho == 0.5 and cfg.balance.normalize is False and cfg.steps == 7
    assert cfg.model.name == "tiny"
    with pytest.raises(ConfigError, match="must look like key=value"):
        preset("tiny").with_overrides(["steps"])


def test_configs_stored_before_the_rename_load_under_the_new_names():
    data = preset("mini-marble").to_dict()
    data["balance"]["refresh_every"] = data["balance"].pop("harmonize_every") + 3  # a run stored before 2026-12
    data["balance"]["refresh_scope"] = "step"
    data["balance"].pop("harmonize_scope")
    cfg = TrainConfig.from_dict(data)
    assert cfg.balance.harmonize_every == 13 and cfg.balance.harmonize_scope == "step"
    assert "refresh_every" not in json.dumps(cfg.to_dict())
    assert preset("mini-marble").with_overrides(["balance.refresh_every=4"]).balance.harmonize_every == 4
    data["balance"]["harmonize_every"] = 5
    with pytest.raises(ConfigError, match=r"balance\.refresh_every.*old name of harmonize_every"):
        TrainConfig.from_dict(data)


def test_invalid_json_is_a_config_error():
    with pytest.raises(ConfigError, match="is not valid JSON"):
        TrainConfig.from_json("{steps: 3")


def test_paper_presets_combine_amortized_units_as_the_release_and_the_others_as_the_evidence_favours():
    for name in PRESETS:
        expected = "authors" if name.startswith("sd35m-paper") else "masked"
        assert preset(name).balance.amortized_combination == expected, name


def test_sd35_preset_carries_the_papers_hyperparameters():
    cfg = preset("sd35m-paper")
    assert (cfg.model.lora_rank, cfg.model.lora_alpha) == (32, 64.0)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.grad_clip) == (3e-4, 1e-4, 1.0)
    assert (cfg.nft.nft_beta, cfg.nft.adv_clip_max, cfg.nft.kl_coef) == (0.1, 5.0, 1e-4)
    assert (cfg.balance.harmonize_every, cfg.balance.ema_rho) == (10, 0.7)
    assert (cfg.sampling.num_steps, cfg.sampling.resolution, cfg.sampling.images_per_prompt) == (25, 512, 24)


def test_the_object150_family_is_the_object_family_stopped_at_step_150():
    """Fixed before its study (docs/study-object150/PREREGISTRATION.md): the same world, rewards, batch, LoRA, rate
    and balancing as object-*, only 150 steps, and the sequential baseline's three stages rescaled to 50 each."""
    from core.presets import OBJECT_SHORT_STEPS

    assert OBJECT_SHORT_STEPS == 150
    for strategy in ("marble", "weighted-sum", "equal", "sequential", "marble-full"):
        short, full = preset(f"object150-{strategy}").to_dict(), preset(f"object-{strategy}").to_dict()
        assert short.pop("steps") == 150 and full.pop("steps") == 200
        stages = [s.pop("steps") for s in short["balance"].pop("stages") or []]
        full_stages = [s.pop("steps") for s in full["balance"].pop("stages") or []]
        assert short == full  # nothing else differs
        if strategy == "sequential":
            assert stages == [50, 50, 50] and full_stages == [66, 66, 68]
