"""The "new run" form, generated from ``TrainConfig``: one field per config leaf, help text from the
config's own field docstrings, choices from the registries. Form values -> ``TrainConfig`` goes through
the config's validation, and its error message is shown to the user word for word.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import typing
from dataclasses import dataclass
from typing import Any

from core import config as cfgmod
from core.cache import model_available
from core.config import ConfigError, TrainConfig, available_presets, preset

# Leaves that get their own widgets elsewhere on the form (rewards table, stages text) or are internal.
SKIP = {"rewards", "balance.stages", "model.lora_targets", "prompts.sources", "balance.single_reward",
        "model.device"}
SECTIONS = ("balance", "model", "prompts", "sampling", "nft", "advantage", "optim", "")
SECTION_TITLES = {"balance": "Strategy and MARBLE knobs", "model": "Model and LoRA", "prompts": "Prompts",
                  "sampling": "Sampling (rollouts)", "nft": "DiffusionNFT loss", "advantage": "Advantages",
                  "optim": "Optimizer", "": "Run"}


@dataclass(frozen=True)
class FormField:
    path: str  # dotted config path, e.g. "balance.ema_rho"
    label: str
    kind: str  # "int" | "float" | "bool" | "choice" | "multi" | "text"
    default: Any
    help: str
    choices: tuple[str, ...] = ()


@functools.lru_cache(maxsize=1)
def _field_docs() -> dict[tuple[str, str], str]:
    """(dataclass name, field name) -> the docstring written under the field in core/config.py."""
    tree = ast.parse(inspect.getsource(cfgmod))
    docs = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for a, b in zip(body, body[1:]):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                    and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
                docs[(node.name, a.target.id)] = md_literal(" ".join(b.value.value.replace("``", "").split()))
    return docs


def md_literal(text: str) -> str:
    """``text`` for Gradio's ``info`` lines, which read ``*`` and ``_`` pairs as emphasis and honour neither
    backslash escapes nor HTML entities ("ᾱ_t = ρ·ᾱ_{t-1}" and "α* ... α*" came out italic): a word that holds a
    ``*``, or a ``_`` that is not between two ASCII letters or digits ("Σ_k", unlike "marble_full", which renders
    as it is), becomes a `code span`, the one construct those lines keep literal."""
    import re

    def word(m: re.Match) -> str:
        token = m.group(0)
        core = token.rstrip(",.;:")
        if "*" not in core and not re.search(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", core):
            return token
        return f"`{core}`{token[len(core):]}"

    def outside_code(part: str) -> str:
        if len(part) > 1 and part.startswith("`") and part.endswith("`"):  # a code span: as written
            return part
        return re.sub(r"[^\s`]*[_*][^\s`]*", word, part)

    return "".join(outside_code(p) for p in re.split(r"(`[^`]*`)", text))


def exposed() -> bool:
    """True when the app serves beyond loopback (app/__main__.py sets MARBLE_EXPOSED with the login)."""
    import os

    return os.environ.get("MARBLE_EXPOSED") == "1"


def allowed_models() -> list[str]:
    """What model.name may be when exposed: the presets' built-in models and the repos in the local HF cache.
    A free path would let a web user probe which server paths exist (its error says whether it is there)."""
    from core.cache import cached_repos

    names = {preset(n).model.name for n in available_presets()}
    return sorted(n for n in names if "/" not in n) + cached_repos()


def _choices(path: str) -> tuple[str, ...]:
    if path == "model.name" and exposed():
        return tuple(allowed_models())
    if path == "balance.strategy":
        from core.balancing import available_balancers

        return tuple(available_balancers())
    return {"advantage.std_mode": cfgmod.STD_MODES, "balance.harmonize_scope": cfgmod.HARMONIZE_SCOPES,
            "balance.amortized_combination": cfgmod.AMORTIZED_COMBINATIONS,
            "balance.gradients": cfgmod.GRADIENT_PATHS, "sampling.sampler": cfgmod.SAMPLERS,
            "model.dtype": cfgmod.DTYPES,
            "prompts.split": ("train", "test"), "report_to": cfgmod.TRACKERS}.get(path, ())


def form_fields(base: TrainConfig | None = None) -> list[FormField]:
    """Every editable leaf of TrainConfig, grouped by section, with defaults from ``base``."""
    base = base or preset(default_preset())
    docs = _field_docs()
    out: list[FormField] = []

    def walk(obj: Any, prefix: str) -> None:
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            path = f"{prefix}.{f.name}" if prefix else f.name
            value = getattr(obj, f.name)
            if path in SKIP:
                continue
            if dataclasses.is_dataclass(value):
                walk(value, path)
                continue
            t = hints[f.name]
            choices = _choices(path)
            if choices:
                kind = "multi" if isinstance(value, list) else "choice"  # multi: any subset, e.g. report_to
            elif t is bool:
                kind = "bool"
            elif t is int:
                kind = "int"
            elif t is float:
                kind = "float"
            else:
                kind = "text"
            if isinstance(value, dict):  # e.g. balance.reward_groups: edited as JSON text
                kind, value = "text", json.dumps(value)
            label = f.name.replace("_", " ")
            out.append(FormField(path, label, kind, value, docs.get((type(obj).__name__, f.name), ""), choices))

    walk(base, "")
    order = {s: i for i, s in enumerate(SECTIONS)}
    return sorted(out, key=lambda f: order.get(f.path.split(".")[0] if "." in f.path else "", len(order)))


def section_of(field: FormField) -> str:
    return field.path.split(".")[0] if "." in field.path else ""


def default_preset() -> str:
    names = list(available_presets())
    return next((n for n in names if n.startswith("mini-marble")), names[0])


def selectable_presets() -> list[str]:
    """Presets whose model is available here (the SD3.5 preset only when its weights are present)."""
    out = []
    for name in available_presets():
        model = preset(name).model.name
        if "/" in model and not model_available(model):
            continue
        out.append(name)
    return out


def parse_weights(text: str, rewards: list[str]) -> dict[str, float]:
    """'colorfulness=2, brightness=0.5' -> weights; rewards not named keep weight 1."""
    weights = {r: 1.0 for r in rewards}
    for part in filter(None, (p.strip() for p in (text or "").replace(";", ",").split(","))):
        if "=" not in part:
            raise ConfigError("reward weights", part, "write name=weight pairs separated by commas, "
                                                      "e.g. colorfulness=2, brightness=0.5")
        name, value = (x.strip() for x in part.split("=", 1))
        if name not in weights:
            raise ConfigError("reward weights", name, f"is not a selected reward; selected: {', '.join(rewards)}")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ConfigError("reward weights", part, "the weight must be a number") from None
    return weights


def parse_stages(text: str) -> list[dict]:
    """'colorfulness:80; jpeg_compressibility+brightness:40@tiny' -> [{rewards, steps, sources}, ...]; an
    optional '@source+source' names the prompt sources a stage draws from (default: all of the run's)."""
    stages = []
    for part in filter(None, (p.strip() for p in (text or "").replace("\n", ";").split(";"))):
        if ":" not in part:
            raise ConfigError("stages", part, "write reward+reward:steps, stages separated by ';', "
                                              "e.g. colorfulness:80; brightness+contrast:40")
        names, steps = part.rsplit(":", 1)
        steps, _, where = steps.partition("@")
        try:
            n = int(steps.strip())
        except ValueError:
            raise ConfigError("stages", part, "the number of steps after ':' must be an integer") from None
        stages.append({"rewards": [r.strip() for r in names.split("+") if r.strip()], "steps": n,
                       "sources": [src.strip() for src in where.split("+") if src.strip()]})
    return stages


def format_stages(stages: list) -> str:
    return "; ".join("+".join(s.rewards) + f":{s.steps}" + ("@" + "+".join(s.sources) if s.sources else "")
                     for s in stages)


def build_config(preset_name: str, values: dict[str, Any], rewards: list[str], weights_text: str,
                 stages_text: str, single_reward: str | None, sources: list[str]) -> TrainConfig:
    """Form values -> a validated TrainConfig (raises ConfigError with the message to show)."""
    base = preset(preset_name)
    data = base.to_dict()
    for path, value in values.items():
        node = data
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = _coerce(value, node[leaf], path)
    if not rewards:
        raise ConfigError("rewards", [], "select at least one reward")
    kwargs = {r["name"]: r.get("kwargs", {}) for r in data["rewards"]}
    weights = parse_weights(weights_text, rewards)
    data["rewards"] = [{"name": r, "weight": weights[r], "kwargs": kwargs.get(r, {})} for r in rewards]
    data["balance"]["stages"] = parse_stages(stages_text)
    data["balance"]["single_reward"] = single_reward or None
    data["prompts"]["sources"] = list(sources)
    if exposed() and data["model"]["name"] not in allowed_models():
        raise ConfigError("model.name", data["model"]["name"], f"this server is reachable from the network, so "
                          f"only known models are offered: {', '.join(allowed_models())}")
    files = [x for x in data["prompts"]["sources"] if str(x).startswith("file:")]
    if exposed() and files:
        raise ConfigError("prompts.sources", files[0], "this server is reachable from the network, so only the "
                          "registered prompt sources are offered (file: paths are for the CLI)")
    return TrainConfig.from_dict(data)


def config_form_values(cfg: TrainConfig, fields: list[FormField]) -> list[Any]:
    """A config as form values: one per generated field, then rewards, weights, stages, single reward and
    prompt sources (the order of the New-run page's outputs)."""
    data = cfg.to_dict()
    values = []
    for f in fields:
        node: Any = data
        for part in f.path.split("."):
            node = node[part]
        values.append(json.dumps(node) if isinstance(node, dict) else node)
    weights = ", ".join(f"{r.name}={r.weight:g}" for r in cfg.rewards if r.weight != 1.0)
    return [*values, cfg.reward_names, weights, format_stages(cfg.balance.stages), cfg.balance.single_reward,
            list(cfg.prompts.sources)]


def _coerce(value: Any, current: Any, path: str) -> Any:
    """Gradio numbers arrive as floats; ints must stay ints so validation sees the user's value."""
    if isinstance(current, dict) and isinstance(value, str):
        try:
            parsed = json.loads(value or "{}")
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ConfigError(path, value, 'must be a JSON object, e.g. {"general": ["pickscore", "hpsv2"]} or {}')
        return parsed
    if isinstance(current, bool):
        return bool(value)
    if isinstance(current, int) and isinstance(value, float) and value.is_integer():
        return int(value)
    if value is None:
        raise ConfigError(path, value, "is empty; enter a value")
    return value
