"""Reward functions as a user writes them (TRL's signature), named by import path in tests: `tests.rewardfns:<name>`."""


def allowed_letters(prompts, completions, letters, **columns):
    """The fraction of a response's words that are among the row's `letters` (the synthetic task's answer column)."""
    out = []
    for completion, allowed in zip(completions, letters):
        words = completion.split()
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
