"""The reward interface and the registry the UI and the trainer pick rewards from.

Every reward shares one signature (STYLE.md principle 6): a batch of images plus its prompts and
per-sample metadata in, one float per image out, NaN where the reward does not apply to a sample
(MARBLE_SPEC.md §3: OCR on a prompt without quoted text, GenEval on a prompt without GenEval metadata).

    images   [B, 3, H, W] floating, values in [0, 1], any device
    prompts  B strings
    metadata B mappings, e.g. {"source": "color", ...}
    ->       [B] float32 on the CPU, NaN = "not applicable"

Subclasses implement :meth:`Reward.score`; :meth:`Reward.__call__` validates what goes in and what
comes out, so every reward fails the same way, with a message naming the rule, the bad value and the
valid choices.

This module does not import torch at module level: the web process imports the registry (to list
reward names and validate configs) and must not pay for torch (STYLE.md principle 1). torch is
imported where tensors are actually handled.
"""

from __future__ import annotations

import abc
import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover - for annotations only
    import torch

RewardFactory = Callable[..., "Reward"]


class Reward(abc.ABC):
    """Scores a batch of images; one float per image, NaN where the reward does not apply.

    ``name`` and ``description`` are set from the registry by :func:`make_reward`; a reward built
    directly from its class keeps the class attributes (the class name is used in error messages
    when ``name`` is empty).
    """

    name: str = ""
    """Registry name, e.g. "jpeg_compressibility"."""
    description: str = ""
    """One line shown in the UI."""
    higher_is_better: bool = True
    """Whether training should push this reward up. Every reward here is oriented so that it is."""

    def __call__(
        self,
        images: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> torch.Tensor:
        """Validate the inputs, score them, validate the output.

        Args:
            images: floating tensor [B, 3, H, W] with every value in [0, 1], on any device.
            prompts: B strings, the prompt of each image.
            metadata: B mappings, the prompt set's metadata of each image.

        Returns:
            float32 tensor [B] on the CPU; NaN where the reward does not apply to that sample.

        Raises:
            TypeError: ``images`` is not a tensor, or ``score`` returned something that is not one.
            ValueError: a shape, length, dtype or range rule is broken; the message names it.
        """
        import torch

        batch = self._check_images(images)
        _check_prompts(prompts, batch)
        _check_metadata(metadata, batch)
        with torch.no_grad():
            scores = self.score(images.float(), prompts, metadata)
        return self._check_scores(scores, batch)

    @abc.abstractmethod
    def score(
        self,
        images: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> torch.Tensor:
        """Score already-validated inputs.

        Args:
            images: float32 tensor [B, 3, H, W] in [0, 1], on the caller's device.
            prompts: B strings.
            metadata: B mappings.

        Returns:
            A real-valued tensor [B] on any device; NaN where the reward does not apply.
        """

    # ---- validation -------------------------------------------------------------------------

    @property
    def _label(self) -> str:
        return f"reward {self.name or type(self).__name__!r}"

    def _check_images(self, images: Any) -> int:
        """Check type, shape, dtype and value range of ``images``; return the batch size B."""
        import torch

        if not isinstance(images, torch.Tensor):
            raise TypeError(f"{self._label}: images must be a torch.Tensor [B, 3, H, W], "
                            f"got {type(images).__name__}")
        shape = tuple(images.shape)
        if images.ndim != 4 or shape[1] != 3:
            raise ValueError(f"{self._label}: images.shape={shape}: must be [B, 3, H, W] "
                             f"(4 dimensions, 3 RGB channels in dimension 1)")
        if min(shape) < 1:
            raise ValueError(f"{self._label}: images.shape={shape}: B, H and W must all be >= 1")
        if not images.dtype.is_floating_point:
            raise ValueError(f"{self._label}: images.dtype={images.dtype}: must be floating "
                             f"(float16, bfloat16, float32 or float64) with values in [0, 1]")
        low, high = (float(v) for v in torch.aminmax(images))  # one pass; NaN propagates
        if math.isnan(low) or math.isnan(high):
            raise ValueError(f"{self._label}: images contain NaN values; every value must be in [0, 1]")
        if low < 0.0 or high > 1.0:
            raise ValueError(f"{self._label}: image values span [{low:.6g}, {high:.6g}]: every value "
                             f"must be in [0, 1] (map a [-1, 1] decoder output with x / 2 + 0.5 "
                             f"and clamp first)")
        return shape[0]

    def _check_scores(self, scores: Any, batch: int) -> torch.Tensor:
        """Check ``score``'s output is a real [B] tensor without infinities; return it as CPU float32."""
        import torch

        if not isinstance(scores, torch.Tensor):
            raise TypeError(f"{self._label}: score() must return a torch.Tensor of shape [{batch}], "
                            f"got {type(scores).__name__}")
        if tuple(scores.shape) != (batch,):
            raise ValueError(f"{self._label}: score() returned shape {tuple(scores.shape)}: "
                             f"must be ({batch},), one value per image")
        if scores.dtype.is_complex:
            raise ValueError(f"{self._label}: score() returned dtype {scores.dtype}: must be real "
                             f"(floating, integer or bool)")
        scores = scores.detach().to(device="cpu", dtype=torch.float32)
        if bool(torch.isinf(scores).any()):
            raise ValueError(f"{self._label}: score() returned {scores.tolist()}: values must be "
                             f"finite, or NaN where the reward does not apply")
        return scores


def _check_prompts(prompts: Any, batch: int) -> None:
    """Check ``prompts`` is a sequence of ``batch`` strings (a bare string is rejected)."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a sequence of {batch} strings (one per image), "
                         f"got {type(prompts).__name__}")
    if len(prompts) != batch:
        raise ValueError(f"len(prompts)={len(prompts)} does not match the batch size "
                         f"images.shape[0]={batch}")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise ValueError(f"prompts[{i}]={prompt!r}: every prompt must be a str")


def _check_metadata(metadata: Any, batch: int) -> None:
    """Check ``metadata`` is a sequence of ``batch`` mappings."""
    if isinstance(metadata, (str, Mapping)) or not isinstance(metadata, Sequence):
        raise ValueError(f"metadata must be a sequence of {batch} mappings (one per image), "
                         f"got {type(metadata).__name__}")
    if len(metadata) != batch:
        raise ValueError(f"len(metadata)={len(metadata)} does not match the batch size "
                         f"images.shape[0]={batch}")
    for i, item in enumerate(metadata):
        if not isinstance(item, Mapping):
            raise ValueError(f"metadata[{i}]={item!r}: every metadata item must be a mapping "
                             f"(e.g. a dict), possibly empty")


# ---- registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    factory: RewardFactory
    description: str


_REGISTRY: dict[str, _Entry] = {}


def register_reward(name: str, description: str) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator: register ``factory(**kwargs) -> Reward`` under ``name``.

    The name must be a non-empty identifier-like string (lowercase letters, digits, underscores),
    not registered yet; the description one non-empty line. Heavy dependencies (model libraries)
    belong inside the factory, so that importing the registry stays cheap. The factory is returned
    unchanged.
    """
    _check_name(name)
    if not isinstance(description, str) or not description.strip() or "\n" in description:
        raise ValueError(f"reward {name!r}: description={description!r}: must be one non-empty line")

    def decorator(factory: RewardFactory) -> RewardFactory:
        if not callable(factory):
            raise TypeError(f"reward {name!r}: register_reward decorates a factory function, "
                            f"got {type(factory).__name__}")
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered; names must be unique "
                             f"(registered: {', '.join(sorted(_REGISTRY))})")
        _REGISTRY[name] = _Entry(factory, description.strip())
        return factory

    return decorator


def _check_name(name: Any) -> None:
    valid = (isinstance(name, str) and name != "" and name[0].isalpha()
             and all(c.islower() or c.isdigit() or c == "_" for c in name))
    if not valid:
        raise ValueError(f"reward name {name!r}: must start with a letter and contain only lowercase "
                         f"letters, digits and underscores, e.g. 'jpeg_compressibility'")


def available_rewards() -> dict[str, str]:
    """Registered rewards: name -> one-line description, sorted by name."""
    return {name: _REGISTRY[name].description for name in sorted(_REGISTRY)}


def make_reward(name: str, **kwargs: Any) -> Reward:
    """Build the reward registered as ``name`` with the factory's keyword arguments.

    Raises:
        ValueError: ``name`` is not registered (the message lists the valid names), or ``kwargs``
            hold arguments the factory does not accept or lack ones it requires (the message names
            them and lists the accepted ones). Factories raise ValueError for bad argument values.
    """
    if name not in _REGISTRY:
        raise ValueError(f"reward name {name!r} is not registered; valid choices: "
                         f"{', '.join(sorted(_REGISTRY)) or '(none registered)'}")
    entry = _REGISTRY[name]
    _check_kwargs(name, entry.factory, kwargs)
    reward = entry.factory(**kwargs)
    if not isinstance(reward, Reward):
        raise TypeError(f"reward {name!r}: its factory returned {type(reward).__name__}, "
                        f"not a Reward")
    reward.name = name
    reward.description = entry.description
    return reward


def _check_kwargs(name: str, factory: RewardFactory, kwargs: Mapping[str, Any]) -> None:
    """Reject arguments ``factory`` does not accept and report required ones that are missing."""
    params = inspect.signature(factory).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    accepted_text = ", ".join(accepted) or "none"
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"reward {name!r}: unknown argument(s) {', '.join(unknown)}; "
                         f"accepted arguments: {accepted_text}")
    missing = [p.name for p in params if p.name in accepted
               and p.default is inspect.Parameter.empty and p.name not in kwargs]
    if missing:
        raise ValueError(f"reward {name!r}: missing required argument(s) {', '.join(missing)}; "
                         f"accepted arguments: {accepted_text}")


def check_number_in_range(reward: str, arg: str, value: Any, low: float, high: float,
                          integer: bool = False) -> None:
    """Factory helper: raise ValueError unless ``low <= value <= high`` (and an int if ``integer``)."""
    kind = "an integer" if integer else "a number"
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = is_number and math.isfinite(value) and low <= value <= high
    if integer:
        ok = ok and isinstance(value, int)
    if not ok:
        raise ValueError(f"reward {reward!r}: {arg}={value!r}: must be {kind} in [{low:g}, {high:g}]")
