"""Online RL on the default experiment (tiny.yaml) beyond the trained pipeline of test_pipeline.py, through `make`
as a user types it: GRPO and RLOO learn from the task's ground truth named by import path; a reward module written
for TRL's GRPOTrainer runs unchanged in `make grpo` on standard and on conversational data; and a reward model too
weak and pushed too far is caught by the judge (rlhf/rl/overopt.py): the run is flagged, stops early, and keeps a policy
no worse than SFT by the ground truth."""

import json
import re
from pathlib import Path

import pytest
import yaml

from rlhf.maths import guard
from rlhf.runs import records

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
        out = make(stage, f"ARGS=results_dir={root} reward.model=0 'reward.functions={{rlhf.inputs.data:letters_reward: 1}}'")
        assert f"{stage} does not use rm" in out.stdout and out.stdout.count("reusing ") == 1
        summary = records.latest(tiny(root), stage, "test")[1]
        m = summary["metrics"]
        # beats SFT: the win rate's 95% interval (200 held-out prompts) lies above 0.6
        assert m["eval_scored_by"] == "reward_functions" and m["eval_win_rate_vs_sft_ci95"][0] > 0.6, m
        assert "rm" not in summary["lineage"]["upstream"] and summary["inputs"]["rm_run"] is None
        # no judge watched it: a run that ended above kl_band says so, as the guard's flag would have
        above = m["train_kl_ref_last5"] > getattr(tiny(root), stage).kl_band[1]
        assert any("no judge watched" in w for w in summary["warnings"]) == above, m
        config = yaml.safe_load((records.Path(summary["run_dir"]) / "config.yaml").read_text())
        assert config["reward"] == {"model": 0.0, "functions": {"rlhf.inputs.data:letters_reward": 1.0},
                                    "judge_functions": {}, "judge_model": "", "grader_functions": {},
                                    "grader_model": "", "ensemble_lambda": 1.0}
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
    from rlhf.experiment import config

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


# A deliberately weak reward model: 500 pairs, of which the judge takes 88% (440) and the RM 60 (it ranks ~60% of
# held-out pairs), pushed far from SFT by a beta of 0.002
WEAK = ("data.pref_pairs=500", "data.judge_fraction=0.88", "ppo.kl_coef=0.002")


def judged(summary: dict) -> list[dict]:
    run = records.Path(summary["run_dir"])
    return [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "overopt/judge" in m]


def test_unguarded_a_weak_reward_model_pushed_far_loses_to_sft_and_is_flagged(root):
    """keep=last, no early stop: the proxy's score rises while the task's ground truth (never seen by any stage)
    falls, and the policy loses to SFT by it on held-out prompts while the reward model, trained against, says it
    wins. The judge, trained like the RM on the same SFT features, learned its shortcut too and rises with it; the
    run is flagged for leaving its KL budget (tiny.yaml's kl_band: 6 nats), where neither is trusted."""
    out = make("ppo", f"ARGS=results_dir={root} {' '.join(WEAK)} ppo.keep=last ppo.overopt_stop=false")
    assert "warning: ppo: the policy left its KL budget" in out.stderr
    exp = tiny(root)
    rm = records.latest(exp, "rm", "test")[1]
    assert rm["data"] == {"train": 60, "trained": 60, "judge": 440, "eval": 200} and rm["judge"]["pairs"] == 440
    assert rm["judge"]["seed"] == exp.seed + 1000 and "weak" in rm["judge"]["independence"]
    assert rm["metrics"]["eval_judge_accuracy"] > rm["metrics"]["eval_accuracy"] + 0.15 and rm["ensemble"] == []
    summary = records.latest(exp, "ppo", "test")[1]
    m, wins = summary["metrics"], summary["metrics"]["eval_win_rates"]
    assert m["kl_budget_left"]["kl_ref"] > exp.ppo.kl_band[1] and m["train_kl_ref_last5"] > exp.ppo.kl_band[1]
    assert wins["reward_model"]["win_rate"] >= 0.85 and wins["reward_model"]["grader"] == "trained against"
    assert wins["ground_truth"]["ci95"][1] < 0.5 and wins["ground_truth"]["grader"] == "independent"
    assert wins["judge"]["grader"] == "independent" and m["eval_scored_by"] == "ground_truth"
    curve = judged(summary)
    # every judge_every iterations before the update, and once after the last one (61: the final policy)
    assert [c["step"] for c in curve] == [*range(1, 61, exp.ppo.judge_every), 61]
    # the KL of the judge's own samples: 0 for the SFT policy (its reference), then growing far past the budget
    assert curve[0]["overopt/kl"] == pytest.approx(0.0, abs=1e-4) and curve[-1]["overopt/kl"] > exp.ppo.kl_band[1]
    assert curve[-1]["overopt/proxy"] > curve[0]["overopt/proxy"] + 0.8
    assert curve[-1]["overopt/truth"] < curve[0]["overopt/truth"] - 0.3
    assert "stopped_early" not in m and summary["model"]["kept"] is None  # keep=last, overopt_stop=false
    assert m["judge_last_policy"]["iteration"] == curve[-1]["step"]
    assert (records.Path(summary["run_dir"]) / "overoptimization.png").stat().st_size > 10_000


def test_guarded_the_same_run_stops_early_and_keeps_a_policy_no_worse_than_sft(root):
    """The same run with the shipped guard (keep=auto, overopt_stop): it stops where it leaves its KL budget (or at
    the judge's significant fall, whichever comes first), saving the remaining iterations, and keeps the one-SE policy within the KL budget (kl_band's high end); by the
    held-out ground truth that policy is not significantly below SFT, where the unguarded one lost. `make eval`
    scores the kept policy (the same samples as the stage's check)."""
    args = f"ARGS=results_dir={root} {' '.join(WEAK)}"
    make("ppo", args)
    exp = tiny(root)
    summary = records.latest(exp, "ppo", "test")[1]
    kept, m = summary["model"]["kept"], summary["metrics"]
    assert summary["flags"] and m["stopped_early"]["steps_saved"] > 0
    first = min(e["iteration"] for e in (m.get("judge_fell"), m.get("kl_budget_left")) if e)
    assert m["stopped_early"]["iteration"] == first < exp.ppo.steps
    assert m["episodes"] == first * exp.ppo.rollout_batch  # those it trained on, not the planned steps
    assert kept["keep"] == "judge" and m["judge_kept_policy"]["iteration"] == kept["iteration"]
    assert m["judge_kept_policy"]["kl_ref"] <= exp.ppo.kl_band[1]
    gt = m["eval_win_rates"]["ground_truth"]
    assert gt["ci95"][1] >= 0.5, gt
    assert m["eval_kl_ref"] <= exp.ppo.kl_band[1]
    make("eval", args + " reward.grader_functions={tests.rewardfns:length_reward: 1}")  # with a grader of the user's
    report = records.latest(exp, "eval", "test")[1]["metrics"]["ppo"]
    assert report["mean_ground_truth"] == pytest.approx(m["eval_score_policy"], abs=1e-6)
    assert "mean_judge" in report and "win_rate_vs_sft_judge" in report
    assert report["win_rate_vs_sft_grader"]["grader"] == "independent"  # make eval left it out


def test_grpo_scores_with_the_ensemble_and_logs_the_judge(root):
    """rm.ensemble=2: the RM stage trains a second member (a bootstrap resample, seed + 1); GRPO's reward is the
    members' mean - lambda x std, logged with their spread, and the judge scores it every iteration."""
    make("grpo", f"ARGS=results_dir={root} rm.ensemble=2 {' '.join(WEAK[:2])} grpo.judge_every=1 {' '.join(SHORT)}")
    exp = tiny(root)
    rm = records.latest(exp, "rm", "test")[1]
    assert len(rm["ensemble"]) == 1 and rm["ensemble"][0]["seed"] == exp.seed + 1
    assert rm["ensemble"][0]["pairs"] == 60 and len(rm["metrics"]["eval_ensemble_accuracies"]) == 2
    summary = records.latest(exp, "grpo", "test")[1]
    run = records.Path(summary["run_dir"])
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"kl/ref"' in line]
    assert len(steps) == 2 and all(s["reward/ensemble_std"] > 0 for s in steps)
    assert [c["step"] for c in judged(summary)] == [1, 2, 3]  # 3: the policy after the last update
    assert set(summary["metrics"]["eval_win_rates"]) == {"ground_truth", "reward_model", "judge"}
    assert summary["metrics"]["judge_last_policy"]["iteration"] == 3 and steps[1]["overopt/judge_gain_se"] > 0


def test_make_flag_calibration_reports_rates_with_intervals(root, tmp_path):
    """`make flag-calibration` as a user types it, shortened to one healthy seed of 6 iterations, seed 0 in the
    module's results dir (its SFT run reused, as the study reuses any unchanged upstream run): the table and JSON it
    writes agree with its runs (the rate is flagged / n, with Wilson's interval)."""
    out = tmp_path / "out"
    sft_runs = set(records.stage_root(tiny(root), "sft").iterdir())  # the module's tests' SFT runs so far
    proc = make("flag-calibration", "SEEDS=1",
                f"ARGS=--scenarios healthy --steps 6 --first-seed 0 --results {root} --out {out}")
    (js,) = out.glob("*-flag.json")
    rec = json.loads(js.read_text())
    (row,), (run,) = rec["rows"], rec["runs"]
    ppo = json.loads((Path(run["trace"]).parent / "summary.json").read_text())
    assert run["seed"] == 0 and Path(ppo["lineage"]["upstream"]["sft"]["run"]) in sft_runs  # one of them, reused
    assert set(records.stage_root(tiny(root), "sft").iterdir()) == sft_runs  # none trained anew
    assert row["scenario"] == "healthy" and row["n"] == 1 and row["flagged"] == int(bool(run["flags"]))
    assert row["flag_rate"] == row["flagged"] and row["flag_ci95"] == ([0.0, 0.7935] if not run["flags"] else
                                                                       [0.2065, 1.0])
    assert row["saved_truth_win_mean"] == round(run["truth_win"], 4)  # the table's mean is the one run's figure
    md = js.with_suffix(".md").read_text()
    assert "| healthy | 6 | 1 |" in md and "false-flag rate (healthy)" in md and md in proc.stdout
    # each measured policy's truth on either half of the held-out prompts (SFT against itself: all ties), for the
    # best by the truth held out
    assert len(run["halves"]) == len(run["measured"]) and run["halves"][0] == [0.5, 0.5]
    assert "best by the truth, held out" in row["against"] and "saved - best by the truth, held out" in md


def test_a_users_judge_functions_guard_grpo_without_a_reward_model(root):
    """reward.judge_functions: the user's own judge (here a length reward) grades GRPO trained on the task's reward
    function with no reward model: its paired measurements along training and its held-out win rate (labelled
    selected and graded by the same judge, beside the reward function it optimized, labelled trained against), and the kept policy."""
    judge = "'reward.judge_functions={tests.rewardfns:length_reward: 1}'"
    out = make("grpo", f"ARGS=results_dir={root} reward.model=0 'reward.functions={{rlhf.inputs.data:letters_reward: 1}}' "
                       f"{judge} grpo.judge_every=1 {' '.join(SHORT)}")
    assert "grpo does not use rm" in out.stdout
    summary = records.latest(tiny(root), "grpo", "test")[1]
    curve = judged(summary)
    assert [c["step"] for c in curve] == [1, 2, 3] and curve[0]["overopt/judge_gain"] == 0.0
    assert all(c["overopt/judge"] <= 0 for c in curve)  # -|tokens - 4| / 4: the length reward's scale
    assert curve[1]["overopt/judge_gain_se"] > 0 and "overopt/judge_win" in curve[1]
    wins = summary["metrics"]["eval_win_rates"]
    assert wins["judge"]["grader"] == "selected and graded by the same judge" and wins["judge"]["score_policy"] <= 0
    assert wins["reward_functions"]["grader"] == "trained against" and "reward_model" not in wins
    assert summary["model"]["kept"]["keep"] == "judge" and summary["model"]["kept"]["iteration"] in (1, 2, 3)


def test_make_rm_measures_a_users_judge_on_its_held_out_pairs(root):
    """With reward.judge_functions set, `make rm` scores its held-out pairs with that judge too: its accuracy and the
    errors it shares with the reward model, for that judge (summary `own_judge`)."""
    judge = "'reward.judge_functions={rlhf.inputs.data:letters_reward: 1}'"
    make("rm", f"ARGS=results_dir={root} {judge}")
    summary = records.latest(tiny(root), "rm", "test")[1]
    own, m = summary["own_judge"], summary["metrics"]
    assert own["judge"] == {"functions": {"rlhf.inputs.data:letters_reward": 1.0}, "model": ""}
    n = summary["data"]["eval"]
    assert own["independence"]["rm_errors"] == round((1 - m["eval_accuracy"]) * n)
    # the task's ground truth ranks its own pairs: chosen responses are the task's better ones
    assert m["eval_own_judge_accuracy"] == own["eval_accuracy"] >= 0.9
    assert m["eval_own_judge_accuracy_ci95"] == own["eval_accuracy_ci95"] == \
        guard.wilson(round(own["eval_accuracy"] * n), n)


def test_rm_says_how_many_pairs_trls_reward_trainer_leaves_out(tmp_path, capsys):
    """TRL's RewardTrainer drops the pairs longer than data.max_length (SFT's trainer truncates): the RM
    says how many, once, and records them (`data.trained`, `warnings`); with none left it stops in one line."""
    from rlhf.recipes import rm, sft
    from rlhf.runs.records import StageInputError

    short = tiny(tmp_path, "data.max_length=16", "sft.max_steps=2", "rm.max_steps=2")
    sft.train(short)
    capsys.readouterr()
    summary = rm.train(short)
    err = capsys.readouterr().err
    # after 2 steps the RM may not rank better than chance, nor its judge be independent: those warnings may be there
    d, (warned, judged, *rest) = summary["data"], summary["warnings"]
    chance = guard.rm_at_chance("rm", summary)
    assert [w for w in rest if w.startswith("rm: the reward model ranks ")] == ([chance] if chance else [])
    assert all(w.startswith(("rm: the reward model ranks ", "rm: the judge is weak")) for w in rest), rest
    assert d["train"] == 1600 and 0 < d["trained"] < 1600 and summary["judge"]["pairs_trained"] < 400
    assert warned == (f"rm: {1600 - d['trained']} of 1600 training pairs are longer than data.max_length = 16 tokens "
                      "(chosen or rejected, with the prompt and EOS), and TRL's RewardTrainer leaves them out; raise "
                      "data.max_length to keep them") and judged.startswith("rm judge: ")
    assert err.count(f"warning: {warned}\n") == 1 and err.count(f"warning: {judged}\n") == 1
    with pytest.raises(StageInputError, match=r"^rm: all 1600 training pairs are longer than "
                                              r"data.max_length = 3 tokens .* raise data.max_length"):
        rm.train(tiny(tmp_path, "data.max_length=3", "data.max_prompt_length=2", "rm.max_steps=2"))


def test_a_reward_model_not_shown_better_than_chance_is_said_by_rm_and_by_each_stage_trained_against_it(tmp_path,
                                                                                                         capsys):
    """A reward model that learned nothing (rm.learning_rate=1e-12: its random head) ranks about half of the held-out
    pairs: `rm` warns that it is not shown better than chance (Wilson's interval reaches 50%), and so does an online
    stage whose reward it is, at setup, before anything loads; one that does not use it in the reward says nothing."""
    from rlhf.recipes import grpo, rm, sft
    from rlhf.rl import online_plan

    exp = tiny(tmp_path, "sft.max_steps=2", "rm.max_steps=2", "rm.learning_rate=1e-12", "data.judge_fraction=0")
    sft.train(exp)
    capsys.readouterr()
    summary = rm.train(exp)
    n = summary["data"]["eval"]
    right = round(summary["metrics"]["eval_accuracy"] * n)
    assert n == 200 and guard.wilson(right, n)[0] <= 0.5, right
    warned = guard.rm_at_chance("rm", summary)
    assert warned.startswith(f"rm: the reward model ranks {right / n:.0%} [") and f"] of its {n} held-out pairs: " \
        "not shown better than chance" in warned
    assert summary["warnings"] == [warned] and capsys.readouterr().err.count(f"warning: {warned}\n") == 1

    def plan(*overrides):
        e = tiny(tmp_path, "sft.max_steps=2", "rm.max_steps=2", "rm.learning_rate=1e-12", "data.judge_fraction=0",
                 "grpo.keep=last", *overrides)
        return online_plan.resolve(e, "grpo", e.grpo, prepare=lambda: grpo.prepare(e), group=e.grpo.num_generations)

    unjudged = ("grpo: no judge watches this run (it needs data.judge_fraction > 0, reward.judge_functions or "
                "reward.judge_model): nothing flags reward over-optimization, stops the run or chooses among its "
                "policies; the last policy is saved")  # data.judge_fraction=0: said too (online_plan.unjudged)
    assert plan().warnings == (guard.rm_at_chance("grpo", summary), unjudged)
    assert plan("reward.model=0", "reward.functions={rlhf.inputs.data:letters_reward: 1}").warnings == (unjudged,)
    (said,) = plan("reward.model=0", "reward.functions={rlhf.inputs.data:letters_reward: 1}",
                   "data.judge_fraction=0.2", "data.sft_examples=1600").warnings  # a judge the RM stage would train,
    # but no RM run is loaded (1600 SFT examples + the judge's 400 pairs: the pool and its held-out split are SFT's)
    assert said.startswith("grpo: no judge watches this run (it needs a judge: the RM stage's is not loaded with "
                           "reward.model 0; name reward.judge_functions or reward.judge_model)")


def test_rows_whose_end_trls_trainers_cut_at_max_length_are_counted_at_the_boundary():
    """SFT's sequences are cut to max_length already: one that is max_length long and ends with its EOS is whole, one
    that ends there without it was cut; DPO's pairs (either side) and KTO's completions longer than max_length are
    cut as the collator batches them; the RM's data set (its trainer leaves such pairs out) counts none."""
    from datasets import Dataset

    from rlhf.recipes.trainers import cut_at_max_length

    eos = 2
    sft = Dataset.from_dict({"input_ids": [[5, 6, 7, 2], [5, 6, 7, 8], [5, 2], [5, 6, 7]]})
    assert cut_at_max_length(sft, 4, eos) == 1  # [5, 6, 7, 8]: cut; [5, 6, 7, 2]: exactly whole
    dpo = Dataset.from_dict({"prompt_ids": [[1, 5], [1, 5], [1, 5]], "chosen_ids": [[6, 2], [6, 7, 2], [6, 2]],
                             "rejected_ids": [[7, 2], [7, 2], [7, 8, 2]]})
    assert cut_at_max_length(dpo, 4, eos) == 2  # the second's chosen and the third's rejected are 5 long
    kto = Dataset.from_dict({"prompt_ids": [[1, 5], [1, 5, 6]], "completion_ids": [[6, 2], [7, 2]], "label": [1, 0]})
    assert cut_at_max_length(kto, 4, eos) == 1
    rm = Dataset.from_dict({"chosen_ids": [[1, 5, 6, 7, 8, 2]], "rejected_ids": [[1, 5, 2]]})
    assert cut_at_max_length(rm, 4, eos) == 0


def test_sft_dpo_and_kto_say_how_many_rows_trls_trainers_leave_out(tmp_path, capsys):
    """TRL 1.16's SFT, DPO and KTO trainers keep a sequence's start and leave out the rows whose prompt alone fills
    data.max_length: the stage says how many (training and held-out, once each), records what it trained on
    (`data.trained`), and stops in one line when none is left (KTO's trainer used to raise on an empty data set)."""
    from rlhf.recipes import dpo, kto, sft
    from rlhf.runs.records import StageInputError

    # tiny's prompts are 7 to 9 tokens: those of 9 fill max_length 9, none fills 10
    cut = ["data.max_length=9", "data.max_prompt_length=8", "sft.max_steps=2", "dpo.max_steps=2", "kto.max_steps=2",
           "eval.prompts=4"]
    trained = sft.train(tiny(tmp_path, *cut))  # SFT's trainer leaves out the same rows (all its labels masked)
    s = trained["data"]
    left_out = [w for w in trained["warnings"] if "have a prompt of data.max_length" in w]
    assert 0 < s["trained"] < s["train"] and left_out[0] == (
        f"sft: {s['train'] - s['trained']} of {s['train']} training rows have a prompt of data.max_length = 9 tokens "
        "or more, and TRL's trainer leaves them out (it keeps a sequence's start, so none of their response would be "
        "left); raise data.max_length to keep them")
    # the rows it keeps (prompts of 7 and 8 tokens) are all longer than 9 with their response: TRL cuts their end
    assert trained["warnings"][-1] == (
        f"sft: {s['trained']} of the {s['trained']} training rows it keeps are longer than data.max_length = 9 tokens, "
        "and TRL's trainer cuts their end: their responses are trained on without their ending (and EOS), which "
        "teaches the policy not to stop; raise data.max_length to keep them whole"), trained["warnings"]
    capsys.readouterr()
    summary = dpo.train(tiny(tmp_path, *cut))
    err = capsys.readouterr().err
    d = summary["data"]
    assert 0 < d["trained"] < d["train"]
    said = [w for w in summary["warnings"] if "have a prompt of data.max_length" in w]
    why = ("pairs have a prompt of data.max_length = 9 tokens or more, and TRL's trainer leaves them out (it keeps a "
           "sequence's start, so none of their response would be left); raise data.max_length to keep them")
    assert said[0] == f"dpo: {d['train'] - d['trained']} of {d['train']} training {why}"
    assert len(said) == 2 and re.fullmatch(rf"dpo: \d+ of {d['eval']} held-out {re.escape(why)}", said[1]), said
    assert all(err.count(f"warning: {w}\n") == 1 for w in said)
    assert f"dpo: {d['trained']} of the {d['trained']} training pairs it keeps are longer than data.max_length = 9 " \
           "tokens, and TRL's trainer cuts their end" in err
    # no RM run here: the judge's share of the pool is not trained on, and DPO says so
    judge = [w for w in summary["warnings"] if "held out for the RM stage's judge" in w]
    assert judge and judge[0].endswith("set data.judge_fraction=0 if you will not run `make rm`"), summary["warnings"]
    with pytest.raises(StageInputError, match=r"^kto: all \d+ training rows have a prompt of data.max_length = 7 "
                                              r"tokens or more, .* raise data.max_length to keep them$"):
        kto.train(tiny(tmp_path, *cut, "data.max_length=7", "data.max_prompt_length=6"))
