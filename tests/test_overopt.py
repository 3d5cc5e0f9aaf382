"""Reward over-optimization by hand (rlhf/rl/overopt.py): the paired gain and its error, the one-SE rule within the KL
budget, the fall and the flags, the judge's independence from the reward model, the curves' summary and
correlations; the runs that use them are trained in tests/test_reward_pipeline.py and tests/test_pipeline.py."""

import json
import math

import pytest
import torch

from rlhf.experiment import config, online_sections
from rlhf.maths import curves, guard
from rlhf.inputs import data
from rlhf.rl import checks, overopt, roles, trajectory

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
    d = guard.paired([2.0, 3.0, 4.0, 7.0], [1.0, 1.0, 1.0, 1.0])
    se = math.sqrt(14 / 3) / 2
    assert d["mean"] == 3.0 and d["se"] == pytest.approx(se) and d["n"] == 4
    assert d["ci95"] == pytest.approx([3 - 1.959964 * se, 3 + 1.959964 * se])
    assert guard.paired([1.0], [0.0])["se"] == 0.0
    with pytest.raises(ValueError):
        guard.paired([1.0, 2.0], [1.0])  # unpaired: refused, never truncated


def point(it, gain, se, scores=None, kl=0.0):
    return {"iteration": it, "gain": gain, "gain_se": se, "scores": scores or [], "kl_ref": kl, "proxy": 0.0}


def test_one_se_rule_takes_the_earliest_within_one_error_of_the_best():
    pts = [point(1, 0.0, 0.0), point(6, 0.30, 0.05), point(11, 0.45, 0.05), point(16, 0.50, 0.06),
           point(21, 0.47, 0.06)]
    assert guard.one_se(pts)["iteration"] == 11  # 0.45 >= 0.50 - 0.06; 0.30 is not
    assert guard.one_se(pts[:2])["iteration"] == 6  # 0.30 - 0.05 > 0: the gain stands out from SFT's
    # nothing stands out from SFT (every gain within one error of it, or below): SFT itself
    assert guard.one_se([point(1, 0.0, 0.0), point(6, 0.04, 0.05)])["iteration"] == 1
    assert guard.one_se([point(1, 0.0, 0.0), point(6, -0.3, 0.05), point(11, -0.5, 0.05)])["iteration"] == 1


def test_a_fall_needs_z_paired_standard_errors_below_the_peak():
    peak = point(6, 0.5, 0.1, scores=[1.0, 2.0, 3.0, 4.0])
    pts = [point(1, 0.0, 0.0, scores=[0.0, 0.0, 0.0, 0.0]), peak]
    # drops 0.5, 0.6, 0.4, 0.5: mean 0.5, sd sqrt(0.02/3), se = sd / 2
    se = math.sqrt(0.02 / 3) / 2
    fell = guard.fall(pts, [0.5, 1.4, 2.6, 3.5], z=3.0)
    assert fell["peak"] == 6 and fell["drop"] == pytest.approx(0.5) and fell["z"] == pytest.approx(0.5 / se)
    assert guard.fall(pts, [0.5, 1.4, 2.6, 3.5], z=0.5 / se + 0.01) is None
    assert guard.fall(pts, [1.1, 2.1, 3.1, 4.1], z=3.0) is None  # above the peak
    assert guard.fall([], [1.0], z=3.0) is None


def test_a_uniform_drop_is_a_fall_however_small_its_error():
    """guard.fall: every prompt lower by the same amount leaves the paired drop no spread (se 0); that is the surest
    fall, not none. The mean gain: drops of exactly 0.5 on each prompt. The win rate: all ties with SFT at the peak
    and a loss on every prompt now (each win drops 0.5), while the mean gain's drop (0.1, 3, 0.1, 3: mean 1.55,
    se 0.84, 1.9 standard errors) stays under z = 3."""
    sft = point(1, 0.0, 0.0, scores=[0.0, 0.0, 0.0, 0.0])
    peak = point(6, 2.5, 0.5, scores=[1.0, 2.0, 3.0, 4.0])
    fell = guard.fall([sft, peak], [0.5, 1.5, 2.5, 3.5], z=3.0)
    assert fell["statistic"] == "gain" and fell["peak"] == 6 and fell["drop"] == pytest.approx(0.5)
    assert fell["se"] == 0 and fell["z"] == math.inf
    assert guard.fall([sft, peak], [1.0, 2.0, 3.0, 4.0], z=3.0) is None  # no drop: no fall
    msg = guard.flags("ppo", {**fell, "iteration": 11, "proxy_rise": 0.3}, {})[0]
    assert "mean gain had fallen 0.500 below its peak at iteration 6 (the same on every prompt)" in msg
    tied = point(6, 0.0, 0.0, scores=[0.0, 0.0, 0.0, 0.0])
    now = [-0.1, -3.0, -0.1, -3.0]
    assert guard.paired(tied["scores"], now)["mean"] < 3.0 * guard.paired(tied["scores"], now)["se"]
    fell = guard.fall([sft, tied], now, z=3.0)
    assert fell["statistic"] == "win rate" and fell["drop"] == pytest.approx(0.5) and fell["se"] == 0


def test_a_fall_in_the_judges_win_rate_is_a_fall_though_its_mean_gain_holds():
    """guard.fall tests the win rate against SFT too: two prompts gamed far up and six a little down keep the peak's
    mean gain (0.5) while the win rate falls from 1 to 0.25. The per-prompt win drops 0, 0, 1 x 6: mean 0.75, sd
    sqrt(1.5 / 7), se = sd / sqrt(8)."""
    sft = point(1, 0.0, 0.0, scores=[0.0] * 8)
    peak = point(6, 0.5, 0.0, scores=[0.5] * 8)
    gamed = [2.3, 2.3] + [-0.1] * 6
    assert guard.paired(peak["scores"], gamed)["mean"] == pytest.approx(0.0)  # the mean gain holds
    fell = guard.fall([sft, peak], gamed, z=3.0)
    se = math.sqrt(1.5 / 7) / math.sqrt(8)
    assert fell["statistic"] == "win rate" and fell["peak"] == 6
    assert fell["drop"] == pytest.approx(0.75) and fell["z"] == pytest.approx(0.75 / se)
    assert guard.fall([sft, peak], gamed, z=0.75 / se + 0.01) is None
    msg = guard.flags("ppo", {**fell, "iteration": 11, "proxy_rise": 0.3}, {})[0]
    assert "win rate against SFT had fallen 0.750 below its peak at iteration 6" in msg


def test_the_win_rate_is_measured_against_sfts_reference_draw_not_its_first_measurement():
    """A policy whose early samples share SFT's random numbers (the same seed) beats SFT's first measurement on every
    prompt; later, decorrelated samples of the same quality (the same mean gain, 0.1) beat it on half. Against that
    first measurement the win rate falls 0.5 (per prompt 0 x 4, 1 x 4: se sqrt(2/7) / sqrt(8), 2.65 SE); against
    SFT's reference draw (independent of the measurements: here 3.5 on every prompt) it holds at 0.5, and nothing
    falls. The guard tests against its reference and keeps it in its checkpoint state."""
    x = [float(i) for i in range(8)]
    sft, peak = point(1, 0.0, 0.0, scores=x), point(6, 0.1, 0.0, scores=[v + 0.1 for v in x])
    now = [v + 0.1 for v in reversed(x)]
    fell = guard.fall([sft, peak], now, z=2.0)  # without a reference: SFT's first measurement
    assert fell["statistic"] == "win rate" and fell["z"] == pytest.approx(0.5 / (math.sqrt(2 / 7) / math.sqrt(8)))
    reference = [3.5] * 8
    assert guard.fall([sft, peak], now, z=2.0, reference=reference) is None
    g = guard.Guard(every=5, budget=6.0, z=2.0)
    g.reference = reference
    for p in (sft, peak, point(11, 0.1, 0.0, scores=now)):
        g.add(p)
    assert g.fell is None
    g.reference = None  # the same run tested against SFT's first measurement falls at iteration 11
    g.points, g.fell = [], None
    for p in (sft, peak, point(11, 0.1, 0.0, scores=now)):
        g.add(p)
    assert g.fell["iteration"] == 11
    restored = guard.Guard(every=5, budget=6.0, z=2.0)
    restored.restore({**g.state(), "judge_reference": reference}, set())
    assert restored.reference == reference and guard.Guard(5, 6.0, 2.0).state()["judge_reference"] is None
    older = guard.Guard(every=5, budget=6.0, z=2.0)  # a checkpoint from before the reference draw
    older.restore({k: v for k, v in g.state().items() if k != "judge_reference"}, set())
    assert older.reference == x


def test_the_fall_threshold_grows_with_the_planned_measurements():
    """guard.fall_z: alpha spread over the K (K - 1) / 2 pairs of a run's K measurements (every period and once
    after the last update) and the two statistics tested, Student's t with n - 1 degrees of freedom; an online
    section's threshold is its own overopt_z, else that of the run it plans. A drop of 3.6 paired standard errors is
    a fall in a run of 13 measurements and not in one of 61 (with a fixed z = 3, both)."""
    assert [guard.planned_measurements(s, e) for s, e in ((60, 5), (300, 5), (300, 15), (7, 5), (10, 0))] == \
        [13, 61, 21, 3, 0]
    # Student's t from tables: t(120) at 0.9995 = 3.373, t(60) at 0.995 = 2.660, t(30) at 0.999 = 3.385
    for p, df, table in ((0.9995, 120, 3.373), (0.995, 60, 2.660), (0.999, 30, 3.385), (0.975, 10, 2.228)):
        assert guard.t_quantile(p, df) == pytest.approx(table, abs=2e-3)
    # the exact t quantile at 1 - 0.05 / (K (K - 1) / 2 pairs x 2 statistics), computed apart from the code (mpmath,
    # 30 digits: the root of 1 - betainc(df / 2, 1 / 2, 0, df / (df + t^2)) / 2 = p): K 13, 21, 61 with 128 prompts
    # (df 127; p = 1 - 0.05 / 156, / 420, / 3660) and K 4 with 64 (df 63, p = 1 - 0.05 / 12)
    for k, n, exact in ((13, 128, 3.5006061), (21, 128, 3.7823882), (61, 128, 4.3533433), (4, 64, 2.7241229)):
        assert guard.fall_z(k, 0.05, n) == pytest.approx(exact, abs=1e-4)
    z13, z21, z61 = (guard.fall_z(k, 0.05, 128) for k in (13, 21, 61))
    exp = config.load(TINY)
    assert guard.threshold(exp.ppo, 128) == z13 and guard.threshold(exp.grpo, 128) == guard.fall_z(4, 0.05, 128)
    long = config.load(TINY, ["ppo.steps=300", "grpo.steps=300", "grpo.judge_every=15", "rloo.overopt_z=3"])
    assert (guard.threshold(long.ppo, 128), guard.threshold(long.grpo, 128)) == (z61, z21)
    assert guard.threshold(long.rloo, 128) == 3.0
    # a drop of 0.36 with a paired standard error of 0.1 (differences 0.36 +- a, n = 4): 3.6 standard errors
    a = 0.1 * 2 * math.sqrt(3 / 4)  # sd of (+a, -a, +a, -a) is a sqrt(4/3); se = sd / 2
    peak = point(6, 0.5, 0.1, scores=[1.0, 1.0, 1.0, 1.0])
    now = [1.0 - 0.36 - x for x in (a, -a, a, -a)]
    pts = [point(1, 0.0, 0.0, scores=[0.0] * 4), peak]  # SFT's below both: the win rate holds at 1
    assert guard.fall(pts, now, 3.0)["z"] == pytest.approx(3.6)
    assert guard.fall(pts, now, z13) is not None and guard.fall(pts, now, z61) is None


def test_the_fall_simulation_runs_the_guards_test_and_its_false_falls_stay_within_alpha():
    """studies/fall_simulation.py: its vectorized test flags the same measurement as guard.fall on every simulated
    run; on a plateau of 13 independent measurements (tiny PPO's) a fixed z = 3 flags about 14% of runs, the
    shipped threshold fewer than alpha: the whole of Wilson's 95% interval over 4,000 runs is below 0.05 (the
    study's 10,000 runs: 3.4% [3.0, 3.7])."""
    import importlib.util

    import numpy as np

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("fall_simulation", ROOT / "studies" / "fall_simulation.py")
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    rng = np.random.default_rng(0)
    s, ref = sim.scores(rng, 40, 8, 16, 0.5, "normal", sim.curve("fall", 8, 1.5))
    first = sim.first_fall(s, 2.0, ref)
    for run, reference, got in zip(s, ref.tolist(), first):
        pts, want = [], -1
        for k, sc in enumerate(run.tolist()):
            g = sum(x - y for x, y in zip(sc, run[0].tolist())) / len(sc)
            if want < 0 and guard.fall(pts, sc, 2.0, reference):
                want = k
            pts.append(point(k, g, 0.0, scores=sc))
        assert got == want
    assert 0 < (first >= 0).sum() < 40
    # its confirmed stop tests the same falls: confirming every one (alpha near 1) stops where the test first fired
    always = sim.confirmed_fall(rng, s, 2.0, ref, sim.curve("fall", 8, 1.5), 1 - 1e-9, 16)[0]
    assert always.tolist() == first.tolist()
    uniform = np.array([[[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0], [0.5, 1.5, 2.5, 3.5]]])  # a drop of 0.5, se 0
    assert sim.first_fall(uniform, 3.0).tolist() == [2]
    z13 = guard.fall_z(13, 0.05, 128)
    plateau, ref = sim.scores(rng, 4000, 13, 128, 0.0, "normal", np.zeros(13))
    fixed, shipped = ((sim.first_fall(plateau, z, ref) >= 0).sum() for z in (3.0, z13))
    assert guard.wilson(int(fixed), 4000)[0] > 0.1 and guard.wilson(int(shipped), 4000)[1] < 0.05
    # correlated measurements (AR(1) 0.9) on a rise to a plateau: the win rate against SFT's same-seed first draw
    # drifts down as the policy's samples decorrelate from it (a false fall in about a fifth of the runs); against
    # SFT's independent reference draw, as the guard measures it, each statistic stays within alpha / 2
    rise, ref = sim.scores(rng, 4000, 13, 128, 0.9, "normal", sim.curve("rise", 13))
    same_seed = int((sim.first_fall(rise, z13, None, ("win rate",)) >= 0).sum())
    assert guard.wilson(same_seed, 4000)[0] > 0.1
    for stat in sim.STATISTICS:
        assert guard.wilson(int((sim.first_fall(rise, z13, ref, (stat,)) >= 0).sum()), 4000)[1] < 0.025
    # the final playoff: a slow decline (half the gain, lost over the last 60% of the run) that the fall test mostly
    # misses leaves the guard near the last policy; the playoff recovers most of the best measured policy's gain, and
    # on a healthy rise it switches about alpha of the time between equally good policies, never to a worse one
    z = guard.fall_z(13, 0.05, 128)
    decline = sim.playoff_cell(rng, 1000, 13, 128, z, 0.05, "fall", 0.3)
    assert decline["guard"] < decline["best_measured"] - 0.15 and decline["playoff"] > decline["best_measured"] - 0.06
    rise = sim.playoff_cell(rng, 1000, 13, 128, z, 0.05, "rise")
    assert rise["worse"]["k"] == 0 and rise["switched"]["ci95"][0] < 0.05 < rise["switched"]["ci95"][1] + 0.02
    # the margin (a fifth of the guard's choice's measured gain): on the plateau it all but stops the switches
    # between equally good policies; on the decline it still recovers most of the gain
    held = sim.playoff_cell(rng, 1000, 13, 128, z, 0.05, "rise", margin=0.2)
    assert held["switched"]["ci95"][1] < 0.02 and held["worse"]["k"] == 0
    decline_m = sim.playoff_cell(rng, 1000, 13, 128, z, 0.05, "fall", 0.3, margin=0.2)
    assert decline_m["playoff"] > decline["guard"] + 0.1 and decline_m["switched"]["rate"] < decline["switched"]["rate"]
    # the shipped stop: a fall confirmed on 512 fresh prompts. On the correlated plateau above, about alpha x alpha
    # of the runs (the test alone: a few percent); a fall of the whole gain is still stopped in nearly every run
    plateau, ref = sim.scores(rng, 4000, 13, 128, 0.9, "normal", np.zeros(13))
    alone = int((sim.first_fall(plateau, z13, ref) >= 0).sum())
    stopped, tested = sim.confirmed_fall(rng, plateau, z13, ref, np.zeros(13), 0.05, 512)
    assert guard.wilson(int((stopped >= 0).sum()), 4000)[1] < 0.01 < guard.wilson(alone, 4000)[0]
    assert (tested[stopped >= 0] >= 1).all() and tested.sum() >= alone
    fall, ref = sim.scores(rng, 1000, 13, 128, 0.5, "normal", sim.curve("fall", 13, 0.6))
    assert (sim.confirmed_fall(rng, fall, z13, ref, sim.curve("fall", 13, 0.6), 0.05, 512)[0] >= 0).mean() > 0.85
    # with the shipped fall_margin (a tenth of the peak's measured gain) too; a margin of nearly the whole measured
    # gain (0.99 x about 0.6) lets few falls of at most 0.6 count (about 10%: where the peak was measured low)
    shipped = sim.confirmed_fall(rng, fall, z13, ref, sim.curve("fall", 13, 0.6), 0.05, 512, margin=0.1)[0]
    assert (shipped >= 0).mean() > 0.85
    assert (sim.confirmed_fall(rng, fall, z13, ref, sim.curve("fall", 13, 0.6), 0.05, 512, margin=0.99)[0]
            >= 0).mean() < 0.3


def test_flags_fire_on_a_fall_or_a_saved_policy_below_sft():
    fell = {"iteration": 31, "peak": 16, "drop": 0.3, "se": 0.05, "z": 6.0, "proxy_rise": 0.4}
    (f,) = guard.flags("ppo", fell, {})
    assert "iteration 31" in f and "peak at iteration 16" in f and "reward over-optimization" in f
    (f,) = guard.flags("ppo", {**fell, "proxy_rise": -0.2}, {})
    assert "the update itself went wrong" in f
    check = lambda lo, hi: {"eval_prompts": 200, "eval_win_rates": {  # noqa: E731
        "judge": {"win_rate": (lo + hi) / 2, "ci95": [lo, hi]}, "reward_model": {"win_rate": 0.9, "ci95": [0.8, 1]}}}
    (f,) = guard.flags("grpo", None, check(0.30, 0.45))
    assert "loses to SFT by the judge" in f and "n=200" in f
    assert guard.flags("grpo", None, check(0.40, 0.52)) == []  # not significantly below 0.5
    assert guard.flags("grpo", None, {"eval_win_rates": {"reward_model": {"win_rate": 0.1, "ci95": [0, .2]}}}) == []


def test_the_kept_policy_is_chosen_within_the_kl_budget():
    """Guard.read_kl joins each measurement's KL; the selection and the policies it holds are the eligible ones."""
    j = guard.Guard(every=5, budget=6.0, z=3.0)
    for it, gain, se, kl in ((1, 0.0, 0.0, 0.0), (6, 0.2, 0.05, 2.0), (11, 0.35, 0.05, 4.0), (16, 0.9, 0.05, 9.0)):
        j.add(point(it, gain, se, scores=[gain, gain]))
        j.read_kl(it, kl)
    assert [p["kl_ref"] for p in j.points] == [0.0, 2.0, 4.0, 9.0]
    # the KL budget is left on the mean of the last `every` iterations: 2, 4, 9 (no 5 yet) -> not yet
    assert j.left is None and not j.should_stop
    for it, kl in ((17, 5.0), (18, 8.0)):
        j.read_kl(it, kl)
    assert j.left is None  # 2 + 4 + 9 + 5 + 8 = 28 / 5 = 5.6 <= 6
    j.read_kl(19, 7.0)  # 4 + 9 + 5 + 8 + 7 = 33 / 5 = 6.6 > 6
    assert j.left == {"iteration": 19, "kl_ref": pytest.approx(6.6), "window": 5, "budget": 6.0} and j.should_stop
    assert [p["iteration"] for p in j.eligible()] == [1, 6, 11]
    assert guard.one_se(j.eligible())["iteration"] == 11  # 16 is past the budget: its gain does not count
    # policies held: within two errors of the best eligible gain (0.35 - 0.10), and the latest (16: the last policy
    # while the run has not fallen or left its budget); 1 and 6 let go
    assert j.held == {11, 16}
    (f,) = guard.flags("ppo", None, {}, j.left)
    assert "left its KL budget: kl/ref averaged 6.60 over the 5 iterations to 19" in f and "(6)" in f
    assert "the kept policy is chosen within it" in f
    (f,) = guard.flags("ppo", None, {}, j.left, keeps=False)  # keep: last chooses nothing
    assert "the last policy is saved all the same (ppo.keep = last)" in f and "chosen within" not in f
    j.read_kl(99, 1.0)  # an iteration with no measurement changes nothing
    assert j.held == {11, 16} and j.select()["iteration"] == 11


def test_a_last_policy_set_aside_for_its_kl_alone_is_said():
    """GRPO's judge_every of 15 over 15 iterations: kl/ref averaged over the window stays under the budget (no flag),
    while the last measurement alone is past it, so the keep rule takes the SFT policy: a note says why and what to
    raise, where a new user's run kept SFT with `flags none`."""
    j = guard.Guard(every=15, budget=2.0, z=3.0)
    for it, kl in ((1, 0.0), (16, 2.41)):
        j.add(point(it, 0.0 if it == 1 else 0.5, 0.05, scores=[0.0, 0.5]))
        for step in range(max(it - 14, 1), it + 1):
            j.read_kl(step, kl if step == it else 1.5)
    assert j.left is None and [p["iteration"] for p in j.eligible()] == [1] and j.select()["iteration"] == 1
    kept = {"iteration": 1, "last": False}
    said = guard.set_aside_for_kl("grpo", kept, j.points[-1], j.budget, bool(j.left or j.fell))
    assert said == ("grpo: the last policy's KL to the reference, 2.41 nats as measured, is above grpo.kl_band's high "
                    "end (2), so the guard kept the latest policy within it, after 0 updates (the SFT policy); kl/ref "
                    "sums over each response's tokens: raise grpo.kl_band's high end to trust the reward model further")
    assert guard.set_aside_for_kl("grpo", {"iteration": 16, "last": True}, j.points[-1], 2.0, False) is None
    assert guard.set_aside_for_kl("grpo", kept, j.points[-1], 2.0, True) is None  # a flag already says why
    assert guard.set_aside_for_kl("grpo", kept, {**j.points[-1], "kl_ref": 1.9}, 2.0, False) is None


def test_the_kept_policy_is_the_last_unless_the_run_fell_or_left_its_budget():
    """Guard.select: a run that neither fell nor left its KL budget keeps its last policy (measured after the last
    update), however its gain compares with a noisy best; one that fell or left keeps the one-SE rule's choice
    within the budget, and never the policy measured after an early stop's update. Four prompts with their own
    noise at each measurement (SFT's mean 0, so a gain is a row's mean), so each drop has a spread."""
    rows = {1: [0.1, -0.1, 0.05, -0.05], 6: [0.35, 0.2, 0.4, 0.25], 11: [0.6, 0.45, 0.4, 0.55],
            16: [0.4, 0.55, 0.5, 0.35], 21: [0.52, 0.32, 0.47, 0.37]}  # gains 0, 0.3, 0.5, 0.45, 0.42

    def run(its, kls=None, final=None, scores=None):
        j = guard.Guard(every=5, budget=6.0, z=3.0)
        for k, it in enumerate(its):
            sc = (scores or {}).get(it, rows[it])
            j.add(point(it, sum(sc) / 4, 0.05, scores=sc))
            j.read_kl(it, (kls or {}).get(it, 1.0 if k else 0.0))
        if final:  # measure_final's point: after the last update, its KL the judge's own
            sc = final[0]
            j.add({**point(1 + 5 * len(its), sum(sc) / 4, 0.05, scores=sc), "final": True, "kl_ref": final[1],
                   **final[2]})
            j.prune()
        return j
    # a plateau: 0.50 was the best measurement, the last (0.42) is within noise of it and no fall was called (its
    # drops from 11: 0.08, 0.13, -0.07, 0.18: mean 0.08, se sqrt(0.035 / 3) / 2 = 0.054, 1.5 standard errors)
    j = run([1, 6, 11, 16], final=(rows[21], 2.0, {}))
    assert j.fell is None and j.select()["iteration"] == 21 and 21 in j.held
    assert guard.one_se(j.eligible())["iteration"] == 11  # the one-SE rule would have kept 11
    # a fall (16 drops 0.4, 0.6, 0.4, 0.6 below 11: mean 0.5, se 0.058, 8.7 standard errors) -> the one-SE rule: 11
    fell = run([1, 6, 11, 16], scores={16: [0.2, -0.15, 0.0, -0.05]}, final=(rows[1], 2.0, {}))
    assert fell.fell["iteration"] == 16 and fell.fell["z"] == pytest.approx(0.5 / (math.sqrt(0.04 / 3) / 2))
    assert fell.select()["iteration"] == 11
    # the budget left (7, 7, 7, 7, 7 > 6): one-SE within it; the policy after the stop is never kept
    left = run([1, 6, 11], final=([1.0, 0.8, 0.95, 0.85], 7.0, {"stopped": True}))
    for step in range(12, 17):
        left.read_kl(step, 7.0)
    assert left.left and left.select()["iteration"] == 11
    assert [p["iteration"] for p in left.eligible()] == [1, 6, 11]


def test_the_final_playoff_keeps_a_challenger_only_when_fresh_prompts_show_it_better():
    """guard.playoff by hand: the challenger's paired gain over the guard's choice on the same fresh prompts, one-sided
    Student's t at alpha; a gain within noise leaves the guard's choice, a uniform gain (se 0) wins, a uniform loss
    loses. Guard.challenger: the best measured policy within the budget against a last one the fall test kept, the
    latest within the budget against an early pick, none when the two are one."""
    inc = [0.0, 0.5, -0.5, 1.0, -1.0, 0.2, -0.2, 0.0]
    up = [x + d for x, d in zip(inc, [0.6, 0.4, 0.5, 0.7, 0.3, 0.5, 0.6, 0.4])]  # gains: mean 0.5, sd 0.1309
    r = guard.playoff(inc, up, 0.05)
    se = math.sqrt(sum((d - 0.5) ** 2 for d in [0.6, 0.4, 0.5, 0.7, 0.3, 0.5, 0.6, 0.4]) / 7 / 8)
    assert r["gain"] == pytest.approx(0.5) and r["se"] == pytest.approx(se) and r["prompts"] == 8
    assert r["threshold"] == pytest.approx(guard.t_quantile(0.95, 7)) and r["threshold"] == pytest.approx(1.895, abs=2e-3)
    assert r["won"] and r["t"] == pytest.approx(0.5 / se)
    noisy = [x + d for x, d in zip(inc, [0.6, -0.5, 0.4, -0.3, 0.2, -0.4, 0.3, 0.0])]  # mean 0.0375: within noise
    assert not guard.playoff(inc, noisy, 0.05)["won"]
    assert guard.playoff(inc, [x + 0.01 for x in inc], 0.05)["won"]  # the same small gain on every prompt
    assert not guard.playoff(inc, [x - 0.01 for x in inc], 0.05)["won"]
    # the margin: the same gains (mean 0.5, se as above) must beat 0.3 significantly: t = 0.2 / se = 4.32 wins;
    # beating 0.45 (t = 1.08) does not, though the gain alone is significant; a uniform gain must exceed it
    m = guard.playoff(inc, up, 0.05, margin=0.3)
    assert m["won"] and m["gain"] == pytest.approx(0.5) and m["margin"] == 0.3 and m["t"] == pytest.approx(0.2 / se)
    assert not guard.playoff(inc, up, 0.05, margin=0.45)["won"]
    assert guard.playoff(inc, up, 0.05, margin=0.45)["t"] == pytest.approx(0.05 / se)
    assert not guard.playoff(inc, [x + 0.01 for x in inc], 0.05, margin=0.02)["won"]
    assert guard.playoff(inc, [x + 0.03 for x in inc], 0.05, margin=0.02)["won"]

    rows = {1: [0.0] * 4, 6: [0.3, 0.2, 0.4, 0.3], 11: [0.6, 0.5, 0.4, 0.5], 16: [0.4, 0.3, 0.45, 0.35]}
    j = guard.Guard(every=5, budget=6.0, z=30.0)  # a fall test that sees nothing: the decline 11 -> 16 is missed
    for it, sc in rows.items():
        j.add(point(it, sum(sc) / 4, 0.05, scores=sc))
        j.read_kl(it, 1.0 if it > 1 else 0.0)
    assert j.fell is None and j.select()["iteration"] == 16 and j.challenger(j.select())["iteration"] == 11
    early = next(p for p in j.points if p["iteration"] == 6)
    assert j.challenger(early)["iteration"] == 16  # against an early pick: the latest within the budget
    flat = guard.Guard(every=5, budget=6.0, z=30.0)
    flat.add(point(1, 0.0, 0.0, scores=[0.0] * 4))
    assert flat.challenger(flat.select()) is None


def test_a_fall_stops_the_run_only_when_fresh_prompts_confirm_it():
    """guard.confirm by hand: the statistic that fell, tested once more on fresh prompts, one-sided at alpha (Student's
    t): the paired drop peak - current, or the peak's wins over the current policy above one half. Guard with
    confirm_alpha: a fall from a held peak waits for that test; confirmed, it is the run's fall and stops it;
    unconfirmed, it is reported and the run goes on (a later fall is tested again); a peak no longer held, or no
    confirmation level, leaves the fall as seen."""
    peak, drops = [1.0, 2.0, 3.0, 4.0, 0.5, 1.5], [0.6, 0.4, 0.5, 0.7, 0.3, 0.5]  # mean 0.5
    se = math.sqrt(sum((d - 0.5) ** 2 for d in drops) / 5 / 6)
    c = guard.confirm(peak, [p - d for p, d in zip(peak, drops)], "gain", 0.05)
    assert c["drop"] == pytest.approx(0.5) and c["se"] == pytest.approx(se) and c["t"] == pytest.approx(0.5 / se)
    assert c["threshold"] == pytest.approx(guard.t_quantile(0.95, 5)) and c["confirmed"] and c["prompts"] == 6
    noisy = [p + d for p, d in zip(peak, [-0.4, 0.5, -0.3, 0.4, -0.2, 0.1])]  # mean drop -0.0167: not confirmed
    assert not guard.confirm(peak, noisy, "gain", 0.05)["confirmed"]
    assert guard.confirm(peak, [p - 0.01 for p in peak], "gain", 0.05)["confirmed"]  # uniform: se 0
    # the win rate: the peak beats the current policy on 5 prompts, ties 1 -> 0.5, 0.5, 0.5, 0.5, 0.5, 0 above one half
    w = guard.confirm(peak, [p - 0.1 for p in peak[:5]] + [peak[5]], "win rate", 0.05)
    se_w = math.sqrt((5 * (0.5 - 5 / 12) ** 2 + (5 / 12) ** 2) / 5 / 6)
    assert w["drop"] == pytest.approx(5 / 12) and w["se"] == pytest.approx(se_w) and w["confirmed"]
    # the peak better on half the prompts and worse on the other half: no win-rate fall
    assert not guard.confirm(peak, [p + (0.1 if i % 2 else -0.1) for i, p in enumerate(peak)], "win rate",
                             0.05)["confirmed"]

    def run(confirm_alpha, keep=True):
        g = guard.Guard(every=5, budget=6.0, z=3.0, keep=keep, confirm_alpha=confirm_alpha)
        g.add(point(1, 0.0, 0.0, scores=[0.0] * 4))
        g.add(point(6, 2.5, 0.5, scores=[1.0, 2.0, 3.0, 4.0]))
        g.add(point(11, 2.0, 0.5, scores=[0.5, 1.4, 2.6, 3.5]))  # 0.5 below the peak, z 12.2
        return g
    seen = run(0.0)
    assert seen.fell["peak"] == 6 and seen.pending is None and seen.should_stop  # no confirmation: as seen
    assert seen.fell["fresh"] == {"skipped": "no confirmation (no playoff: too few fresh prompts or playoff_alpha 0)"}
    assert run(0.05, keep=False).fell["fresh"] == {"skipped": "the peak's copy was not kept"}
    g = run(0.05)
    assert g.fell is None and g.pending["peak"] == 6 and g.pending["iteration"] == 11 and not g.should_stop
    g.confirm(peak, noisy)  # not confirmed: reported, the run goes on
    assert g.fell is None and g.pending is None and not g.should_stop
    assert g.unconfirmed[0]["iteration"] == 11 and not g.unconfirmed[0]["fresh"]["confirmed"]
    g.add(point(16, 1.5, 0.5, scores=[0.0, 1.0, 2.0, 3.0]))  # falls again: tested again
    assert g.pending["iteration"] == 16
    g.confirm(peak, [p - d for p, d in zip(peak, drops)])
    assert g.fell["iteration"] == 16 and g.fell["fresh"]["confirmed"] and g.should_stop
    assert g.state()["judge_unconfirmed"] == g.unconfirmed
    again = guard.Guard(every=5, budget=6.0, z=3.0, confirm_alpha=0.05)
    again.restore(g.state(), {1, 6, 11, 16})
    assert again.unconfirmed == g.unconfirmed and again.fell == g.fell and again.held == g.held
    # each statistic's peak keeps its copy while it is the peak, though the selection let it go: here the win
    # rate's (every prompt above SFT's draw, a small gain) beside the gain's (a larger gain, half the prompts)
    p = guard.Guard(every=5, budget=6.0, z=30.0, confirm_alpha=0.05)
    p.reference = [0.0] * 4
    for it, sc, se in ((1, [0.0] * 4, 0.0), (6, [0.1] * 4, 0.0), (11, [2.0, 2.0, -1.0, -1.0], 0.1)):
        p.add(point(it, sum(sc) / 4, se, scores=sc))
        p.read_kl(it, 0.5)
    assert p.peaks() == {6, 11} and 6 not in p.held and 6 in p.copies
    p.confirm_alpha = 0.0
    assert p.copies == p.held  # without a confirmation only the selection's
    assert "confirmed on 6 fresh prompts: a drop of 0.500, t " in guard.flags("ppo", g.fell, {})[0]


def test_a_fall_counts_only_beyond_its_margin():
    """guard.confirm with a margin: the drop less the margin, one-sided at alpha (Student's t). Guard.confirm's margin
    is fall_margin x what the peak gained over SFT on the judge's prompts by the statistic that fell (guard.gained: its
    mean gain, or its win rate against SFT's reference draw less one half), none when the peak gained nothing."""
    peak, drops = [1.0, 2.0, 3.0, 4.0, 0.5, 1.5], [0.6, 0.4, 0.5, 0.7, 0.3, 0.5]  # mean 0.5
    current = [p - d for p, d in zip(peak, drops)]
    se = math.sqrt(sum((d - 0.5) ** 2 for d in drops) / 5 / 6)
    c = guard.confirm(peak, current, "gain", 0.05, margin=0.3)
    assert c["drop"] == pytest.approx(0.5) and c["margin"] == 0.3 and c["t"] == pytest.approx(0.2 / se)  # 3.46
    assert c["confirmed"] and c["threshold"] == pytest.approx(guard.t_quantile(0.95, 5))  # 2.02
    assert not guard.confirm(peak, current, "gain", 0.05, margin=0.45)["confirmed"]  # t 0.87
    assert guard.confirm(peak, [p - 0.5 for p in peak], "gain", 0.05, margin=0.45)["confirmed"]  # se 0, above
    assert not guard.confirm(peak, [p - 0.4 for p in peak], "gain", 0.05, margin=0.45)["confirmed"]  # se 0, below
    sft = [0.0, 0.0, 5.0, 4.0]
    assert guard.gained({"gain": 2.5, "scores": [1.0, 2.0, 3.0, 4.0]}, "gain", sft) == 2.5
    assert guard.gained({"gain": 2.5, "scores": [1.0, 2.0, 3.0, 4.0]}, "win rate", sft) == 0.125  # 1, 1, 0, 0.5
    assert guard.margin(0.1, 2.5) == 0.25 and guard.margin(0.1, -0.3) == 0.0

    def run(fall_margin, peak_gain=2.5):
        g = guard.Guard(every=5, budget=6.0, z=3.0, confirm_alpha=0.05, fall_margin=fall_margin)
        g.add(point(1, 0.0, 0.0, scores=[0.0] * 4))
        g.add(point(6, peak_gain, 0.5, scores=[1.0, 2.0, 3.0, 4.0]))
        g.add(point(11, 2.0, 0.5, scores=[0.5, 1.4, 2.6, 3.5]))
        g.confirm(peak, current)
        return g
    small = run(0.1)  # margin 0.25 of the peak's gain 2.5: the fresh drop of 0.5 is beyond it, t 4.33
    assert small.fell["fresh"]["margin"] == pytest.approx(0.25) and small.fell["fresh"]["confirmed"]
    assert small.should_stop
    big = run(0.2)  # margin 0.5: the same drop is not beyond it (t 0); the run goes on
    assert big.fell is None and big.unconfirmed[0]["fresh"]["margin"] == pytest.approx(0.5) and not big.should_stop
    assert run(0.2, peak_gain=-0.1).fell["fresh"]["margin"] == 0.0  # a peak no better than SFT: no margin
    assert small.fell["gained"] == 2.5  # recorded with the fall (judge_fell), confirmed or not
    assert "confirmed on 6 fresh prompts: a drop of 0.500, beyond a margin of 0.250, t 4.33 against 2.01" in \
        guard.flags("ppo", small.fell, {})[0]


def test_the_judge_confirms_a_fall_on_fresh_prompts_and_puts_the_policy_back():
    """overopt.Judge._confirm: the current policy and the peak's sample the confirmation's fresh prompts with the seed
    no measurement uses, the guard tests the fall on their scores, and the current policy's weights go back into the
    adapter before training goes on; the peak's scores are drawn once."""
    import types

    s = types.SimpleNamespace(confirm_rows=[{"prompt": "p"}] * 4, seed=10)
    j = object.__new__(overopt.Judge)
    j.s, j.weights, j.guard = s, {6: "w6", 11: "w11"}, guard.Guard(5, 6.0, 3.0, confirm_alpha=0.05)
    j.peak_fresh = {}
    j.guard.pending = {"iteration": 11, "peak": 6, "statistic": "gain", "drop": 0.5, "se": 0.1, "z": 5.0,
                       "proxy_rise": 0.2, "gained": 0.8}
    loaded, drawn = [], []
    current, at_peak = [0.0, 1.0, 2.0, 3.0], [0.5, 1.4, 2.6, 3.5]

    def sample(rows, seed):
        drawn.append((len(rows), seed, loaded[-1] if loaded else "current"))
        return None, None, None, None, at_peak if loaded and loaded[-1] == "w6" else current
    j._sample_and_judge, j.load_policy = sample, loaded.append
    j._confirm(11)
    assert drawn == [(4, 13, "current"), (4, 13, "w6")] and loaded == ["w6", "w11"]  # the current policy back last
    assert j.guard.fell["fresh"]["drop"] == pytest.approx(0.5) and j.guard.pending is None
    # a second fall from the same peak: the peak's fresh scores are reused (same weights, prompts and seed)
    j.guard.fell, j.weights[16] = None, "w16"
    j.guard.pending = {"iteration": 16, "peak": 6, "statistic": "gain", "drop": 0.5, "se": 0.1, "z": 5.0,
                       "proxy_rise": 0.2, "gained": 0.8}
    drawn.clear()
    j._confirm(16)
    assert drawn == [(4, 13, "w11")] and loaded == ["w6", "w11"]  # only the current policy sampled, nothing loaded


def test_with_beta_0_the_kl_budget_reads_the_judges_own_kl():
    """GRPO/RLOO with beta 0 measure no KL in the rollout (kl/ref is 0): the budget reads the KL of the judge's own
    samples at its measurements (window: one measurement), and a guarded run loads the reference adapter for it."""
    j = guard.Guard(every=5, budget=6.0, z=3.0, rollout_kl=False)
    for it, kl in ((1, 0.0), (6, 5.0), (11, 7.0)):
        j.add({**point(it, 0.1 * it, 0.05, scores=[1.0, 1.0]), "kl": kl})
        for step in range(it, it + 5):
            j.read_kl(step, 0.0)  # what the rollout logs without a reference pass
            assert j.left is None or step >= 11
    assert [p["kl_ref"] for p in j.points] == [0.0, 5.0, 7.0]
    assert j.left == {"iteration": 11, "kl_ref": 7.0, "window": 1, "budget": 6.0, "measured_by": "judge"}
    assert j.should_stop
    (f,) = guard.flags("grpo", None, {}, j.left)
    assert "the KL of the judge's samples was 7.00 at iteration 11 (no KL in the rollout: grpo.beta = 0)" in f
    assert online_sections.guarded(config.load(TINY, ["grpo.beta=0"]), config.load(TINY, ["grpo.beta=0"]).grpo)
    for off in ("grpo.judge_every=0", "data.judge_fraction=0"):
        exp = config.load(TINY, [off])
        assert not online_sections.guarded(exp, exp.grpo)


def test_the_selecting_judge_is_labelled_so_and_the_judge_samples_as_graded():
    """A win rate by the judge that chose the kept policy, or could stop the run, says so; the others keep their role;
    the reward model DPO and KTO are graded by was fit on their training pairs. The judge samples at
    the held-out check's temperature, top_p and response length, with the stage's batch and copy."""
    from rlhf.rl import checks

    exp = config.load(TINY, ["eval.temperature=0.7", "eval.top_p=0.9", "eval.max_new_tokens=7"])
    assert checks.grader_role(exp, "ppo", "judge", "judge") == "selected and graded by the same judge"
    assert checks.grader_role(exp, "ppo", "ground_truth", "judge") == "independent"
    assert checks.grader_role(exp, "grpo", "reward_model", "judge") == "trained against"
    # keep: last with overopt_stop on: the judge's fall test chose where the run ended, so what was saved
    last = config.load(TINY, ["ppo.keep=last"])
    assert checks.grader_role(last, "ppo", "judge") == "selected and graded by the same judge"
    free = config.load(TINY, ["ppo.keep=last", "ppo.overopt_stop=false"])
    assert checks.grader_role(free, "ppo", "judge") == "independent"
    # DPO and KTO train on the pairs the reward model was fit on (KTO: unless kto.path gives its own feedback)
    assert [checks.grader_role(exp, s, "reward_model") for s in ("dpo", "kto")] == ["fit on the same pairs"] * 2
    assert checks.grader_role(config.load(TINY, ["kto.path=feedback.jsonl"]), "kto", "reward_model") == "independent"
    assert checks.grader_role(exp, "dpo", "judge") == checks.grader_role(exp, "dpo", "ground_truth") == "independent"
    stage = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 1.0, "batch_size": 64, "copy_bytes": 5}
    assert overopt.sampling(exp.eval, stage) == {"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "batch_size": 64,
                                            "copy_bytes": 5}


def test_the_headline_win_rate_is_the_tasks_else_the_rms_else_the_users_grader_else_the_judges():
    """A held-out check's eval_win_rate_vs_sft: the task's graders', else the reward model's, else the user's
    independent grader's (a DPO run graded by reward.grader_functions alone reported none), else the judge's."""
    from rlhf.rl import checks

    scored = {"ground_truth": 1, "reward_model": 1, "grader": 1, "judge": 1}
    assert checks.headline("ground_truth", scored) == "ground_truth"
    assert checks.headline(None, scored) == "reward_model"
    assert checks.headline(None, {"grader": 1, "judge": 1}) == "grader"
    assert checks.headline(None, {"judge": 1}) == "judge"
    assert checks.headline(None, {}) is None


def test_a_judge_is_wired_to_its_sampler_threshold_and_kl_source():
    """Judge(...) as the online stages build it: it samples at eval's settings, tests falls at the threshold of the
    run it plans (its prompts, its steps) and reads the KL budget from the rollout unless beta is 0."""
    import types

    exp = config.load(TINY, ["reward.model=0", "reward.functions={rlhf.inputs.data:letters_reward: 1}", "eval.temperature=0.7",
                             "eval.top_p=0.9", "ppo.steps=300", "grpo.beta=0"])
    roles = types.SimpleNamespace(judge_head=object(), device=torch.device("cpu"))
    rm = {"judge": {"reward_stats": {"mean": 1.0, "std": 2.0}}}
    stage = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 1.0, "batch_size": 64, "copy_bytes": 0}
    def settings(section, prompts):
        return overopt.settings(section, exp.reward, exp.eval, exp.data.source, exp.seed, rm, 1, prompts, stage, 64)
    ppo = overopt.Judge(settings(exp.ppo, [{"prompt": "p"}] * 200), roles, None)
    assert ppo.on and ppo.keep and ppo.guard.rollout_kl and len(ppo.rows) == 128 and ppo.judge_std == 2.0
    assert (ppo.gen_kwargs["temperature"], ppo.gen_kwargs["top_p"], ppo.kl_temperature, ppo.score_rows) == (0.7, 0.9, 1.0, 64)
    assert ppo.guard.z == guard.fall_z(61, 0.05, 128)
    grpo = overopt.Judge(settings(exp.grpo, [{"prompt": "p"}] * 64), roles, None)
    assert not grpo.guard.rollout_kl and grpo.guard.z == guard.fall_z(4, 0.05, 64)
    # the playoff's fresh prompts: after the judge's (200 - 128 = 72 of the 256 asked); none left after GRPO's 64
    assert ppo.s.playoff_rows == [{"prompt": "p"}] * 72 and ppo.s.playoff_alpha == 0.05
    assert len(settings(exp.ppo, [{"prompt": "p"}] * 1000).playoff_rows) == 512  # four times judge_prompts
    assert ppo.guard.confirm_alpha == 0.0  # 200 prompts: none left after the playoff's to confirm a fall on
    pool = [{"prompt": str(i)} for i in range(1000)]
    wide = overopt.Judge(settings(exp.ppo, pool), roles, None)  # the judge's 128, the playoff's 512, the other 360
    assert wide.s.rows == pool[:128] and wide.s.playoff_rows == pool[128:640] and wide.s.confirm_rows == pool[640:]
    assert wide.guard.confirm_alpha == 0.05
    assert grpo.s.playoff_rows == [] and grpo.s.playoff_alpha == 0.0


def test_the_judges_independence_from_the_reward_model_by_hand():
    from rlhf.recipes import rm

    rm_m = [1.0, -1.0, -2.0, 0.5, -0.5, 2.0]    # wrong on pairs 2, 3, 5
    judge = [0.5, -1.0, 1.0, -0.2, 2.0, 1.0]    # wrong on 2 (shared) and 4 (its own)
    ind = rm.judge_independence(rm_m, judge)
    assert ind["rm_errors"] == 3 and ind["judge_error_rate"] == pytest.approx(2 / 6)
    assert ind["judge_error_rate_on_rm_errors"] == pytest.approx(1 / 3)
    assert ind["ci95"] == pytest.approx(guard.wilson(1, 3)) and not ind["weak"]
    assert ind["margin_correlation"] == pytest.approx(guard.correlation(rm_m, judge))
    assert not rm.judge_independence(rm_m, [-1.0, -1.0, -1.0, 1.0, -1.0, 1.0])["weak"]  # all 3 shared: n too small
    # 20 RM errors of 40 pairs, the judge wrong on 18 of them: 0.9, Wilson's low end 0.70 > 0.5
    many = rm.judge_independence([-1.0] * 20 + [1.0] * 20, [-1.0] * 18 + [1.0] * 22)
    assert many["judge_error_rate_on_rm_errors"] == pytest.approx(0.9) and many["weak"]
    assert not rm.judge_independence([1.0, 2.0], [1.0, -1.0])["weak"]  # an RM without errors


def test_correlation_by_hand():
    assert guard.correlation([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == pytest.approx(1.0)
    assert guard.correlation([1.0, 2.0, 3.0], [3.0, 1.0, 2.0]) == pytest.approx(-0.5)
    assert guard.correlation([1.0, 2.0], [1.0, 2.0]) is None
    assert guard.correlation([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None


def test_summary_reads_the_judged_iterations_only():
    h = history([0.0, 1.0, 0.5], [0.0, 1.0, 2.0], truth=[0.1, 0.3, 0.2], every=2)
    s = curves.summary(h)
    assert s["overopt_judge_last"] == 0.5 and s["overopt_judge_peak"] == 1.0
    assert s["overopt_judge_peak_iteration"] == 3 and s["overopt_proxy_last"] == 2.0
    assert s["overopt_corr_judge_truth"] == pytest.approx(1.0)
    # proxy 0, 1, 2 against truth .1, .3, .2: r = 0.1 / sqrt(2 x 0.02)
    assert s["overopt_corr_proxy_truth"] == pytest.approx(0.1 / math.sqrt(2 * 0.02))
    assert curves.summary([{"kl/ref": 1.0}]) == {}


def test_plot_draws_only_with_a_judge(tmp_path):
    assert not curves.plot([{"kl/ref": 1.0}], tmp_path / "none.png")
    assert curves.plot(history([0.0, 1.0, 0.5], [0.0, 1.0, 2.0], truth=[0.1, 0.3, 0.2]), tmp_path / "c.png")
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
    exp = config.load(TINY, ["rm.ensemble=3", "reward.ensemble_lambda=0.5", "reward.model=2.0"])
    scorer = roles.Scorer(roles.scoring(exp.reward, exp.data.source, [(0.0, 1.0), (1.0, 2.0), (-1.0, 0.5)]))
    # on the members' scales: row 1 = (1, 1, 1); row 2 = (2, 0, 2): mean 4/3, std over the three sqrt(8/9)
    total, parts = scorer(torch.tensor([[1.0, 3.0, -0.5], [2.0, 1.0, 0.0]]), [{"prompt": "p"}] * 2, ["x", "y"],
                          trajectory.Timer())
    std = math.sqrt(8 / 9)
    assert total.tolist() == pytest.approx([2.0, 2.0 * (4 / 3 - 0.5 * std)])
    assert parts["ensemble_std"] == pytest.approx([0.0, std])
    tiny = config.load(TINY)
    one = roles.Scorer(roles.scoring(tiny.reward, tiny.data.source, [(1.0, 2.0)]))  # K = 1: the member's own score, as before
    assert one(torch.tensor([[3.0]]), [{"prompt": "p"}], ["x"], trajectory.Timer())[0].tolist() == [1.0]


def test_a_mean_of_batch_rates_gets_the_interval_of_its_effective_n():
    """TRL's DPO eval accuracy is the mean of its batches' accuracies, the last batch smaller: 200 rows in batches of
    32 are 6 x 32 + 8, n_eff = 7^2 / (6/32 + 1/8) = 156.8 (by hand), not 200; 64 in batches of 32: 64. Simulated,
    the mean's spread is that of a rate of n_eff rows."""
    assert guard.batch_mean_wilson(0.8, 200, 32) == pytest.approx(guard.wilson(0.8 * 156.8, 156.8))
    assert guard.batch_mean_wilson(0.8125, 64, 32) == pytest.approx(guard.wilson(52, 64))
    assert guard.batch_mean_wilson(0.5, 10, 32) == pytest.approx(guard.wilson(5, 10))  # one batch, all the rows
    # 2 ranks, 200 rows in global batches of 16: 13 x 16 = 208 positions, rows 0-7 twice (weight 2/208 each):
    # n_eff = 208^2 / (192 + 8 x 4) = 193.1; batches of 32: 224 positions, rows 0-23 twice: 224^2 / (176 + 96) = 184.5
    assert guard.batch_mean_wilson(0.8, 200, 16, 2) == pytest.approx(guard.wilson(0.8 * 208**2 / 224, 208**2 / 224))
    assert guard.batch_mean_wilson(0.8, 200, 32, 2) == pytest.approx(guard.wilson(0.8 * 224**2 / 272, 224**2 / 272))
    assert guard.batch_mean_wilson(0.8, 192, 32, 2) == pytest.approx(guard.wilson(0.8 * 192, 192))  # none repeated
    g = torch.Generator().manual_seed(0)
    rows = (torch.rand(20_000, 200, generator=g) < 0.8).float()
    means = torch.stack([rows[:, i:i + 32].mean(1) for i in range(0, 200, 32)], 1).mean(1)
    assert means.std().item() == pytest.approx(math.sqrt(0.8 * 0.2 / 156.8), rel=0.03)
    assert means.std().item() > 1.1 * math.sqrt(0.8 * 0.2 / 200)  # a rate of 200 rows reads 11% too narrow


def test_the_calibrations_wilson_interval_by_hand():
    """studies/harness.py's rate interval (flag_calibration's tables): Wilson's, by hand; and the detection rate's
    denominator."""
    import importlib.util

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("flag_calibration", ROOT / "studies" / "flag_calibration.py")
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    # 1 of 10: p = 0.1, z^2 = 3.8415; centre (0.1 + 0.19207) / 1.38415, half 1.96 sqrt(0.009 + 0.009604) / 1.38415
    z2 = 1.959964**2
    centre, half = (0.1 + z2 / 20) / (1 + z2 / 10), 1.959964 * math.sqrt(0.009 + z2 / 400) / (1 + z2 / 10)
    assert cal.rate_interval(1, 10) == pytest.approx([centre - half, centre + half], abs=1e-4)
    assert cal.rate_interval(0, 1) == pytest.approx([0.0, 0.7935], abs=1e-4)
    assert cal.rate_interval(10, 10)[1] == pytest.approx(1.0) and cal.rate_interval(0, 0) == [0.0, 1.0]
    # detection counts the seeds whose unguarded run lost: seed 2 won unguarded, so its missed flag is not a miss
    run = {"scenario": "weak-rm", "truth_ci95": [0.4, 0.6], "stopped_early": None}
    guarded = [{**run, "seed": 1, "flags": ["x"], "truth_win": 0.5}, {**run, "seed": 2, "flags": [], "truth_win": 0.6},
               {**run, "seed": 3, "flags": [], "truth_win": 0.5}]
    plain = [{**run, "seed": s, "truth_win": w} for s, w in ((1, 0.2), (2, 0.55), (3, 0.3))]
    row = cal.summarize("weak-rm", guarded, plain)
    assert (row["flagged"], row["plain_lost"], row["detected"]) == (1, 2, 1)
    assert row["detected_ci95"] == cal.rate_interval(1, 2)
    assert "detection rate (runs that lose to SFT unguarded): 1/2 = 0.50" in cal.markdown([row], 3)


def test_the_calibration_merges_records_a_later_run_replacing_an_earlier(tmp_path):
    """--merge with no new seeds: the table of earlier records' runs, a later file's run of the same scenario, seed
    and guard replacing the earlier file's (seed 2 was rerun after a change and is no longer flagged); the record
    names the merged ones and keeps only its own runs."""
    import importlib.util
    import json

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("flag_calibration", ROOT / "studies" / "flag_calibration.py")
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    run = {"scenario": "healthy", "plain": False, "truth_win": 0.7, "truth_ci95": [0.6, 0.8], "stopped_early": None}
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps({"runs": [{**run, "seed": 1, "flags": []}, {**run, "seed": 2, "flags": ["fell"]}]}))
    new.write_text(json.dumps({"runs": [{**run, "seed": 2, "flags": []}, {**run, "seed": 3, "flags": []}]}))
    assert cal.main(["--seeds", "0", "--scenarios", "healthy", "--merge", str(old), str(new),
                     "--out", str(tmp_path / "out")]) == 0
    (rec,) = (tmp_path / "out").glob("*-flag.json")
    record = json.loads(rec.read_text())
    (row,) = record["rows"]
    assert (row["n"], row["flagged"]) == (3, 0)
    # the record names the records it merged and keeps only its own runs (none here); merging it reads theirs
    assert record["merged"] == [str(old), str(new)] and record["runs"] == []
    assert [(r["seed"], r["flags"]) for r in cal.record_runs(rec)] == [(1, []), (2, ["fell"]), (2, []), (3, [])]


def test_a_users_judge_is_measured_on_the_rms_held_out_pairs_by_hand():
    """rm.own_judge_check: the user's judge functions score each held-out pair's chosen and rejected response (with
    the response's token ids and EOS, as the stages pass them); its accuracy counts a tie as an error, and the
    shared errors are those on the pairs the RM got wrong (judge_independence)."""
    from rlhf.inputs import models
    from rlhf.recipes import rm

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
    assert ind["ci95"] == pytest.approx(list(guard.wilson(1, 2))) and not ind["weak"]


def test_the_kl_studys_table_averages_seeds_with_their_standard_error():
    """studies/overopt_kl.py's summary: per RM and setting, means over seeds and the ground truth's standard error
    over seeds by hand (sd / sqrt(n)); one seed keeps its own interval."""
    import importlib.util

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("overopt_kl", ROOT / "studies" / "overopt_kl.py")
    kl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kl)
    row = {"rm_pairs": 150, "rm_accuracy": 0.8, "setting": "beta 0.05", "eval_kl_ref": 3.0, "rm_win": 0.9,
           "judge_win": 0.7, "truth_ci95": [0.4, 0.6]}
    rows = [{**row, "truth_win": w, "eval_kl_ref": k} for w, k in ((0.4, 2.0), (0.6, 4.0), (0.5, 3.0))]
    table = kl.summarize(rows + [{**row, "setting": "beta 0.2", "truth_win": 0.55}])
    se = math.sqrt(((0.1**2) * 2) / 2 / 3)  # sd 0.1 over three seeds
    assert f"| 150 (0.80) | beta 0.05 | 3 | 3.0 | 0.90 | 0.70 | 0.50 ± {se:.2f} (0.40, 0.60, 0.50) |" in table
    assert "| 150 (0.80) | beta 0.2 | 1 | 3.0 | 0.90 | 0.70 | 0.55 [0.40, 0.60] |" in table



def load_script(name: str):
    import importlib.util

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location(name, ROOT / "studies" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trace_of_three():
    """A recorded run of 10 iterations judged every 5: SFT (1), iteration 6 (the judge's best) and the final policy
    (11, after the last update), each graded on four held-out prompts by the ground truth."""
    base = {"proxy": 0.0, "gain_se": 0.05, "win": 0.5, "win_ci95": [0.4, 0.6], "kl": None,
            "judge_heldout": [0.0] * 4, "judge_fresh": [0.0] * 4}
    return {"stage": "ppo", "steps": 10, "every": 5, "z": 3.0, "budget": 6.0, "kl_ref": [0.0] + [1.0] * 9,
            "points": [{**base, "iteration": 1, "gain": 0.0, "gain_se": 0.0, "kl_ref": 0.0, "scores": [0.0] * 4,
                        "truth_heldout": [0.0] * 4},
                       {**base, "iteration": 6, "gain": 0.5, "kl_ref": 1.0, "scores": [0.5, 0.75, 0.25, 0.5],
                        "truth_heldout": [1.0, 0.0, 1.0, 0.0], "judge_heldout": [1.0] * 4,
                        "judge_fresh": [0.2] * 4},
                       {**base, "iteration": 11, "gain": 0.46, "kl_ref": 1.2, "final": True,
                        "scores": [0.4, 0.75, 0.25, 0.45], "truth_heldout": [1.0, 1.0, 1.0, 0.0],
                        "judge_heldout": [1.0] * 4, "judge_fresh": [0.3] * 4}]}


def test_the_guard_study_replays_the_shipped_judge_and_grades_every_rule_by_hand():
    """studies/guard_study.py: a recorded run replayed through rlhf/maths/guard.py's Guard (no fall: 11's drops below 6,
    0.1, 0, 0, 0.05, are 0.0375 with a standard error of 0.024, 1.6 of them, under z = 3), and each rule's kept policy graded by the held-out ground truth: the
    shipped rule keeps the last (11: 3 wins and a tie in 4, 0.875), the one-SE rule 6 (the earliest within 0.5 -
    0.05; 2 wins, 2 ties: 0.75), 0.125 below the last, not significantly (differences 0, -1, 0, 0: se 0.25); measured
    again on fresh prompts, 11 is the better of the two."""
    study = load_script("guard_study")
    trace = trace_of_three()
    j = study.replay(trace)
    assert [p["iteration"] for p in j.points] == [1, 6, 11] and j.fell is None and j.stopped is None
    out = study.analyze_run(trace)
    assert out["last_truth_win"] == 0.875 and out["best_truth_win"] == 0.875
    assert all(not f["flagged"] and f["stopped"] is None for f in out["falls"].values())
    rules = out["rules"]
    assert rules["shipped"]["iteration"] == 11 and rules["shipped"]["minus_last"] == 0.0
    assert rules["one-SE (before)"] == {"iteration": 6, "truth_win": 0.75, "minus_last": -0.125, "below_last": False,
                                        "below_best": False, "below_sft": False, "flag_heldout": False}
    assert rules["best measured"]["iteration"] == 6 and rules["re-measured"]["iteration"] == 11  # fresh: 0.3 > 0.2
    # a fall at the final measurement (drops 0.5, 0.65, 0.35, 0.3: mean 0.45, se 0.078, 5.8 standard errors): the
    # run fell, so the shipped rule keeps the one-SE choice, 6
    trace["points"][2]["scores"] = [0.0, 0.1, -0.1, 0.2]
    assert study.replay(trace).fell["iteration"] == 11 and study.replay(trace, z=6.0).fell is None
    assert study.analyze_run(trace)["rules"]["shipped"]["iteration"] == 6


def test_the_studies_report_what_the_guard_kept_against_what_it_discarded(tmp_path):
    """flag_calibration.summarize: the traced runs' saved, last and best-measured ground truth and how many saved a
    policy significantly below their last one, with Wilson's interval; guard_variants.means: the saved-minus-last
    differences' mean and standard error over seeds, by hand."""
    cal, variants = load_script("flag_calibration"), load_script("guard_variants")
    run = {"scenario": "healthy", "truth_ci95": [0.6, 0.8], "stopped_early": None, "steps": 300, "measurements": 61,
           "flags": [], "last_truth_win": 0.8, "best_truth_win": 0.85, "saved_below_best": False}
    # measured: iteration, KL, judge gain, truth win; run 1 saved iteration 6 (truth 0.7) of a peak at 11 (the
    # judge's best, truth 0.9) and a last at 16 (0.5); run 2 saved its last (0.8), the judge's best at 6 (0.6)
    runs = [{**run, "seed": 1, "truth_win": 0.7, "saved_below_last": True, "kept": 6,
             "measured": [[1, 0, 0, 0.5], [6, 1, 0.2, 0.7], [11, 2, 0.4, 0.9], [16, 3, 0.3, 0.5]],
             "halves": [[0.5, 0.5], [0.8, 0.6], [0.7, 1.0], [0.5, 0.5]]},
            {**run, "seed": 2, "truth_win": 0.8, "saved_below_last": False, "flags": ["fell"], "kept": 11,
             "stopped_early": {"compute_saved": 0.5, "iteration": 16}, "best_iteration": 11,
             "measured": [[1, 0, 0, 0.5], [6, 1, 0.5, 0.6], [11, 2, 0.3, 0.8]],
             "halves": [[0.5, 0.5], [0.7, 0.5], [0.8, 0.8]]}]
    row = cal.summarize("healthy", runs, [])
    # saved - last: 0.2, 0; saved - the judge's best: -0.2, 0.2; saved - the truth's best: -0.2, 0
    against = row["against"]
    assert against["last"]["mean"] == pytest.approx(0.1) and against["last"]["se"] == pytest.approx(0.1)
    assert against["best by the judge"]["mean"] == pytest.approx(0.0)
    assert against["best by the judge"]["se"] == pytest.approx(0.2)
    assert against["best by the truth"]["mean"] == pytest.approx(-0.1)
    # held out: run 1 picks iteration 6 on the even half (0.8; graded on the odd: 0.6 - 0.6) and 11 on the odd (1.0;
    # on the even: 0.8 - 0.7), 0.05; run 2 picks its saved 11 on both halves, 0: mean 0.025, se 0.025
    assert against["best by the truth, held out"]["mean"] == pytest.approx(0.025)
    assert against["best by the truth, held out"]["se"] == pytest.approx(0.025)
    # halves: against SFT's 0s, per prompt 1, 0, 1, -1: the even prompts win twice, the odd tie and lose
    assert cal.halves([{"truth_heldout": [0, 0, 0, 0]}, {"truth_heldout": [1, 0, 1, -1]}]) == [[0.5, 0.5], [1.0, 0.25]]
    assert against["last"]["ci95"] == pytest.approx([0.1 - 12.71 * 0.1, 0.1 + 12.71 * 0.1], abs=1e-4)
    assert (row["traced"], row["flagged_or_stopped"], row["saved_below_last"]) == (2, 1, 1)
    assert row["truth_win_mean"] == 0.75 and row["last_truth_win_mean"] == 0.8 and row["best_truth_win_mean"] == 0.85
    assert row["saved_below_last_ci95"] == row["flagged_or_stopped_ci95"] == cal.rate_interval(1, 2)
    md = cal.markdown([{**row, "steps": 300}], 2)
    assert "| healthy | 300 | 61 | 2 | 1/2 [0.09, 0.91] | 0.750 / 0.800 / 0.850 | 1/2 [0.09, 0.91] | 0/2 |" in md
    assert "| healthy | 2 | +0.100 +- 0.100 [-1.171, +1.371] | +0.000 +- 0.200" in md
    assert "| +0.025 +- 0.025 [-0.293, +0.343] |\n" in md  # 12.71 x 0.025
    # a record without its halves (its trace gone) is left out of that column alone, which then says its n
    unhalved = [runs[0], {k: v for k, v in runs[1].items() if k != "halves"}]
    fewer = cal.markdown([{**cal.summarize("healthy", unhalved, []), "steps": 300}], 2)
    assert "| +0.050 +- 0.000 [+0.050, +0.050] (n 1) |\n" in fewer
    # run 2 stopped at 16, 5 iterations after its best by the truth (11)
    assert row["stop_delay"] == {"median": 5, "min": 5, "max": 5, "n": 1}
    assert "healthy: the 1 early stop(s) came a median 5 iterations after the best measured policy by the truth" in md
    # the playoff's margin replayed on the recorded playoff: run 1's guard chose 6 (measured gain 0.2) against 11,
    # paired gain 0.05, se 0.02 on 512 prompts: t 2.5 > 1.648 switches at margin 0; at 0.1 (0.02 to beat) t 1.5 does
    # not, and at 0.25 neither (t 0); run 2 had no playoff and keeps its 11
    po = {"incumbent": 6, "challenger": 11, "gain": 0.05, "se": 0.02, "prompts": 512, "alpha": 0.05,
          "incumbent_gain": 0.2}
    trace = tmp_path / "guard_trace.json"  # per-prompt truth of run 1's policies: 11 beats the last, 1 loses to it
    trace.write_text(json.dumps({"points": [{"iteration": i, "truth_heldout": t} for i, t in
                                            ((1, [0, 0, 0, 0]), (6, [1, 0, 1, 0]), (11, [1, 1, 1, 1]),
                                             (16, [1, 0, 1, 1]))]}))
    played = [{**runs[0], "playoff": po, "trace": str(trace)}, runs[1]]
    assert not cal.below_last({"kept": 11}, played[0]) and cal.below_last({"kept": 1}, played[0])
    assert cal.below_last({"kept": 6}, played[0])  # its own kept policy: the record's answer (saved_below_last)
    # a record made now keeps the playoff's two answers, so a replay needs no trace; one with neither stops in a line
    pts = json.loads(trace.read_text())["points"]
    assert cal.playoff_below_last(po, pts) == {"6": False, "11": False}  # 6's 2 of 4 against 3 of 4: not significant
    assert cal.playoff_below_last({**po, "incumbent": 1}, pts) == {"1": True, "11": False}
    assert cal.playoff_below_last(None, pts) == {}
    kept_in_record = {**played[0], "trace": str(tmp_path / "gone.json"), "below_last_at": {"1": True, "11": False}}
    assert not cal.below_last({"kept": 11}, kept_in_record) and cal.below_last({"kept": 1}, kept_in_record)
    with pytest.raises(SystemExit, match="healthy seed 1's record predates below_last_at and its trace .*gone.json"):
        cal.below_last({"kept": 11}, {**played[0], "trace": str(tmp_path / "gone.json")})
    assert [cal.replayed(played[0], m) for m in (0.0, 0.1, 0.25)] == [11, 6, 6] and cal.replayed(runs[1], 0.5) == 11
    assert cal.replayed({**played[0], "playoff": {**po, "incumbent_gain": -0.3}}, 0.5) == 11  # no gain: no margin
    rp = cal.replay(played, [0.0, 0.1])
    assert rp["0"]["switched"] == 1 and rp["0.1"]["switched"] == 0 and rp["0"]["playoffs"] == 1
    # at margin 0 run 1 saves 11 (truth 0.9; its last 0.5): saved - last 0.4 and 0 over the two runs
    assert rp["0"]["against"]["last"]["mean"] == pytest.approx(0.2) and rp["0.1"]["against"]["last"]["mean"] == \
        pytest.approx(0.1)
    assert rp["0"]["below_last"] == 0 and rp["0.1"]["below_last"] == 1  # run 1 kept 6, below its last
    assert "| healthy | 0 | 1/1 | 0 | +0.200 +- 0.200" in cal.markdown([{**row, "steps": 300, "replay": rp}], 2)
    # a confirmed fall replayed at other fall margins: fresh drop 0.1, se 0.02, the peak's gain 0.5, threshold 1.648:
    # t 5 at margin 0; 0.1 x 0.5 = 0.05 to exceed: t 2.5 counts; 0.2: 0.1 to exceed, t 0 does not
    f = {"drop": 0.1, "se": 0.02, "threshold": 1.648, "gained": 0.5, "prompts": 512}
    assert [cal.reconfirmed(f, m) for m in (0.0, 0.1, 0.2)] == [True, True, False]
    assert cal.reconfirmed({**f, "gained": -0.2}, 0.9)  # a peak no better than SFT: no margin
    # the same drop on every prompt (se 0): it counts above the margin and not below it, as guard.confirm has it
    assert cal.reconfirmed({**f, "se": 0.0}, 0.1) and not cal.reconfirmed({**f, "se": 0.0}, 0.3)
    fell = cal.refalls([{**runs[0], "fall": f}, {**runs[1], "fall": None}], [0.1, 0.2])
    assert fell == {"0.1": {"kept": [1], "let_go": []}, "0.2": {"kept": [], "let_go": [1]}}
    assert "| healthy | 0.2 | 0: - | 1: 1 |" in cal.markdown([{**row, "steps": 300, "refalls": fell}], 2)
    summary = {"judge_fell": {"iteration": 16, "peak": 11, "statistic": "gain", "gained": 0.5,
                              "fresh": {**f, "t": 5.0, "margin": 0.0}}}
    assert cal.fall_of(summary, []) == {"iteration": 16, "peak": 11, "statistic": "gain", "margin": 0.0, "t": 5.0, **f}
    older = {"judge_fell": {**summary["judge_fell"], "gained": None}}  # before the margin: the peak's gain
    del older["judge_fell"]["gained"]
    assert cal.fall_of(older, [{"iteration": 11, "gain": 0.4}])["gained"] == 0.4
    assert cal.fall_of({"judge_fell": {"fresh": {"skipped": "no playoff"}}}, []) is None and cal.fall_of({}, []) is None
    r = {"variant": "bpe", "stage": "ppo", "last_iteration": 129}
    rows = [{**r, "truth_win": 0.70, "last_truth_win": 0.72, "kept_minus_last": -0.01, "kept": 41},
            {**r, "truth_win": 0.80, "last_truth_win": 0.76, "kept_minus_last": 0.03, "kept": 129},
            {**r, "truth_win": 0.75, "last_truth_win": 0.75, "kept_minus_last": 0.0, "kept": 129}]
    (m,) = variants.means(rows)
    # win differences -0.02, 0.04, 0: mean 0.00667, sd sqrt((0.02667^2 + 0.03333^2 + 0.00667^2) / 2)
    sd = math.sqrt(((-0.02 - 0.02 / 3) ** 2 + (0.04 - 0.02 / 3) ** 2 + (0.02 / 3) ** 2) / 2)
    assert m["win_minus_last"] == pytest.approx(0.02 / 3) and m["win_minus_last_se"] == pytest.approx(sd / math.sqrt(3))
    assert m["score_minus_last"] == pytest.approx(0.02 / 3) and m["kept_last"] == 2 and m["seeds"] == 3


def test_a_win_rate_whose_prompts_all_had_one_outcome_has_the_interval_its_n_gives_not_an_empty_one():
    """50 ties (a policy that answers as SFT does), 50 wins, 50 losses: the normal interval has no spread to measure
    ([v, v]); at most Wilson's upper end at 0 of 50 of the prompts, u = (z^2/n) / (1 + z^2/n) = 0.071348, would have
    had another outcome, each moving the mean to the far end at most. With a spread the normal interval is kept."""
    z2 = 1.959964 ** 2
    u = (z2 / 50) / (1 + z2 / 50)
    assert u == pytest.approx(0.071348, abs=1e-6)
    for ours, v, low, high in (([1.0] * 50, 0.5, 0.5 - u / 2, 0.5 + u / 2), ([2.0] * 50, 1.0, 1 - u, 1.0),
                               ([0.0] * 50, 0.0, 0.0, u)):
        w = checks.win_rate(ours, [1.0] * 50)
        assert w["win_rate"] == v and w["n"] == 50
        assert (w["ci_low"], w["ci_high"]) == pytest.approx((low, high), abs=1e-12)
    # one win, two ties, one loss: outcomes 1, .5, 0, .5, mean .5, sample sd sqrt(1/6), z sd / 2
    w = checks.win_rate([2.0, 1.0, 0.0, 1.0], [1.0] * 4)
    half = 1.959964 * math.sqrt(0.5 / 3) / 2
    assert (w["ci_low"], w["ci_high"]) == pytest.approx((0.5 - half, 0.5 + half)) and (w["wins"], w["ties"]) == (1, 2)


def test_a_reward_model_is_said_not_better_than_chance_while_wilsons_interval_reaches_half():
    """Wilson's 95% interval of the held-out pair accuracy: 44 of 100 is [0.3467, 0.5377] (said, with its figures); 59
    of 100, [0.492, 0.681] (said); 60 of 100, [0.502, 0.691], and 120 of 200, [0.531, 0.665] (not said)."""
    assert guard.wilson(44, 100) == pytest.approx([0.3467, 0.5377], abs=1e-4)
    assert guard.chance_rm("rm", 0.44, 100) == (
        "rm: the reward model ranks 44% [35%, 54%] of its 100 held-out pairs: not shown better than chance, so a stage "
        "trained against it follows noise (more pairs or epochs, or another rm.learning_rate, would help it learn)")
    assert guard.wilson(59, 100)[0] == pytest.approx(0.4920, abs=1e-4) and guard.chance_rm("ppo", 0.59, 100)
    assert guard.wilson(60, 100)[0] == pytest.approx(0.5020, abs=1e-4) and guard.chance_rm("ppo", 0.6, 100) is None
    assert guard.wilson(40, 100)[1] == pytest.approx(0.4980, abs=1e-4) and guard.chance_rm("rm", 0.4, 100) == (
        "rm: the reward model ranks 40% [30.9%, 49.8%] of its 100 held-out pairs: worse than chance, so a stage trained "
        "against it learns the opposite of the pairs' preference: check that chosen and rejected are not swapped in "
        "the data (or data.columns)")
    assert "not shown better than chance" in guard.chance_rm("rm", 0.41, 100)  # [32%, 51%]: reaches 50%
    assert guard.rm_at_chance("ppo", {"metrics": {"eval_accuracy": 0.6}, "data": {"eval": 200}}) is None
