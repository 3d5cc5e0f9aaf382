import math

import pytest
import torch

from rlhf.rl import generation
from rlhf.maths import losses


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
    # mean 2, biased variance 2/3: (x - 2) / sqrt(2/3); without the shift the mean comes back: x/sd - 2/sd + 2
    sd = (2 / 3) ** 0.5
    assert w[0].tolist() == pytest.approx([-1 / sd, 0.0, 1 / sd, 0.0], rel=1e-5)
    unshifted = losses.masked_whiten(x, m, shift_mean=False)[0, :3].tolist()
    assert unshifted == pytest.approx([(v - 2) / sd + 2 for v in (1.0, 2.0, 3.0)], rel=1e-5)


def test_masked_whiten_takes_its_moments_over_every_process_through_total():
    """Data parallel: one rank's rows whitened with the batch's moments (`total` adds the other rank's sums, as
    dist.all_reduce_ does) are the whole batch's rows whitened on one process."""
    x = torch.tensor([[1.0, 2.0, 9.0], [4.0, -3.0, 0.5]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    mine, theirs, their_mask = x[:1], x[1:], m[1:]
    mean = losses.masked_mean(x, m)
    other = iter([torch.stack([(theirs * their_mask).sum(), their_mask.sum()]),  # the sums behind the mean
                  torch.stack([((theirs - mean) ** 2 * their_mask).sum(), their_mask.sum()])])  # the variance's
    w = losses.masked_whiten(mine, m[:1], total=lambda t: t + next(other).double())
    assert w[0].tolist() == pytest.approx(losses.masked_whiten(x, m)[0].tolist(), rel=1e-6)
    assert w[0].tolist() != pytest.approx(losses.masked_whiten(mine, m[:1])[0].tolist(), rel=1e-3)  # its own moments differ


def test_response_mask_after_eos():
    eos = 2
    resp = torch.tensor([[5, 6, 2, 0, 0], [5, 5, 5, 5, 5], [2, 0, 0, 0, 0]])
    assert generation.response_mask(resp, eos).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


# ------------------------------------------------------------------------------------------------------ GRPO, RLOO
def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0])  # two groups of 3
    sd1 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased std of [1, 0, 0]
    sd2 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # [3, 2, 2]: the same spread
    grpo = losses.group_advantages(r, 3, "mean", scale="group")
    want = [2 / 3 / (sd1 + 1e-4), -1 / 3 / (sd1 + 1e-4), -1 / 3 / (sd1 + 1e-4),
            2 / 3 / (sd2 + 1e-4), -1 / 3 / (sd2 + 1e-4), -1 / 3 / (sd2 + 1e-4)]
    assert grpo.tolist() == pytest.approx(want, rel=1e-5)
    dr = losses.group_advantages(r, 3, "mean", scale="none")  # Dr. GRPO: centred only
    assert dr.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 2 / 3, -1 / 3, -1 / 3], rel=1e-6)
    loo = losses.group_advantages(r, 3, "loo", scale="none")  # r_i - mean of the other two
    assert loo.tolist() == pytest.approx([1.0, -0.5, -0.5, 1.0, -0.5, -0.5], rel=1e-6)
    # RLOO's advantage is GRPO's centred one times G / (G - 1)
    assert loo.tolist() == pytest.approx((dr * 3 / 2).tolist(), rel=1e-6)
    same = losses.group_advantages(torch.tensor([0.5, 0.5, 0.5, 0.5]), 2, "mean", scale="group")
    assert same.tolist() == [0.0] * 4  # no variance in a group: no signal, and no division by zero
    # TRL's scale_rewards="batch": the centred rewards over the std of the whole batch
    sd_all = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0]).std().item()
    batch = losses.group_advantages(r, 3, "mean", scale="batch")
    assert batch.tolist() == pytest.approx([x / (sd_all + 1e-4) for x in dr.tolist()], rel=1e-5)


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
    loss, stats = losses.group_policy_loss(logp, old, adv, mask, 0.2, ref, 0.1, "grpo", 2.0)
    assert loss.item() == pytest.approx(seq, rel=1e-5)
    loss, _ = losses.group_policy_loss(logp, old, adv, mask, 0.2, ref, 0.1, "dapo", 3.0)
    assert loss.item() == pytest.approx((sum(tok[0]) + tok[1][0]) / 3, rel=1e-5)
    # clipped where it binds: row 0's second token (A > 0, ratio > 1.2); row 1's (A < 0, ratio > 1.2) keeps its gradient
    assert stats["clipfrac"] == pytest.approx(1 / 3)
    assert stats["kl_ref_token"] == pytest.approx(kl[0][0] / 3, rel=1e-5)
    no_ref, _ = losses.group_policy_loss(logp, old, adv, mask, 0.2, None, 0.0, "grpo", 2.0)
    assert no_ref.item() == pytest.approx((sum(pg[0]) / 2 + pg[1][0]) / 2, rel=1e-5)


@pytest.mark.parametrize("norm", ["grpo", "dapo", "dr_grpo", "rloo"])
def test_group_policy_loss_gradient_does_not_depend_on_the_micro_batch_split(norm):
    torch.manual_seed(0)
    logp = torch.randn(8, 5, requires_grad=True)
    old, ref, adv = logp.detach() + 0.1 * torch.randn(8, 5), torch.randn(8, 5), torch.randn(8)
    mask = (torch.rand(8, 5) > 0.3).float()
    mask[:, 0] = 1
    denom = losses.group_loss_denominator(norm, 8.0, float(mask.sum()), 5)
    whole, _ = losses.group_policy_loss(logp, old, adv, mask, 0.2, ref, 0.05, norm, denom)
    (g_whole,) = torch.autograd.grad(whole, logp)
    parts = sum(losses.group_policy_loss(logp[i:i + 3], old[i:i + 3], adv[i:i + 3], mask[i:i + 3], 0.2, ref[i:i + 3],
                                         0.05, norm, denom)[0] for i in range(0, 8, 3))
    (g_parts,) = torch.autograd.grad(parts, logp)
    torch.testing.assert_close(g_parts, g_whole)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


# ------------------------------------------------------------------- TRL 1.16's loss types on lengths 2 and 8, by hand
def two_responses():
    """Response 0 has 2 tokens, response 1 has 8 (of 8 positions); advantages +1 and -0.5."""
    torch.manual_seed(0)
    logp = (-torch.rand(2, 8) - 0.1).requires_grad_()
    mask = torch.zeros(2, 8)
    mask[0, :2], mask[1, :] = 1.0, 1.0
    return logp, mask, torch.tensor([1.0, -0.5])


# on-policy (ratio 1, nothing clipped), no KL: the loss is -sum A_i x (weight of each token) and d loss / d logp of a
# token of response i is -A_i x its weight. TRL 1.16: grpo 1/(L_i n), bnpo and dapo 1/tokens, dr_grpo
# 1/(n max_completion_length), RLOOTrainer 1/n (the sequence log-prob ratio: its tokens' sum)
BY_HAND = {  # loss_type: (denominator args (responses, tokens, max_completion_length), loss, grad row 0, grad row 1)
    "grpo": ((2, 10, 8), (-1.0 + 0.5) / 2, -1.0 / (2 * 2), 0.5 / (8 * 2)),
    "bnpo": ((2, 10, 8), (-2 * 1.0 + 8 * 0.5) / 10, -1.0 / 10, 0.5 / 10),
    "dapo": ((2, 10, 8), (-2 * 1.0 + 8 * 0.5) / 10, -1.0 / 10, 0.5 / 10),
    "dr_grpo": ((2, 10, 8), (-2 * 1.0 + 8 * 0.5) / (2 * 8), -1.0 / 16, 0.5 / 16),
    "rloo": ((2, 10, 8), (-1.0 + 0.5) / 2, -1.0 / 2, 0.5 / 2),
}


@pytest.mark.parametrize("loss_type", sorted(BY_HAND))
def test_loss_types_by_hand_with_gradients_on_lengths_2_and_8(loss_type):
    (n, tokens, max_len), want, g0, g1 = BY_HAND[loss_type]
    logp, mask, adv = two_responses()
    denom = losses.group_loss_denominator(loss_type, n, tokens, max_len)
    loss, stats = losses.group_policy_loss(logp, logp.detach(), adv, mask, 0.2, None, 0.0, loss_type, denom)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    want_grad = torch.stack([torch.full((8,), g0), torch.full((8,), g1)]) * mask
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-8)
    assert stats["clipfrac"] == 0.0 and stats["approx_kl"] == 0.0


def test_rloo_clips_the_sequence_ratio_as_a_whole_by_hand():
    """TRL's RLOOTrainer: r = exp(sum_t logp - old), loss = mean over responses of max(-A r, -A clip(r, 0.8, 1.2))."""
    logp, mask, adv = two_responses()
    old = logp.detach().clone()
    old[0, :2] -= 0.25  # response 0: log-ratio sum 0.5, r = e^0.5 > 1.2 with A > 0: clipped, no gradient
    old[1, :] += 0.1 / 8  # response 1: log-ratio sum -0.1, r = e^-0.1 inside: -A r = 0.5 e^-0.1
    loss, stats = losses.group_policy_loss(logp, old, adv, mask, 0.2, None, 0.0, "rloo", 2.0)
    assert loss.item() == pytest.approx((-1.2 + 0.5 * math.exp(-0.1)) / 2, rel=1e-5)
    (grad,) = torch.autograd.grad(loss, logp)
    want = torch.zeros(2, 8)
    want[1, :] = 0.5 * math.exp(-0.1) / 2  # d(-A e^{sum}) / d logp_t = -A r, every token of the response alike
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7)
    assert stats["clipfrac"] == pytest.approx(2 / 10)  # response 0's 2 tokens of 10


def test_grpo_kl_term_and_its_gradient_by_hand():
    """beta * k3 per token, averaged per response (grpo): d/d logp of exp(d) - d - 1 (d = ref - logp) is 1 - exp(d)."""
    logp, mask, adv = two_responses()
    ref = logp.detach() + 0.3
    loss, stats = losses.group_policy_loss(logp, logp.detach(), adv, mask, 0.2, ref, 0.1, "grpo", 2.0)
    k3 = math.exp(0.3) - 0.3 - 1
    assert loss.item() == pytest.approx((-1.0 + 0.5) / 2 + 0.1 * k3, rel=1e-5)
    (grad,) = torch.autograd.grad(loss, logp)
    kl_grad = 0.1 * (1 - math.exp(0.3))
    want = torch.stack([torch.full((8,), (-1.0 + kl_grad) / 4), torch.full((8,), (0.5 + kl_grad) / 16)]) * mask
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7)
    assert stats["kl_ref_token"] == pytest.approx(k3, rel=1e-5)
    # the KL in the reward (RLOO): no KL term in the loss, and the k3 logged all the same (not 0)
    no_term, stats = losses.group_policy_loss(logp, logp.detach(), adv, mask, 0.2, ref, 0.0, "rloo", 2.0)
    assert no_term.item() == pytest.approx((-1.0 + 0.5) / 2, rel=1e-6)
    assert stats["kl_ref_token"] == pytest.approx(k3, rel=1e-5)


@pytest.mark.parametrize("loss_type", ["grpo", "rloo"])
def test_bias_corrected_kl_term_and_its_gradient_by_hand(loss_type):
    """TRL 1.16's use_bias_correction_kl: beta * k3 * ratio per token. On-policy (ratio 1) the loss is k3's, but the
    ratio's gradient adds k3 to each token's KL gradient: beta * (k3 + 1 - exp(d)), d = ref - logp. Off-policy the
    term is weighted by each token's ratio (grpo: each response's token mean, averaged; rloo: summed per response)."""
    logp, mask, _ = two_responses()
    adv = torch.zeros(2)  # the KL term alone
    ref = logp.detach() + 0.3
    k3 = math.exp(0.3) - 0.3 - 1
    loss, _ = losses.group_policy_loss(logp, logp.detach(), adv, mask, 0.2, ref, 0.1, loss_type, 2.0, True)
    plain, _ = losses.group_policy_loss(logp, logp.detach(), adv, mask, 0.2, ref, 0.1, loss_type, 2.0)
    assert loss.item() == pytest.approx(plain.item(), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    weight = [1 / 4, 1 / 16] if loss_type == "grpo" else [1 / 2, 1 / 2]  # d loss / d (a token's term)
    want = torch.stack([torch.full((8,), 0.1 * (k3 + 1 - math.exp(0.3)) * w) for w in weight]) * mask
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7)
    # off-policy: old log-probs 0.1 below, so every token's ratio is e^0.1 (no advantage: nothing is clipped)
    off, stats = losses.group_policy_loss(logp, logp.detach() - 0.1, adv, mask, 0.2, ref, 0.1, loss_type, 2.0, True)
    per_response = [k3 * math.exp(0.1) * (1 if loss_type == "grpo" else n) for n in (2, 8)]
    assert off.item() == pytest.approx(0.1 * sum(per_response) / 2, rel=1e-5)
    assert stats["kl_ref_token"] == pytest.approx(k3, rel=1e-5)  # logged: k3 itself, not weighted


def test_loss_denominators_follow_trl():
    assert losses.group_loss_denominator("grpo", 4, 30, 16) == 4
    assert losses.group_loss_denominator("rloo", 4, 30, 16) == 4
    assert losses.group_loss_denominator("dr_grpo", 4, 30, 16) == 64  # a constant: responses x max_completion_length
    assert losses.group_loss_denominator("dapo", 4, 30, 16) == 30
    assert losses.group_loss_denominator("bnpo", 4, 30, 16) == 30
    assert losses.group_loss_denominator("cispo", 4, 30, 16) == 30
    assert losses.group_loss_denominator("sapo", 4, 30, 16) == 4
    with pytest.raises(ValueError, match="loss_type"):
        losses.group_loss_denominator("sequence", 4, 30, 16)
    from rlhf.experiment import config

    assert config.CHOICES["grpo.loss_type"] == config.CHOICES["rloo.loss_type"] == set(losses.LOSS_TYPES)
    assert config.CHOICES["grpo.scale_rewards"] == {*losses.SCALE_REWARDS, True, False}


# ------------------------------------------------------------------------------------------------------ one KL
def test_exact_kl_by_hand_never_negative_and_zero_for_the_same_distribution():
    p, q = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.25, 0.5, 0.25])
    kl = losses.exact_kl(p.log().view(1, 1, 3), q.log().view(1, 1, 3))
    assert kl.item() == pytest.approx(0.5 * math.log(2) + 0.25 * math.log(0.5), rel=1e-6)  # = ln(2) / 4
    torch.manual_seed(0)
    a, b = torch.randn(4, 5, 50).log_softmax(-1), torch.randn(4, 5, 50).log_softmax(-1)
    assert (losses.exact_kl(a, b) >= 0).all() and (losses.exact_kl(a, a) == 0).all()
    # it is the expectation, under the policy, of the sampled log-ratio (k1) the old estimate used
    want = (a.exp() * (a - b)).sum(-1)
    torch.testing.assert_close(losses.exact_kl(a, b), want.clamp(min=0))


def test_kl_controller_moves_beta_by_the_clipped_error_times_episodes_over_horizon():
    c = losses.KLController(0.1, target=4.0, horizon=1000, adaptive=True)
    c.update(kl=5.0, n=100)  # error 5/4 - 1 = 0.25, clipped to 0.2: beta x (1 + 0.2 x 100/1000)
    assert c.beta == pytest.approx(0.1 * 1.02)
    c.update(kl=3.0, n=500)  # error -0.25 -> -0.2: x (1 - 0.2 x 0.5)
    assert c.beta == pytest.approx(0.1 * 1.02 * 0.9)
    c.update(kl=4.4, n=1000)  # error 0.1, inside the clip: x 1.1
    assert c.beta == pytest.approx(0.1 * 1.02 * 0.9 * 1.1)
    fixed = losses.KLController(0.1, 4.0, 1000, adaptive=False)
    fixed.update(kl=100.0, n=1000)
    assert fixed.beta == 0.1


def test_kl_reward_penalty_is_beta_times_the_summed_log_ratio_over_the_response():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -0.2, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the second response ended after two tokens
    # (0.5 - 1 + 0) and (0.2 + 0), x 0.04
    assert losses.kl_reward_penalty(logp, ref, mask, 0.04).tolist() == pytest.approx([0.04 * -0.5, 0.04 * 0.2])


def test_conservative_score_is_the_members_mean_less_lambda_population_stds():
    z = torch.tensor([[1.0, 3.0], [0.0, 0.0], [2.0, -2.0]])
    # means 2, 0, 0; population stds 1, 0, 2
    assert losses.conservative_score(z, 0.5).tolist() == pytest.approx([2 - 0.5, 0.0, -1.0])
    assert losses.conservative_score(z[:, :1], 0.5).tolist() == [1.0, 0.0, 2.0]  # one member: its own score


# --------------------------------------------- TRL 1.16's GRPOConfig options (epsilon_high, delta, GSPO, cispo, ...)
def one_token_each(ratios, adv):
    """Responses of one token each, whose ratio pi / pi_old is `ratios`: (logp, old, mask, adv)."""
    logp = torch.tensor([[math.log(r)] for r in ratios]).requires_grad_()
    return logp, torch.zeros(len(ratios), 1), torch.ones(len(ratios), 1), torch.tensor(adv)


def test_epsilon_high_raises_only_the_upper_clip_by_hand():
    """DAPO's clip-higher: A > 0 with ratio 1.25 is clipped at 1.2 by epsilon 0.2 but not at 1.28 by epsilon_high;
    A < 0 with ratio 0.75 stays clipped at 1 - epsilon = 0.8 either way (dapo: summed over tokens / denom 2)."""
    logp, old, mask, adv = one_token_each([1.25, 0.75], [1.0, -1.0])
    plain, s0 = losses.group_policy_loss(logp, old, adv, mask, 0.2, None, 0.0, "dapo", 2.0)
    assert plain.item() == pytest.approx((-1.2 + 0.8) / 2, rel=1e-5) and s0["clipfrac"] == 1.0
    high, s1 = losses.group_policy_loss(logp, old, adv, mask, 0.2, None, 0.0, "dapo", 2.0, epsilon_high=0.28)
    assert high.item() == pytest.approx((-1.25 + 0.8) / 2, rel=1e-5) and s1["clipfrac"] == pytest.approx(1 / 2)
    (grad,) = torch.autograd.grad(high, logp)  # d(-A r)/d logp = -A r for the unclipped token; 0 where clipped
    torch.testing.assert_close(grad, torch.tensor([[-1.25 / 2], [0.0]]), rtol=1e-6, atol=1e-8)


def test_delta_caps_the_unclipped_ratio_by_hand():
    """Two-sided clipping: A < 0 with ratio 2 would cost -A r = 2; delta 1.5 caps it at 1.5 (no gradient there)."""
    logp, old, mask, adv = one_token_each([2.0], [-1.0])
    plain, _ = losses.group_policy_loss(logp, old, adv, mask, 0.2, None, 0.0, "grpo", 1.0)
    capped, _ = losses.group_policy_loss(logp, old, adv, mask, 0.2, None, 0.0, "grpo", 1.0, delta=1.5)
    assert (plain.item(), capped.item()) == pytest.approx((2.0, 1.5), rel=1e-6)
    (grad,) = torch.autograd.grad(capped, logp)
    assert grad.item() == 0.0


def test_sequence_level_ratio_gspo_by_hand():
    """importance_sampling_level=sequence: one ratio per response, exp(mean of its tokens' log-ratios), on each of its
    tokens: response 0 (2 tokens, log-ratios 0.05 and 0.15: s = e^0.1, A = 1, inside the clip), response 1 (8 tokens of
    log-ratio -0.05: s = e^-0.05, A = -0.5). grpo: each response's mean (its own -A s), averaged; the gradient of a
    token is -A s / (L_i n)."""
    logp, mask, adv = two_responses()
    old = logp.detach().clone()
    old[0, 0] -= 0.05
    old[0, 1] -= 0.15
    old[1, :] += 0.05
    s0, s1 = math.exp(0.1), math.exp(-0.05)
    loss, stats = losses.group_policy_loss(logp, old, adv, mask, 0.2, None, 0.0, "grpo", 2.0, level="sequence")
    assert loss.item() == pytest.approx((-s0 + 0.5 * s1) / 2, rel=1e-5)
    (grad,) = torch.autograd.grad(loss, logp)
    want = torch.stack([torch.full((8,), -s0 / (2 * 2)), torch.full((8,), 0.5 * s1 / (8 * 2))]) * mask
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-8)
    assert stats["clipfrac"] == 0.0
    token, _ = losses.group_policy_loss(logp, old, adv, mask, 0.2, None, 0.0, "grpo", 2.0)  # per token: not the same
    assert token.item() == pytest.approx(((-math.exp(0.05) - math.exp(0.15)) / 2 + 0.5 * s1) / 2, rel=1e-5)


def test_cispo_weights_log_pi_by_the_detached_capped_ratio_by_hand():
    """cispo: -A x min(r, epsilon_high) (no gradient) x log pi per token, summed / denom: ratio e^0.5 under a cap of 5
    weighs by e^0.5; under TRL's default cap (epsilon_high unset: epsilon, 0.2) by 0.2. The gradient is -A w / denom."""
    logp, old, mask, adv = one_token_each([math.exp(0.5), 1.0], [1.0, -1.0])
    old = old + torch.tensor([[0.0], [0.0]])
    loss, stats = losses.group_policy_loss(logp, old, adv, mask, 0.2, None, 0.0, "cispo", 2.0, epsilon_high=5.0)
    w = [math.exp(0.5), 1.0]
    lp = [0.5, 0.0]  # log pi = log r here (old log-probs 0)
    assert loss.item() == pytest.approx((-w[0] * lp[0] + w[1] * lp[1]) / 2, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-w[0] / 2], [w[1] / 2]]), rtol=1e-6, atol=1e-8)
    assert stats["clipfrac"] == 0.0
    capped, stats = losses.group_policy_loss(logp, old, adv, mask, 0.2, None, 0.0, "cispo", 2.0)
    (grad,) = torch.autograd.grad(capped, logp)
    torch.testing.assert_close(grad, torch.tensor([[-0.2 / 2], [0.2 / 2]]), rtol=1e-6, atol=1e-8)
    assert stats["clipfrac"] == pytest.approx(1 / 2)  # A > 0 above the cap


def test_sapo_soft_clip_by_hand():
    """sapo: -A sigmoid(tau (r - 1)) 4 / tau per token, tau 1.0 where A > 0 and 1.05 elsewhere (TRL's defaults),
    averaged as grpo. On-policy: -A 2 / tau, and the gradient -A (sigmoid' (0) = 1/4), the same as grpo's."""
    logp, mask, adv = two_responses()
    loss, stats = losses.group_policy_loss(logp, logp.detach(), adv, mask, 0.2, None, 0.0, "sapo", 2.0)
    assert loss.item() == pytest.approx((-2.0 + 0.5 * 2 / 1.05) / 2, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    want = torch.stack([torch.full((8,), -1.0 / 4), torch.full((8,), 0.5 / 16)]) * mask
    torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-8)
    off = torch.tensor([[math.log(1.5)]]).requires_grad_()  # ratio 1.5, A = 1: -sigmoid(0.5) x 4
    loss, _ = losses.group_policy_loss(off, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), 0.2, None,
                                       0.0, "sapo", 1.0, sapo_temperatures=(2.0, 1.05))
    assert loss.item() == pytest.approx(-4 / (1 + math.exp(-1.0)) / 2.0, rel=1e-6)


def test_high_entropy_mask_and_the_entropy_bonus_by_hand():
    """top_entropy_quantile 0.5 keeps the tokens at or above the median of the masked entropies (torch.quantile's
    linear interpolation: of 1, 2, 3, 4, 2.5); the policy terms count there only; the bonus is the token-mean
    entropy over those tokens, divided by the minibatch's micro-batches."""
    ent = torch.tensor([[1.0, 4.0, 9.0], [3.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    keep = losses.high_entropy_mask(ent, mask, 0.5)
    assert keep.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert losses.high_entropy_mask(ent, mask, 1.0) is mask
    # over every process's tokens, as TRL gathers them: another rank's 5, 6, 7, 8 move the median of the eight to 4.5
    other = torch.tensor([5.0, 6.0, 7.0, 8.0])
    gathered = losses.high_entropy_mask(ent, mask, 0.5, gather=lambda v: torch.cat([v, other]))
    assert gathered.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert losses.high_entropy_mask(ent, mask, 0.6, gather=lambda v: torch.cat([v, other])).tolist() == [
        [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]  # the 0.4 quantile of 1..8: 3.8 (of this rank's 1..4 alone: 2.2)
    assert losses.high_entropy_mask(ent, mask, 0.6).tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert losses.entropy_bonus(ent, keep, 2).item() == pytest.approx((4.0 + 3.0) / 2 / 2)
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = losses.group_policy_loss(logp, logp.detach(), torch.tensor([1.0, 1.0]), mask, 0.2, None, 0.0, "dapo",
                                       4.0, token_mask=keep)
    assert loss.item() == pytest.approx(-2 / 4)  # two of the four tokens count


def test_normalize_then_sum_by_hand():
    """TRL's multi_objective_aggregation="normalize_then_sum": each reward normalized within its group (a None left
    out of its group's mean and std), the weighted sum, then whitened over the batch; a response nothing scores
    gets advantage 0."""
    nan = math.nan
    cols = torch.tensor([[1.0, 0.0], [3.0, nan], [2.0, 4.0], [0.0, 2.0]])  # two groups of 2; weights 1 and 0.5
    summed = losses.normalize_then_sum(cols, torch.tensor([1.0, 0.5]), 2)
    s2 = math.sqrt(2.0)  # the unbiased std of two values 2 apart
    # group 1: reward 0 -> (1 - 2) / s2, (3 - 2) / s2; reward 1 -> one value: (0 - 0) / (0 + eps) = 0, and nan left out
    # group 2: reward 0 -> (2 - 1) / s2, (0 - 1) / s2; reward 1 -> (4 - 3) / s2, (2 - 3) / s2, weighted 0.5
    want = [-1 / (s2 + 1e-4), 1 / (s2 + 1e-4), 1.5 / (s2 + 1e-4), -1.5 / (s2 + 1e-4)]
    assert summed.tolist() == pytest.approx(want, rel=1e-6)
    adv = losses.whitened(summed, summed)
    mean, sd = sum(want) / 4, math.sqrt(sum((x - sum(want) / 4) ** 2 for x in want) / 3)
    assert adv.tolist() == pytest.approx([(x - mean) / (sd + 1e-4) for x in want], rel=1e-6)
    none = losses.normalize_then_sum(torch.tensor([[nan], [1.0]]), torch.tensor([1.0]), 2)
    assert math.isnan(none[0].item()) and losses.whitened(none, none)[0].item() == 0.0


def test_loss_denominator_counts_per_loss_type():
    """A micro-batch of 6 loss tokens, of a minibatch of 4 responses in 2 micro-batches (every rank), of a rollout
    batch of 16 responses and 40 tokens, max_completion_length 8."""
    d = {t: losses.loss_denominator(t, 6.0, 4.0, 40.0, 16.0, 2, 8) for t in losses.LOSS_TYPES}
    assert d == {"grpo": 4, "sapo": 4, "rloo": 4, "dr_grpo": 32, "dapo": 10, "cispo": 10, "bnpo": 12}


def test_whitened_advantages_by_hand():
    """RLOOConfig.normalize_advantages: (A - mean) / (std + 1e-4) over the whole rollout batch (unbiased std)."""
    every = torch.tensor([1.0, -1.0, 3.0, 1.0])  # mean 1, unbiased std sqrt(8 / 3)
    got = losses.whitened(every[:2], every)
    assert got.tolist() == pytest.approx([0.0, -2 / (math.sqrt(8 / 3) + 1e-4)], rel=1e-6)


def test_sampler_importance_sampling_weight_by_hand():
    """TRL's truncated importance sampling against the sampler's gap: pi_old / pi_sampler per token or per response
    (the summed log-ratio), clamped (truncate) or zeroed outside [clip_min, clip_max] (mask); only the policy terms
    are weighted."""
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    sample = torch.tensor([[-0.5, 0.2], [-2.0, 5.0]])  # log-ratios 0.5, -0.2; 2.0 and (masked) -5
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    tt = losses.sampler_is_weight(old, sample, mask, "token_truncate", None, 3.0)
    assert tt.flatten().tolist() == pytest.approx([math.exp(0.5), math.exp(-0.2), 3.0, 1.0], rel=1e-6)
    tm = losses.sampler_is_weight(old, sample, mask, "token_mask", 0.9, 3.0)
    assert tm.flatten().tolist() == pytest.approx([math.exp(0.5), 0.0, 0.0, 1.0], rel=1e-6)
    st = losses.sampler_is_weight(old, sample, mask, "sequence_truncate", None, 3.0)
    assert st.flatten().tolist() == pytest.approx([math.exp(0.3), 3.0], rel=1e-6)
    sm = losses.sampler_is_weight(old, sample, mask, "sequence_mask", None, 3.0)
    assert sm.flatten().tolist() == pytest.approx([math.exp(0.3), 0.0], rel=1e-6)
    # the weight multiplies each response's policy term (dapo: summed / 3 tokens), not the KL term
    logp = torch.zeros(2, 2, requires_grad=True)
    ref = torch.full((2, 2), 0.3)
    adv = torch.tensor([1.0, -1.0])
    k3 = math.exp(0.3) - 0.3 - 1
    loss, _ = losses.group_policy_loss(logp, logp.detach(), adv, mask, 0.2, ref, 0.1, "dapo", 3.0, is_weight=sm)
    assert loss.item() == pytest.approx((-2 * math.exp(0.3) + 0.0 + 3 * 0.1 * k3) / 3, rel=1e-5)
    rloo, _ = losses.group_policy_loss(logp, logp.detach(), adv, mask, 0.2, None, 0.0, "rloo", 2.0, is_weight=st)
    assert rloo.item() == pytest.approx((-math.exp(0.3) + 3.0) / 2, rel=1e-5)
    # PPO's clipped surrogate weighs each token's term the same way (token_truncate), before the token mean
    new = torch.log(torch.tensor([[1.5, 1.1], [1.0, 1.0]]))
    ppo, _ = losses.policy_loss(new, old, torch.tensor([[1.0, 2.0], [-1.0, 4.0]]), mask, 0.2, tt)
    assert ppo.item() == pytest.approx((-1.2 * math.exp(0.5) - 2.2 * math.exp(-0.2) + 1.0 * 3.0) / 3, rel=1e-5)
    # the spread the runs log: the std of pi_old / q over the response tokens (here e^0.5, e^-0.2, e^2)
    from rlhf.rl.trajectory import sampler_gap

    r = [math.exp(0.5), math.exp(-0.2), math.exp(2.0)]
    mu = sum(r) / 3
    gap = sampler_gap(sample, old, mask)
    assert gap["rollout/sampler_ratio_std"] == pytest.approx(math.sqrt(sum((x - mu) ** 2 for x in r) / 2), rel=1e-5)
    assert gap["rollout/logprob_gap_mean"] == pytest.approx(2.7 / 3) and gap["rollout/logprob_gap_max"] == 2.0


def test_ppo_k3_rewards_and_whitened_rewards_by_hand():
    """TRL 0.25.1's kl_estimator k3 (exp(ref - logp) - (ref - logp) - 1 per token, never negative) in the per-token
    rewards, and whiten_rewards: whitened with their mean kept (masked_whiten's shift_mean=False)."""
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2)
    rewards, kl = losses.kl_penalized_rewards(torch.tensor([2.0]), logp, ref, mask, beta=0.1, estimator="k3")
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert kl.flatten().tolist() == pytest.approx(k3, rel=1e-6)
    assert rewards.flatten().tolist() == pytest.approx([-0.1 * k3[0], -0.1 * k3[1] + 2.0], rel=1e-6)
    x, m = torch.tensor([[1.0, 3.0, 9.0]]), torch.tensor([[1.0, 1.0, 0.0]])  # mean 2, variance 1 over the mask
    kept = losses.masked_whiten(x, m, shift_mean=False)
    assert kept.flatten().tolist() == pytest.approx([2 - 1 / math.sqrt(1 + 1e-8), 2 + 1 / math.sqrt(1 + 1e-8), 0.0])


def test_off_policy_mask_by_hand():
    """TRL's off_policy_mask_threshold: drop a response only when its advantage is negative and its mean
    log pi_sampler - log pi is above the threshold (0.1 here): response 0 (A < 0, mean gap 0.25) is dropped;
    response 1 (A < 0, gap 0.05) and response 2 (A > 0, gap 0.5) are kept."""
    logp = torch.zeros(3, 2)
    sample = torch.tensor([[0.2, 0.3], [0.05, 9.0], [0.5, 0.5]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    keep = losses.off_policy_mask(torch.tensor([-1.0, -1.0, 1.0]), logp, sample, mask, 0.1)
    assert keep.flatten().tolist() == [0.0, 1.0, 1.0]
