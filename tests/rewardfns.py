"""Reward functions as a user writes them (TRL's convention), named by import path in tests: `tests.rewardfns:<name>`."""

import asyncio
import os
import re


def allowed_letters(prompts, completions, letters, **columns):
    """The fraction of a response's words that are among the row's `letters` (the synthetic task's answer column);
    a completion is a string, or TRL's message list on conversational data."""
    out = []
    for completion, allowed in zip(completions, letters):
        words = (completion[0]["content"] if isinstance(completion, list) else completion).split()
        out.append(sum(w in allowed.split() for w in words) / max(len(words), 4))
    return out


def wrong_length(prompts, completions, **columns):
    return [0.0] * (len(completions) - 1)


def nan_on_second_row(prompts, completions, **columns):
    return [float("nan") if i == 1 else 0.0 for i in range(len(completions))]


def raises(prompts, completions, **columns):
    raise KeyError("answer")


def not_numbers(prompts, completions, **columns):
    return ["good"] * len(completions)


not_callable = 3


# ---- A reward module written for TRL 1.16's GRPOTrainer, used here unchanged: the kinds of functions TRL's docs show
# (a format reward, a length reward, one reading an answer column), one logging through log_metric / log_extra, an
# async one and one that applies to some rows only (None elsewhere). Each takes standard (strings) and conversational
# (message lists) inputs, as a TRL user writes it.
def _content(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def format_reward(completions, **kwargs):
    """True when the response is one-letter words only (Python bools, as TRL accepts)."""
    return [re.fullmatch(r"\s*[a-z](\s+[a-z])*\s*", _content(c)) is not None for c in completions]


def length_reward(completions, completion_ids, **kwargs):
    """Closer to 4 tokens is better: -|tokens - 4| / 4, counted on completion_ids."""
    return [-abs(len(ids) - 4) / 4 for ids in completion_ids]


def answer_reward(prompts, completions, answer, **kwargs):
    """1.0 when the response is the row's `answer` column."""
    return [1.0 if _content(c).strip() == a else 0.0 for c, a in zip(completions, answer)]


def logging_reward(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
    """Scores 0 and logs the words per response (a metric), each response's word count (a column) and the step."""
    words = [len(_content(c).split()) for c in completions]
    log_metric("words", sum(words) / len(words))
    log_metric("step_seen", trainer_state.global_step)
    log_extra("n_words", words)
    log_extra("last_prompt_turn", [p[-1]["content"] if isinstance(p, list) else p for p in prompts])
    return [0.0] * len(completions)


async def async_reward(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(_content(c).split())) for c in completions]


def math_only(completions, task, **kwargs):
    """Applies to the rows whose `task` column is "math" (None for the others)."""
    return [2.0 if t == "math" else None for t in task]


def one(completions, **kwargs):
    return [1.0] * len(completions)


def hundred(completions, **kwargs):
    return [100.0] * len(completions)


def model(completions, **kwargs):
    """A user's function that happens to be called `model`, like the reward model's logged component."""
    return [7.0] * len(completions)


def none_everywhere(completions, **kwargs):
    return [None] * len(completions)


def no_kwargs(prompts, completions):
    """Written for a caller that passes two arguments: TRL passes more (completion_ids, trainer_state, ...)."""
    return [0.0] * len(completions)


def positional_text(text):
    """Takes one text at a time: not TRL's convention at all."""
    return 0.0


def raises_on_rank_1(prompts, completions, **columns):
    """Fails on data-parallel rank 1 only (tests/test_distributed.py: a failure one rank meets)."""
    if os.environ.get("RANK") == "1":
        raise KeyError("rank 1's rows")
    return [0.0] * len(completions)
