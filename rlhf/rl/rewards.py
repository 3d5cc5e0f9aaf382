"""Reward functions: Python callables named `package.module:function` in the experiment's `reward` section, called
as TRL 1.16's GRPOTrainer calls them. They score responses in PPO, GRPO and RLOO (next to or instead of the reward
model) and decide the held-out win rates. The synthetic task's ground truth is one of them (`rlhf.inputs.data:letters_reward`).

The calling convention (TRL's `_calculate_rewards`): f(prompts=, completions=, completion_ids=, trainer_state=,
log_extra=, log_metric=, **columns) -> one score per completion, where
- prompts / completions are strings, or on conversational rows the prompt's message list and
  `[{"role": "assistant", "content": text}]` (the messages the chat template rendered, kept as row["prompt_messages"]);
- completion_ids are the response's token ids (EOS included when it ended), one list per completion;
- trainer_state is a transformers.TrainerState (`trainer_state()`: global_step = iterations done, max_steps, epoch);
- log_extra(column, values) adds a column to the stage's sample table, log_metric(name, value) a scalar to the
  step's metrics (as `reward_fn/<name>`, averaged over the step's calls);
- columns are the rows' other fields, one list each.
A score may be a Python or numpy number or bool (as float), or None: the function does not apply to that response, and
it is left out of the weighted sum (TRL: None -> NaN, nansum over the functions). Async functions are awaited (the
batch's async functions concurrently, as TRL gathers them). A function that returns the wrong length, NaN/inf or a
non-number stops the step with an error naming the function and the row; one that raises, the function and the line
of its own file where it raised (raised_at).

Components are keyed by their import path; each is logged as `reward/<name>`, name being the function's own name when
no other component has it, else the shortest unambiguous suffix of its path (`math:score`, `a.math:score`;
config.log_names, which the config's checks apply)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import inspect
import math
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from rlhf.experiment.config import ConfigError, first_line, log_names
from rlhf.experiment.sections import RewardConfig

if TYPE_CHECKING:
    from rlhf.inputs.models import Loading

TASK_GROUND_TRUTH = {"synthetic": "rlhf.inputs.data:letters_reward"}
"""The reward function each data source brings of its own (its ground truth), by data.source."""


class RewardFunctionError(RuntimeError):
    """A reward function failed on a batch (raised, wrong length, NaN or a non-number)."""


@dataclass(frozen=True)
class RewardFn:
    path: str
    """The import path: the component's key."""
    fn: Callable
    weight: float = 1.0
    name: str = ""
    """The name it is logged under (config.log_names); by default the function's own name."""

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", self.path.rsplit(":", 1)[1])


def resolve(path: str, where: str = "reward.functions") -> Callable:
    """The callable an import path names; a path that does not resolve is a config error (before any model loads)."""
    module, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ConfigError(f"{where}: {path!r}: cannot import module {module!r} ({e}); is it on PYTHONPATH?") from None
    except SyntaxError as e:  # the user's file, where Python stopped reading it
        raise ConfigError(f"{where}: {path!r}: {e.filename}:{e.lineno}: {e.msg}") from None
    except AttributeError:
        raise ConfigError(f"{where}: {path!r}: module {module!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise ConfigError(f"{where}: {path!r} is not callable")
    return fn


def resolved(functions: dict[str, float], where: str = "reward.functions") -> list[RewardFn]:
    """`functions` ({import path: weight}, the config key `where`), resolved and named for the log."""
    names = log_names(list(functions))
    return [RewardFn(path, resolve(path, where), w, names[path]) for path, w in functions.items()]


def configured(r: RewardConfig) -> list[RewardFn]:
    """The reward section `r`'s own reward functions (reward.functions)."""
    return resolved(r.functions)


TRL_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""The keywords every call passes (score), beside the rows' other columns."""


def check_calls(r: RewardConfig, row_sets: dict[str, list[dict]], where: str = "config") -> None:
    """Every function the reward section `r` names (functions, judge_functions, grader_functions), its signature
    bound to the keywords `score` will pass on each of `row_sets` ({what the rows are: rows}, each scored apart: the
    held-out rows first, then an online stage's training prompts; the grader scores the held-out rows alone),
    TRL_KWARGS and those rows' columns, before anything loads: a
    function TRL's convention cannot call (no **kwargs for what it does not use, a column those rows lack) is a
    ConfigError naming it and the rows, not a TypeError at the first scoring, after the base has loaded. A callable
    without a signature (a builtin) is left to its first call."""
    for group in ("functions", "judge_functions", "grader_functions"):
        for f in resolved(getattr(r, group), f"reward.{group}"):
            try:
                sig = inspect.signature(f.fn)
            except (TypeError, ValueError):
                continue
            for what, rows in list(row_sets.items())[: 1 if group == "grader_functions" else None]:
                keys = [*TRL_KWARGS, *columns(rows)]
                try:
                    sig.bind(**dict.fromkeys(keys))
                except TypeError as e:
                    cols = ", ".join(keys[len(TRL_KWARGS):]) or "none"
                    raise ConfigError(f"{where}: reward.{group}: {f.path!r} cannot be called as TRL calls a reward "
                                      f"function on {what} ({e}): it gets {'=, '.join(TRL_KWARGS)}= and their other "
                                      f"columns ({cols}) as keywords; take the ones it needs by name and the rest "
                                      f"with **kwargs", key=f"reward.{group}") from None


def _functions_and_model(r: RewardConfig, role: str, ld: Loading, batch_size: int) -> list[RewardFn]:
    """reward.<role>_functions, resolved, then reward.<role>_model as one more function of weight 1 (loaded once, as
    `ld` says, scoring `batch_size` texts a pass)."""
    path = getattr(r, f"{role}_model")
    model = ([RewardFn(f"{role}_model", ModelJudge.of(ld, path, f"reward.{role}_model", batch_size), 1.0,
                       f"{role}_model")] if path else [])
    return resolved(getattr(r, f"{role}_functions"), f"reward.{role}_functions") + model


def judges(r: RewardConfig, ld: Loading, batch_size: int) -> list[RewardFn]:
    """The user's own judge: its judge functions (reward.judge_functions) and its judge model (reward.judge_model,
    weight 1); [] when the judge is the RM stage's adapter."""
    return _functions_and_model(r, "judge", ld, batch_size)


def independent(r: RewardConfig, ld: Loading, batch_size: int) -> list[RewardFn]:
    """The user's independent grader: reward.grader_functions and reward.grader_model (weight 1); [] without."""
    return _functions_and_model(r, "grader", ld, batch_size)


def trained_functions(r: RewardConfig) -> set[str]:
    """The reward functions an online stage trains against: those of `r.functions` with a weight not 0."""
    return {name for name, weight in r.functions.items() if weight}


def own_judge(r: RewardConfig) -> bool:
    """Whether the user names the judge (reward.judge_functions or reward.judge_model) instead of the RM stage's
    judge adapter."""
    return bool(r.judge_functions or r.judge_model)


def judge_spec(r: RewardConfig) -> dict:
    """The user's judge as configured (what a measure of it is valid for)."""
    return {"functions": dict(r.judge_functions), "model": r.judge_model}


class ModelJudge:
    """reward.judge_model as a judge function: a reward model of the user's own (another base, a larger RM; a hub id
    or a directory holding a one-label sequence classifier, as TRL's RewardTrainer saves one) with its own
    tokenizer, loaded once per process on the stages' device (quantized as the experiment's base is). It scores
    each prompt + completion as TRL's RewardTrainer trained it: a string pair with the tokenizer's EOS appended (and
    its BOS), a conversational one through the tokenizer's chat template; its raw score, read by the classifier's
    own rule (the last token that is not padding)."""

    _loaded: dict[str, "ModelJudge"] = {}

    def __init__(self, ld: Loading, path: str, field: str, batch_size: int):
        from rlhf.inputs import models

        self.path, self.field, self.batch_size = path, field, batch_size
        try:
            self.tok = models.load_tokenizer(path)
        except (OSError, models.ModelLoadError) as e:  # the field's own words, not model.name's
            advice = getattr(e, "advice", "") or "Name a local directory or a hub id this machine can reach"
            raise ConfigError(f"{field}: cannot load {path!r} ({getattr(e, 'reason', None) or first_line(e)}); "
                              f"{advice[:1].lower()}{advice[1:]}") from None
        self.model = models.load_base(ld, path, "judge", self.tok, train=False, field=field).eval()

    @classmethod
    def of(cls, ld: Loading, path: str, field: str, batch_size: int) -> "ModelJudge":
        """The model at `path` (`field` names it in errors; `batch_size` texts scored a pass: eval.batch_size),
        loaded once per process."""
        if path not in cls._loaded:
            cls._loaded[path] = cls(ld, path, field, batch_size)
        return cls._loaded[path]

    def texts(self, prompts: list, completions: list) -> tuple[list[str], bool]:
        """The texts it scores, and whether the tokenizer adds its special tokens (not to chat-templated ones)."""
        from rlhf.rl.generation import eos_terminated

        if prompts and isinstance(prompts[0], list):  # conversational rows (as_trl): the judge's own template
            if not self.tok.chat_template:
                raise ConfigError(f"{self.field}: {self.path}'s tokenizer has no chat template for the "
                                  f"conversational prompts; give it one or use string prompts")
            return [self.tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)], False
        return [eos_terminated(p + c, self.tok) if self.tok.eos_token else p + c
                for p, c in zip(prompts, completions)], True

    def __call__(self, prompts: list, completions: list, **_) -> list[float]:
        texts, special = self.texts(prompts, completions)
        return classifier_scores(self.model, self.tok, texts, special, self.batch_size)


def classifier_scores(model, tok, texts: list[str], special: bool, batch_size: int) -> list[float]:
    """A one-label sequence classifier's raw scores of `texts`, `batch_size` at a time (its tokenizer adding its
    special tokens or not), each read by the classifier's own rule (the last token that is not padding)."""
    import torch

    from rlhf.inputs import models

    out = []
    with torch.no_grad(), models.autocast(model):
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=special)
            out += model(**enc.to(next(model.parameters()).device)).logits[:, 0].float().tolist()
    return out


def graders(r: RewardConfig, source: str) -> tuple[list[RewardFn], str | None]:
    """What win rates are scored with, and its name: the reward section's functions ("reward_functions"), else the
    ground truth of the task (data.source: `source`) ("ground_truth"), else nothing (([], None): the reward model
    decides)."""
    if r.functions:
        return configured(r), "reward_functions"
    path = TASK_GROUND_TRUTH.get(source)
    return ([RewardFn(path, resolve(path))], "ground_truth") if path else ([], None)


def columns(rows: list[dict]) -> dict[str, list]:
    """The rows' other fields as TRL passes them: one list per column (None where a row lacks it)."""
    keys = list(dict.fromkeys(k for r in rows for k in r.get("columns", {})))
    return {k: [r.get("columns", {}).get(k) for r in rows] for k in keys}


def as_trl(rows: list[dict], prompts: list[str], completions: list[str]) -> tuple[list, list]:
    """Prompts and completions as TRL passes them: on conversational rows (they keep the messages the chat template
    rendered as "prompt_messages") the message lists and [{"role": "assistant", "content": text}]; else the strings."""
    if rows and all("prompt_messages" in r for r in rows):
        return [r["prompt_messages"] for r in rows], [[{"role": "assistant", "content": c}] for c in completions]
    return prompts, completions


def trainer_state(global_step: int = 0, max_steps: int = 0, epoch: float = 0.0):
    """What a function gets as `trainer_state`: a transformers.TrainerState holding the stage's progress (TRL passes
    its trainer's own)."""
    from transformers import TrainerState

    return TrainerState(global_step=global_step, max_steps=max_steps, epoch=epoch)


class Log:
    """What functions log during one scoring through TRL's callbacks: log_metric(name, value) and
    log_extra(column, values)."""

    def __init__(self):
        self.metrics: dict[str, list[float]] = {}
        self.extra: dict[str, list] = {}

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extra.setdefault(column, []).extend(values)

    def means(self) -> dict[str, float]:
        """Each logged metric averaged over its calls, as `reward_fn/<name>`."""
        return {f"reward_fn/{k}": sum(v) / len(v) for k, v in self.metrics.items()}


def is_async(fn: Callable) -> bool:
    """Whether calling `fn` returns a coroutine (a partial is looked through; a callable object by its __call__)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def checked(f: RewardFn, out, prompts: list[str], completions: list[str]) -> list[float | None]:
    """f's output as floats (None kept: does not apply), or RewardFunctionError naming f and the completion by its
    place in f's call."""
    try:
        out = list(out)
    except TypeError:
        raise RewardFunctionError(f"reward function {f.path} returned {type(out).__name__}, not a list of floats"
                                  ) from None
    if len(out) != len(completions):
        raise RewardFunctionError(f"reward function {f.path} returned {len(out)} scores for {len(completions)} "
                                  f"completions")
    vals: list[float | None] = []
    for i, v in enumerate(out):
        if v is None:
            vals.append(None)
            continue
        try:
            x = float(v) if not isinstance(v, (str, bytes)) else None
        except (TypeError, ValueError):
            x = None
        if x is None:
            raise RewardFunctionError(f"reward function {f.path}: its score for completion {i} of the {len(out)} in "
                                      f"its call is {v!r} ({type(v).__name__}), not a number or None (prompt "
                                      f"{prompts[i][:80]!r})")
        if not math.isfinite(x):
            raise RewardFunctionError(f"reward function {f.path}: its score for completion {i} of the {len(out)} in "
                                      f"its call is {x} (prompt {prompts[i][:80]!r}, completion "
                                      f"{completions[i][:80]!r}); return None where it does not apply")
        vals.append(x)
    return vals


def run_async(awaitables: list) -> list:
    """The awaitables' results (or exceptions), awaited together on a fresh event loop; in a worker thread when this
    thread already runs one (a notebook)."""
    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def raised_at(e: BaseException, fn: Callable) -> str:
    """ " (at file:line, in name)": where in the function's own source file `e` was raised (its deepest frame there;
    else the deepest frame), so a user's error points at the user's line; "" without a traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    try:
        own = inspect.getsourcefile(inspect.unwrap(fn))
    except TypeError:
        own = None
    mine = [fr for fr in frames if own and fr.filename == own] or frames
    return f" (at {mine[-1].filename}:{mine[-1].lineno}, in {mine[-1].name})" if mine else ""


def score(fns: list[RewardFn], prompts: list[str], completions: list[str], rows: list[dict], *,
          completion_ids: list[list[int]] | None = None, state=None, log: Log | None = None
          ) -> dict[str, list[float | None]]:
    """Each function's scores by import path (unweighted; None where it does not apply); the caller weights and sums
    them. `prompts` are the rendered prompt texts (error messages), `state` the trainer_state passed (default: step
    0), `log` collects what the functions log (default: dropped)."""
    log = log if log is not None else Log()
    p, c = as_trl(rows, prompts, completions)
    kwargs = {**columns(rows), "completion_ids": completion_ids, "trainer_state": state or trainer_state(),
              "log_extra": log.log_extra, "log_metric": log.log_metric}
    outs, pending = {}, {}
    for f in fns:
        try:
            out = f.fn(prompts=p, completions=c, **kwargs)
        except Exception as e:  # noqa: BLE001 - the user's function: report which one, then stop
            for coro in pending.values():
                getattr(coro, "close", lambda: None)()  # never awaited: closed quietly
            raise RewardFunctionError(f"reward function {f.path} raised {type(e).__name__}: {e}{raised_at(e, f.fn)}"
                                      ) from e
        (pending if is_async(f.fn) or inspect.isawaitable(out) else outs)[f.path] = out
    if pending:
        for path, out in zip(pending, run_async(list(pending.values()))):
            if isinstance(out, Exception):
                fn = next(f.fn for f in fns if f.path == path)
                raise RewardFunctionError(f"reward function {path} raised {type(out).__name__}: {out}"
                                          f"{raised_at(out, fn)}") from out
            outs[path] = out
    return {f.path: checked(f, outs[f.path], prompts, completions) for f in fns}


def weighted_sum(fns: list[RewardFn], scores: dict[str, list[float | None]], prompts: list[str] | None = None,
                 unscored_ok: bool = False) -> list[float | None]:
    """Per row, the sum of weight x score over the functions that apply to it (TRL's nansum). A row no function
    applies to is None when `unscored_ok` (something else scores it: the reward model), else RewardFunctionError
    (TRL would leave the response out of its group's baseline; nothing here does)."""
    n = len(next(iter(scores.values()))) if scores else 0
    out: list[float | None] = []
    for i in range(n):
        applied = [f.weight * scores[f.path][i] for f in fns if scores[f.path][i] is not None]
        if not applied and fns and not unscored_ok:
            where = f" (prompt {prompts[i][:80]!r})" if prompts else ""
            raise RewardFunctionError(f"completion {i} of the {n} scored{where}: every reward function returned None "
                                      f"({', '.join(f.path for f in fns)}); make one apply to every response, or give "
                                      f"reward.model a weight")
        out.append(sum(applied) if applied else None)
    return out
