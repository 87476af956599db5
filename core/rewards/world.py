"""Rewards of the built-in mini world: GenEval-like checks done with image analysis (core.world.checker).

Specialist rewards apply only to their own task and return NaN elsewhere (spec §3), and give graded
partial credit, because pass/fail rewards on hard prompts are mostly all-zero within a group and then
carry no advantage signal (ENV_NOTES):

    color_fidelity    world-color prompts     each requested (colour, shape) object present
    count_accuracy    world-count prompts     soft count of objects of the colour vs the number asked
    spatial_relation  world-position prompts  both objects present and the relation between them
    single_object     single-object prompts   the requested object present and alone, of the size asked when
                      (world-general,         one is named
                      world-single)
    object_size       world-size prompts      the same check on prompts that name a size ("a small red circle")
    (each specialist also multiplies by exp(-objects beyond those asked): the prompt asks for exactly
    its objects, and otherwise a general reward can be raised with clutter the specialists never see)
    world_geneval     every world prompt      strict pass/fail of the whole prompt (for evaluation)

A prompt applies when its metadata carries the world spec (``task`` and ``objects``), whatever the
source is called, so the rewards also work on ``file:`` prompt sets that carry the same metadata.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.rewards.base import Reward, register_reward


TASKS_OF = {"color_fidelity": ("color",), "count_accuracy": ("count",), "spatial_relation": ("position",),
            "single_object": ("single",), "object_size": ("size",),
            "world_geneval": ("single", "color", "count", "position", "size")}
"""Which world tasks (a prompt's metadata ``task``) each world reward scores; NaN on every other prompt."""


class WorldReward(Reward):
    """Runs the checker on every image whose metadata is a spec of one of ``tasks``; NaN on the rest."""

    def __init__(self, tasks: tuple[str, ...], strict: bool = False):
        self.tasks = tasks
        self.strict = strict

    def applies(self, meta: Mapping[str, Any]) -> bool:
        return meta.get("task") in self.tasks and isinstance(meta.get("objects"), list)

    def score(self, images, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]):
        import numpy as np
        import torch

        from core.world.checker import GRADERS, detect, geneval_pass

        out = torch.full((len(prompts),), float("nan"))
        todo = [i for i, m in enumerate(metadata) if self.applies(m)]
        if not todo:
            return out
        arr = (images[todo].permute(0, 2, 3, 1).cpu().numpy() * 255.0).round().astype(np.uint8)
        for row, i in enumerate(todo):
            spec = metadata[i]
            dets = detect(arr[row])
            out[i] = float(geneval_pass(spec, dets)) if self.strict else GRADERS[spec["task"]](spec, dets)
        return out


@register_reward("color_fidelity", "Mini world, colour prompts only: each requested colour-and-shape object "
                                   "present, no others (graded, 0-1; NaN on other prompts)")
def color_fidelity() -> Reward:
    return WorldReward(TASKS_OF["color_fidelity"])


@register_reward("count_accuracy", "Mini world, count prompts only: exp(-|soft count of the colour - n| - other objects), "
                                   "with a little shape credit (0-1; NaN on other prompts)")
def count_accuracy() -> Reward:
    return WorldReward(TASKS_OF["count_accuracy"])


@register_reward("spatial_relation", "Mini world, position prompts only: both objects present, no others, "
                                     "and their relation, graded by the centre margin (0-1; NaN on other prompts)")
def spatial_relation() -> Reward:
    return WorldReward(TASKS_OF["spatial_relation"])


@register_reward("single_object", "Mini world, single-object prompts only: the requested colour-and-shape object, "
                                  "alone, of the requested size if one is named (graded, 0-1; NaN on other prompts)")
def single_object() -> Reward:
    return WorldReward(TASKS_OF["single_object"])


@register_reward("object_size", "Mini world, sized single-object prompts only (world-size): the requested "
                               "colour-and-shape object, alone, of the size asked (graded, 0-1; NaN on other prompts)")
def object_size() -> Reward:
    return WorldReward(TASKS_OF["object_size"])


@register_reward("world_geneval", "Mini world, every world prompt: strict pass/fail of the whole prompt "
                                  "(GenEval-style, 0 or 1; NaN on prompts without a world spec)")
def world_geneval() -> Reward:
    return WorldReward(TASKS_OF["world_geneval"], strict=True)
