"""Reward over-optimization: the flag's two rules, the curves' summary and correlations (rlhf/overopt.py) by hand;
the RM stage's judge and ensemble and the online stages' use of them are trained in tests/test_overopt_pipeline.py."""

import math

import pytest

from rlhf import config, data, online, overopt, roles

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


def test_a_gain_the_judge_does_not_confirm_is_flagged():
    # proxy +2.0 since the first measurement, judge +0.6: 0.3 of it confirmed (iteration 1 to iteration 11)
    h = history([0.0, 0.5, 1.0, 0.3, 0.1, 0.6], [0.0, 0.5, 1.0, 1.5, 2.0, 2.0], every=2)
    flags = overopt.flags("ppo", h, {}, confirm=0.5)
    assert len(flags) == 1 and "iteration 1 " in flags[0] and "by 2.00" in flags[0] and "only 0.60" in flags[0]
    assert overopt.flags("ppo", h, {}, confirm=0.3) == []  # 0.6 >= 0.3 x 2.0
    # a proxy that lost its gain needs no confirming; one measurement has no gain
    assert overopt.flags("ppo", history([0.0, -1.0], [0.0, -0.5]), {}, 0.5) == []
    assert overopt.flags("ppo", history([0.0], [3.0]), {}, 0.5) == []


def test_confirmed_by_hand():
    first = {"judge": 0.2, "proxy": 0.5}
    assert overopt.confirmed(first, {"judge": 0.7, "proxy": 1.5}, 0.5)       # 0.5 >= 0.5 x 1.0
    assert not overopt.confirmed(first, {"judge": 0.6, "proxy": 1.5}, 0.5)   # 0.4 < 0.5
    assert overopt.confirmed(first, {"judge": -1.0, "proxy": 0.0}, 0.5)      # the proxy fell: nothing to confirm
    assert overopt.confirmed(first, first, 0.5)


def test_heldout_disagreement_is_flagged():
    wins = lambda j, p: {"eval_win_rates": {"judge": {"win_rate": j}, "reward_model": {"win_rate": p}}}  # noqa: E731
    assert len(overopt.flags("grpo", [], wins(0.4, 0.8), 0.25)) == 1
    assert overopt.flags("grpo", [], wins(0.6, 0.8), 0.25) == []
    assert overopt.flags("grpo", [], wins(0.4, 0.45), 0.25) == []
    assert overopt.flags("grpo", [], {"eval_win_rates": {"reward_model": {"win_rate": 0.9}}}, 0.25) == []


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
                          online.Timer())
    std = math.sqrt(8 / 9)
    assert total.tolist() == pytest.approx([2.0, 2.0 * (4 / 3 - 0.5 * std)])
    assert parts["ensemble_std"] == pytest.approx([0.0, std])
    one = roles.Scorer(config.load(TINY), None, [(1.0, 2.0)])  # K = 1: the member's own score, as before
    assert one(torch.tensor([[3.0]]), [{"prompt": "p"}], ["x"], online.Timer())[0].tolist() == [1.0]
