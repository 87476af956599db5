"""Where reward-model weights come from: a local path, or the Hugging Face cache via ``huggingface_hub``.

Every model-based reward resolves its files through :func:`resolve_folder` or :func:`resolve_file`, so a
missing model fails the same way everywhere: one :class:`RewardWeightsNotFoundError` that names the reward,
the repo id / file it looked for, where it looked, and how to put the files there.

Downloading follows ``HF_HUB_OFFLINE`` (read when the reward is built, not at import time): when it is set
(the Makefile and the tests set it; this project's machines have no network) only local files and the
cache are used; when it is unset, ``huggingface_hub`` may download into the cache as usual.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from core.cache import hf_cache_dir

_TRUE = ("1", "on", "yes", "true")


class RewardWeightsNotFoundError(FileNotFoundError):
    """A reward model's files are neither at a local path nor in the Hugging Face cache."""


def hf_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` forbids downloads (read from the environment at call time)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _looks_like_repo_id(source: str) -> bool:
    return source.count("/") == 1 and not source.startswith((".", "/", "~")) and " " not in source


def _missing(reward: str, what: str, source: str, detail: str, fix: str) -> RewardWeightsNotFoundError:
    cache = hf_cache_dir()
    mode = ("HF_HUB_OFFLINE is set, so nothing is downloaded" if hf_offline()
            else "the download failed")
    return RewardWeightsNotFoundError(
        f"reward {reward!r}: {what} not found: {detail}. Looked for {source!r} as a local path and in the "
        f"Hugging Face cache {cache} ({mode}). {fix}")


def resolve_folder(source: str, *, reward: str, what: str, required: Sequence[str] = ("config.json",),
                   required_any: Sequence[str] = (), allow_patterns: Sequence[str] | None = None) -> Path:
    """A local folder holding ``required`` files: ``source`` itself, or the cached snapshot of repo ``source``.

    Args:
        source: a local folder, or a Hugging Face repo id ("org/name").
        reward: the reward's registry name (for the message).
        what: what the folder is, e.g. "the PickScore model" (for the message).
        required: files that must all be in the folder (e.g. config.json).
        required_any: files of which at least one must be there (e.g. model.safetensors, pytorch_model.bin).
        allow_patterns: when downloading is allowed, fetch only files matching these patterns.

    Raises:
        RewardWeightsNotFoundError: naming the repo id / folder, the cache searched and how to fix it.
    """
    path = Path(source).expanduser()
    hint_files = ", ".join(list(required) + ([" or ".join(required_any)] if required_any else []))
    if path.is_dir():
        absent = _absent(path, required, required_any)
        if absent:
            raise _missing(reward, what, source, f"the folder {str(path)!r} lacks {', '.join(absent)}",
                           f"Point it at a folder holding {hint_files} (the files of the Hugging Face repo).")
        return path
    if not _looks_like_repo_id(source):
        raise _missing(reward, what, source, "no such folder, and it is not a repo id of the form org/name",
                       f"Pass a folder holding {hint_files} or a Hugging Face repo id.")
    from huggingface_hub import snapshot_download

    fix = (f"On a machine with network run `hf download {source}` and copy its cache folder "
           f"models--{source.replace('/', '--')} into {hf_cache_dir()} (or set HF_HUB_CACHE), or pass the "
           f"path of a local folder holding {hint_files}.")
    try:
        snapshot = Path(snapshot_download(repo_id=source, cache_dir=hf_cache_dir(), local_files_only=hf_offline(),
                                          allow_patterns=list(allow_patterns) if allow_patterns else None))
    except Exception as e:  # noqa: BLE001 - LocalEntryNotFound, OfflineModeIsEnabled, HTTP and OS errors alike
        raise _missing(reward, what, source, f"repo {source!r} is not in the cache ({type(e).__name__})",
                       fix) from None
    absent = _absent(snapshot, required, required_any)
    if absent:
        raise _missing(reward, what, source, f"the cached snapshot {str(snapshot)!r} lacks {', '.join(absent)}",
                       fix)
    return snapshot


def _absent(folder: Path, required: Sequence[str], required_any: Sequence[str]) -> list[str]:
    absent = [f for f in required if not (folder / f).exists()]
    if required_any and not any((folder / f).exists() for f in required_any):
        absent.append(" or ".join(required_any))
    return absent


def resolve_file(source: str, filename: str, *, reward: str, what: str) -> Path:
    """A local file: ``source`` itself, ``source/filename`` for a folder, or ``filename`` of repo ``source``.

    Raises:
        RewardWeightsNotFoundError: naming the repo id and file, the cache searched and how to fix it.
    """
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / filename).is_file():
            return path / filename
        raise _missing(reward, what, source, f"the folder {str(path)!r} has no {filename}",
                       f"Put {filename} there, or pass the file's own path.")
    if not _looks_like_repo_id(source):
        raise _missing(reward, what, source, "no such file or folder, and it is not a repo id of the form org/name",
                       f"Pass the path of {filename} or a Hugging Face repo id holding it.")
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id=source, filename=filename, cache_dir=hf_cache_dir(),
                                    local_files_only=hf_offline()))
    except Exception as e:  # noqa: BLE001
        raise _missing(reward, what, f"{source}/{filename}", f"file {filename!r} of repo {source!r} is not in the "
                       f"cache ({type(e).__name__})",
                       f"On a machine with network run `hf download {source} {filename}` and copy the cache folder "
                       f"models--{source.replace('/', '--')} into {hf_cache_dir()} (or set HF_HUB_CACHE), or pass "
                       f"the local path of {filename}.") from None


def resolve_device(device: str):
    """"auto" -> CUDA when available, else CPU; otherwise the named device (checked)."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(device)


DTYPE_NAMES = ("float32", "bfloat16", "float16")


def resolve_dtype(reward: str, dtype: str):
    import torch

    if dtype not in DTYPE_NAMES:
        raise ValueError(f"reward {reward!r}: dtype={dtype!r}: valid choices: {', '.join(DTYPE_NAMES)}")
    return getattr(torch, dtype)
