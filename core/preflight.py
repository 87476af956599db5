"""Checks of a run that need more than its config — its prompt sources, its reward servers, the machine —
done before a run is queued (``jobs.runner.submit``: CLI and web form) or started (``core.train``), so a
mistake is one clear message instead of a failure at the first step.

- :func:`reward_coverage`: every reward must apply to some prompt of the run's sources. A reward that applies
  to none returns NaN on every sample: its advantage is empty, the balancer gives it α = 0, and the run
  trains without it while its curves stay blank. That is never what the user meant (a specialist reward
  picked without its prompt source), so the run is **refused**, not warned about: a warning in a job log is
  read after the compute is spent, and nothing may be fixed silently. A reward meant only to be watched
  belongs in evaluation (core.evaluate), where NaN is fine.
- :func:`rewards_usable`: every reward can be built here: a model-based reward's weights are on this machine
  (a local path or the Hugging Face cache), a ``remote`` reward has a server url. The message gives the
  ``hf download`` command that makes it usable.
- :func:`remote_rewards_reachable`: a ``remote`` reward's server answers its health check.
- :func:`model_found`: model.name is a built-in model, a local folder or a repo id in the local HF cache.
- :func:`check_resources`: the memory estimate (core.limits) against this machine (torch-free for CPU runs).

Torch-free: the web process calls these through ``jobs.runner.submit``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from core.config import ConfigError, TrainConfig
from core.rewards.world import TASKS_OF

Applies = Callable[[str, Mapping[str, Any]], bool]


def _world(*tasks: str) -> Applies:
    # core/rewards/world.py: WorldReward.applies (the metadata carries a world spec of one of its tasks)
    return lambda _prompt, meta: meta.get("task") in tasks and isinstance(meta.get("objects"), list)


def _ocr(prompt: str, _meta: Mapping[str, Any]) -> bool:
    from core.rewards.ocr import quoted_text

    return quoted_text(prompt) is not None


def _geneval(_prompt: str, meta: Mapping[str, Any]) -> bool:
    return bool(meta.get("include"))  # core/rewards/geneval.py: parse_requirements is None without it


APPLIES: dict[str, Applies] = {
    **{name: _world(*tasks) for name, tasks in TASKS_OF.items()},
    "ocr": _ocr,
    "geneval": _geneval,
}
"""Rewards that score only some prompts (NaN on the rest), with the test they apply; every other reward
(image statistics, CLIP-family scores, remote servers) applies to every prompt."""

_NEEDS = {
    "color_fidelity": "world-color prompts (metadata task=color)",
    "count_accuracy": "world-count prompts (metadata task=count)",
    "spatial_relation": "world-position prompts (metadata task=position)",
    "single_object": "single-object prompts (world-general or world-single; metadata task=single)",
    "object_size": "world-size prompts (metadata task=size)",
    "world_geneval": "mini-world prompts (a world-* source)",
    "ocr": "prompts with \"quoted\" text (e.g. nft-ocr)",
    "geneval": "GenEval prompts with \"include\" metadata (e.g. nft-geneval)",
}


def reward_coverage(config: TrainConfig) -> None:
    """Raise ConfigError naming a reward that applies to no prompt of the run's sources (and split)."""
    from core.prompts import load_source

    todo = {i: r.name for i, r in enumerate(config.rewards) if r.name in APPLIES}
    if not todo:
        return
    items = []
    for name in config.prompts.sources:
        try:
            items += load_source(name).split(config.prompts.split)
        except ValueError as e:
            raise ConfigError("prompts.sources", name, str(e)) from None
    for i, reward in todo.items():
        test = APPLIES[reward]
        if not any(test(it.text, it.metadata) for it in items):
            raise ConfigError(f"rewards[{i}].name", reward,
                              f"applies to no prompt of the run's sources ({', '.join(config.prompts.sources)}, "
                              f"split {config.prompts.split}): it would score NaN everywhere and get α = 0. It "
                              f"needs {_NEEDS[reward]}; add such a source or drop the reward")


def remote_rewards_reachable(config: TrainConfig, timeout: float = 3.0) -> None:
    """Raise ConfigError when a ``remote`` reward's server does not answer its health check (GET url)."""
    for i, r in enumerate(config.rewards):
        if r.name != "remote":
            continue
        url = r.kwargs.get("url")
        try:
            with urllib.request.urlopen(urllib.request.Request(str(url), method="GET"), timeout=timeout) as resp:
                json.loads(resp.read(65536) or b"{}")
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            raise ConfigError(f"rewards[{i}].kwargs.url", url, f"the reward server does not answer ({reason}); "
                                                                f"start it (docs/remote-reward.md) or fix the url") from None


# Rewards that need model files: which factory arguments name them. ("folder", arg): a model folder or repo id;
# ("file", arg, name_arg): the file named by ``name_arg`` in the folder / repo ``arg`` (or ``arg`` itself a file).
_FILES: dict[str, tuple[tuple[str, ...], ...]] = {
    "pickscore": (("folder", "model"), ("folder", "processor")),
    "clipscore": (("folder", "model"),),
    "hpsv2": (("file", "checkpoint", "filename"), ("folder", "clip")),
    "aesthetic": (("file", "head", "filename"), ("folder", "clip")),
    "imagereward": (("file", "checkpoint", "filename"), ("file", "checkpoint", "med_config"), ("folder", "tokenizer")),
    "geneval": (("folder", "detector"), ("folder", "clip")),
}


def _snapshots(repo: str) -> list[Path]:
    from core.cache import hf_cache_dir

    root = Path(hf_cache_dir()) / ("models--" + repo.replace("/", "--")) / "snapshots"
    return [d for d in root.iterdir() if d.is_dir()] if root.is_dir() else []


def _has_folder(source: str) -> bool:
    path = Path(source).expanduser()
    return path.is_dir() or any(any(d.iterdir()) for d in _snapshots(source))


def _has_file(source: str, filename: str) -> bool:
    path = Path(source).expanduser()
    if path.is_file() or (path / filename).is_file() or Path(filename).expanduser().is_file():
        return True
    return any((d / filename).is_file() for d in _snapshots(source))


def missing_reward_files(name: str, kwargs: Mapping[str, Any] | None = None) -> str | None:
    """What a reward lacks on this machine, with the commands that provide it; None when it can be built here.

    Torch-free (file system only): the New-run form asks it for every reward to say which are usable, and
    :func:`rewards_usable` refuses a run before it is queued and again before its first rollout. A ``remote``
    reward needs the ``url`` of its server (its health check is :func:`remote_rewards_reachable`)."""
    kwargs = dict(kwargs or {})
    if name == "remote":
        if not kwargs.get("url"):
            return ("needs the url of its scoring server (rewards[].kwargs.url, e.g. in a config file for "
                    "`python -m core.train --config FILE`; protocol: docs/remote-reward.md)")
        return None
    if name not in _FILES:
        return None
    import inspect

    from core.cache import hf_cache_dir
    from core.rewards.base import _REGISTRY
    from core.rewards.hub import hf_offline

    if not hf_offline():
        return None  # huggingface_hub may download what is missing when the reward is built
    params = inspect.signature(_REGISTRY[name].factory).parameters
    value = {k: kwargs.get(k, p.default) for k, p in params.items()}
    missing: list[str] = []
    for kind, arg, *rest in _FILES[name]:
        source = str(value[arg])
        if kind == "folder" and not _has_folder(source):
            missing.append(f"hf download {source}" if "/" in source and not source.startswith((".", "/", "~"))
                           else f"a folder at {source}")
        elif kind == "file" and not _has_file(source, str(value[rest[0]])):
            missing.append(f"hf download {source} {value[rest[0]]}" if "/" in source
                           and not source.startswith((".", "/", "~")) else f"the file {source}/{value[rest[0]]}")
    if not missing:
        return None
    return (f"needs model weights that are not on this machine: run `{'` and `'.join(missing)}` on a machine with "
            f"network and copy the cache into {hf_cache_dir()} (or set HF_HUB_CACHE to it), or give the reward "
            f"local paths in its kwargs")


def rewards_usable(config: TrainConfig) -> None:
    """Raise ConfigError naming the first reward that cannot be built here (missing weights, no server url)."""
    for i, r in enumerate(config.rewards):
        why = missing_reward_files(r.name, r.kwargs)
        if why:
            raise ConfigError(f"rewards[{i}].name", r.name, why)


def model_found(config: TrainConfig) -> None:
    """model.name is a built-in model, a local folder or a repo id in the local Hugging Face cache: a name that is
    none of them is refused when the run is queued, not when the worker first loads it."""
    from core.cache import BUILT_IN_MODELS, hf_cache_dir, model_available

    name = config.model.name
    if name in BUILT_IN_MODELS or model_available(name):
        return
    raise ConfigError("model.name", name, f"must be a built-in model ({', '.join(BUILT_IN_MODELS)}), an existing "
                      f"diffusers folder, or a Hugging Face repo id already in the local cache ({hf_cache_dir()}); "
                      f"nothing is downloaded at run time")


def check_resources(config: TrainConfig, world_size: int = 1) -> None:
    """The memory estimate against this host's RAM for CPU runs (GPU runs: the trainer, against the GPU)."""
    from core.limits import check_fits_host

    check_fits_host(config, world_size)


def check_run(config: TrainConfig, world_size: int = 1) -> None:
    """Everything above, cheapest first."""
    model_found(config)
    check_resources(config, world_size)
    rewards_usable(config)
    reward_coverage(config)
    remote_rewards_reachable(config)


def check_device_memory(config: TrainConfig, device: Any, world_size: int = 1) -> None:
    """The memory estimate against the device a process trains on (called by the trainer before loading)."""
    from core.limits import check_fits, host_memory_bytes

    if getattr(device, "type", "cpu") == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        check_fits(config, int(props.total_memory), f"GPU {device} ({props.name})", world_size)
    else:
        check_fits(config, host_memory_bytes(), "this machine's RAM", world_size)
