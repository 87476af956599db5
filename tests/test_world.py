"""The mini world: deterministic generator, prompt sources, tokenizer, analytic checker and its rewards.

Ground truth comes from the generator itself: a render of a spec is a correct image for that spec's
prompt; a render of a deliberately different spec is a wrong one.
"""

import copy
import math

import numpy as np
import pytest
import torch

from core.prompts import PromptSampler, available_sources, load_source
from core.rewards import make_reward
from core.world.checker import detect, geneval_pass, grade
from core.rewards.world import TASKS_OF
from core.world.prompts import SOURCES, TASK_SOURCES
from core.world.scenes import (COLORS, NUMBERS, PALETTE, RELATIONS, SHAPES, all_specs, caption, random_spec, render,
                               to_tensor, vocabulary)

SPECIALISTS = {"color_fidelity": "world-color", "count_accuracy": "world-count", "spatial_relation": "world-position",
               "single_object": "world-general", "object_size": "world-size"}


# ---- generator ------------------------------------------------------------------------------------

def test_render_is_deterministic_for_a_seed_and_varies_across_seeds():
    spec = {"task": "position", "objects": [{"color": "red", "shape": "circle"}, {"color": "blue", "shape": "square"}],
            "relation": "left of"}
    a, b, c = render(spec, 7), render(spec, 7), render(spec, 8)
    assert a.shape == (64, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    rng1, rng2 = np.random.default_rng(5), np.random.default_rng(5)
    assert [random_spec(rng1) for _ in range(20)] == [random_spec(rng2) for _ in range(20)]


def test_render_draws_what_the_spec_asks():
    spec = {"task": "count", "objects": [{"color": "yellow", "shape": "triangle"}], "count": 3}
    for seed in range(5):
        dets = detect(render(spec, seed))
        assert len(dets) == 3
        assert {d.color for d in dets} == {"yellow"} and {d.shape for d in dets} == {"triangle"}


def test_captions_use_only_the_world_vocabulary_and_the_spec_space_is_complete():
    vocab = set(vocabulary())
    for task, n in (("single", 63), ("color", 252), ("count", 63), ("position", 1512)):
        specs = all_specs(task)
        assert len(specs) == n
        texts = [caption(s) for s in specs]
        assert len(set(texts)) == n  # one prompt per spec
        assert all(set(t.split()) <= vocab for t in texts)
    assert caption({"task": "count", "objects": [{"color": "red", "shape": "circle"}], "count": 2}) == "two red circles"


def test_tokenizer_makes_each_caption_word_one_token():
    from core.world.tokenizer import build_tokenizer

    tok = build_tokenizer(16)
    for word in vocabulary():
        assert len(tok(word).input_ids) == 3, word  # <start> word <end>
    ids = tok("a red circle left of a blue square").input_ids
    assert len(ids) == 10
    assert len(tok("an unknown zebra").input_ids) > 4  # other text still tokenizes (byte fallback)


# ---- prompt sources -------------------------------------------------------------------------------

def test_world_sources_are_registered_with_disjoint_splits_and_their_spec_as_metadata():
    for name, (task, _) in SOURCES.items():
        assert name in available_sources()
        src = load_source(name)
        train, test = {it.text for it in src.train}, {it.text for it in src.test}
        assert train and test and not (train & test)
        assert len(test) == pytest.approx((len(train) + len(test)) / 5, abs=1)
        for it in src.train[:20] + src.test[:20]:
            assert it.metadata["source"] == name and it.metadata["task"] == task
            assert caption(it.metadata) == it.text
    assert load_source("world-count").test[0] == load_source("world-count").test[0]  # stable order


def test_sampler_stratifies_each_step_across_the_four_world_sources():
    sampler = PromptSampler(list(TASK_SOURCES))
    items = sampler.sample(8, np.random.default_rng(0), step=0)
    assert sorted(it.metadata["source"] for it in items) == sorted(list(TASK_SOURCES) * 2)


def test_world_single_and_world_size_split_world_generals_prompts_by_their_size_word():
    general = {it.text for it in load_source("world-general").split("train") + load_source("world-general").test}
    single, size = ({it.text for it in load_source(n).train + load_source(n).test} for n in ("world-single", "world-size"))
    assert single | size == general and not single & size
    assert all(len(t.split()) == 3 for t in single)  # "a red circle"
    assert all(t.split()[1] in ("small", "large") for t in size)
    assert {it.metadata["task"] for it in load_source("world-size").train} == {"size"}


# ---- checker on ground truth ----------------------------------------------------------------------

def test_checker_is_right_on_ground_truth_renders():
    rng = np.random.default_rng(11)
    passes, scores = [], []
    for _ in range(160):
        spec = random_spec(rng)
        g = grade(spec, render(spec, rng))
        passes.append(g["pass"])
        scores.append(g["score"])
    assert np.mean(passes) >= 0.97
    assert np.mean(scores) >= 0.9


def test_checker_reads_every_palette_colour_and_shape():
    for color in COLORS:
        for shape in SHAPES:
            spec = {"task": "single", "objects": [{"color": color, "shape": shape}], "size": None}
            dets = detect(render(spec, 0))
            assert len(dets) == 1 and dets[0].color == color and dets[0].shape == shape, (color, shape)
            assert dets[0].color_probs[color] > 0.9


# ---- specialist rewards ---------------------------------------------------------------------------

def _wrong(spec: dict, rng: np.random.Generator) -> dict:
    """A spec whose render is a wrong image for ``spec``'s prompt, on the aspect its reward checks."""
    w = copy.deepcopy(spec)
    if spec["task"] in ("single", "size"):  # another colour, and the other size when one is asked
        w["objects"][0]["color"] = str(rng.choice([c for c in COLORS if c != spec["objects"][0]["color"]]))
        w["size"] = {"small": "large", "large": "small"}.get(spec.get("size"))
    elif spec["task"] == "color":  # different colours for both objects
        used = {o["color"] for o in spec["objects"]}
        others = [c for c in COLORS if c not in used]
        for o, c in zip(w["objects"], rng.choice(others, size=2, replace=False)):
            o["color"] = str(c)
    elif spec["task"] == "count":  # another number of objects
        w["count"] = int(rng.choice([n for n in (1, *NUMBERS) if abs(n - spec["count"]) >= 2]
                                    or [n for n in (1, *NUMBERS) if n != spec["count"]]))
        if w["count"] == 1:
            w = {"task": "single", "objects": w["objects"], "size": None}
    else:  # the opposite relation
        opposite = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
        w["relation"] = opposite[spec["relation"]]
    return w


@pytest.mark.parametrize("reward_name", sorted(SPECIALISTS))
def test_specialist_scores_correct_renders_high_wrong_ones_low_and_nan_off_its_source(reward_name):
    reward = make_reward(reward_name)
    source = load_source(SPECIALISTS[reward_name])
    rng = np.random.default_rng(0)
    items = source.test[:12]
    good = to_tensor(np.stack([render(it.metadata, rng) for it in items]))
    bad = to_tensor(np.stack([render(_wrong(it.metadata, rng), rng) for it in items]))
    prompts, meta = [it.text for it in items], [it.metadata for it in items]
    r_good, r_bad = reward(good, prompts, meta), reward(bad, prompts, meta)
    assert r_good.mean() >= 0.85 and r_good.min() >= 0.6
    assert r_bad.mean() <= 0.4
    assert bool((r_good > r_bad).all())
    # graded, not pass/fail: wrong renders still get partial credit between 0 and the correct ones
    assert 0.0 <= float(r_bad.min()) and float(r_bad.max()) < 1.0
    others = [load_source(s).test[0] for s, (task, _) in SOURCES.items() if task not in TASKS_OF[reward_name]]
    assert len(others) >= 3
    off = reward(to_tensor(np.stack([render(it.metadata, 0) for it in others])), [it.text for it in others],
                 [it.metadata for it in others])
    assert bool(torch.isnan(off).all())
    assert bool(torch.isnan(reward(good[:2], ["a red circle"] * 2, [{}, {"source": "tiny"}])).all())


def test_position_reward_grades_the_margin_between_the_objects():
    from core.world.checker import position_score
    from core.world.scenes import Placed, draw

    spec = {"task": "position", "objects": [{"color": "red", "shape": "circle"}, {"color": "blue", "shape": "square"}],
            "relation": "left of"}
    scores = []
    for dx in (-20, -4, 0, 4, 20):  # red's x minus blue's x
        img = draw([Placed("red", "circle", 32 + dx / 2, 20, 12), Placed("blue", "square", 32 - dx / 2, 44, 12)],
                   (20, 20, 30))
        scores.append(position_score(spec, detect(img)))
    assert scores == sorted(scores, reverse=True) and scores[0] > 0.8 and scores[-1] < 0.35
    assert 0.4 < scores[2] < 0.8  # a tie earns half the relation credit


def test_relation_check_needs_both_colours_and_reads_which_side_each_is_on():
    from core.world.checker import relation_holds
    from core.world.scenes import Placed, draw

    spec = {"task": "position", "objects": [{"color": "red", "shape": "circle"}, {"color": "blue", "shape": "square"}],
            "relation": "left of"}
    red_left = draw([Placed("red", "circle", 16, 30, 12), Placed("blue", "square", 48, 34, 12)], (20, 20, 30))
    red_right = draw([Placed("red", "circle", 48, 30, 12), Placed("blue", "square", 16, 34, 12)], (20, 20, 30))
    assert relation_holds(spec, detect(red_left)) is True
    assert relation_holds(spec, detect(red_right)) is False
    assert relation_holds({**spec, "relation": "right of"}, detect(red_right)) is True
    # the shape does not matter, a missing colour leaves nothing to judge
    assert relation_holds(spec, detect(draw([Placed("red", "triangle", 16, 30, 12),
                                             Placed("blue", "circle", 48, 34, 12)], (20, 20, 30)))) is True
    assert relation_holds(spec, detect(draw([Placed("red", "circle", 16, 30, 12),
                                             Placed("green", "square", 48, 34, 12)], (20, 20, 30)))) is None
    # two objects of one colour: the second requested object is the other one
    same = {**spec, "objects": [{"color": "red", "shape": "circle"}, {"color": "red", "shape": "square"}]}
    assert relation_holds(same, detect(draw([Placed("red", "circle", 16, 20, 16),
                                             Placed("red", "square", 48, 44, 10)], (20, 20, 30)))) is True


def test_count_reward_falls_with_the_distance_to_the_number_asked():
    reward = make_reward("count_accuracy")
    spec = {"task": "count", "objects": [{"color": "green", "shape": "square"}], "count": 3, "source": "world-count"}
    values = []
    for n in (3, 2, 4, 1):
        img = render({"task": "count", "objects": spec["objects"], "count": n} if n > 1 else
                     {"task": "single", "objects": spec["objects"], "size": None}, 1)
        values.append(float(reward(to_tensor(img[None]), ["three green squares"], [spec])[0]))
    assert values[0] > 0.9 and max(values[1:3]) < 0.45 and values[3] < values[1]


@pytest.mark.parametrize("reward_name", sorted(SPECIALISTS))
def test_every_specialist_penalizes_stray_objects_of_another_colour(reward_name):
    """The hole colorfulness exploited: after RL the model added 1-2 off-prompt objects per image, which
    raised colorfulness and cost the specialists almost nothing. Each stray object now costs ~exp(-1)."""
    from core.world.scenes import Placed, draw

    red, blue = {"color": "red", "shape": "circle"}, {"color": "blue", "shape": "square"}
    spec = {"color": {"task": "color", "objects": [red, blue]},
            "count": {"task": "count", "objects": [red], "count": 2},
            "position": {"task": "position", "objects": [red, blue], "relation": "left of"},
            "general": {"task": "single", "objects": [red], "size": None},
            "size": {"task": "size", "objects": [red], "size": "large"}}[SPECIALISTS[reward_name].split("-")[1]]
    second = spec["objects"][-1]  # count asks for two of the same object
    asked = [Placed("red", "circle", 14, 20, 16), Placed(second["color"], second["shape"], 48, 20, 16)]
    asked = asked[:1] if spec["task"] == "single" else [Placed("red", "circle", 16, 18, 28)] if spec["task"] == "size" \
        else asked
    strays = [Placed("yellow", "triangle", 16, 50, 12), Placed("green", "triangle", 48, 50, 12)]
    reward = make_reward(reward_name)
    meta = dict(spec, source=SPECIALISTS[reward_name])
    images = [draw(asked + strays[:n], (20, 20, 30)) for n in range(3)]
    assert [len(detect(img)) for img in images] == [len(asked) + n for n in range(3)]  # the strays are really there
    values = reward(to_tensor(np.stack(images)), ["x"] * 3, [meta] * 3).tolist()
    assert values[0] > 0.75 and values[1] < 0.5 * values[0] and values[2] < 0.5 * values[1]


def test_world_geneval_is_strict_pass_fail_on_every_world_task():
    reward = make_reward("world_geneval")
    rng = np.random.default_rng(2)
    specs = [random_spec(rng) for _ in range(16)]
    good = reward(to_tensor(np.stack([render(s, rng) for s in specs])), [caption(s) for s in specs], specs)
    assert set(good.tolist()) <= {0.0, 1.0} and good.mean() >= 0.9
    spec = {"task": "single", "objects": [{"color": "red", "shape": "circle"}], "size": None}
    blue = render({"task": "single", "objects": [{"color": "blue", "shape": "circle"}], "size": None}, 0)
    assert not geneval_pass(spec, detect(blue))
    # a sized prompt passes only at the size asked
    small = {"task": "size", "objects": [{"color": "red", "shape": "circle"}], "size": "small"}
    assert geneval_pass(small, detect(render(small, 0)))
    assert not geneval_pass(small, detect(render(dict(small, size="large"), 0)))
    assert math.isnan(float(reward(to_tensor(blue[None]), ["x"], [{"source": "tiny"}])[0]))


def test_palette_colours_are_far_apart():
    rgb = np.asarray(list(PALETTE.values()), dtype=float)
    d = np.sqrt(((rgb[:, None] - rgb[None]) ** 2).sum(-1)) + np.eye(len(rgb)) * 1e9
    assert d.min() > 80
    assert RELATIONS == ("left of", "right of", "above", "below")


def test_mini_presets_come_first_and_differ_only_in_the_balancing_strategy():
    from core.config import PRESETS, preset

    names = ["mini-marble", "mini-weighted-sum", "mini-equal", "mini-sequential"]
    assert list(PRESETS)[:4] == names
    configs = [preset(n).to_dict() for n in names]
    assert [c["balance"]["strategy"] for c in configs] == ["marble", "weighted_sum", "equal", "sequential"]
    for c in configs:
        assert c["model"]["name"] == "mini-world" and c["prompts"]["sources"] == list(TASK_SOURCES)
        assert {k: v for k, v in c.items() if k != "balance"} == {k: v for k, v in configs[0].items()
                                                                  if k != "balance"}
    stages = configs[3]["balance"]["stages"]
    assert sum(s["steps"] for s in stages) == configs[0]["steps"]
    assert {r for s in stages for r in s["rewards"]} == {r["name"] for r in configs[0]["rewards"]}


def test_single_object_reward_grades_the_size_asked():
    reward = make_reward("single_object")
    obj = {"color": "orange", "shape": "triangle"}
    values = {}
    for asked in ("small", "large", None):
        spec = {"task": "single", "objects": [obj], "size": asked, "source": "world-general"}
        for drawn in ("small", "large"):
            img = render({"task": "single", "objects": [obj], "size": drawn}, 3)
            values[asked, drawn] = float(reward(to_tensor(img[None]), ["x"], [spec])[0])
    assert values["small", "small"] > 0.8 and values["large", "large"] > 0.8
    assert values["small", "large"] < 0.2 and values["large", "small"] < 0.2
    assert values[None, "small"] > 0.8 and values[None, "large"] > 0.8  # no size named, no size judged


@pytest.mark.parametrize("family, sources", [("quality", ["world-general", "world-color", "world-count"]),
                                             ("object", ["world-single", "world-size"])])
def test_a_world_studys_presets_share_everything_but_the_balancing_and_cover_every_reward(family, sources):
    from core.config import PRESETS, TrainConfig, preset
    from core.preflight import reward_coverage

    names = [n for n in PRESETS if n.startswith(f"{family}-")]
    assert names == [f"{family}-{s}" for s in ("marble", "weighted-sum", "equal", "sequential", "marble-full")]
    configs = [preset(n) for n in names]
    for c in configs:
        c.validate()
        reward_coverage(c)  # every specialist has its prompts
    dicts = [c.to_dict() for c in configs]
    assert dicts[0]["prompts"]["sources"] == sources and dicts[0]["steps"] == 200
    for d in dicts:
        assert {k: v for k, v in d.items() if k != "balance"} == {k: v for k, v in dicts[0].items() if k != "balance"}
    assert [d["balance"]["strategy"] for d in dicts] == ["marble", "weighted_sum", "equal", "sequential", "marble_full"]
    # the sequential schedule spends the same budget, each specialist on its own source, every reward once
    stages = configs[3].balance.stages
    assert sum(s.steps for s in stages) == 200
    assert sorted(r for s in stages for r in s.rewards) == sorted(r.name for r in configs[0].rewards)
    for s in stages[:-1]:  # a specialist's stage reads only its source, which holds its prompts
        (reward,) = s.rewards
        reward_coverage(TrainConfig.from_dict(dict(dicts[0], prompts={"sources": s.sources, "split": "train"},
                                                   rewards=[{"name": reward}], balance={"strategy": "equal"})))
