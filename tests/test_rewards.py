"""Reward functions named by import path: resolution before any model loads, checked outputs, columns as TRL passes
them, the synthetic task's ground truth as one of them, and what eval judges by."""

import json

import pytest

from rlhf.experiment import config
from rlhf.inputs import data, formats
from rlhf.rl import rewards

from .conftest import TINY


def fn(path: str, weight: float = 1.0) -> rewards.RewardFn:
    return rewards.RewardFn(path, rewards.resolve(path), weight)


def test_import_paths_resolve_or_fail_naming_the_path(tmp_path, monkeypatch):
    assert rewards.resolve("rlhf.inputs.data:letters_reward") is data.letters_reward
    (tmp_path / "half_written.py").write_text("def f(prompts, completions, **kw):\n"
                                              "    return [len(c for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(config.ConfigError) as e:  # one line: the file and the line Python stopped at, no traceback
        rewards.resolve("half_written:f")
    assert str(e.value).startswith(f"reward.functions: 'half_written:f': {tmp_path / 'half_written.py'}:2: ")
    assert "does not match opening parenthesis" in str(e.value) and e.value.__cause__ is None and "\n" not in str(e.value)
    with pytest.raises(config.ConfigError, match="cannot import module 'tests.nowhere'"):
        rewards.resolve("tests.nowhere:f")
    with pytest.raises(config.ConfigError, match="module 'tests.rewardfns' has no attribute 'missing'"):
        rewards.resolve("tests.rewardfns:missing")
    with pytest.raises(config.ConfigError, match="is not callable"):
        rewards.resolve("tests.rewardfns:not_callable")
    with pytest.raises(config.ConfigError, match="is not an import path 'package.module:function'"):
        config.load(TINY, ["reward.functions={tests.rewardfns.allowed_letters: 1}"])
    with pytest.raises(config.ConfigError, match="nothing scores the responses"):
        config.load(TINY, ["reward.model=0"])
    with pytest.raises(config.ConfigError, match=r"reward.functions.rlhf.inputs.data:letters_reward: expected float"):
        config.load(TINY, ["reward.functions={rlhf.inputs.data:letters_reward: high}"])
    with pytest.raises(config.ConfigError, match=r"grpo.rollout_batch \(60\) must be a multiple of grpo.num_gen"):
        config.load(TINY, ["grpo.rollout_batch=60", "grpo.minibatch=60", "grpo.micro_batch=60"])
    with pytest.raises(config.ConfigError, match="rloo.num_generations must be >= 2"):
        config.load(TINY, ["rloo.num_generations=1"])


def test_a_function_trls_call_cannot_reach_is_a_config_error_naming_it():
    """Bound to the keywords `score` passes before anything loads: no **kwargs, a text at a time, or a column the
    data lacks is one line naming the config key, the function and what it would get; TRL-style functions pass."""
    rows = [{"prompt": "x", "columns": {"letters": "a b"}}, {"prompt": "y", "columns": {"letters": "c"}}]
    good = ["tests.rewardfns:allowed_letters", "tests.rewardfns:format_reward", "tests.rewardfns:length_reward",
            "tests.rewardfns:logging_reward", "tests.rewardfns:async_reward", "rlhf.inputs.data:letters_reward"]
    rewards.check_calls(config.load(TINY, ["reward.functions={" + ", ".join(f"{p}: 1" for p in good) + "}"]).reward,
                        {"the rows": rows})
    for group, path, says in (
            ("functions", "no_kwargs", "got an unexpected keyword argument 'completion_ids'"),
            ("judge_functions", "positional_text", "missing a required argument: 'text'"),
            ("grader_functions", "answer_reward", "missing a required argument: 'answer'")):
        exp = config.load(TINY, [f"reward.{group}={{tests.rewardfns:{path}: 1}}"])
        with pytest.raises(config.ConfigError) as e:
            rewards.check_calls(exp.reward, {"the rows (r.jsonl)": rows}, "x.yaml")
        assert str(e.value).startswith(f"x.yaml: reward.{group}: 'tests.rewardfns:{path}' cannot be called as TRL "
                                       f"calls a reward function on the rows (r.jsonl) ({says}): it gets prompts=, "
                                       "completions=, completion_ids=, trainer_state=, log_extra=, log_metric= and "
                                       "their other columns (letters) as keywords"), e.value
    # found once the experiment loaded, the error is named as load's own: by the override that set the key (the CLI)
    given = [f"reward.{group}={{tests.rewardfns:{path}: 1}}"]
    with pytest.raises(config.ConfigError) as e:
        rewards.check_calls(exp.reward, {"the rows (r.jsonl)": rows}, str(TINY))
    named = str(config.origin(e.value, TINY, given))
    assert named.startswith(f"override {given[0]}: reward.{group}: 'tests.rewardfns:{path}' cannot be called"), named
    assert config.origin(e.value, TINY, []) is e.value  # tiny.yaml sets no reward key: said as it was
    grader = config.load(TINY, ["reward.grader_functions={tests.rewardfns:answer_reward: 1}"]).reward
    held_out = [{**rows[0], "columns": {"answer": "a"}}]
    both = {"the held-out rows": held_out, "the training prompts (p.jsonl)": rows}
    rewards.check_calls(grader, both)  # the grader scores the held-out rows alone: their column is enough
    # a reward function scores both, each set apart: a column the held-out rows have and the prompts lack is named
    function = config.load(TINY, ["reward.functions={tests.rewardfns:answer_reward: 1}"]).reward
    rewards.check_calls(function, {"the held-out rows": held_out})
    with pytest.raises(config.ConfigError, match=r"on the training prompts \(p.jsonl\) \(missing a required "
                                                 r"argument: 'answer'\).*their other columns \(letters\)"):
        rewards.check_calls(function, both)


@pytest.mark.parametrize("path, message", [
    ("tests.rewardfns:wrong_length", r"returned 2 scores for 3 completions"),
    ("tests.rewardfns:nan_on_second_row", r"tests.rewardfns:nan_on_second_row: its score for completion 1 of the 3 "
                                          r"in its call is nan \(prompt 'p1'"),
    ("tests.rewardfns:raises", r"tests.rewardfns:raises raised KeyError: 'answer' \(at \S+/tests/rewardfns.py:27, "
                               r"in raises\)"),  # the user's own line
    ("tests.rewardfns:not_numbers", r"its score for completion 0 of the 3 in its call is 'good' \(str\), not a "
                                    r"number"),
])
def test_a_failing_function_is_named_with_the_completion(path, message):
    with pytest.raises(rewards.RewardFunctionError, match=message):
        rewards.score([fn(path)], ["p0", "p1", "p2"], ["a", "b", "c"], [{}, {}, {}])


def test_columns_reach_the_function_as_lists_and_weights_sum():
    rows = [{"prompt": "x", "columns": {"letters": "a b"}}, {"prompt": "y", "columns": {"letters": "c"}}]
    assert rewards.columns(rows) == {"letters": ["a b", "c"]}
    fns = [fn("tests.rewardfns:allowed_letters", 2.0), fn("rlhf.inputs.data:letters_reward", -1.0)]
    parts = rewards.score(fns, ["\n\nHuman: a b\n\nAssistant:", "\n\nHuman: c\n\nAssistant:"], [" a a c", " c"], rows)
    assert parts["tests.rewardfns:allowed_letters"] == pytest.approx([2 / 4, 1 / 4])  # keyed by import path
    assert parts["rlhf.inputs.data:letters_reward"] == pytest.approx([(2 - 1) / 4, 1 / 4])  # ground truth, min length 4
    assert rewards.weighted_sum(fns, parts) == pytest.approx([2 * 0.5 - 0.25, 2 * 0.25 - 0.25])


def test_the_synthetic_task_brings_its_ground_truth_and_an_answer_column():
    exp = config.load(TINY)
    splits = data.load(exp)
    row = splits.prompts(1)[0]
    assert set(row["columns"]) == {"letters", "response_len_min"}
    assert set(row["columns"]["letters"].split()) == data._prompt_letters(row["prompt"])
    fns, by = rewards.graders(exp.reward, exp.data.source)
    assert by == "ground_truth" and [f.path for f in fns] == ["rlhf.inputs.data:letters_reward"]
    pairs = splits.pairs(50)
    gt = rewards.score(fns, [p["prompt"] for p in pairs], [p["chosen"] for p in pairs], pairs)[fns[0].path]
    assert gt == [data.gt_reward(p["prompt"], p["chosen"], exp.data.synthetic.response_len_min) for p in pairs]
    # the row's response_len_min column reaches the function (4 is also its fallback: set another one)
    row = {"prompt": "\n\nHuman: a b\n\nAssistant:", "columns": {"letters": "a b", "response_len_min": 8}}
    assert rewards.score(fns, [row["prompt"]], [" a"], [row])[fns[0].path] == [1 / 8]
    del row["columns"]["response_len_min"]
    assert rewards.score(fns, [row["prompt"]], [" a"], [row])[fns[0].path] == [1 / 4]
    mine = config.load(TINY, ["reward.functions={tests.rewardfns:allowed_letters: 1}"])
    assert rewards.graders(mine.reward, mine.data.source)[1] == "reward_functions"
    assert rewards.graders(exp.reward, "hh-rlhf") == ([], None)


def test_a_users_jsonl_fields_become_columns(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "What is 2+2?", "answer": "4", "difficulty": 1},
        {"prompt": "What is 3+3?", "answer": "6", "meta": {"nested": "dropped"}}]) + "\n")
    rows, _ = formats.load_file(str(path), "prompts")
    assert [r["columns"] for r in rows] == [{"answer": "4", "difficulty": 1}, {"answer": "6"}]
    assert rewards.columns(rows) == {"answer": ["4", "6"], "difficulty": [1, None]}


def test_every_online_stage_puts_the_rm_on_its_held_out_scale_unless_told_not_to():
    from rlhf.rl import roles

    rm = {"reward_stats": {"mean": 0.5, "std": 2.0}}
    exp = config.load(TINY, [])
    for stage in config.ONLINE:
        assert roles.reward_scale(getattr(exp, stage), rm) == (0.5, 2.0), stage
        off = config.load(TINY, [f"{stage}.normalize_reward=false"])
        assert roles.reward_scale(getattr(off, stage), rm) == (0.0, 1.0), stage
        assert roles.reward_scale(getattr(exp, stage), None) == (0.0, 1.0), stage  # no reward model


# ---- TRL 1.16's reward-function convention (GRPOTrainer._calculate_rewards) and components keyed by import path

TRL_MODULE = {"format_reward": 1.0, "length_reward": 0.5, "answer_reward": 2.0, "logging_reward": 1.0,
              "async_reward": 0.25, "math_only": 1.0}
"""tests/rewardfns.py's TRL-style functions and their weights."""


def functions_override(weights: dict[str, float], module: str = "tests.rewardfns") -> str:
    return "reward.functions={" + ", ".join(f"{module}:{k}: {w}" for k, w in weights.items()) + "}"


@pytest.fixture
def two_scores(monkeypatch):
    """Two user modules that each define `score`: a.math:score (1.0 per response), b.code:score (100.0)."""
    import sys
    import types

    from . import rewardfns

    for name, fn in (("a.math", rewardfns.one), ("b.code", rewardfns.hundred)):
        pkg, mod = types.ModuleType(name.split(".")[0]), types.ModuleType(name)
        mod.score = fn
        monkeypatch.setitem(sys.modules, name.split(".")[0], pkg)
        monkeypatch.setitem(sys.modules, name, mod)
    return config.load(TINY, ["reward.model=0", "reward.functions={a.math:score: 1.0, b.code:score: 0.5}"])


def test_functions_with_one_name_are_kept_apart_in_the_sum_the_log_and_the_win_rates(two_scores):
    from rlhf.rl import checks, roles, trajectory

    fns = rewards.configured(two_scores.reward)
    assert [(f.path, f.name) for f in fns] == [("a.math:score", "math:score"), ("b.code:score", "code:score")]
    rows = [{"prompt": "p0"}, {"prompt": "p1"}]
    scores = rewards.score(fns, ["p0", "p1"], ["x", "y"], rows)
    assert scores == {"a.math:score": [1.0, 1.0], "b.code:score": [100.0, 100.0]}
    assert rewards.weighted_sum(fns, scores) == [51.0, 51.0]  # 1.0 x 1 + 0.5 x 100 (keyed by name: 150)
    assert checks.grader_scores(checks.plan(two_scores, "ppo", rows), rows, ["x", "y"],
                                [[1], [2]]) == ([51.0, 51.0], "reward_functions")
    scorer = roles.Scorer(roles.scoring(two_scores.reward, two_scores.data.source))
    total, parts = scorer(None, rows, ["x", "y"], trajectory.Timer(), [[1], [2]])
    assert total.tolist() == [51.0, 51.0] and parts == {"math:score": [1.0, 1.0], "code:score": [100.0, 100.0]}
    assert scorer.metrics(parts) == {"reward/math:score": 1.0, "reward/code:score": 100.0,
                                     "reward/math:score/none": 0, "reward/code:score/none": 0}


def test_log_names_are_the_short_name_when_unique_else_an_unambiguous_suffix():
    assert config.log_names(["tests.rewardfns:allowed_letters", "rlhf.inputs.data:letters_reward"]) == {
        "tests.rewardfns:allowed_letters": "allowed_letters", "rlhf.inputs.data:letters_reward": "letters_reward"}
    assert config.log_names(["x.m:f", "y.x.m:f"]) == {"x.m:f": "x.m:f", "y.x.m:f": "y.x.m:f"}
    # the names the stages log themselves under reward/ are never a function's
    assert config.log_names(["my.mod:model", "my.mod:mean", "my.mod:ground_truth"]) == {
        "my.mod:model": "mod:model", "my.mod:mean": "mod:mean", "my.mod:ground_truth": "mod:ground_truth"}
    with pytest.raises(config.ConfigError, match=r"'a.b:f' and 'a.b:f' would be logged as reward/f"):
        config.log_names(["a.b:f", "a.b:f"])
    exp = config.load(TINY, ["reward.functions={a.math:score: 1.0, b.code:score: 0.5, c.d:model: 1}"])  # no import
    assert config.log_names(list(exp.reward.functions)) == {"a.math:score": "math:score",
                                                            "b.code:score": "code:score", "c.d:model": "d:model"}


def test_a_users_function_called_model_is_not_overwritten_by_the_reward_model():
    import torch

    from rlhf.rl import roles, trajectory

    exp = config.load(TINY, ["reward.functions={tests.rewardfns:model: 1.0}"])
    total, parts = roles.Scorer(roles.scoring(exp.reward, exp.data.source, [(1.0, 2.0)]))(torch.tensor([[3.0], [5.0]]), [{"prompt": "p"}] * 2,
                                                         ["x", "y"], trajectory.Timer())
    assert parts == {"rewardfns:model": [7.0, 7.0], "model": [1.0, 2.0]}  # the RM on its scale: (raw - 1) / 2
    assert total.tolist() == [8.0, 9.0]


def _rows(conversational: bool) -> list[dict]:
    """Four prompt rows of the synthetic task as the online stages get them (rendered by a chat template when
    conversational), with an `answer` and a `task` column added."""
    from rlhf.inputs import models

    exp = config.load(TINY, [f"data.synthetic.conversational={str(conversational).lower()}"])
    splits = data.load(exp)
    tok = models.build_tokenizer([])
    tok.chat_template = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + eos_token }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    rows = splits.render(tok).prompts(4)
    for row, answer, task in zip(rows, ["a b c d", "x", "a b", "z"], ["math", "code", "math", "code"]):
        row["columns"] = {**row["columns"], "answer": answer, "task": task}
    return rows


@pytest.mark.parametrize("conversational", [False, True], ids=["standard", "conversational"])
def test_a_module_written_for_trls_grpo_trainer_runs_unchanged(conversational):
    from rlhf.rl import roles, trajectory

    exp = config.load(TINY, ["reward.model=0", functions_override(TRL_MODULE)])
    rows = _rows(conversational)
    assert all(isinstance(r["prompt"], str) for r in rows)  # what the policy samples from: the rendered text
    texts, ids = ["a b c d", "hello", "a b", "x"], [[1, 2, 3, 4], [5], [1, 2, 3, 4, 5, 6], [7, 2]]
    scorer = roles.Scorer(roles.scoring(exp.reward, exp.data.source, section=exp.grpo, pool=64))
    total, parts = scorer(None, rows, texts, trajectory.Timer(), ids, step=3)
    # format (bools) x1 + length x0.5 + answer x2 + logging 0 + async (words) x0.25 + math_only x1 (None: left out)
    assert parts["format_reward"] == [1.0, 0.0, 1.0, 1.0] and parts["math_only"] == [2.0, None, 2.0, None]
    assert total.tolist() == pytest.approx([1 + 0 + 2 + 1 + 2, 0 - 0.375 + 0 + 0.25, 1 - 0.25 + 2 + 0.5 + 2,
                                            1 - 0.25 + 0 + 0.25])
    m = scorer.metrics(parts)
    assert m["reward/math_only"] == 2.0 and m["reward/math_only/none"] == 2 and m["reward/format_reward/none"] == 0
    assert m["reward/length_reward"] == pytest.approx((0 - 0.75 - 0.5 - 0.5) / 4)
    assert m["reward_fn/words"] == 2.0 and m["reward_fn/step_seen"] == 2  # trainer_state.global_step: 2 steps done
    assert scorer.log.extra["n_words"] == [4, 1, 2, 1]
    turns = scorer.log.extra["last_prompt_turn"]
    if conversational:  # the messages the template rendered, as TRL passes them
        assert [r["prompt_messages"][-1]["content"] for r in rows] == turns and "Human" not in turns[0]
    else:
        assert turns == [r["prompt"] for r in rows]


def test_the_ground_truth_takes_message_lists_as_trl_passes_them():
    prompt, completion = [{"role": "user", "content": "a b"}], [{"role": "assistant", "content": "a b b c"}]
    assert data.letters_reward([prompt, "\n\nHuman: a b\n\nAssistant:"], [completion, " a b b c"]) == [0.5, 0.5]
    rows = _rows(True)
    texts = [" " + " ".join(sorted(r["columns"]["letters"].split())[:1] * 4) for r in rows]  # all allowed: 1.0
    conversational = config.load(TINY, ["data.synthetic.conversational=true"])
    gt = rewards.graders(conversational.reward, conversational.data.source)[0]
    assert rewards.score(gt, [r["prompt"] for r in rows], texts, rows)[gt[0].path] == [1.0] * 4


def test_none_python_bools_and_async_are_taken_as_trl_takes_them():
    import numpy as np

    def fn(f, w=1.0):
        return rewards.RewardFn(f"my.mod:{f.__name__}", f, w)

    def py_bools(completions, **kw):
        return [True, False]

    def np_bools(completions, **kw):
        return [np.True_, np.False_]

    async def later(completions, **kw):
        return [3.0, None]

    fns = [fn(py_bools), fn(np_bools), fn(later, 2.0)]
    scores = rewards.score(fns, ["p0", "p1"], ["a", "b"], [{}, {}])
    assert scores == {"my.mod:py_bools": [1.0, 0.0], "my.mod:np_bools": [1.0, 0.0], "my.mod:later": [3.0, None]}
    assert rewards.weighted_sum(fns, scores) == [1 + 1 + 6.0, 0.0]  # row 1: `later` does not apply
    none = [fn(later), rewards.RewardFn("tests.rewardfns:none_everywhere", rewardfns_none)]
    with pytest.raises(rewards.RewardFunctionError, match=r"completion 1 of the 2 scored \(prompt 'p1'\): every reward "
                                                          r"function returned None"):
        rewards.weighted_sum(none, rewards.score(none, ["p0", "p1"], ["a", "b"], [{}, {}]), ["p0", "p1"])


def rewardfns_none(completions, **kw):
    from . import rewardfns

    return rewardfns.none_everywhere(completions)


def test_rows_no_function_applies_to_keep_the_reward_models_score_alone():
    import torch

    from rlhf.rl import roles, trajectory

    exp = config.load(TINY, ["reward.functions={tests.rewardfns:none_everywhere: 1.0}"])
    scorer = roles.Scorer(roles.scoring(exp.reward, exp.data.source))
    total, parts = scorer(torch.tensor([[0.5], [-1.0]]), [{"prompt": "p"}] * 2, ["x", "y"], trajectory.Timer())
    assert total.tolist() == [0.5, -1.0] and parts["none_everywhere"] == [None, None]
    m = scorer.metrics(parts)
    assert "reward/none_everywhere" not in m and m["reward/none_everywhere/none"] == 2 and m["reward/model"] == -0.25


def test_log_extra_columns_land_in_the_sample_table(tmp_path):
    from types import SimpleNamespace

    from rlhf.rl import online

    tables, lines, logged = [], [], []
    session = SimpleNamespace(probe=SimpleNamespace(sample=lambda step: None, read=lambda: {}),
                              log=lambda step, m: logged.append(dict(m)),
                              tracker=SimpleNamespace(table=lambda *a: tables.append(a)),
                              run=SimpleNamespace(log=lambda step, m: lines.append(m)))
    o = SimpleNamespace(log_samples_every=1, save_steps=0, steps=5)
    samples = ("reward", [["p0", "a", 1.0], ["p1", "b", 0.0]], {"n_words": [1, 1, 7]})
    online.Record("grpo", o, session, None, None, None, tmp_path).end(1, 0.0, {}, samples)
    assert logged[0]["time/step_s"] > 0  # the iteration's time is in its metrics line, not only in the history
    assert tables == [("samples", ["prompt", "response", "reward", "n_words"], [["p0", "a", 1.0, 1],
                                                                              ["p1", "b", 0.0, 1]])]
    assert lines[0]["sample_columns"][-1] == "n_words" and lines[0]["samples"][1][-1] == 1


def test_a_dict_override_arrives_intact_through_make():
    """`make grpo ARGS='reward.functions={...}'` as a user types it: the shell line the Makefile builds splits the
    dict at its spaces (and drops the quotes); the CLI joins the pieces again."""
    import subprocess

    from rlhf import cli

    from .conftest import ROOT

    typed = 'reward.functions={"tests.rewardfns:allowed_letters": 0.5, "rlhf.inputs.data:letters_reward": -1.0}'
    out = subprocess.run(["make", "-n", "grpo", f"ARGS={typed}", "VENV=/venv"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    line = next(x for x in out.stdout.splitlines() if " -m rlhf grpo " in x)
    shell = subprocess.run(["sh", "-c", "printf '%s\\0' " + line.split(" -m rlhf ", 1)[1]], capture_output=True,
                           text=True, check=True)
    argv = shell.stdout.split("\0")[:-1]
    assert argv[:3] == ["grpo", "--exp", "experiments/tiny.yaml"] and len(argv) > 4  # split by the shell
    want = {"tests.rewardfns:allowed_letters": 0.5, "rlhf.inputs.data:letters_reward": -1.0}
    assert config.load(ROOT / argv[2], argv[3:]).reward.functions == want
    args = cli.parse_args(argv)  # argparse sees the joined override (a piece like `-1.0}` is no option)
    assert config.load(ROOT / args.exp, args.overrides).reward.functions == want
    assert config.parse_overrides(["grpo.kl_band=[0.1,", "0.2]", "grpo.steps=3"]) == {
        "grpo": {"kl_band": [0.1, 0.2], "steps": 3}}
    with pytest.raises(config.ConfigError, match=r"override 'reward.functions=\{a: \[1\}': the value is not valid"):
        config.parse_overrides(["reward.functions={a:", "[1}"])


def test_a_judge_models_texts_follow_trls_reward_trainer():
    """rewards.ModelJudge renders what it scores as TRL's RewardTrainer trained it: a string prompt + completion with
    the tokenizer's EOS appended once (its BOS added by the tokenizer), a conversational one through the judge's own
    chat template (no special tokens added again); conversational rows with a template-less tokenizer are refused."""
    from rlhf.inputs import models

    judge = object.__new__(rewards.ModelJudge)
    judge.path, judge.field, judge.tok = "my-rm", "reward.judge_model", models.build_tokenizer(["a b c"])
    eos = judge.tok.eos_token
    assert judge.texts(["p:", "q:"], [" a", f" b{eos}"]) == ([f"p: a{eos}", f"q: b{eos}"], True)
    chat = [[{"role": "user", "content": "hi"}]]
    with pytest.raises(config.ConfigError, match="reward.judge_model: my-rm's tokenizer has no chat template"):
        judge.texts(chat, [[{"role": "assistant", "content": "a"}]])
    judge.tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert judge.texts(chat, [[{"role": "assistant", "content": "a"}]]) == (["<user>hi<assistant>a"], False)
