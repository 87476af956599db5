"""Rewards that need weights or a server are refused before a run is queued (and again before its first
rollout), with the command that makes them usable; the New-run form marks them (issue 18, item 1)."""

import pytest

from core.config import ConfigError, preset


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _snapshot(cache, repo: str, *files: str):
    snap = cache / ("models--" + repo.replace("/", "--")) / "snapshots" / "abc123"
    snap.mkdir(parents=True, exist_ok=True)
    for f in files:
        (snap / f).write_text("{}")
    return snap


def _with_reward(name: str, **kwargs):
    cfg = preset("tiny").to_dict()
    cfg["rewards"] = [{"name": "brightness", "weight": 1.0, "kwargs": {}},
                      {"name": name, "weight": 1.0, "kwargs": kwargs}]
    from core.config import TrainConfig

    return TrainConfig.from_dict(cfg)


def test_missing_weights_name_the_download_commands_and_files_make_them_usable(empty_cache, tmp_path):
    from core.preflight import missing_reward_files, rewards_usable

    why = missing_reward_files("pickscore")
    assert "hf download yuvalkirstain/PickScore_v1" in why and "hf download laion/CLIP-ViT-H-14" in why
    assert str(empty_cache) in why
    with pytest.raises(ConfigError) as e:
        rewards_usable(_with_reward("pickscore"))
    assert str(e.value).startswith("rewards[1].name='pickscore': needs model weights")
    # only what is still missing is named: the model in the cache, the processor not
    _snapshot(empty_cache, "yuvalkirstain/PickScore_v1", "config.json")
    why = missing_reward_files("pickscore")
    assert "PickScore_v1" not in why and "laion/CLIP-ViT-H-14-laion2B-s32B-b79K" in why
    _snapshot(empty_cache, "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "tokenizer.json")
    assert missing_reward_files("pickscore") is None
    rewards_usable(_with_reward("pickscore"))
    # a file reward: the file itself must be in the snapshot
    _snapshot(empty_cache, "xswu/HPSv2", "other.pt")
    assert "hf download xswu/HPSv2 HPS_v2.1_compressed.pt" in missing_reward_files("hpsv2")
    # local paths in the kwargs are used as they are
    head = tmp_path / "head.pth"
    head.write_bytes(b"x")
    clip = tmp_path / "clip"
    clip.mkdir()
    assert missing_reward_files("aesthetic", {"head": str(head), "clip": str(clip)}) is None
    assert f"a folder at {tmp_path / 'nope'}" in missing_reward_files("clipscore", {"model": str(tmp_path / "nope")})
    # weight-free rewards are always usable; remote needs its url
    assert missing_reward_files("brightness") is None
    assert "url" in missing_reward_files("remote") and missing_reward_files("remote", {"url": "http://x"}) is None


def test_the_form_marks_unusable_rewards_and_refuses_them_before_queueing(web_store, empty_cache):
    from app.forms import config_form_values, form_fields
    from app.pages.new_run import reward_choices, start, unusable_rewards
    from core.rewards import EXTERNAL_REWARDS, available_rewards

    names = list(available_rewards())
    unusable = unusable_rewards(names)
    assert set(unusable) == set(EXTERNAL_REWARDS)  # all seven, and nothing else
    labels = dict((v, label) for label, v in reward_choices(names, unusable))
    assert labels["clipscore"] == "clipscore — needs weights" and labels["remote"] == "remote — needs a server"
    assert labels["brightness"] == "brightness"

    fields = form_fields(preset("tiny"))
    *values, rewards, weights, stages, single, sources = config_form_values(preset("tiny"), fields)
    error, status = start("tiny", "", rewards + ["clipscore"], weights, stages, single, sources, fields, values)
    assert error.startswith("**Not started.** `` rewards[") and "clipscore" in error, error
    assert "`hf download openai/clip-vit-large-patch14`" in error and error.endswith(" ``")  # the command whole
    assert status == "" and web_store.list_runs() == []


def test_the_job_refuses_before_its_first_rollout(web_store, empty_cache):
    """A run queued before its weights went missing (or through the store directly) fails at once, one line."""
    from jobs import schema as s
    from jobs.job import execute

    cfg = _with_reward("imagereward")
    run_id = web_store.create_run(cfg.to_dict(), strategy="marble", total_steps=cfg.steps)
    web_store.claim(run_id)
    assert execute(web_store, run_id, heartbeat_seconds=0.2) == s.FAILED
    run = web_store.get_run(run_id)
    assert "rewards[1].name='imagereward'" in run.error and "hf download THUDM/ImageReward" in run.error
    assert run.step == 0 and not list(run.run_dir.glob("samples/*"))


def test_a_model_that_is_nowhere_is_refused_when_queued_not_in_the_worker(empty_cache, tmp_path):
    """A model name that is no built-in model, folder or cached repo id failed only once the worker loaded it
    (new-user pass); submit's preflight now names the field and the rule."""
    from core.cache import BUILT_IN_MODELS
    from core.models import available_models
    from core.preflight import model_found

    assert set(BUILT_IN_MODELS) == set(available_models())  # the torch-free list is the registry's
    cfg = preset("tiny")
    for name in BUILT_IN_MODELS:
        model_found(cfg.with_overrides({"model.name": name}))
    with pytest.raises(ConfigError, match=r"model.name='nonexistent-model': must be a built-in model \(tiny, "
                                          r"mini-world\), an existing diffusers folder, or a Hugging Face repo id"):
        model_found(cfg.with_overrides({"model.name": "nonexistent-model"}))
    with pytest.raises(ConfigError, match="org/model"):
        model_found(cfg.with_overrides({"model.name": "org/model"}))
    _snapshot(empty_cache, "org/model", "model_index.json")
    model_found(cfg.with_overrides({"model.name": "org/model"}))  # cached: accepted
    model_found(cfg.with_overrides({"model.name": str(tmp_path)}))  # an existing folder: accepted (loading checks it)
