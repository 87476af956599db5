"""The mini world's prompt sources, like the paper's general / OCR / GenEval sources (spec §8).

    world-general   "a red circle", "a large blue triangle"       general rewards only
    world-color     "a red circle and a blue square"               + color_fidelity
    world-count     "three green squares"                          + count_accuracy
    world-position  "a red circle left of a blue square"           + spatial_relation
    world-single    "a red circle" (world-general's unsized half)  + single_object
    world-size      "a large blue triangle" (its sized half)       + object_size

world-single and world-size split world-general's prompts by whether they name a size, so that two
specialists (the object alone; the object alone at the size asked) have prompt sets of their own.

Each item's metadata is the world spec the caption was made from (``task``, ``objects``, ``count``,
``relation``, ``size``) plus ``source``; the specialist rewards read it and return NaN on other tasks.
Split: the task's full spec list in a fixed shuffled order, every 5th prompt held out for testing.
The held-out prompts are new *prompts* for RL (never trained on by the policy); the base model's
pretraining drew captions from the whole world, as a web-scale base model would have seen similar text.
"""

from __future__ import annotations

import numpy as np

from core.prompts import PromptItem, PromptSource, register_source
from core.world.scenes import all_specs, caption

SPLIT_SEED = 20260  # fixed: the split is part of the benchmark, not of a run
SOURCES = {  # source name -> (task, description)
    "world-general": ("single", "Mini world: one object, optional size (\"a large red circle\"); general rewards."),
    "world-color": ("color", "Mini world: two objects with their colours (\"a red circle and a blue square\")."),
    "world-count": ("count", "Mini world: 2-4 objects of one colour and shape (\"three green squares\")."),
    "world-position": ("position", "Mini world: two objects and a relation (\"a red circle left of a blue "
                                   "square\": left of, right of, above, below)."),
    "world-single": ("single", "Mini world: one object, no size word (\"a red circle\"); single_object's prompts."),
    "world-size": ("size", "Mini world: one object with a size word (\"a small blue square\"); object_size's prompts."),
}
TASK_SOURCES = ("world-general", "world-color", "world-count", "world-position")
"""One source per pretraining task: what the model card measures."""
_KEEP = {"world-single": lambda spec: spec.get("size") is None}
"""Sources that keep only some of their task's specs."""


def world_items(source: str) -> list[PromptItem]:
    """Every prompt of a world source, in the source's fixed shuffled order."""
    task = SOURCES[source][0]
    specs = [s for s in all_specs(task) if _KEEP.get(source, lambda _: True)(s)]
    order = np.random.default_rng([SPLIT_SEED, list(SOURCES).index(source)]).permutation(len(specs))
    return [PromptItem(caption(specs[i]), {"source": source, **specs[i]}) for i in order]


def world_source(source: str) -> PromptSource:
    items = world_items(source)
    test = [it for i, it in enumerate(items) if i % 5 == 4]
    train = [it for i, it in enumerate(items) if i % 5 != 4]
    return PromptSource(source, SOURCES[source][1], train, test)


def _register(source: str) -> None:
    register_source(source, SOURCES[source][1])(lambda: world_source(source))


for _name in SOURCES:
    _register(_name)
