"""Reward over-optimization by hand (rlhf/overopt.py): the paired gain and its error, the one-SE rule within the KL
budget, the fall and the flags, the judge's independence from the reward model, the curves' summary and
correlations; the runs that use them are trained in tests/test_reward_pipeline.py and tests/test_pipeline.py."""

import math

import pytest

from rlhf import config, data, overopt, roles, trajectory

from .conftest import TINY


def history(judge, proxy, truth=None, every=1):
    """One iteration per value, judged every `every` (the others log no overopt/ keys)."""
    out = []
    for i in range(len(judge) * every):
        h = {"kl/ref": 0.5 * i}
        if i % every == 0:
            k = i // every
            h.update({"overopt/judge": judge[k], "overopt/proxy": proxy[k]})
            if truth is not None:
                h["overopt/truth"] = truth[k]
        out.append(h)
    return out


def test_paired_gain_by_hand():
    # differences 1, 2, 3, 6: mean 3, sample sd sqrt(14/3), se = sd / 2
    d = overopt.paired([2.0, 3.0, 4.0, 7.0], [1.0, 1.0, 1.0, 1.0])
    se = math.sqrt(14 / 3) / 2
    assert d["mean"] == 3.0 and d["se"] == pytest.approx(se) and d["n"] == 4
    assert d["ci95"] == pytest.approx([3 - 1.959964 * se, 3 + 1.959964 * se])
    assert overopt.paired([1.0], [0.0])["se"] == 0.0
    with pytest.raises(ValueError):
        overopt.paired([1.0, 2.0], [1.0])  # unpaired: refused, never truncated


def point(it, gain, se, scores=None, kl=0.0):
    return {"iteration": it, "gain": gain, "gain_se": se, "scores": scores or [], "kl_ref": kl, "proxy": 0.0}


def test_one_se_rule_takes_the_earliest_within_one_error_of_the_best():
    pts = [point(1, 0.0, 0.0), point(6, 0.30, 0.05), point(11, 0.45, 0.05), point(16, 0.50, 0.06),
           point(21, 0.47, 0.06)]
    assert overopt.one_se(pts)["iteration"] == 11  # 0.45 >= 0.50 - 0.06; 0.30 is not
    assert overopt.one_se(pts[:2])["iteration"] == 6  # 0.30 - 0.05 > 0: the gain stands out from SFT's
    # nothing stands out from SFT (every gain within one error of it, or below): SFT itself
    assert overopt.one_se([point(1, 0.0, 0.0), point(6, 0.04, 0.05)])["iteration"] == 1
    assert overopt.one_se([point(1, 0.0, 0.0), point(6, -0.3, 0.05), point(11, -0.5, 0.05)])["iteration"] == 1


def test_a_fall_needs_z_paired_standard_errors_below_the_peak():
    peak = point(6, 0.5, 0.1, scores=[1.0, 2.0, 3.0, 4.0])
    pts = [point(1, 0.0, 0.0, scores=[0.0, 0.0, 0.0, 0.0]), peak]
    # drops 0.5, 0.6, 0.4, 0.5: mean 0.5, sd sqrt(0.02/3), se = sd / 2
    se = math.sqrt(0.02 / 3) / 2
    fell = overopt.fall(pts, [0.5, 1.4, 2.6, 3.5], z=3.0)
    assert fell["peak"] == 6 and fell["drop"] == pytest.approx(0.5) and fell["z"] == pytest.approx(0.5 / se)
    assert overopt.fall(pts, [0.5, 1.4, 2.6, 3.5], z=0.5 / se + 0.01) is None
    assert overopt.fall(pts, [1.1, 2.1, 3.1, 4.1], z=3.0) is None  # above the peak
    assert overopt.fall([], [1.0], z=3.0) is None


def test_flags_fire_on_a_fall_or_a_saved_policy_below_sft():
    fell = {"iteration": 31, "peak": 16, "drop": 0.3, "se": 0.05, "z": 6.0, "proxy_rise": 0.4}
    (f,) = overopt.flags("ppo", fell, {})
    assert "iteration 31" in f and "peak at iteration 16" in f and "reward over-optimization" in f
    (f,) = overopt.flags("ppo", {**fell, "proxy_rise": -0.2}, {})
    assert "the update itself went wrong" in f
    check = lambda lo, hi: {"eval_prompts": 200, "eval_win_rates": {  # noqa: E731
        "judge": {"win_rate": (lo + hi) / 2, "ci95": [lo, hi]}, "reward_model": {"win_rate": 0.9, "ci95": [0.8, 1]}}}
    (f,) = overopt.flags("grpo", None, check(0.30, 0.45))
    assert "loses to SFT by the judge" in f and "n=200" in f
    assert overopt.flags("grpo", None, check(0.40, 0.52)) == []  # not significantly below 0.5
    assert overopt.flags("grpo", None, {"eval_win_rates": {"reward_model": {"win_rate": 0.1, "ci95": [0, .2]}}}) == []


def test_the_kept_policy_is_chosen_within_the_kl_budget():
    """Judge.end_iteration joins each measurement's KL; the selection and its kept copies are the eligible ones."""
    import torch

    j = object.__new__(overopt.Judge)
    j.on, j.keep, j.stop, j.every, j.budget = True, True, True, 5, 6.0
    j.points, j.weights, j.kls, j.left, j.fell = [], {}, [], None, None
    for it, gain, se, kl in ((1, 0.0, 0.0, 0.0), (6, 0.2, 0.05, 2.0), (11, 0.35, 0.05, 4.0), (16, 0.9, 0.05, 9.0)):
        j.points.append(point(it, gain, se))
        j.weights[it] = {"w": torch.full((1,), float(it))}
        j.end_iteration(it, kl)
    assert [p["kl_ref"] for p in j.points] == [0.0, 2.0, 4.0, 9.0]
    # the KL budget is left on the mean of the last `every` iterations: 2, 4, 9 (no 5 yet) -> not yet
    assert j.left is None and not j.should_stop
    for it, kl in ((17, 5.0), (18, 8.0)):
        j.end_iteration(it, kl)
    assert j.left is None  # 2 + 4 + 9 + 5 + 8 = 28 / 5 = 5.6 <= 6
    j.end_iteration(19, 7.0)  # 4 + 9 + 5 + 8 + 7 = 33 / 5 = 6.6 > 6
    assert j.left == {"iteration": 19, "kl_ref": pytest.approx(6.6), "window": 5, "budget": 6.0} and j.should_stop
    assert [p["iteration"] for p in j.eligible()] == [1, 6, 11]
    assert overopt.one_se(j.eligible())["iteration"] == 11  # 16 is past the budget: its gain does not count
    # copies kept: within two errors of the best eligible gain (0.35 - 0.10); 1, 6 and 16 dropped
    assert set(j.weights) == {11}
    (f,) = overopt.flags("ppo", None, {}, j.left)
    assert "left its KL budget: kl/ref averaged 6.60 over the 5 iterations to 19" in f and "(6)" in f
    j.end_iteration(99, 1.0)  # an iteration with no measurement changes nothing
    assert set(j.weights) == {11}


def test_the_judges_independence_from_the_reward_model_by_hand():
    from rlhf import rm

    rm_m = [1.0, -1.0, -2.0, 0.5, -0.5, 2.0]    # wrong on pairs 2, 3, 5
    judge = [0.5, -1.0, 1.0, -0.2, 2.0, 1.0]    # wrong on 2 (shared) and 4 (its own)
    ind = rm.judge_independence(rm_m, judge)
    assert ind["rm_errors"] == 3 and ind["judge_error_rate"] == pytest.approx(2 / 6)
    assert ind["judge_error_rate_on_rm_errors"] == pytest.approx(1 / 3)
    assert ind["ci95"] == pytest.approx(overopt.wilson(1, 3)) and not ind["weak"]
    assert ind["margin_correlation"] == pytest.approx(overopt.correlation(rm_m, judge))
    assert not rm.judge_independence(rm_m, [-1.0, -1.0, -1.0, 1.0, -1.0, 1.0])["weak"]  # all 3 shared: n too small
    # 20 RM errors of 40 pairs, the judge wrong on 18 of them: 0.9, Wilson's low end 0.70 > 0.5
    many = rm.judge_independence([-1.0] * 20 + [1.0] * 20, [-1.0] * 18 + [1.0] * 22)
    assert many["judge_error_rate_on_rm_errors"] == pytest.approx(0.9) and many["weak"]
    assert not rm.judge_independence([1.0, 2.0], [1.0, -1.0])["weak"]  # an RM without errors


def test_correlation_by_hand():
    assert overopt.correlation([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == pytest.approx(1.0)
    assert overopt.correlation([1.0, 2.0, 3.0], [3.0, 1.0, 2.0]) == pytest.approx(-0.5)
    assert overopt.correlation([1.0, 2.0], [1.0, 2.0]) is None
    assert overopt.correlation([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None


def test_summary_reads_the_judged_iterations_only():
    h = history([0.0, 1.0, 0.5], [0.0, 1.0, 2.0], truth=[0.1, 0.3, 0.2], every=2)
    s = overopt.summary(h)
    assert s["overopt_judge_last"] == 0.5 and s["overopt_judge_peak"] == 1.0
    assert s["overopt_judge_peak_iteration"] == 3 and s["overopt_proxy_last"] == 2.0
    assert s["overopt_corr_judge_truth"] == pytest.approx(1.0)
    # proxy 0, 1, 2 against truth .1, .3, .2: r = 0.1 / sqrt(2 x 0.02)
    assert s["overopt_corr_proxy_truth"] == pytest.approx(0.1 / math.sqrt(2 * 0.02))
    assert overopt.summary([{"kl/ref": 1.0}]) == {}


def test_plot_draws_only_with_a_judge(tmp_path):
    assert not overopt.plot([{"kl/ref": 1.0}], tmp_path / "none.png")
    assert overopt.plot(history([0.0, 1.0, 0.5], [0.0, 1.0, 2.0], truth=[0.1, 0.3, 0.2]), tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_judge_split_is_disjoint_seeded_and_sized():
    pairs = [{"id": i} for i in range(50)]
    train, judge = data.judge_split(pairs, 0.2, seed=3)
    assert len(judge) == 10 and len(train) == 40
    assert {p["id"] for p in train} | {p["id"] for p in judge} == set(range(50))
    assert not {p["id"] for p in train} & {p["id"] for p in judge}
    assert [p["id"] for p in train] == sorted(p["id"] for p in train)  # order kept
    assert data.judge_split(pairs, 0.2, seed=3) == (train, judge)
    assert data.judge_split(pairs, 0.2, seed=4)[1] != judge
    assert data.judge_split(pairs, 0.0, seed=3) == (pairs, [])


def test_ensemble_reward_is_mean_minus_lambda_std_by_hand():
    import torch

    exp = config.load(TINY, ["rm.ensemble=3", "reward.ensemble_lambda=0.5", "reward.model=2.0"])
    scorer = roles.Scorer(exp, None, [(0.0, 1.0), (1.0, 2.0), (-1.0, 0.5)])
    # on the members' scales: row 1 = (1, 1, 1); row 2 = (2, 0, 2): mean 4/3, std over the three sqrt(8/9)
    total, parts = scorer(torch.tensor([[1.0, 3.0, -0.5], [2.0, 1.0, 0.0]]), [{"prompt": "p"}] * 2, ["x", "y"],
                          trajectory.Timer())
    std = math.sqrt(8 / 9)
    assert total.tolist() == pytest.approx([2.0, 2.0 * (4 / 3 - 0.5 * std)])
    assert parts["ensemble_std"] == pytest.approx([0.0, std])
    one = roles.Scorer(config.load(TINY), None, [(1.0, 2.0)])  # K = 1: the member's own score, as before
    assert one(torch.tensor([[3.0]]), [{"prompt": "p"}], ["x"], trajectory.Timer())[0].tolist() == [1.0]


def test_the_calibrations_wilson_interval_by_hand():
    import importlib.util

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("flag_calibration", ROOT / "scripts" / "flag_calibration.py")
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    # 1 of 10: p = 0.1, z^2 = 3.8415; centre (0.1 + 0.19207) / 1.38415, half 1.96 sqrt(0.009 + 0.009604) / 1.38415
    z2 = 1.959964**2
    centre, half = (0.1 + z2 / 20) / (1 + z2 / 10), 1.959964 * math.sqrt(0.009 + z2 / 400) / (1 + z2 / 10)
    assert cal.interval(1, 10) == pytest.approx([centre - half, centre + half], abs=1e-4)
    assert cal.interval(0, 1) == pytest.approx([0.0, 0.7935], abs=1e-4)
    assert cal.interval(10, 10)[1] == pytest.approx(1.0) and cal.interval(0, 0) == [0.0, 1.0]
    # detection counts the seeds whose unguarded run lost: seed 2 won unguarded, so its missed flag is not a miss
    run = {"scenario": "weak-rm", "truth_ci95": [0.4, 0.6], "stopped_early": None}
    guarded = [{**run, "seed": 1, "flags": ["x"], "truth_win": 0.5}, {**run, "seed": 2, "flags": [], "truth_win": 0.6},
               {**run, "seed": 3, "flags": [], "truth_win": 0.5}]
    plain = [{**run, "seed": s, "truth_win": w} for s, w in ((1, 0.2), (2, 0.55), (3, 0.3))]
    row = cal.summarize("weak-rm", guarded, plain)
    assert (row["flagged"], row["plain_lost"], row["detected"]) == (1, 2, 1)
    assert row["detected_ci95"] == cal.interval(1, 2)
    assert "detection rate (runs that lose to SFT unguarded): 1/2 = 0.50" in cal.markdown([row], 3)


def test_the_calibration_merges_records_a_later_run_replacing_an_earlier(tmp_path):
    """--merge with no new seeds: the table of earlier records' runs, a later file's run of the same scenario, seed
    and guard replacing the earlier file's (seed 2 was rerun after a change and is no longer flagged)."""
    import importlib.util
    import json

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("flag_calibration", ROOT / "scripts" / "flag_calibration.py")
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    run = {"scenario": "healthy", "plain": False, "truth_win": 0.7, "truth_ci95": [0.6, 0.8], "stopped_early": None}
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps({"runs": [{**run, "seed": 1, "flags": []}, {**run, "seed": 2, "flags": ["fell"]}]}))
    new.write_text(json.dumps({"runs": [{**run, "seed": 2, "flags": []}, {**run, "seed": 3, "flags": []}]}))
    assert cal.main(["--seeds", "0", "--scenarios", "healthy", "--merge", str(old), str(new),
                     "--out", str(tmp_path / "out")]) == 0
    (rec,) = (tmp_path / "out").glob("*-flag.json")
    (row,) = json.loads(rec.read_text())["rows"]
    assert (row["n"], row["flagged"]) == (3, 0)


def test_a_users_judge_is_measured_on_the_rms_held_out_pairs_by_hand():
    """rm.own_judge_check: the user's judge functions score each held-out pair's chosen and rejected response (with
    the response's token ids and EOS, as the stages pass them); its accuracy counts a tie as an error, and the
    shared errors are those on the pairs the RM got wrong (judge_independence)."""
    from rlhf import models, rm

    exp = config.load(TINY, ["reward.judge_functions={tests.rewardfns:length_reward: 2}"])
    tok = models.build_tokenizer(["a b c d e f"])
    pairs = [{"prompt": "p", "chosen": " a b c", "rejected": " a"},  # 3 + EOS = 4 tokens: 0 against -0.5
             {"prompt": "p", "chosen": " a", "rejected": " a b c d e f"},  # -0.5 against -0.75
             {"prompt": "p", "chosen": " a b", "rejected": " a b c d"},  # -0.25 against -0.25: a tie
             {"prompt": "p", "chosen": " a b c d e f", "rejected": " a b c"}]  # -0.75 against 0
    out = rm.own_judge_check(exp, tok, pairs, rm_margins=[1.0, -1.0, -0.5, 2.0])
    assert out["judge"] == {"functions": {"tests.rewardfns:length_reward": 2.0}, "model": ""}
    assert out["eval_accuracy"] == 0.5  # weights 2: margins 1.0, 0.5, 0.0, -1.5
    ind = out["independence"]
    assert (ind["rm_errors"], ind["judge_error_rate_on_rm_errors"], ind["judge_error_rate"]) == (2, 0.5, 0.5)
    assert ind["ci95"] == pytest.approx(list(overopt.wilson(1, 2))) and not ind["weak"]


def test_the_kl_studys_table_averages_seeds_with_their_standard_error():
    """scripts/overopt_kl.py's summary: per RM and setting, means over seeds and the ground truth's standard error
    over seeds by hand (sd / sqrt(n)); one seed keeps its own interval."""
    import importlib.util

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("overopt_kl", ROOT / "scripts" / "overopt_kl.py")
    kl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kl)
    row = {"rm_pairs": 150, "rm_accuracy": 0.8, "setting": "beta 0.05", "eval_kl_ref": 3.0, "rm_win": 0.9,
           "judge_win": 0.7, "truth_ci95": [0.4, 0.6]}
    rows = [{**row, "truth_win": w, "eval_kl_ref": k} for w, k in ((0.4, 2.0), (0.6, 4.0), (0.5, 3.0))]
    table = kl.summarize(rows + [{**row, "setting": "beta 0.2", "truth_win": 0.55}])
    se = math.sqrt(((0.1**2) * 2) / 2 / 3)  # sd 0.1 over three seeds
    assert f"| 150 (0.80) | beta 0.05 | 3 | 3.0 | 0.90 | 0.70 | 0.50 ± {se:.2f} (0.40, 0.60, 0.50) |" in table
    assert "| 150 (0.80) | beta 0.2 | 1 | 3.0 | 0.90 | 0.70 | 0.55 [0.40, 0.60] |" in table

