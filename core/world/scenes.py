"""The mini world: procedural 64×64 scenes of coloured shapes and the captions that describe them.

A *spec* is what a caption asks for, as plain JSON-able metadata (it travels with the prompt as
``PromptItem.metadata`` and is what the rewards check):

    {"task": "single",   "objects": [{"color": "red", "shape": "circle"}], "size": "large" | None}
    {"task": "color",    "objects": [A, B]}                        "a red circle and a blue square"
    {"task": "count",    "objects": [A], "count": 3}               "three red circles"
    {"task": "position", "objects": [A, B], "relation": "left of"} "a red circle left of a blue square"

``render(spec, rng)`` draws one scene that satisfies the spec (positions, sizes and the dark tinted
background are random); the same spec and the same seed give the same image. Shapes are drawn with
PIL at 4× and box-downsampled, so edges are anti-aliased like a decoder's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

RESOLUTION = 64
SUPERSAMPLE = 4

# RGB 0-255. Far apart from each other and from any dark background, so nearest-palette colour
# identification is unambiguous (chance level for a colour is 1/7).
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (225, 45, 45),
    "orange": (245, 145, 35),
    "yellow": (240, 230, 60),
    "green": (55, 190, 70),
    "blue": (55, 100, 240),
    "purple": (165, 70, 215),
    "white": (240, 240, 240),
}
COLORS = tuple(PALETTE)
SHAPES = ("circle", "square", "triangle")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles"}
NUMBERS = {2: "two", 3: "three", 4: "four"}
RELATIONS = ("left of", "right of", "above", "below")
SIZES = ("small", "large")
# Object extent (diameter / side) in pixels of the 64-px image.
SIZE_RANGE = {"small": (9, 12), None: (14, 22), "large": (26, 32), "multi": (10, 16)}
MIN_GAP = 10  # a relation holds with at least this many pixels between the two centres

TASKS = ("single", "color", "count", "position", "size")
"""``size`` specs are single objects with a size word; their captions and renders are those of ``single``. The task
exists so that a specialist can score sized prompts alone (world-size), apart from the unsized ones."""


# ---- captions ------------------------------------------------------------------------------------

def _noun(obj: dict) -> str:
    return f"{obj['color']} {obj['shape']}"


def caption(spec: dict) -> str:
    """The prompt text of a spec."""
    task, objs = spec["task"], spec["objects"]
    if task in ("single", "size"):
        size = spec.get("size")
        return f"a {size + ' ' if size else ''}{_noun(objs[0])}"
    if task == "color":
        return f"a {_noun(objs[0])} and a {_noun(objs[1])}"
    if task == "count":
        return f"{NUMBERS[spec['count']]} {objs[0]['color']} {PLURALS[objs[0]['shape']]}"
    if task == "position":
        return f"a {_noun(objs[0])} {spec['relation']} a {_noun(objs[1])}"
    raise ValueError(f"spec task {task!r} is unknown; valid choices: {', '.join(TASKS)}")


def vocabulary() -> list[str]:
    """Every word a caption can use, in a fixed order (the text side's word tokens)."""
    words = ["a", "and"] + list(COLORS) + list(SHAPES) + list(PLURALS.values()) + list(NUMBERS.values())
    words += list(SIZES)
    for rel in RELATIONS:
        words += rel.split()
    return list(dict.fromkeys(words))


# ---- the spec space ------------------------------------------------------------------------------

def all_specs(task: str) -> list[dict]:
    """Every spec of a task in a fixed order (the prompt sources split these into train/test)."""
    objs = [{"color": c, "shape": s} for s in SHAPES for c in COLORS]
    if task == "single":
        return [{"task": "single", "objects": [o], "size": z} for z in (None, *SIZES) for o in objs]
    if task == "color":  # two objects of different colours and different shapes: colour binding
        return [{"task": "color", "objects": [a, b]} for a in objs for b in objs
                if a["color"] != b["color"] and a["shape"] != b["shape"]]
    if task == "size":
        return [{"task": "size", "objects": [o], "size": z} for z in SIZES for o in objs]
    if task == "count":
        return [{"task": "count", "objects": [o], "count": n} for n in NUMBERS for o in objs]
    if task == "position":
        return [{"task": "position", "objects": [a, b], "relation": r} for r in RELATIONS for a in objs
                for b in objs if a["color"] != b["color"]]
    raise ValueError(f"task {task!r} is unknown; valid choices: {', '.join(TASKS)}")


# Pretraining mix: how often each task's captions are drawn.
TASK_MIX = {"single": 0.3, "color": 0.2, "count": 0.25, "position": 0.25}


def random_spec(rng: np.random.Generator, mix: dict[str, float] | None = None) -> dict:
    """A uniformly random spec of a task drawn with ``mix`` (default :data:`TASK_MIX`)."""
    mix = mix or TASK_MIX
    task = str(rng.choice(list(mix), p=np.asarray(list(mix.values())) / sum(mix.values())))
    color = lambda: str(rng.choice(COLORS))  # noqa: E731
    shape = lambda: str(rng.choice(SHAPES))  # noqa: E731
    if task == "single":
        size = [None, None, *SIZES][rng.integers(4)]
        return {"task": "single", "objects": [{"color": color(), "shape": shape()}], "size": size}
    if task == "count":
        return {"task": "count", "objects": [{"color": color(), "shape": shape()}],
                "count": int(rng.choice(list(NUMBERS)))}
    c1, c2 = (str(c) for c in rng.choice(COLORS, size=2, replace=False))
    if task == "color":
        s1, s2 = (str(s) for s in rng.choice(SHAPES, size=2, replace=False))
        return {"task": "color", "objects": [{"color": c1, "shape": s1}, {"color": c2, "shape": s2}]}
    return {"task": "position", "objects": [{"color": c1, "shape": shape()}, {"color": c2, "shape": shape()}],
            "relation": str(rng.choice(RELATIONS))}


# ---- rendering -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placed:
    """One drawn object: centre (cx, cy) and extent in pixels of the 64-px image."""

    color: str
    shape: str
    cx: float
    cy: float
    extent: float


def _background(rng: np.random.Generator) -> tuple[int, int, int]:
    """A dark tinted background: a random hue at low value, far from every palette colour."""
    base = rng.uniform(8, 30)
    tint = rng.uniform(0, 28, size=3)
    return tuple(int(v) for v in base + tint)


def _place(rng: np.random.Generator, extents: list[float], relation: str | None = None,
           tries: int = 200) -> list[tuple[float, float]]:
    """Non-overlapping centres for objects of the given extents (and ``relation`` between the first two)."""
    margin = 2.0
    for _ in range(tries):
        centres = []
        for e in extents:
            lo, hi = e / 2 + margin, RESOLUTION - e / 2 - margin
            centres.append((rng.uniform(lo, hi), rng.uniform(lo, hi)))
        ok = all(np.hypot(a[0] - b[0], a[1] - b[1]) > (ea + eb) / 2 * 1.15 + 1
                 for i, (a, ea) in enumerate(zip(centres, extents))
                 for b, eb in zip(centres[i + 1:], extents[i + 1:]))
        if ok and relation is not None:
            ok = relation_margin(relation, centres[0], centres[1]) >= MIN_GAP
        if ok:
            return centres
    raise RuntimeError(f"could not place {len(extents)} objects of extents {extents} in {tries} tries")


def relation_margin(relation: str, a: tuple[float, float], b: tuple[float, float]) -> float:
    """Signed distance (pixels) by which centre ``a`` is ``relation`` centre ``b``; > 0 when it holds.
    Image y grows downwards, so "above" means a smaller y."""
    if relation == "left of":
        return b[0] - a[0]
    if relation == "right of":
        return a[0] - b[0]
    if relation == "above":
        return b[1] - a[1]
    if relation == "below":
        return a[1] - b[1]
    raise ValueError(f"relation {relation!r} is unknown; valid choices: {', '.join(RELATIONS)}")


def layout(spec: dict, rng: np.random.Generator) -> list[Placed]:
    """Where each object of a spec goes (random sizes and positions that satisfy it)."""
    task, objs = spec["task"], spec["objects"]
    if task in ("single", "size"):
        lo, hi = SIZE_RANGE[spec.get("size")]
        items = [objs[0]]
    elif task == "count":
        lo, hi = SIZE_RANGE["multi"]
        items = [objs[0]] * int(spec["count"])
    else:
        lo, hi = SIZE_RANGE["multi"]
        items = list(objs)
    extents = [float(rng.uniform(lo, hi)) for _ in items]
    centres = _place(rng, extents, spec.get("relation") if task == "position" else None)
    return [Placed(o["color"], o["shape"], cx, cy, e) for o, (cx, cy), e in zip(items, centres, extents)]


def draw(placed: list[Placed], background: tuple[int, int, int]) -> np.ndarray:
    """Objects on a background -> uint8 [64, 64, 3]."""
    s = SUPERSAMPLE
    img = Image.new("RGB", (RESOLUTION * s, RESOLUTION * s), background)
    pen = ImageDraw.Draw(img)
    for p in placed:
        cx, cy, h = p.cx * s, p.cy * s, p.extent * s / 2
        fill = PALETTE[p.color]
        if p.shape == "circle":
            pen.ellipse([cx - h, cy - h, cx + h, cy + h], fill=fill)
        elif p.shape == "square":
            h *= 0.9  # a square of the same extent looks bigger than a circle; keep areas comparable
            pen.rectangle([cx - h, cy - h, cx + h, cy + h], fill=fill)
        elif p.shape == "triangle":
            pen.polygon([(cx, cy - h), (cx - h, cy + h), (cx + h, cy + h)], fill=fill)
        else:
            raise ValueError(f"shape {p.shape!r} is unknown; valid choices: {', '.join(SHAPES)}")
    img = img.resize((RESOLUTION, RESOLUTION), Image.Resampling.BOX)
    return np.array(img, dtype=np.uint8)  # a writable copy (torch.from_numpy warns on read-only arrays)


def render(spec: dict, rng: np.random.Generator | int) -> np.ndarray:
    """One scene satisfying ``spec`` as uint8 [64, 64, 3]; deterministic for a given seed."""
    rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
    background = _background(rng)
    return draw(layout(spec, rng), background)


def render_batch(specs: list[dict], rng: np.random.Generator) -> np.ndarray:
    """Scenes for several specs, uint8 [B, 64, 64, 3]."""
    return np.stack([render(s, rng) for s in specs])


def to_tensor(images: np.ndarray):
    """uint8 [B, H, W, 3] -> float tensor [B, 3, H, W] in [0, 1] (the rewards' input)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0
