import math

import pytest
import torch

from rlhf import generation, losses


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_bradley_terry_by_hand():
    rc, rr = torch.tensor([2.0, 0.5]), torch.tensor([1.0, 1.5])
    want = -(math.log(sig(1.0)) + math.log(sig(-1.0))) / 2
    assert losses.bradley_terry(rc, rr).item() == pytest.approx(want, rel=1e-6)
    margin = torch.tensor([0.5, 0.0])
    want_m = -(math.log(sig(0.5)) + math.log(sig(-1.0))) / 2
    assert losses.bradley_terry(rc, rr, margin).item() == pytest.approx(want_m, rel=1e-6)
    want_c = want + 0.1 * ((3.0**2 + 2.0**2) / 2)
    assert losses.bradley_terry(rc, rr, center_coef=0.1).item() == pytest.approx(want_c, rel=1e-6)


def test_dpo_sigmoid_by_hand():
    beta = 0.1
    loss, rc, rr = losses.dpo_sigmoid(torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([-11.0]),
                                      torch.tensor([-11.0]), beta)
    # chosen log-ratio +1, rejected -1 -> beta * 2 = 0.2
    assert loss.item() == pytest.approx(-math.log(sig(0.2)), rel=1e-6)
    assert rc.item() == pytest.approx(0.1) and rr.item() == pytest.approx(-0.1)
    same, _, _ = losses.dpo_sigmoid(*(torch.tensor([-3.0]),) * 4, beta)
    assert same.item() == pytest.approx(math.log(2))


def test_gae_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.2, 0.4]])
    m = torch.ones(1, 3)
    g, lam = 0.9, 0.8
    d2 = 1.0 - 0.4
    d1 = 0.0 + g * 0.4 - 0.2
    d0 = 0.0 + g * 0.2 - 0.5
    a2 = d2
    a1 = d1 + g * lam * a2
    a0 = d0 + g * lam * a1
    adv, ret = losses.gae(r, v, m, g, lam)
    assert adv[0].tolist() == pytest.approx([a0, a1, a2], rel=1e-6)
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.2, a2 + 0.4], rel=1e-6)


def test_gae_ignores_padding_after_the_response():
    r = torch.tensor([[0.0, 1.0, 9.0]])
    v = torch.tensor([[0.5, 0.2, 7.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    adv, _ = losses.gae(r, v, m, 1.0, 1.0)
    short, _ = losses.gae(r[:, :2], v[:, :2], m[:, :2], 1.0, 1.0)
    assert adv[0, :2].tolist() == pytest.approx(short[0].tolist()) and adv[0, 2] == 0


def test_kl_penalty_placement():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -2.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards, kl = losses.kl_penalized_rewards(torch.tensor([2.0, 3.0]), logp, ref, mask, beta=0.1)
    assert kl.flatten().tolist() == pytest.approx([0.5, 0.0, -1.0, 0.0, 1.0, 0.0])
    # -beta*kl on every response token, the score on the last real one, nothing on padding
    assert rewards.flatten().tolist() == pytest.approx([-0.05, 0.0, 0.1 + 2.0, 0.0, -0.1 + 3.0, 0.0])


def test_clipped_policy_loss_by_hand():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    m = torch.ones(1, 3)
    loss, st = losses.policy_loss(new, old, adv, m, clip=0.2)
    # token 0: A>0, ratio 1.5 clipped to 1.2 -> -1.2 ; token 1: A<0, ratio 0.5 clipped to 0.8 -> max(0.5, 0.8)=0.8
    # token 2: ratio 1.1 inside -> -2.2
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2) / 3, rel=1e-6)
    assert st["clipfrac"] == pytest.approx(2 / 3)


def test_clipped_value_loss_by_hand():
    v, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 0.5]])
    loss, _ = losses.value_loss(v, old, ret, torch.ones(1, 2), clip=0.2)
    # token 0: unclipped (1-2)^2=1, clipped (0.2-2)^2=3.24 -> 3.24; token 1: (0-0.5)^2 both = 0.25
    assert loss.item() == pytest.approx(0.5 * (3.24 + 0.25) / 2, rel=1e-6)


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = losses.masked_whiten(x, m)
    assert losses.masked_mean(w, m).item() == pytest.approx(0.0, abs=1e-6) and w[0, 3] == 0


def test_response_mask_after_eos():
    eos = 2
    resp = torch.tensor([[5, 6, 2, 0, 0], [5, 5, 5, 5, 5], [2, 0, 0, 0, 0]])
    assert generation.response_mask(resp, eos).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


# ------------------------------------------------------------------------------------------------------ GRPO, RLOO
def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0])  # two groups of 3
    sd1 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased std of [1, 0, 0]
    sd2 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # [3, 2, 2]: the same spread
    grpo = losses.group_advantages(r, 3, "mean", scale=True)
    want = [2 / 3 / (sd1 + 1e-4), -1 / 3 / (sd1 + 1e-4), -1 / 3 / (sd1 + 1e-4),
            2 / 3 / (sd2 + 1e-4), -1 / 3 / (sd2 + 1e-4), -1 / 3 / (sd2 + 1e-4)]
    assert grpo.tolist() == pytest.approx(want, rel=1e-5)
    dr = losses.group_advantages(r, 3, "mean", scale=False)  # Dr. GRPO: centred only
    assert dr.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 2 / 3, -1 / 3, -1 / 3], rel=1e-6)
    loo = losses.group_advantages(r, 3, "loo", scale=False)  # r_i - mean of the other two
    assert loo.tolist() == pytest.approx([1.0, -0.5, -0.5, 1.0, -0.5, -0.5], rel=1e-6)
    # RLOO's advantage is GRPO's centred one times G / (G - 1)
    assert loo.tolist() == pytest.approx((dr * 3 / 2).tolist(), rel=1e-6)
    same = losses.group_advantages(torch.tensor([0.5, 0.5, 0.5, 0.5]), 2, "mean", scale=True)
    assert same.tolist() == [0.0] * 4  # no variance in a group: no signal, and no division by zero


def test_k3_kl_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    d = -0.5
    assert losses.k3_kl(logp, ref).tolist() == pytest.approx([math.exp(d) - d - 1, 0.0], abs=1e-7)
    assert (losses.k3_kl(torch.randn(50), torch.randn(50)) >= 0).all()


def test_group_policy_loss_by_hand():
    """Two responses (lengths 2 and 1), advantages +1 and -1, clip 0.2, beta 0.1."""
    logp = torch.tensor([[-1.0, -0.5], [-2.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0], [-2.3, 0.0]])
    ref = torch.tensor([[-1.2, -0.5], [-2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    r = [[1.0, math.exp(0.5)], [math.exp(0.3)]]
    # -min(r A, clip(r) A): row 0 (A=+1): -1, -min(1.6487, 1.2) = -1.2 (clipped); row 1 (A=-1): -min(-1.35, -1.2) = 1.35
    pg = [[-1.0, -1.2], [r[1][0]]]
    kl = [[math.exp(-0.2) + 0.2 - 1, 0.0], [0.0]]
    tok = [[pg[0][0] + 0.1 * kl[0][0], pg[0][1] + 0.1 * kl[0][1]], [pg[1][0] + 0.1 * kl[1][0]]]
    seq = (sum(tok[0]) / 2 + tok[1][0]) / 2
    loss, stats = losses.group_policy_loss(logp, old, adv, mask, 0.2, ref, 0.1, "sequence", 2.0)
    assert loss.item() == pytest.approx(seq, rel=1e-5)
    loss, _ = losses.group_policy_loss(logp, old, adv, mask, 0.2, ref, 0.1, "token", 3.0)
    assert loss.item() == pytest.approx((sum(tok[0]) + tok[1][0]) / 3, rel=1e-5)
    # clipped where it binds: row 0's second token (A > 0, ratio > 1.2); row 1's (A < 0, ratio > 1.2) keeps its gradient
    assert stats["clipfrac"] == pytest.approx(1 / 3)
    assert stats["kl_ref_token"] == pytest.approx(kl[0][0] / 3, rel=1e-5)
    no_ref, _ = losses.group_policy_loss(logp, old, adv, mask, 0.2, None, 0.0, "sequence", 2.0)
    assert no_ref.item() == pytest.approx((sum(pg[0]) / 2 + pg[1][0]) / 2, rel=1e-5)


@pytest.mark.parametrize("norm", ["sequence", "token"])
def test_group_policy_loss_gradient_does_not_depend_on_the_micro_batch_split(norm):
    torch.manual_seed(0)
    logp = torch.randn(8, 5, requires_grad=True)
    old, ref, adv = logp.detach() + 0.1 * torch.randn(8, 5), torch.randn(8, 5), torch.randn(8)
    mask = (torch.rand(8, 5) > 0.3).float()
    mask[:, 0] = 1
    denom = 8.0 if norm == "sequence" else float(mask.sum())
    whole, _ = losses.group_policy_loss(logp, old, adv, mask, 0.2, ref, 0.05, norm, denom)
    (g_whole,) = torch.autograd.grad(whole, logp)
    parts = sum(losses.group_policy_loss(logp[i:i + 3], old[i:i + 3], adv[i:i + 3], mask[i:i + 3], 0.2, ref[i:i + 3],
                                         0.05, norm, denom)[0] for i in range(0, 8, 3))
    (g_parts,) = torch.autograd.grad(parts, logp)
    torch.testing.assert_close(g_parts, g_whole)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
