"""Prompt sources: named sets of prompts with metadata, split into train and test, sampled per step.

A source yields ``PromptItem``s; ``metadata["source"]`` always names the source so specialist rewards can
decide where they apply (spec §1: most rollouts are informative for a few rewards only). Each step draws
its prompts stratified across the configured sources (spec §8: 16/16/16 across three sources).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from core.limits import MAX_PROMPT_FILE_BYTES, check_prompt


@dataclass(frozen=True)
class PromptItem:
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptSource:
    name: str
    description: str
    train: list[PromptItem]
    test: list[PromptItem]

    def split(self, split: str) -> list[PromptItem]:
        items = self.train if split == "train" else self.test
        if not items:
            raise ValueError(f"prompt source {self.name!r} has no {split!r} prompts")
        return items


_SOURCES: dict[str, tuple[str, Callable[[], PromptSource]]] = {}


def register_source(name: str, description: str):
    def deco(builder: Callable[[], PromptSource]):
        _SOURCES[name] = (description, builder)
        return builder

    return deco


def available_sources() -> dict[str, str]:
    return {name: desc for name, (desc, _) in _SOURCES.items()}


def validate_source_name(name: str) -> str | None:
    """None when ``name`` can be loaded, else the reason (used by config validation)."""
    if name.startswith("file:"):
        path = Path(name[5:]).expanduser()
        if path.is_dir():
            return None if split_files(path) else (
                f"prompt folder {str(path)!r} holds neither train.txt + test.txt nor train_metadata.jsonl + "
                f"test_metadata.jsonl (DiffusionNFT's dataset layout)")
        if not path.is_file():
            return f"prompt file {str(path)!r} does not exist"
        if path.suffix not in (".txt", ".jsonl"):
            return f"prompt file {str(path)!r} must end in .txt (one prompt a line) or .jsonl"
        try:  # read it now, so a bad line is refused before a run is queued, not at its first step
            _read_items_cached(path)
        except ValueError as e:
            return str(e)
        return None
    if name not in _SOURCES:
        return f"valid choices: {', '.join(_SOURCES)} or file:PATH(.txt|.jsonl|folder)"
    return None


def load_source(name: str) -> PromptSource:
    if name.startswith("file:"):
        path = Path(name[5:]).expanduser()
        return _load_folder(path, name) if path.is_dir() else _load_file(path, name)
    if name not in _SOURCES:
        raise ValueError(f"prompt source {name!r} is unknown; valid choices: {', '.join(_SOURCES)} or file:PATH")
    return _SOURCES[name][1]()


def _split_every(items: list[PromptItem], every: int = 5) -> tuple[list[PromptItem], list[PromptItem]]:
    """Deterministic held-out split: every ``every``-th prompt is a test prompt."""
    test = [it for i, it in enumerate(items) if i % every == every - 1]
    train = [it for i, it in enumerate(items) if i % every != every - 1]
    return train, test


def _load_file(path: Path, name: str) -> PromptSource:
    """.txt: one prompt a line. .jsonl: objects with "prompt" (or "text") and any metadata; an optional
    "split" key ("train"/"test") overrides the default every-5th held-out split."""
    items, explicit = _read_items(path, name)
    if any(s is not None for s in explicit):
        train = [it for it, s in zip(items, explicit) if s != "test"]
        test = [it for it, s in zip(items, explicit) if s == "test"]
    else:
        train, test = _split_every(items) if len(items) >= 5 else (items, items)
    return PromptSource(name, f"prompts from {path}", train, test)


def split_files(folder: Path) -> tuple[Path, Path] | None:
    """(train, test) files of a DiffusionNFT-style prompt folder, or None: train.txt + test.txt (general,
    OCR) or train_metadata.jsonl + test_metadata.jsonl (GenEval)."""
    for pattern in ("{}.txt", "{}_metadata.jsonl"):
        train, test = folder / pattern.format("train"), folder / pattern.format("test")
        if train.is_file() and test.is_file():
            return train, test
    return None


def _load_folder(folder: Path, name: str) -> PromptSource:
    """A DiffusionNFT-style folder: its own train and test files (see :func:`split_files`)."""
    files = split_files(folder)
    if files is None:
        raise ValueError(validate_source_name(f"file:{folder}"))
    train, test = (_read_items(path, name)[0] for path in files)
    return PromptSource(name, f"prompts from {folder}", train, test)


def _read_text(path: Path) -> str:
    """A prompt file's text: bounded in size, UTF-8, errors naming the file."""
    try:
        size = path.stat().st_size
        if size > MAX_PROMPT_FILE_BYTES:
            raise ValueError(f"prompt file {str(path)!r} is {size / 2**20:.1f} MiB; the limit is "
                             f"{MAX_PROMPT_FILE_BYTES // 2**20} MiB")
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"prompt file {str(path)!r} cannot be read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {str(path)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                         f"{e.start}); save it as UTF-8") from None


@functools.lru_cache(maxsize=32)
def _read_items_key(path: str, mtime_ns: int, size: int) -> tuple[list[PromptItem], list[str | None]]:
    return _read_items(Path(path), "check")


def _read_items_cached(path: Path) -> None:
    """Parse a prompt file once per version (config validation runs often)."""
    st = path.stat()
    _read_items_key(str(path.resolve()), st.st_mtime_ns, st.st_size)


def _read_items(path: Path, name: str) -> tuple[list[PromptItem], list[str | None]]:
    """The prompts of a .txt / .jsonl file and each one's explicit "split" (None when absent)."""
    items: list[PromptItem] = []
    explicit: list[str | None] = []
    for lineno, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        if path.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: a line must be a JSON object with a \"prompt\" key, not a "
                                 f"{type(obj).__name__}")
            text = obj.pop("prompt", obj.pop("text", None))
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{where}: needs a non-empty \"prompt\" string")
            split = obj.pop("split", None)
            if split not in (None, "train", "test"):
                raise ValueError(f"{where}: split={split!r}: valid choices: train, test (or no split key)")
            check_prompt(text.strip(), where)
            explicit.append(split)
            items.append(PromptItem(text.strip(), {"source": name, **obj}))
        else:
            check_prompt(line.strip(), where)
            explicit.append(None)
            items.append(PromptItem(line.strip(), {"source": name}))
    if not items:
        raise ValueError(f"prompt file {path} holds no prompts")
    return items, explicit


_TINY_SUBJECTS = ["circle", "square", "triangle", "star", "ring", "stripe pattern"]
_TINY_COLOURS = ["red", "green", "blue", "yellow", "purple", "white"]


@register_source("tiny", "36 short colour-and-shape captions for the tiny model (every 5th held out).")
def _tiny_source() -> PromptSource:
    items = [PromptItem(f"a {c} {s}", {"source": "tiny", "color": c, "object": s})
             for s in _TINY_SUBJECTS for c in _TINY_COLOURS]
    train, test = _split_every(items)
    return PromptSource("tiny", available_sources()["tiny"], train, test)


NFT_PROMPTS_DIR = Path(__file__).resolve().parents[1] / "data" / "prompts"
"""Where the nft-* sources read DiffusionNFT's prompt sets: copy its dataset/pickscore, dataset/ocr and
dataset/geneval folders here (or point a run at them with file:FOLDER)."""
NFT_SOURCES = {
    "nft-general": ("pickscore", "DiffusionNFT's general prompts (data/prompts/pickscore/{train,test}.txt)."),
    "nft-ocr": ("ocr", "DiffusionNFT's OCR prompts, text in quotes (data/prompts/ocr/{train,test}.txt)."),
    "nft-geneval": ("geneval", "DiffusionNFT's GenEval prompts with object/count/colour/position metadata "
                               "(data/prompts/geneval/{train,test}_metadata.jsonl)."),
}


def _nft_source(name: str) -> PromptSource:
    folder = NFT_PROMPTS_DIR / NFT_SOURCES[name][0]
    if split_files(folder) is None:
        raise ValueError(f"prompt source {name!r} reads {folder}, which holds neither train.txt + test.txt nor "
                         f"train_metadata.jsonl + test_metadata.jsonl. Copy the folder dataset/{folder.name} of "
                         f"github.com/NVlabs/DiffusionNFT there, or use file:/path/to/{folder.name}.")
    return _load_folder(folder, name)


for _name, (_folder, _description) in NFT_SOURCES.items():
    register_source(_name, _description)(lambda _name=_name: _nft_source(_name))


class PromptSampler:
    """Draws each step's prompts, stratified across sources in equal shares (the remainder rotates)."""

    def __init__(self, source_names: list[str], split: str = "train"):
        self.sources = [load_source(n) for n in source_names]
        self.split = split
        self.pools = [s.split(split) for s in self.sources]

    def sample(self, n: int, rng: np.random.Generator, step: int = 0) -> list[PromptItem]:
        k = len(self.pools)
        counts = [n // k] * k
        for j in range(n % k):
            counts[(step + j) % k] += 1
        out: list[PromptItem] = []
        for pool, c in zip(self.pools, counts):
            if c == 0:
                continue
            idx = rng.choice(len(pool), size=c, replace=c > len(pool))
            out.extend(pool[i] for i in idx)
        return out


# The built-in mini world's sources (world-general, world-color, world-count, world-position) register
# themselves on import; imported last because they use this module's PromptItem and register_source.
import core.world.prompts  # noqa: E402,F401
