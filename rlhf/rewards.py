"""Reward functions: Python callables named `package.module:function` in the experiment's `reward` section, with
TRL's signature f(prompts, completions, **columns) -> list[float]. They score responses in PPO, GRPO and RLOO (next
to or instead of the reward model) and decide the held-out win rates. The synthetic task's ground truth is one of
them (`rlhf.data:letters_reward`). A function that raises or returns anything but one finite number per response
stops the step with an error naming the function and the row."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable

from .config import ConfigError, Experiment

TASK_GROUND_TRUTH = {"synthetic": "rlhf.data:letters_reward"}
"""The reward function each data source brings of its own (its ground truth), by data.source."""


class RewardFunctionError(RuntimeError):
    """A reward function failed on a batch (raised, wrong length, NaN or a non-number)."""


@dataclass(frozen=True)
class RewardFn:
    path: str
    fn: Callable
    weight: float = 1.0

    @property
    def name(self) -> str:
        return self.path.rsplit(":", 1)[1]


def resolve(path: str, where: str = "reward.functions") -> Callable:
    """The callable an import path names; a path that does not resolve is a config error (before any model loads)."""
    module, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ConfigError(f"{where}: {path!r}: cannot import module {module!r} ({e}); is it on PYTHONPATH?") from None
    except AttributeError:
        raise ConfigError(f"{where}: {path!r}: module {module!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise ConfigError(f"{where}: {path!r} is not callable")
    return fn


def configured(exp: Experiment) -> list[RewardFn]:
    """The experiment's own reward functions (reward.functions), resolved."""
    return [RewardFn(path, resolve(path), w) for path, w in exp.reward.functions.items()]


def judges(exp: Experiment) -> tuple[list[RewardFn], str | None]:
    """What win rates are scored with, and its name: the experiment's reward functions ("reward_functions"), else the
    task's own ground truth ("ground_truth"), else nothing (([], None): the reward model decides)."""
    if exp.reward.functions:
        return configured(exp), "reward_functions"
    path = TASK_GROUND_TRUTH.get(exp.data.source)
    return ([RewardFn(path, resolve(path))], "ground_truth") if path else ([], None)


def has_judge(exp: Experiment) -> bool:
    """Whether win rates have a judge other than the reward model (judges(exp), without importing anything)."""
    return bool(exp.reward.functions) or exp.data.source in TASK_GROUND_TRUTH


def columns(rows: list[dict]) -> dict[str, list]:
    """The rows' other fields as TRL passes them: one list per column (None where a row lacks it)."""
    keys = list(dict.fromkeys(k for r in rows for k in r.get("columns", {})))
    return {k: [r.get("columns", {}).get(k) for r in rows] for k in keys}


def call(f: RewardFn, prompts: list[str], completions: list[str], cols: dict[str, list]) -> list[float]:
    """f's scores, checked: one finite number per completion, or RewardFunctionError naming f and the row."""
    try:
        out = f.fn(prompts=prompts, completions=completions, **cols)
    except Exception as e:  # noqa: BLE001 - the user's function: report which one, then stop
        raise RewardFunctionError(f"reward function {f.path} raised {type(e).__name__}: {e}") from e
    try:
        out = list(out)
    except TypeError:
        raise RewardFunctionError(f"reward function {f.path} returned {type(out).__name__}, not a list of floats"
                                  ) from None
    if len(out) != len(completions):
        raise RewardFunctionError(f"reward function {f.path} returned {len(out)} scores for {len(completions)} "
                                  f"completions")
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
            raise RewardFunctionError(f"reward function {f.path}: row {i} is {v!r} ({type(v).__name__}), not a number "
                                      f"(prompt {prompts[i][:80]!r})")
        if not math.isfinite(float(v)):
            raise RewardFunctionError(f"reward function {f.path}: row {i} is {float(v)} (prompt {prompts[i][:80]!r}, "
                                      f"completion {completions[i][:80]!r})")
    return [float(v) for v in out]


def score(fns: list[RewardFn], prompts: list[str], completions: list[str], rows: list[dict]) -> dict[str, list[float]]:
    """Each function's scores by name (unweighted); the caller weights and sums them."""
    cols = columns(rows)
    return {f.name: call(f, prompts, completions, cols) for f in fns}


def weighted_sum(fns: list[RewardFn], scores: dict[str, list[float]]) -> list[float]:
    n = len(next(iter(scores.values()))) if scores else 0
    return [sum(f.weight * scores[f.name][i] for f in fns) for i in range(n)]
