"""Checkpoint folders that cannot run code and can be trusted (docs/reliability.md).

A checkpoint is ``RUN/checkpoints/step_NNNNNN/``:
- ``pytorch_lora_weights.safetensors`` — the policy LoRA in the diffusers format (core.models);
- ``training_state.safetensors`` — every tensor needed to resume (policy and old adapters, optimizer
  moments, ...), one flat dict of named tensors;
- ``training_state.json`` — everything else (step, config, balancer state, optimizer hyper-parameters);
- ``config.json`` — the run's config, for people;
- ``manifest.json`` — written last: the size and sha256 of every other file in the folder.

Nothing here unpickles: safetensors holds raw tensor bytes and a JSON header. The folder is written as
``.tmp_step_NNNNNN_<pid>/`` and renamed when its manifest is in place, so a kill leaves either a complete
folder or an orphan temp folder that :func:`remove_orphans` deletes on the next start. A folder whose
files do not match its manifest (truncated, flipped bytes, missing, unexpected) is refused by
:func:`verify`, naming the file; :func:`pick` then falls back to the previous good checkpoint.

Extra state (e.g. a parameter EMA) is one more prefix in the tensor dict, one more key in the JSON, or
one more file in the folder: the manifest covers every file generically.

This module imports torch only inside the functions that need it: the job runner verifies manifests
without it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable

MANIFEST_FILE = "manifest.json"
STATE_TENSORS_FILE = "training_state.safetensors"
STATE_JSON_FILE = "training_state.json"
LORA_FILE = "pytorch_lora_weights.safetensors"
EMA_FOLDER = "ema"  # the parameter EMA's LoRA, a diffusers LoRA folder inside a checkpoint (issue 15)
LEGACY_STATE_FILE = "training_state.pt"  # a pickle (before issue 17): never loaded
FORMAT = 1
TMP_PREFIX = ".tmp_step_"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be trusted or used; the message names the file and the reason."""


# ---- manifest --------------------------------------------------------------------------------------

def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def _sha256(path: Path, sync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def write_manifest(folder: str | Path) -> Path:
    """Hash every file under ``folder`` (flushing each to disk) and write ``manifest.json`` last."""
    folder = Path(folder)
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p, sync=True)}
             for p in _files(folder)}
    path = folder / MANIFEST_FILE
    write_bytes(path, (json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True) + "\n").encode())
    return path


def verify(folder: str | Path) -> dict:
    """Check every file of a checkpoint folder against its manifest; returns the manifest.

    Raises :class:`CheckpointError` naming the first file that is missing, unexpected, of the wrong size or
    with the wrong sha256, or the manifest itself when it is absent or unreadable."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {str(folder)!r} is not a folder")
    path = folder / MANIFEST_FILE
    if not path.is_file():
        legacy = folder / LEGACY_STATE_FILE
        if legacy.exists():
            raise CheckpointError(_legacy_message(legacy))
        raise CheckpointError(f"checkpoint {str(folder)!r} has no {MANIFEST_FILE} (a partial copy, or not a "
                              f"checkpoint written by this program); its files cannot be trusted")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
            raise TypeError("'files' is not a table of files")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{str(path)!r} is unreadable or damaged ({type(e).__name__}: {e})") from None
    present = {p.relative_to(folder).as_posix() for p in _files(folder)}
    for rel in sorted(present - set(files)):
        raise CheckpointError(f"{str(folder / rel)!r} is not listed in {MANIFEST_FILE}: an unexpected file in a "
                              f"checkpoint is refused (remove it, or resume from another checkpoint)")
    for rel, entry in sorted(files.items()):
        file = folder / rel
        if rel not in present:
            raise CheckpointError(f"{str(file)!r} is missing (listed in {MANIFEST_FILE})")
        size = file.stat().st_size
        if size != entry.get("size"):
            raise CheckpointError(f"{str(file)!r} has {size} bytes, its manifest says {entry.get('size')} "
                                  f"(truncated or damaged)")
        if _sha256(file) != entry.get("sha256"):
            raise CheckpointError(f"{str(file)!r} does not match the sha256 in its manifest (damaged)")
    return manifest


def _legacy_message(path: Path) -> str:
    return (f"{str(path)!r} is a pickled training state from an older version of this program; it is never "
            f"loaded, because unpickling a file can run any code in it. Resume from a checkpoint written by "
            f"this version, or start the run again")


# ---- writing ---------------------------------------------------------------------------------------

def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it came from) is a full disk, however the library phrased it."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc).lower()
        if "no space left" in text or "storagefull" in text or "disk quota exceeded" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_error(path: Path, exc: BaseException) -> OSError:
    """One sentence for a full disk, whatever the library said (chain the original with ``from``)."""
    return OSError(errno.ENOSPC, f"no space left on device while writing {str(path)!r}; free some space on "
                                 f"its disk and resume the run")


def write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_state(folder: str | Path, tensors: dict[str, Any], meta: dict) -> None:
    """Write ``training_state.safetensors`` (named tensors) and ``training_state.json`` (``meta``)."""
    from safetensors.torch import save

    folder = Path(folder)
    data = {name: t.detach().cpu().contiguous().clone() for name, t in tensors.items()}
    write_bytes(folder / STATE_TENSORS_FILE, save(data, metadata={"format": str(FORMAT)}))
    write_bytes(folder / STATE_JSON_FILE, (json.dumps({"format": FORMAT, **meta}, indent=1) + "\n").encode())


def load_state(folder: str | Path) -> tuple[dict[str, Any], dict]:
    """The tensors and JSON of a verified checkpoint folder (call :func:`verify` first)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    folder = Path(folder)
    for name in (STATE_TENSORS_FILE, STATE_JSON_FILE):
        if not (folder / name).is_file():
            if (folder / LEGACY_STATE_FILE).exists():
                raise CheckpointError(_legacy_message(folder / LEGACY_STATE_FILE))
            raise CheckpointError(f"{str(folder / name)!r} is missing: {str(folder)!r} is not a training checkpoint")
    try:
        tensors = load((folder / STATE_TENSORS_FILE).read_bytes())
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{str(folder / STATE_TENSORS_FILE)!r} could not be read ({e})") from None
    try:
        meta = json.loads((folder / STATE_JSON_FILE).read_text())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else meta!r}, expected {FORMAT}")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(folder / STATE_JSON_FILE)!r} could not be read ({e})") from None
    return tensors, meta


# ---- optimizer state <-> tensors + JSON ------------------------------------------------------------

def split_optimizer_state(state_dict: dict, prefix: str = "optimizer/") -> tuple[dict, dict]:
    """``optimizer.state_dict()`` -> (named tensors, JSON). Tensors are named ``optimizer/<param>/<key>``;
    the JSON keeps the param groups and the non-tensor per-parameter values."""
    import torch

    tensors, scalars = {}, {}
    for pid, entries in state_dict["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}{pid}/{key}"] = value
            else:
                scalars.setdefault(str(pid), {})[key] = value
    groups = state_dict["param_groups"]
    try:
        json.dumps(groups)
        json.dumps(scalars)
    except TypeError as e:
        raise TypeError(f"the optimizer state holds a value that is neither a tensor nor JSON ({e})") from None
    return tensors, {"param_groups": groups, "scalars": scalars, "params": [str(p) for p in state_dict["state"]]}


def join_optimizer_state(tensors: dict, meta: dict, prefix: str = "optimizer/") -> dict:
    """The inverse of :func:`split_optimizer_state`: a dict ``optimizer.load_state_dict`` accepts."""
    state: dict[int, dict] = {int(p): dict(meta["scalars"].get(p, {})) for p in meta["params"]}
    for name, value in tensors.items():
        if name.startswith(prefix):
            pid, key = name[len(prefix):].split("/", 1)
            state.setdefault(int(pid), {})[key] = value
    groups = [dict(g) for g in meta["param_groups"]]
    for g in groups:
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


def with_prefix(prefix: str, tensors: dict) -> dict:
    return {f"{prefix}{k}": v for k, v in tensors.items()}


def strip_prefix(prefix: str, tensors: dict) -> dict:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


# ---- finding and choosing checkpoints --------------------------------------------------------------

def step_of(folder: str | Path) -> int | None:
    m = _STEP_DIR.match(Path(folder).name)
    return int(m.group(1)) if m else None


def checkpoints_in(run_dir: str | Path) -> list[Path]:
    """The ``step_*`` folders under ``run_dir/checkpoints``, oldest first (not verified)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def is_checkpoint_folder(path: str | Path) -> bool:
    """A ``step_*`` folder or one holding checkpoint files (else it is taken for a run folder)."""
    path = Path(path)
    return step_of(path) is not None or any((path / n).exists() for n in (
        MANIFEST_FILE, STATE_TENSORS_FILE, STATE_JSON_FILE, LEGACY_STATE_FILE, LORA_FILE))


def pick(candidates: Iterable[str | Path], upto_step: int | None = None) -> tuple[Path, list[tuple[Path, str]]]:
    """The newest candidate that verifies (at or before ``upto_step`` when given), and the newer ones
    skipped with the reason each was refused. Raises :class:`CheckpointError` when none verifies."""
    ordered = sorted((Path(c) for c in candidates), key=lambda p: (step_of(p) or -1), reverse=True)
    if upto_step is not None:
        ordered = [p for p in ordered if (step_of(p) or -1) <= upto_step]
    skipped: list[tuple[Path, str]] = []
    for folder in ordered:
        try:
            verify(folder)
            if not (folder / STATE_TENSORS_FILE).is_file():
                raise CheckpointError(f"{str(folder / STATE_TENSORS_FILE)!r} is missing: not a training checkpoint")
            return folder, skipped
        except CheckpointError as e:
            skipped.append((folder, str(e)))
    if not skipped:
        raise CheckpointError("no checkpoint to resume from" + (f" at or before step {upto_step}"
                                                                if upto_step is not None else ""))
    reasons = "; ".join(reason for _, reason in skipped)
    raise CheckpointError(f"no usable checkpoint: {reasons}")


def remove_orphans(run_dir: str | Path) -> list[Path]:
    """Delete ``checkpoints/.tmp_step_*`` folders left by a process killed while writing; returns them.
    Call it only when no other process writes this run (the trainer's start, rank 0)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    orphans = sorted(p for p in root.iterdir() if p.name.startswith(TMP_PREFIX))
    for p in orphans:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return orphans


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
