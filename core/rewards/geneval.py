"""A GenEval-style compositional reward driven by prompt metadata, on an open-vocabulary detector.

GenEval (Ghosh et al. 2023) checks a generated image against the prompt's metadata — objects, counts,
colours, relative positions — with a Mask2Former detector (mmdetection) and CLIP for colours. mmdetection
needs its own environment; for the original scorer use the ``remote`` reward (docs/remote-reward.md).
Here the same rules run in-process on OWLv2 (``Owlv2ForObjectDetection`` in transformers, weights
google/owlv2-base-patch16-ensemble by default), with CLIP ViT-L/14 classifying colours as GenEval does.

Metadata, one JSON object per prompt (GenEval's evaluation_metadata.jsonl / DiffusionNFT's
train_metadata.jsonl), e.g.::

    {"tag": "position", "include": [{"class": "dog", "count": 1},
                                    {"class": "cat", "count": 1, "position": ["left of", 0]}],
     "prompt": "a photo of a cat left of a dog"}
    {"tag": "counting", "include": [{"class": "bird", "count": 3}], "exclude": [{"class": "bird", "count": 4}]}
    {"tag": "color_attr", "include": [{"class": "car", "count": 1, "color": "red"}, ...]}

"position": [relation, i] places this object relative to the objects of include[i]; relations are
"left of", "right of", "above", "below". A sample without "include" is not a GenEval prompt: NaN.

Rules, restated from GenEval's evaluate_images.py (thresholds are arguments):
- detections of each class: score > threshold (``counting_threshold`` for tag "counting"), sorted by
  score, class-wise NMS, at most 16;
- an include is met when at least ``count`` objects are found; its colour is checked on the ``count``
  most confident ones (CLIP zero-shot over GenEval's 10 colours, three prompt templates averaged, on the
  box crop); its position on every pair with the target include's objects (box-centre offset reduced by
  0.1·(sum of box sizes), direction from the offset's unit vector, ±0.5 cut-offs);
- an exclude {class, count} fails when ``count`` or more objects of that class are found.

Scores (``mode``):
- "partial" (default): the graded score Flow-GRPO / DiffusionNFT train on: for each include, the count
  term 1 − |count − found| / count, then a colour term 1 − |count − #right colour| / count and a position
  term (1 or 0) when those are asked and the count is exact (0 when it is not); the mean of all terms.
  (The Flow-GRPO code also appends a 1 after a failed position check; that slip is not reproduced.)
- "binary": GenEval's pass/fail (1.0 / 0.0), the benchmark metric.

Differences from GenEval that follow from the detector: OWLv2 boxes have no masks, so colours are
classified on the box crop without GenEval's grey-background masking; OWLv2's confidences are lower
than Mask2Former's, so the thresholds default to 0.1 / 0.2 with NMS at IoU 0.5 (Mask2Former needs no
NMS). These defaults were not calibrated against GenEval's own scorer here (no weights on this machine).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from core.rewards.base import Reward, check_number_in_range, register_reward
from core.rewards.hub import resolve_device, resolve_dtype, resolve_folder

if TYPE_CHECKING:  # pragma: no cover
    import torch

COCO_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)
"""GenEval's object vocabulary (object_names.txt): the 80 COCO classes with its spellings."""
GENEVAL_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
COLOR_TEMPLATES = ("a photo of a {color} {cls}", "a photo of a {color}-colored {cls}", "a photo of a {color} object")
RELATIONS = ("left of", "right of", "above", "below")
DETECTION_QUERY = "a photo of a {cls}"
MODES = ("partial", "binary")
QUERY_SETS = ("coco", "prompt")


@dataclass(frozen=True)
class Detection:
    box: tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels of the scored image
    score: float


# ---- the rules (pure functions, tested without any model) ----------------------------------------------

def relative_position(a: Detection, b: Detection, threshold: float = 0.1) -> set[str]:
    """Where ``a`` is relative to ``b``: a subset of {"left of", "right of", "above", "below"}.

    The centre offset is shrunk towards 0 by ``threshold``·(sum of the two boxes' sizes) per axis; the
    relation holds along an axis when the shrunk offset, divided by the full offset's length, exceeds 0.5
    in magnitude (y grows downwards, so "above" is a negative y offset).
    """
    boxes = np.array([a.box, b.box], dtype=np.float64).reshape(2, 2, 2)  # [object, corner, xy]
    center_a, center_b = boxes.mean(axis=1)
    dim_a, dim_b = np.abs(boxes[:, 1] - boxes[:, 0])
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - threshold * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def select_detections(dets: Sequence[Detection], threshold: float, nms_threshold: float,
                      max_objects: int) -> list[Detection]:
    """Keep score > threshold, sorted by score, greedy NMS at ``nms_threshold`` (1 = off), at most max_objects."""
    ordered = sorted((d for d in dets if d.score > threshold), key=lambda d: -d.score)
    kept: list[Detection] = []
    for d in ordered:
        if nms_threshold >= 1 or all(box_iou(d.box, k.box) < nms_threshold for k in kept):
            kept.append(d)
        if len(kept) == max_objects:
            break
    return kept


def parse_requirements(metadata: Mapping[str, Any]) -> tuple[list[dict], list[dict]] | None:
    """(includes, excludes) with int counts and (relation, int index) positions; None if not GenEval metadata.

    Raises ValueError naming the bad entry (unknown relation, count < 1, position index out of range)."""
    include = metadata.get("include")
    if not include:
        return None
    if not isinstance(include, list):
        raise ValueError(f"GenEval metadata 'include' must be a list of objects, got {include!r}")
    includes, excludes = [], []
    for i, req in enumerate(include):
        if not isinstance(req, Mapping) or "class" not in req:
            raise ValueError(f"GenEval metadata include[{i}]={req!r}: needs a 'class'")
        item = {"class": str(req["class"]), "count": int(req.get("count", 1))}
        if item["count"] < 1:
            raise ValueError(f"GenEval metadata include[{i}]: count={req.get('count')!r} must be >= 1")
        if req.get("color") is not None:
            item["color"] = str(req["color"])
        if req.get("position") is not None:
            relation, target = req["position"]
            target = int(target)
            if relation not in RELATIONS or not 0 <= target < i:
                raise ValueError(f"GenEval metadata include[{i}]: position={req['position']!r}: the relation must "
                                 f"be one of {', '.join(RELATIONS)} and the index an earlier include (0..{i - 1})")
            item["position"] = (relation, target)
        includes.append(item)
    for req in metadata.get("exclude") or []:
        excludes.append({"class": str(req["class"]), "count": int(req.get("count", 1))})
    return includes, excludes


ColorFn = Callable[[str, Sequence[Detection]], list[str]]
"""(class name, detections) -> the colour name of each detection."""


def geneval_binary(includes: list[dict], excludes: list[dict], found: Mapping[str, list[Detection]],
                   colors_of: ColorFn, position_threshold: float = 0.1) -> float:
    """GenEval's pass/fail: 1.0 when every include and exclude is satisfied, else 0.0."""
    correct = True
    groups: list[list[Detection] | None] = []
    for req in includes:
        objects = found.get(req["class"], [])[:req["count"]]
        matched = len(objects) >= req["count"]
        if matched and "color" in req:
            matched = colors_of(req["class"], objects).count(req["color"]) >= req["count"]
        if matched and "position" in req:
            relation, target = req["position"]
            matched = groups[target] is not None and all(
                relation in relative_position(obj, other, position_threshold)
                for obj in objects for other in groups[target])
        correct = correct and matched
        groups.append(objects if matched else None)
    for req in excludes:
        if len(found.get(req["class"], [])) >= req["count"]:
            correct = False
    return 1.0 if correct else 0.0


def geneval_partial(includes: list[dict], found: Mapping[str, list[Detection]], colors_of: ColorFn,
                    position_threshold: float = 0.1) -> float:
    """The graded score (mean of count, colour and position terms; see the module docstring)."""
    terms: list[float] = []
    groups: list[list[Detection] | None] = []
    for req in includes:
        n = req["count"]
        objects = found.get(req["class"], [])
        terms.append(1.0 - abs(n - len(objects)) / n)
        matched = len(objects) == n
        if not matched:
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if "color" in req:
                right = colors_of(req["class"], objects).count(req["color"])
                terms.append(1.0 - abs(n - right) / n)
                matched = right == n
            if "position" in req and matched:
                relation, target = req["position"]
                matched = groups[target] is not None and all(
                    relation in relative_position(obj, other, position_threshold)
                    for obj in objects for other in groups[target])
                terms.append(1.0 if matched else 0.0)
        groups.append(objects if matched else None)
    return float(np.mean(terms)) if terms else math.nan


# ---- the reward -------------------------------------------------------------------------------------------

class GenEvalReward(Reward):
    def __init__(self, detector, processor, clip_model, clip_tokenizer, mode: str = "partial",
                 threshold: float = 0.1, counting_threshold: float = 0.2, nms_threshold: float = 0.5,
                 max_objects: int = 16, position_threshold: float = 0.1, queries: str = "coco",
                 batch_size: int = 8):
        self.detector = detector
        self.processor = processor
        self.clip = clip_model
        self.clip_tokenizer = clip_tokenizer
        self.mode = mode
        self.threshold = threshold
        self.counting_threshold = counting_threshold
        self.nms_threshold = nms_threshold
        self.max_objects = max_objects
        self.position_threshold = position_threshold
        self.queries = queries
        self.batch_size = batch_size
        self._color_classifiers: dict[str, torch.Tensor] = {}

    def score(self, images: torch.Tensor, prompts: Sequence[str],
              metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        import torch

        from core.rewards.preprocess import to_pil_images

        parsed = [parse_requirements(m) for m in metadata]
        scores = torch.full((len(prompts),), math.nan)
        todo = [i for i, p in enumerate(parsed) if p is not None]
        if not todo:
            return scores
        classes = list(COCO_CLASSES) if self.queries == "coco" else []
        for includes, excludes in (parsed[i] for i in todo):
            classes += [r["class"] for r in includes + excludes if r["class"] not in classes]
        pils = to_pil_images(images[todo])
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start:start + self.batch_size]
            detections = self.detect(pils[start:start + len(chunk)], classes)
            for i, dets, pil in zip(chunk, detections, pils[start:start + len(chunk)]):
                includes, excludes = parsed[i]
                threshold = self.counting_threshold if metadata[i].get("tag") == "counting" else self.threshold
                found = {c: select_detections(d, threshold, self.nms_threshold, self.max_objects)
                         for c, d in dets.items()}
                found = {c: d for c, d in found.items() if d}
                colors_of = lambda cls, objs, pil=pil: self.classify_colors(pil, cls, objs)  # noqa: E731
                if self.mode == "binary":
                    scores[i] = geneval_binary(includes, excludes, found, colors_of, self.position_threshold)
                else:
                    scores[i] = geneval_partial(includes, found, colors_of, self.position_threshold)
        return scores

    def detect(self, pils, classes: list[str]) -> list[dict[str, list[Detection]]]:
        """Every box of every image, assigned to its best query class (as OWL's post-processing does)."""
        import torch

        param = next(self.detector.parameters())
        queries = [DETECTION_QUERY.format(cls=c) for c in classes]
        inputs = self.processor(text=[queries] * len(pils), images=pils, return_tensors="pt")
        inputs = {k: v.to(param.device) for k, v in inputs.items()}
        inputs["pixel_values"] = inputs["pixel_values"].to(param.dtype)
        with torch.no_grad():
            out = self.detector(**inputs)
        probs = out.logits.float().sigmoid()  # [b, boxes, queries]
        best, label = probs.max(dim=-1)  # [b, boxes]
        boxes = out.pred_boxes.float()  # [b, boxes, 4] centre x, centre y, w, h in [0, 1] of the padded square
        results = []
        for b, pil in enumerate(pils):
            side = float(max(pil.size))  # OWLv2 pads bottom/right to a square: scale by the longer side
            cx, cy, w, h = (boxes[b] * side).unbind(-1)
            xyxy = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1).cpu().tolist()
            per_class: dict[str, list[Detection]] = {}
            for j, (q, s) in enumerate(zip(label[b].tolist(), best[b].tolist())):
                per_class.setdefault(classes[q], []).append(Detection(tuple(xyxy[j]), s))
            results.append(per_class)
        return results

    def classify_colors(self, pil, cls: str, objects: Sequence[Detection]) -> list[str]:
        """GenEval's colour classifier: CLIP zero-shot over 10 colours (3 templates averaged) on each box crop."""
        import torch

        from core.rewards.clip_rewards import clip_image_embeds, clip_text_embeds, image_size
        from core.rewards.preprocess import resize_shortest_center_crop, to_pixel_values

        weights = self._color_classifiers.get(cls)
        if weights is None:
            rows = []
            for color in GENEVAL_COLORS:
                texts = [t.format(color=color, cls=cls) for t in COLOR_TEMPLATES]
                tok = self.clip_tokenizer(texts, padding="max_length", truncation=True,
                                          max_length=min(77, self.clip.config.text_config.max_position_embeddings),
                                          return_tensors="pt").to(self.clip.device)
                with torch.no_grad():
                    emb = clip_text_embeds(self.clip, tok["input_ids"], tok["attention_mask"]).float().mean(dim=0)
                rows.append(emb / emb.norm())
            weights = self._color_classifiers[cls] = torch.stack(rows)  # [10, D]
        size = image_size(self.clip)
        crops = []
        for obj in objects:
            x0, y0, x1, y1 = obj.box
            box = (max(0, math.floor(x0)), max(0, math.floor(y0)), min(pil.size[0], math.ceil(x1)),
                   min(pil.size[1], math.ceil(y1)))
            if box[2] <= box[0] or box[3] <= box[1]:
                box = (0, 0, *pil.size)
            crops.append(resize_shortest_center_crop(pil.crop(box), size))
        pixel_values = to_pixel_values(crops).to(device=self.clip.device, dtype=self.clip.dtype)
        with torch.no_grad():
            img = clip_image_embeds(self.clip, pixel_values).float()
        return [GENEVAL_COLORS[k] for k in (img @ weights.T).argmax(dim=-1).tolist()]


@register_reward("geneval", "GenEval-style objects/counts/colours/positions from prompt metadata (OWLv2 + CLIP)")
def geneval(detector: str = "google/owlv2-base-patch16-ensemble", clip: str = "openai/clip-vit-large-patch14",
            mode: str = "partial", threshold: float = 0.1, counting_threshold: float = 0.2,
            nms_threshold: float = 0.5, max_objects: int = 16, position_threshold: float = 0.1,
            queries: str = "coco", device: str = "auto", dtype: str = "float32", batch_size: int = 8) -> Reward:
    """GenEval on OWLv2 (``detector``: an Owlv2ForObjectDetection folder/repo with its processor) and
    ``clip`` for colours. ``queries``: "coco" asks the detector for GenEval's 80 classes plus any class in
    the metadata (closest to GenEval's closed-set detector), "prompt" only for the batch's classes."""
    from transformers import Owlv2ForObjectDetection, Owlv2Processor

    from core.rewards.clip_rewards import (TOKENIZER_FILES, WEIGHT_FILES, check_batch_size, load_clip_model,
                                           load_tokenizer)

    name = "geneval"
    if mode not in MODES:
        raise ValueError(f"reward {name!r}: mode={mode!r}: valid choices: {', '.join(MODES)}")
    if queries not in QUERY_SETS:
        raise ValueError(f"reward {name!r}: queries={queries!r}: valid choices: {', '.join(QUERY_SETS)}")
    for arg, value in (("threshold", threshold), ("counting_threshold", counting_threshold),
                       ("nms_threshold", nms_threshold), ("position_threshold", position_threshold)):
        check_number_in_range(name, arg, value, 0.0, 1.0)
    check_number_in_range(name, "max_objects", max_objects, 1, 1000, integer=True)
    check_batch_size(name, batch_size)
    dev, torch_dtype = resolve_device(device), resolve_dtype(name, dtype)
    folder = resolve_folder(detector, reward=name, what="the OWLv2 detector", required=("config.json",),
                            required_any=WEIGHT_FILES, allow_patterns=("*.json", "*.txt", "*.safetensors"))
    resolve_folder(detector, reward=name, what="the OWLv2 image processor", required=(),
                   required_any=("preprocessor_config.json", "processor_config.json"))
    resolve_folder(detector, reward=name, what="the OWLv2 tokenizer", required=(), required_any=TOKENIZER_FILES)
    owl = Owlv2ForObjectDetection.from_pretrained(folder, local_files_only=True, dtype=torch_dtype)
    owl = owl.eval().requires_grad_(False).to(dev)
    processor = Owlv2Processor.from_pretrained(folder, local_files_only=True)
    clip_model = load_clip_model(name, clip, "the CLIP model for colours", dev, torch_dtype)
    clip_tokenizer = load_tokenizer(name, clip, "the CLIP tokenizer")
    return GenEvalReward(owl, processor, clip_model, clip_tokenizer, mode, threshold, counting_threshold,
                         nms_threshold, max_objects, position_threshold, queries, batch_size)
