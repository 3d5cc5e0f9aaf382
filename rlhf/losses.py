"""All the maths the stages share, in one place: Bradley-Terry, DPO, and PPO (per-token KL-penalized rewards, GAE,
clipped policy and value losses). Tensors of per-token quantities are (batch, response_len) with a 0/1 mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F


# ------------------------------------------------------------------------------------------------------ preference
def bradley_terry(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None,
                  center_coef: float = 0.0) -> torch.Tensor:
    """-log sigmoid(r_c - r_r - margin), averaged; plus center_coef * mean((r_c + r_r)^2) to keep rewards centred."""
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff).mean()
    if center_coef:
        loss = loss + center_coef * ((r_chosen + r_rejected) ** 2).mean()
    return loss


def dpo_sigmoid(pi_chosen: torch.Tensor, pi_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO loss on summed response log-probs: -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))).
    Returns (loss, chosen implicit rewards, rejected implicit rewards)."""
    chosen = beta * (pi_chosen - ref_chosen)
    rejected = beta * (pi_rejected - ref_rejected)
    return -F.logsigmoid(chosen - rejected).mean(), chosen.detach(), rejected.detach()


# ------------------------------------------------------------------------------------------------------------- PPO
def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under logits; logits (B, T, V), tokens (B, T) -> (B, T)."""
    return torch.gather(F.log_softmax(logits.float(), dim=-1), 2, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_penalized_rewards(score: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                         beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token reward: -beta * (logp - ref_logp) on every response token, plus the sequence score on the last
    one. Returns (rewards, per-token KL estimate), both zero outside the mask."""
    kl = (logp - ref_logp) * mask
    rewards = -beta * kl
    last = mask.sum(1).long().clamp(min=1) - 1  # responses are right-padded: the last real token
    rewards[torch.arange(len(score)), last] += score
    return rewards * mask, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over right-padded responses. Returns (advantages, returns)."""
    values = values * mask
    T = rewards.shape[1]
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last * (mask[:, t + 1] if t + 1 < T else 0)
        adv[:, t] = last
    adv = adv * mask
    return adv, (adv + values) * mask


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                clip: float) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate: mean over tokens of max(-A * r, -A * clip(r, 1-eps, 1+eps)), r = exp(logp - old_logp)."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped > unclipped).float(), mask).item(),
                 "approx_kl": masked_mean(0.5 * log_ratio**2, mask).item()}
    return loss, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, dict]:
    """Clipped value loss: 0.5 * mean over tokens of max((v - R)^2, (clip(v, v_old +- eps) - R)^2)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(loss_unclipped, loss_clipped), mask)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask).item()}
    return loss, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    resid = returns - values
    var_e = masked_mean((resid - masked_mean(resid, mask)) ** 2, mask)
    return float(1 - var_e / var_r) if var_r > 0 else float("nan")


# ------------------------------------------------------------------------------------------------------ GRPO, RLOO
def group_advantages(rewards: torch.Tensor, group: int, baseline: str = "mean", scale: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """One advantage per response from its group of `group` responses to the same prompt (rows g*G .. g*G+G-1):
    r - mean of the group (GRPO) or r - mean of the group's *other* responses (baseline="loo", RLOO); `scale`
    divides by the group's standard deviation (unbiased, + eps). A group whose rewards are all equal gets 0."""
    r = rewards.view(-1, group)
    if baseline == "loo":
        base = (r.sum(1, keepdim=True) - r) / (group - 1)
    else:
        base = r.mean(1, keepdim=True)
    adv = r - base
    if scale:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.reshape(-1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || ref) estimate exp(ref - logp) - (ref - logp) - 1 (Schulman's k3: >= 0, unbiased)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def group_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip: float,
                      ref_logp: torch.Tensor | None, beta: float, norm: str, denom: float) -> tuple[torch.Tensor, dict]:
    """GRPO/RLOO's clipped surrogate with one advantage per response (adv (B,)), plus beta * k3 KL per token when
    `ref_logp` is given. norm="sequence": each response's token mean, summed and divided by `denom` (the minibatch's
    response count); norm="token": every token's term summed and divided by `denom` (the minibatch's token count).
    Dividing by the whole minibatch's count makes the update independent of its split into micro-batches."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    a = adv.unsqueeze(1)
    per_token = torch.max(-a * ratio, -a * torch.clamp(ratio, 1 - clip, 1 + clip))
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    if beta:
        per_token = per_token + beta * kl
    if norm == "sequence":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / denom
    else:
        loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        clipped = (ratio < 1 - clip) & (a < 0) | (ratio > 1 + clip) & (a > 0)
        stats = {"clipfrac": masked_mean(clipped.float(), mask).item(),
                 "approx_kl": masked_mean(0.5 * log_ratio**2, mask).item(),
                 "kl_ref_token": masked_mean(kl, mask).item()}
    return loss, stats
