"""Analytic image analysis of the mini world: find the objects in a 64×64 image and grade a spec.

GenEval-like checks done with plain image analysis, possible because the world is known:
1. background = per-channel median of the border pixels;
2. foreground = pixels farther than ``FG_THRESHOLD`` (RGB, 0-255) from it; connected components
   (``scipy.ndimage.label``, 8-connectivity) of at least ``MIN_AREA`` pixels are the objects;
3. each object's colour = the mean of its core pixels (edges blend with the background), scored
   softly against the palette (a softmax over squared distances);
4. each object's shape = soft scores from two features of its mask: the fill ratio of its bounding
   box (circle π/4, square ~0.95, triangle 0.5) and the share of its pixels in the top half of the
   box (≈0.25 for an upward triangle, 0.5 for the others). Soft because generated squares have
   rounded corners and generated circles are not perfect.

``grade(spec, detections)`` returns graded (partial-credit) scores in [0, 1] per aspect; the rewards
in core/rewards/world.py are thin wrappers around it. ``geneval_pass`` is the strict pass/fail check.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from core.world.scenes import COLORS, PALETTE, SHAPES, relation_margin

FG_THRESHOLD = 60.0
MIN_AREA = 6
COLOR_TEMPERATURE = 35.0  # RGB distance scale of the colour softmax
SHAPE_PROTOTYPES = {  # (bbox fill ratio, share of pixels in the top half of the bbox)
    "circle": (0.785, 0.5),
    "square": (0.95, 0.5),
    "triangle": (0.5, 0.27),
}
SHAPE_SIGMA = (0.08, 0.07)
_PALETTE = np.asarray([PALETTE[c] for c in COLORS], dtype=np.float64)  # [7, 3]


@dataclass(frozen=True)
class Detection:
    """One object found in an image. Coordinates in pixels; probabilities over the palette/shapes."""

    area: int
    cx: float
    cy: float
    rgb: tuple[float, float, float]
    color_probs: dict[str, float]
    shape_probs: dict[str, float]

    @property
    def color(self) -> str:
        return max(self.color_probs, key=self.color_probs.get)

    @property
    def shape(self) -> str:
        return max(self.shape_probs, key=self.shape_probs.get)


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max())
    return z / z.sum()


def color_probs(rgb: np.ndarray) -> dict[str, float]:
    d2 = ((_PALETTE - rgb[None]) ** 2).sum(1)
    return dict(zip(COLORS, _softmax(-d2 / (2 * COLOR_TEMPERATURE ** 2)).tolist()))


def shape_probs(mask: np.ndarray) -> dict[str, float]:
    """Soft shape scores of one component's boolean mask (cropped to its bounding box)."""
    h, w = mask.shape
    fill = mask.sum() / float(h * w)
    top = mask[: h // 2].sum() + (mask[h // 2].sum() / 2 if h % 2 else 0)
    top_share = top / max(1.0, float(mask.sum()))
    feats = np.asarray([fill, top_share])
    logits = np.asarray([-(((feats - np.asarray(SHAPE_PROTOTYPES[s])) / SHAPE_SIGMA) ** 2).sum() / 2
                         for s in SHAPES])
    return dict(zip(SHAPES, _softmax(logits).tolist()))


def background_distance(image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(image as float RGB 0-255 [H, W, 3], background RGB [3] = median of the border pixels, each pixel's RGB
    distance to it [H, W]) for uint8 or [0, 1] float input."""
    img = np.asarray(image, dtype=np.float64)
    if img.max() <= 1.0 + 1e-6 and np.asarray(image).dtype != np.uint8:
        img = img * 255.0
    border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
    background = np.median(border, axis=0)
    return img, background, np.sqrt(((img - background) ** 2).sum(-1))


def palette_distance(img: np.ndarray) -> np.ndarray:
    """Each pixel's RGB distance (0-255 scale) to the nearest palette colour: [H, W]."""
    return np.sqrt(((img[:, :, None, :] - _PALETTE) ** 2).sum(-1)).min(-1)


def detect(image: np.ndarray) -> list[Detection]:
    """Objects in one image: uint8 [H, W, 3] or float [H, W, 3] in [0, 1]. Sorted by area, largest first."""
    from scipy import ndimage

    img, _, dist = background_distance(image)
    fg = dist > FG_THRESHOLD
    labels, n = ndimage.label(fg, structure=np.ones((3, 3)))
    found = []
    for k, sl in enumerate(ndimage.find_objects(labels), start=1):
        if sl is None:
            continue
        mask = labels[sl] == k
        area = int(mask.sum())
        if area < MIN_AREA:
            continue
        ys, xs = np.nonzero(mask)
        core = ndimage.binary_erosion(mask) if area >= 20 else mask
        if core.sum() < 3:
            core = mask
        rgb = img[sl][core].mean(0)
        found.append(Detection(area=area, cx=float(xs.mean() + sl[1].start + 0.5),
                               cy=float(ys.mean() + sl[0].start + 0.5), rgb=tuple(float(v) for v in rgb),
                               color_probs=color_probs(rgb), shape_probs=shape_probs(mask)))
    return sorted(found, key=lambda d: -d.area)


# ---- grading ------------------------------------------------------------------------------------

def object_match(det: Detection, obj: dict, color_weight: float = 0.6) -> float:
    """How well a detection is the requested object, in [0, 1]: colour first, shape on top of it."""
    pc = det.color_probs[obj["color"]]
    return color_weight * pc + (1 - color_weight) * pc * det.shape_probs[obj["shape"]]


def best_assignment(dets: list[Detection], objs: list[dict]) -> tuple[list[float], list[Detection | None]]:
    """Distinct detections for the requested objects maximizing the summed match (brute force: ≤ 2 objects
    here, few detections). Missing detections score 0."""
    best, best_pick = -1.0, None
    slots = list(range(len(dets))) + [None] * len(objs)
    for pick in itertools.permutations(slots, len(objs)):
        if any(p is not None and pick.count(p) > 1 for p in pick):
            continue
        total = sum(object_match(dets[p], o) if p is not None else 0.0 for p, o in zip(pick, objs))
        if total > best:
            best, best_pick = total, pick
    scores = [object_match(dets[p], o) if p is not None else 0.0 for p, o in zip(best_pick, objs)]
    return scores, [dets[p] if p is not None else None for p in best_pick]


def extra_penalty(n_extra: float) -> float:
    """A multiplier in (0, 1]: exp(-extra objects), so one object too many costs what one missing object
    costs in :func:`count_score` (~0.37). Every specialist applies it: the prompt asks for exactly its
    objects (as :func:`geneval_pass` does), and without it a general reward such as colorfulness can be
    raised by adding clutter that the specialists never see (measured: +1.3 to +1.9 stray objects per
    image after 200 MARBLE steps when only the colour reward penalized extras, and mildly)."""
    return math.exp(-max(0.0, n_extra))


def color_score(spec: dict, dets: list[Detection]) -> float:
    """Colour binding: each requested (colour, shape) object present, mostly judged by colour."""
    objs = spec["objects"]
    scores, _ = best_assignment(dets, objs)
    return float(np.mean(scores)) * extra_penalty(len(dets) - len(objs))


def count_score(spec: dict, dets: list[Detection]) -> float:
    """Count accuracy: a soft count k of objects of the requested colour (Σ p(colour)) against n, and the
    soft count of the other objects (Σ 1 - p(colour)) as extras: exp(-|k - n|) · exp(-extras), so one
    object off either way scores ~0.37; plus a little credit for the requested shape."""
    n, obj = int(spec["count"]), spec["objects"][0]
    pcs = np.asarray([d.color_probs[obj["color"]] for d in dets])
    k = float(pcs.sum()) if len(dets) else 0.0
    count_part = math.exp(-abs(k - n)) * extra_penalty(len(dets) - k)
    if len(dets) and pcs.sum() > 0:
        shape_part = float((pcs * np.asarray([d.shape_probs[obj["shape"]] for d in dets])).sum() / pcs.sum())
    else:
        shape_part = 0.0
    return count_part * (0.8 + 0.2 * shape_part)


def position_score(spec: dict, dets: list[Detection], full_margin: float = 6.0) -> float:
    """Spatial relation: both objects present (0.15 each) and the relation between their centres
    (0.7, graded: 0.5 at a tie, 1 from ``full_margin`` pixels the right way, 0 that far the wrong way),
    times the penalty for objects beyond the two."""
    (ma, mb), (da, db) = best_assignment(dets, spec["objects"])
    penalty = extra_penalty(len(dets) - len(spec["objects"]))
    if da is None or db is None:
        return (0.15 * ma + 0.15 * mb) * penalty
    margin = relation_margin(spec["relation"], (da.cx, da.cy), (db.cx, db.cy))
    rel = min(1.0, max(0.0, 0.5 + margin / (2 * full_margin)))
    return (0.15 * ma + 0.15 * mb + 0.7 * ma * mb * rel) * penalty


def relation_holds(spec: dict, dets: list[Detection]) -> bool | None:
    """Position prompts: whether the relation holds between the largest object of the first requested colour
    and the largest other object of the second (hard colour labels, shape ignored); None when the image has
    no such pair. A model that ignores the relation words is right half the time."""
    (a, b) = spec["objects"]
    first = next((d for d in dets if d.color == a["color"]), None)
    second = next((d for d in dets if d.color == b["color"] and d is not first), None)
    if first is None or second is None:
        return None
    return relation_margin(spec["relation"], (first.cx, first.cy), (second.cx, second.cy)) > 0


SHAPE_FILL = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}
"""Share of its extent² an object of each shape covers (the renderer's shapes), to turn area into extent."""


def size_credit(spec: dict, det: Detection | None) -> float:
    """1 when the object's extent (√(area / fill of the requested shape)) lies in the range the world draws for the
    requested size (``SIZE_RANGE``), falling as exp(-4·|log(extent / nearest bound)|) outside it (half-credit
    ~16% off); 1 when the prompt names no size, 0 when there is no object."""
    from core.world.scenes import SIZE_RANGE

    if det is None:
        return 0.0
    if not spec.get("size"):
        return 1.0
    lo, hi = SIZE_RANGE[spec["size"]]
    extent = math.sqrt(det.area / SHAPE_FILL[spec["objects"][0]["shape"]])
    off = math.log(lo / extent) if extent < lo else (math.log(extent / hi) if extent > hi else 0.0)
    return math.exp(-4.0 * off)


def single_score(spec: dict, dets: list[Detection]) -> float:
    """A single object: the requested one present, alone, and of the requested size when one is named."""
    scores, picked = best_assignment(dets, spec["objects"])
    return float(scores[0]) * size_credit(spec, picked[0]) * extra_penalty(len(dets) - 1)


GRADERS = {"single": single_score, "color": color_score, "count": count_score, "position": position_score,
           "size": single_score}  # a sized single object: single_score already judges its size


def geneval_pass(spec: dict, dets: list[Detection]) -> bool:
    """Strict GenEval-style check with hard labels (argmax colour and shape):
    single/colour: exactly the requested objects; size: the one requested object, its extent within ~16 % of the
    size's range (half its size credit); count: exactly n objects, all of the colour and shape;
    position: both objects present (and nothing else) with the relation holding between their centres."""
    task, objs = spec["task"], spec["objects"]
    labels = [(d.color, d.shape) for d in dets]
    if task == "count":
        return len(dets) == int(spec["count"]) and all(lab == (objs[0]["color"], objs[0]["shape"]) for lab in labels)
    wanted = [(o["color"], o["shape"]) for o in objs]
    if sorted(labels) != sorted(wanted):
        return False
    if task == "size":  # alone, the asked object, and its extent within ~16 % of the world's range for the size
        return size_credit(spec, dets[0]) >= 0.5
    if task == "position":
        a = dets[labels.index(wanted[0])]
        b = dets[labels.index(wanted[1])] if wanted[1] != wanted[0] else dets[[i for i, lab in enumerate(labels)
                                                                               if lab == wanted[1]][1]]
        return relation_margin(spec["relation"], (a.cx, a.cy), (b.cx, b.cy)) > 0
    return True


def grade(spec: dict, image: np.ndarray) -> dict[str, float]:
    """All checks of one image against its spec: the task's graded score and the strict pass."""
    dets = detect(image)
    return {"score": GRADERS[spec["task"]](spec, dets), "pass": float(geneval_pass(spec, dets)),
            "num_objects": float(len(dets))}
