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
