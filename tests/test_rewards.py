"""Reward functions named by import path: resolution before any model loads, checked outputs, columns as TRL passes
them, the synthetic task's ground truth as one of them, and what eval judges by."""

import json

import pytest

from rlhf import config, data, rewards

from .conftest import TINY


def fn(path: str, weight: float = 1.0) -> rewards.RewardFn:
    return rewards.RewardFn(path, rewards.resolve(path), weight)


def test_import_paths_resolve_or_fail_naming_the_path():
    assert rewards.resolve("rlhf.data:letters_reward") is data.letters_reward
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
    with pytest.raises(config.ConfigError, match=r"reward.functions.rlhf.data:letters_reward: expected float"):
        config.load(TINY, ["reward.functions={rlhf.data:letters_reward: high}"])
    with pytest.raises(config.ConfigError, match=r"grpo.rollout_batch \(60\) must be a multiple of grpo.num_gen"):
        config.load(TINY, ["grpo.rollout_batch=60", "grpo.minibatch=60", "grpo.micro_batch=60"])
    with pytest.raises(config.ConfigError, match="rloo.num_generations must be >= 2"):
        config.load(TINY, ["rloo.num_generations=1"])


@pytest.mark.parametrize("path, message", [
    ("tests.rewardfns:wrong_length", r"returned 2 scores for 3 completions"),
    ("tests.rewardfns:nan_on_second_row", r"tests.rewardfns:nan_on_second_row: row 1 is nan \(prompt 'p1'"),
    ("tests.rewardfns:raises", r"tests.rewardfns:raises raised KeyError: 'answer'"),
    ("tests.rewardfns:not_numbers", r"row 0 is 'good' \(str\), not a number"),
])
def test_a_failing_function_is_named_with_the_row(path, message):
    with pytest.raises(rewards.RewardFunctionError, match=message):
        rewards.score([fn(path)], ["p0", "p1", "p2"], ["a", "b", "c"], [{}, {}, {}])


def test_columns_reach_the_function_as_lists_and_weights_sum():
    rows = [{"prompt": "x", "columns": {"letters": "a b"}}, {"prompt": "y", "columns": {"letters": "c"}}]
    assert rewards.columns(rows) == {"letters": ["a b", "c"]}
    fns = [fn("tests.rewardfns:allowed_letters", 2.0), fn("rlhf.data:letters_reward", -1.0)]
    parts = rewards.score(fns, ["\n\nHuman: a b\n\nAssistant:", "\n\nHuman: c\n\nAssistant:"], [" a a c", " c"], rows)
    assert parts["allowed_letters"] == pytest.approx([2 / 4, 1 / 4])
    assert parts["letters_reward"] == pytest.approx([(2 - 1) / 4, 1 / 4])  # ground truth, min length 4
    assert rewards.weighted_sum(fns, parts) == pytest.approx([2 * 0.5 - 0.25, 2 * 0.25 - 0.25])


def test_the_synthetic_task_brings_its_ground_truth_and_an_answer_column():
    exp = config.load(TINY)
    splits = data.load(exp)
    row = splits.prompts(1)[0]
    assert set(row["columns"]) == {"letters", "response_len_min"}
    assert set(row["columns"]["letters"].split()) == data._prompt_letters(row["prompt"])
    fns, by = rewards.judges(exp)
    assert by == "ground_truth" and [f.path for f in fns] == ["rlhf.data:letters_reward"]
    pairs = splits.pairs(50)
    gt = rewards.score(fns, [p["prompt"] for p in pairs], [p["chosen"] for p in pairs], pairs)["letters_reward"]
    assert gt == [data.gt_reward(p["prompt"], p["chosen"], exp.data.synthetic.response_len_min) for p in pairs]
    mine = config.load(TINY, ["reward.functions={tests.rewardfns:allowed_letters: 1}"])
    assert rewards.judges(mine)[1] == "reward_functions"
    assert rewards.judges(config.load(TINY, ["data.source=hh-rlhf"])) == ([], None)


def test_a_users_jsonl_fields_become_columns(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "What is 2+2?", "answer": "4", "difficulty": 1},
        {"prompt": "What is 3+3?", "answer": "6", "meta": {"nested": "dropped"}}]) + "\n")
    rows, _ = data.load_file(str(path), "prompts")
    assert [r["columns"] for r in rows] == [{"answer": "4", "difficulty": 1}, {"answer": "6"}]
    assert rewards.columns(rows) == {"answer": ["4", "6"], "difficulty": [1, None]}


def test_every_online_stage_puts_the_rm_on_its_held_out_scale_unless_told_not_to():
    from rlhf import rollout

    rm = {"reward_stats": {"mean": 0.5, "std": 2.0}}
    exp = config.load(TINY, [])
    for stage in config.ONLINE:
        assert rollout.reward_scale(getattr(exp, stage), rm) == (0.5, 2.0), stage
        off = config.load(TINY, [f"{stage}.normalize_reward=false"])
        assert rollout.reward_scale(getattr(off, stage), rm) == (0.0, 1.0), stage
        assert rollout.reward_scale(getattr(exp, stage), None) == (0.0, 1.0), stage  # no reward model
