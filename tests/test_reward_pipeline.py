"""Online RL driven by reward functions alone, through `make` as a user types it, on the default experiment
(tiny.yaml): GRPO and RLOO learn from the task's ground truth named by import path, and a reward module written for
TRL's GRPOTrainer runs unchanged in `make grpo` on standard and on conversational data."""

import json

import pytest
import yaml

from rlhf import records

from .conftest import ROOT, make, tiny

pytestmark = pytest.mark.slow
# tests/rewardfns.py's TRL-style functions that the synthetic task's rows can feed: a format reward (Python bools), a
# length reward (completion_ids), one reading the `letters` answer column, one logging through log_metric / log_extra
# and trainer_state, and an async one
TRL_MODULE = {"format_reward": 1.0, "length_reward": 0.5, "allowed_letters": 2.0, "logging_reward": 1.0,
              "async_reward": 0.25}
SHORT = ("grpo.steps=2", "grpo.rollout_batch=16", "grpo.num_generations=4", "grpo.minibatch=8", "grpo.micro_batch=8",
         "grpo.log_samples_every=1", "eval.prompts=16")


def functions_arg(weights: dict[str, float]) -> str:
    """The override as a user writes it in ARGS: a YAML dict with spaces, quoted once for the shell."""
    return "'reward.functions={" + ", ".join(f"tests.rewardfns:{k}: {w}" for k, w in weights.items()) + "}'"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A results dir holding one SFT run of the default experiment (`make sft`)."""
    root = tmp_path_factory.mktemp("reward-fns")
    make("sft", f"ARGS=results_dir={root}")
    return root


def test_grpo_and_rloo_with_the_ground_truth_reward_function(root):
    """reward.model=0 and the task's ground truth named by import path: no reward model is loaded (nor trained by
    make), and each stage beats SFT by the same function on held-out prompts."""
    for stage in ("grpo", "rloo"):
        out = make(stage, f"ARGS=results_dir={root} reward.model=0 'reward.functions={{rlhf.data:letters_reward: 1}}'")
        assert f"{stage} does not use rm" in out.stdout and out.stdout.count("reusing ") == 1
        summary = records.latest(tiny(root), stage, "test")[1]
        m = summary["metrics"]
        assert m["eval_scored_by"] == "reward_functions" and m["eval_win_rate_vs_sft"] >= 0.75, m
        assert "rm" not in summary["lineage"]["upstream"] and summary["inputs"]["rm_run"] is None
        config = yaml.safe_load((records.Path(summary["run_dir"]) / "config.yaml").read_text())
        assert config["reward"] == {"model": 0.0, "functions": {"rlhf.data:letters_reward": 1.0}}
        first = json.loads((records.Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0])
        assert "reward/letters_reward" in first and "time/score_s" not in first


@pytest.mark.parametrize("conversational", [False, True], ids=["standard", "conversational"])
def test_a_trl_reward_module_runs_unchanged_in_make_grpo(root, tmp_path, conversational):
    """The module's functions, weights and dict override as a TRL user writes them; on conversational data
    (tiny-chat.yaml) they get message lists. What they log lands in the metrics and the sample table."""
    if conversational:
        exp_arg, results = "EXP=experiments/tiny-chat.yaml", tmp_path
        extra = ("sft.max_steps=20",)
    else:
        exp_arg, results, extra = "EXP=experiments/tiny.yaml", root, ()
    args = " ".join((f"results_dir={results}", "reward.model=0", functions_arg(TRL_MODULE), *SHORT, *extra))
    make("grpo", exp_arg, f"ARGS={args}")
    from rlhf import config

    exp = config.load(ROOT / exp_arg.split("=", 1)[1], [f"results_dir={results}"])
    summary = records.latest(exp, "grpo", "test")[1]
    run = records.Path(summary["run_dir"])
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"kl/ref"' in line]
    assert len(steps) == 2
    for m in steps:
        for name in TRL_MODULE:
            assert f"reward/{name}" in m and m[f"reward/{name}/none"] == 0, (name, m)
        assert 0 <= m["reward/format_reward"] <= 1 and m["reward/logging_reward"] == 0
        assert m["reward_fn/words"] >= 0 and m["reward_fn/step_seen"] == m["step"] - 1  # steps done before this one
        total = sum(w * m[f"reward/{k}"] for k, w in TRL_MODULE.items()) - exp.grpo.missing_eos_penalty * (
            1 - m["response/eos_frac"])
        assert m["reward/mean"] == pytest.approx(total, abs=1e-4)
    tables = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "sample_columns" in line]
    assert len(tables) == 2
    for t in tables:  # log_extra's columns beside prompt, response and reward
        assert t["sample_columns"] == ["prompt", "response", "reward", "n_words", "last_prompt_turn"]
        for prompt, response, _, n_words, last_turn in t["samples"]:
            assert n_words == len(response.split())
            # on chat data the functions get the messages: the last user turn's content, not the rendered prompt
            assert (last_turn == prompt) != conversational and (not conversational or last_turn in prompt)
