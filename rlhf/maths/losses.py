"""All the maths the stages share, in one place: Bradley-Terry, DPO, PPO (per-token KL-penalized rewards, GAE,
clipped policy and value losses), GRPO/RLOO's group advantages and loss variants, and the exact KL. Tensors of per-token quantities are (batch, response_len) with a 0/1 mask."""

from __future__ import annotations

import math

from typing import Callable

import torch
import torch.nn.functional as F

from rlhf.experiment.online_sections import KL_STEP


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


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, total=lambda t: t) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8), the mean and variance over the masked entries; `total` sums a tensor over
    every process (dist.all_reduce_ under data parallelism: the global batch's moments; the identity on one)."""
    def mean_of(v: torch.Tensor) -> torch.Tensor:  # summed in float64 over the processes
        s = total(torch.stack([(v * mask).sum(), mask.sum()]).double())
        return (s[0] / s[1].clamp(min=1)).to(x.dtype)

    mean = mean_of(x)
    var = mean_of((x - mean) ** 2)
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


def token_logprobs(logp_all: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The entries of a log-softmax (B, T, V) at `tokens` (B, T) -> (B, T)."""
    return torch.gather(logp_all, 2, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_log_softmax(logp_all: torch.Tensor) -> torch.Tensor:
    return -(logp_all.exp() * logp_all).sum(-1)


def kl_penalized_rewards(score: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                         beta: float, estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token reward: -beta * the KL estimate on every response token, plus the sequence score on the last one.
    The estimate (TRL 0.25.1's PPOConfig.kl_estimator): k1, logp - ref_logp; k3, exp(ref - logp) - (ref - logp) - 1
    (k3_kl). Returns (rewards, per-token KL estimate), both zero outside the mask."""
    kl = (logp - ref_logp) * mask if estimator == "k1" else k3_kl(logp, ref_logp) * mask
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
                clip: float, is_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate: mean over tokens of max(-A * r, -A * clip(r, 1-eps, 1+eps)), r = exp(logp - old_logp);
    with `is_weight` (sampler_is_weight: (B, T) or (B, 1), no gradient) each token's term is multiplied by it first."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
    per_token = torch.max(unclipped, clipped)
    loss = masked_mean(per_token if is_weight is None else per_token * is_weight.detach(), mask)
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
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "rloo", "cispo", "sapo")
"""The group stages' loss variants, by TRL 1.16's names (GRPOConfig.loss_type; "rloo" is RLOOTrainer's loss)."""
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
"""TRL 1.16's GRPOConfig.importance_sampling_level: one ratio per token (GRPO), or one per response (GSPO)."""
SCALE_REWARDS = ("group", "batch", "none")
"""TRL 1.16's GRPOConfig.scale_rewards: divide the centred rewards by the group's std, the batch's, or not at all."""


def group_advantages(rewards: torch.Tensor, group: int, baseline: str = "mean", scale: str = "group",
                     eps: float = 1e-4, batch_std: torch.Tensor | None = None) -> torch.Tensor:
    """One advantage per response from its group of `group` responses to the same prompt (rows g*G .. g*G+G-1):
    r - mean of the group (GRPO) or r - mean of the group's *other* responses (baseline="loo", RLOO), divided by
    (std + eps) where `scale` says (TRL's scale_rewards): "group" the group's std (unbiased), "batch" the std of every
    reward of the batch (`batch_std`: the global batch's over ranks; default the std of `rewards`), "none" not at
    all. A group whose rewards are all equal gets 0."""
    r = rewards.view(-1, group)
    if baseline == "loo":
        base = (r.sum(1, keepdim=True) - r) / (group - 1)
    else:
        base = r.mean(1, keepdim=True)
    adv = r - base
    if scale == "group":
        adv = adv / (r.std(1, keepdim=True) + eps)
    elif scale == "batch":
        adv = adv / ((rewards.std() if batch_std is None else batch_std) + eps)
    return adv.reshape(-1)


def normalize_then_sum(columns: torch.Tensor, weights: torch.Tensor, group: int, eps: float = 1e-4) -> torch.Tensor:
    """TRL 1.16's multi_objective_aggregation="normalize_then_sum" (GDPO): each reward (a column of `columns` (B, K),
    NaN where it does not apply to a response) normalized within each group of `group` responses, (r - mean) / (std
    + eps) with the group's NaN-aware mean and unbiased std, then summed with `weights` (K,), NaNs left out; a
    response no reward applies to gets NaN. The caller whitens the sums over the batch (`whitened`)."""
    g = columns.view(-1, group, columns.shape[1])
    ok = ~torch.isnan(g)
    n = ok.sum(1, keepdim=True)
    mean = torch.where(ok, g, 0.0).sum(1, keepdim=True) / n.clamp(min=1)
    var = (torch.where(ok, g - mean, 0.0) ** 2).sum(1, keepdim=True) / (n - 1).clamp(min=1)
    z = ((g - mean) / (var.sqrt() + eps)).view_as(columns)
    out = torch.where(torch.isnan(z), 0.0, z * weights.to(z)).sum(1)
    return torch.where(torch.isnan(columns).all(1), torch.nan, out)


def whitened(adv: torch.Tensor, every: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """TRL's RLOOConfig.normalize_advantages (and normalize_then_sum's batch step): (adv - mean) / (std + eps), the
    NaN-aware mean and (unbiased) std of `every`, the rollout batch's values over every process; NaN becomes 0 (a
    response nothing scored moves nothing). Fewer than two values have no spread: every advantage is 0."""
    ok = every[~torch.isnan(every)]
    if ok.numel() < 2:  # the std of one value is NaN (and torch warns): the same zeros, said here
        return torch.zeros_like(adv)
    return torch.nan_to_num((adv - ok.mean()) / (ok.std() + eps), nan=0.0)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || ref) estimate exp(ref - logp) - (ref - logp) - 1 (Schulman's k3: >= 0, unbiased)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def exact_kl(logp_all: torch.Tensor, ref_logp_all: torch.Tensor) -> torch.Tensor:
    """The exact per-position KL(policy || ref) = sum over the vocabulary of p * (log p - log q), from both
    log-softmaxes (..., V) -> (...). Never negative (rounding below 0 is clamped; equal inputs give exactly 0).
    Computed one leading row at a time, so its temporaries stay at one row's (T, V)."""
    out = torch.empty(logp_all.shape[:-1], dtype=torch.float32, device=logp_all.device)
    for i in range(logp_all.shape[0]):
        lp, lq = logp_all[i].float(), ref_logp_all[i].float()
        out[i] = (lp.exp() * (lp - lq)).sum(-1)
    return out.clamp(min=0.0)


def group_loss_denominator(loss_type: str, responses: float, tokens: float, max_completion_length: int) -> float:
    """What a group stage's summed loss terms are divided by, as TRL 1.16 aggregates each loss_type: grpo, sapo,
    rloo: `responses` (each response's own mean or sum, averaged over responses); dr_grpo: responses x
    max_completion_length (a constant per response); dapo, cispo, bnpo: `tokens`. loss_denominator gives each
    variant its counts."""
    if loss_type in ("grpo", "sapo", "rloo"):
        return max(responses, 1.0)
    if loss_type == "dr_grpo":
        return max(responses * max_completion_length, 1.0)
    if loss_type in ("dapo", "cispo", "bnpo"):
        return max(tokens, 1.0)
    raise ValueError(f"unknown loss_type {loss_type!r} (one of {', '.join(LOSS_TYPES)})")


def loss_denominator(loss_type: str, micro_tokens: float, responses: float, rollout_tokens: float,
                     rollout_responses: float, micro_batches: int, max_completion_length: int) -> float:
    """A micro-batch's denominator (group_loss_denominator) from the counts each variant normalizes by, so that the
    update does not depend on how a minibatch is split into micro-batches or ranks: `responses` the minibatch's over
    every rank (grpo, sapo, rloo, dr_grpo); dapo, cispo: the rollout batch's loss tokens (`rollout_tokens` over its
    `rollout_responses`, every rank) per minibatch, TRL's tokens of the generation batch per accumulation window;
    bnpo: this micro-batch's loss tokens (`micro_tokens`) times the minibatch's `micro_batches` over every rank, so
    that each micro-batch's token mean is averaged over them (it depends on micro_batch, as in TRL)."""
    tokens = (micro_tokens * micro_batches if loss_type == "bnpo"
              else rollout_tokens * responses / rollout_responses)
    return group_loss_denominator(loss_type, responses, tokens, max_completion_length)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float,
                      gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """TRL 1.16's top_entropy_quantile: 1 on the tokens whose entropy is at least the (1 - quantile) quantile of the
    masked tokens' entropies (torch.quantile, linear interpolation), 0 elsewhere and outside the mask; quantile 1
    keeps every token. `gather` (dist.all_gather_varlen): the quantile is taken over every process's tokens of the
    micro-batch, as TRL gathers them across processes."""
    if quantile >= 1.0:
        return mask
    values = entropy[mask.bool()].float()
    if gather is not None:
        values = gather(values)
    if values.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(values, 1.0 - quantile)
    return ((entropy * mask >= threshold) & mask.bool()).to(mask.dtype)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """TRL 1.16's entropy_coef term (loss - entropy_coef x this): the micro-batch's token-mean entropy over `mask`
    (with top_entropy_quantile, its high-entropy tokens), divided by the minibatch's micro-batches over every rank:
    their mean, whatever each one's loss_type normalization."""
    return (entropy * mask).sum() / mask.sum().clamp(min=1) / micro_batches


def off_policy_mask(adv: torch.Tensor, logp: torch.Tensor, sample_logp: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """TRL 1.16's off_policy_mask_threshold (DeepSeek-V3.2's off-policy sequence mask): (B, 1), 0 for a response with
    a negative advantage whose mean per-token log-ratio of the sampler to the current policy, log pi_sampler -
    log pi (no gradient), is above `threshold`; 1 for the others."""
    gap = ((sample_logp - logp.detach()) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    return ((adv.unsqueeze(1) >= 0) | (gap <= threshold)).to(mask.dtype)


SAMPLER_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""TRL 1.16's vllm_importance_sampling_mode values (the sampler correction's, sampler_is_mode here)."""


def sampler_is_weight(old_logp: torch.Tensor, sample_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                      clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL 1.16's truncated importance-sampling correction for the gap between the sampler and the trained policy
    (its vllm_importance_sampling_*): the ratio pi_old / pi_sampler of the tokens the sampler drew, per token (B, T)
    or per response (B, 1: exp of the summed log-ratio), then truncated to [clip_min, clip_max] (*_truncate) or set
    to 0 outside it (*_mask); None bounds are open. The loss's policy terms are multiplied by it."""
    diff = (old_logp - sample_logp) * mask
    ratio = torch.exp(diff.sum(1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode.endswith("mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"unknown sampler importance sampling mode {mode!r} (one of {', '.join(SAMPLER_IS_MODES)})")


def group_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip: float,
                      ref_logp: torch.Tensor | None, beta: float, loss_type: str,
                      denom: float, bias_correction_kl: bool = False, *, epsilon_high: float | None = None,
                      delta: float | None = None, level: str = "token",
                      sapo_temperatures: tuple[float, float] = (1.0, 1.05),
                      token_mask: torch.Tensor | None = None,
                      is_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """GRPO/RLOO's surrogate with one advantage per response (adv (B,)), plus beta * k3 KL to the reference per
    token when `beta` (`ref_logp` given; without beta its k3 is only logged, as kl_ref_token), summed over the
    batch and divided by `denom` (loss_denominator: dividing by the whole minibatch's count makes the update
    independent of its split into micro-batches). The ratio r is pi / pi_old per token (level="token"), or, with
    level="sequence" (GSPO), one per response, exp of the mean of its tokens' log-ratios, on each of its tokens.
    loss_type (TRL 1.16's names):
      grpo:               max(-A r, -A clip(r, 1 - clip, 1 + epsilon_high)) per token, averaged over its
                          response's tokens, summed over responses;
      dr_grpo, dapo, bnpo: the same terms summed over every token (the variants differ only in `denom`);
      cispo:              -A x min(r, epsilon_high) (no gradient through the weight) x log pi per token, summed
                          over tokens;
      sapo:               -A x sigmoid(tau (r - 1)) x 4 / tau per token, tau = sapo_temperatures[0] where A > 0,
                          [1] elsewhere (a soft clip), averaged as grpo;
      rloo:               TRL's RLOOTrainer: one ratio per response, exp(sum over its tokens of logp - old_logp),
                          clipped as a whole: max(-A r, -A clip(r, 1 - clip, 1 + epsilon_high)) per response,
                          summed over responses (the KL term, when beta, is each response's summed k3).
    epsilon_high (DAPO's clip-higher): the upper clip, default `clip`. delta (two-sided clipping): the unclipped
    ratio is capped at delta too. token_mask (top_entropy_quantile's high_entropy_mask): the policy terms count on
    its tokens only (the KL term on every token). is_weight (sampler_is_weight, (B, T) or (B, 1)): the policy terms
    are multiplied by it (the KL term is not), as TRL's vLLM correction; loss_type rloo takes a (B, 1) one.
    bias_correction_kl (TRL 1.16's use_bias_correction_kl): each token's k3 term is weighted by its own ratio
    pi / pi_old, with its gradient: the KL term's gradient is then the unbiased one of the reverse KL to the
    reference, k3 + (1 - exp(ref - logp)) times d logp at ratio 1, instead of k3's (1 - exp(ref - logp))."""
    high = clip if epsilon_high is None else epsilon_high
    log_ratio = (logp - old_logp) * mask
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    if level == "sequence":
        seq = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        token_ratio = torch.exp(seq).expand_as(logp)
    elif level == "token":
        token_ratio = torch.exp(log_ratio)  # pi / pi_old per token: the surrogate's ratio and the KL term's weight
    else:
        raise ValueError(f"unknown importance_sampling_level {level!r} (one of token, sequence)")
    kl_term = kl * token_ratio if bias_correction_kl else kl  # what beta multiplies in the loss
    if loss_type == "rloo":
        seq_ratio = torch.exp(log_ratio.sum(1))
        capped = seq_ratio if delta is None else torch.clamp(seq_ratio, max=delta)
        per_seq = torch.max(-adv * capped, -adv * torch.clamp(seq_ratio, 1 - clip, 1 + high))
        if is_weight is not None:
            per_seq = per_seq * is_weight.squeeze(1)
        if beta:
            per_seq = per_seq + beta * (kl_term * mask).sum(1)
        loss = per_seq.sum() / denom
        ratio, a, per_row = seq_ratio, adv, True
    else:
        ratio = token_ratio
        a = adv.unsqueeze(1)
        if loss_type == "cispo":
            per_token = -torch.clamp(ratio, max=high).detach() * a * logp
        elif loss_type == "sapo":
            tau = torch.where(a > 0, sapo_temperatures[0], sapo_temperatures[1])
            per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a
        else:
            capped = ratio if delta is None else torch.clamp(ratio, max=delta)
            per_token = torch.max(-a * capped, -a * torch.clamp(ratio, 1 - clip, 1 + high))
        if token_mask is not None:
            per_token = per_token * token_mask
        if is_weight is not None:
            per_token = per_token * is_weight
        if beta:
            per_token = per_token + beta * kl_term
        if loss_type in ("grpo", "sapo"):
            loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / denom
        elif loss_type in ("dr_grpo", "dapo", "bnpo", "cispo"):
            loss = (per_token * mask).sum() / denom
        else:
            raise ValueError(f"unknown loss_type {loss_type!r} (one of {', '.join(LOSS_TYPES)})")
        per_row = False
    with torch.no_grad():
        if loss_type == "cispo":
            clipped = ((ratio > high) & (a > 0)).float()
        elif loss_type == "sapo":
            clipped = torch.zeros_like(ratio)
        else:
            clipped = ((ratio < 1 - clip) & (a < 0) | (ratio > 1 + high) & (a > 0)).float()
        if per_row:  # rloo: a response is clipped as a whole; counted on each of its tokens
            clipped = clipped.unsqueeze(1).expand_as(mask)
        stats = {"clipfrac": masked_mean(clipped, mask).item(),
                 "approx_kl": masked_mean(0.5 * log_ratio**2, mask).item(),
                 "kl_ref_token": masked_mean(kl, mask).item()}
    return loss, stats


class KLController:
    """beta of PPO's KL penalty: fixed, or adapted toward `target` (Ziegler et al. 2019, proportional control): after
    each rollout of n episodes whose mean sequence KL is `kl`, beta *= 1 + clip(kl / target - 1, -KL_STEP, KL_STEP) x
    n / horizon (KL_STEP: online_sections, 0.2)."""

    def __init__(self, beta: float, target: float, horizon: int, adaptive: bool):
        self.beta, self.target, self.horizon, self.adaptive = beta, target, horizon, adaptive

    def update(self, kl: float, n: int) -> None:
        if self.adaptive:
            error = max(-KL_STEP, min(KL_STEP, kl / self.target - 1))
            self.beta *= 1 + error * n / self.horizon


def kl_reward_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """The per-response KL penalty subtracted from the reward before the advantages (TRL's RLOOTrainer,
    kl_penalty=reward): beta x the summed log-ratio log pi - log pi_ref over the response's tokens (k1, at the
    sampling policy)."""
    return beta * ((logp - ref_logp) * mask).sum(1)


def conservative_score(z: torch.Tensor, lam: float) -> torch.Tensor:
    """An ensemble's score (B,) from its members' normalized scores z (B, K): mean - lam x std over the members
    (population std; Coste et al. 2023); a single member's score as it is."""
    if z.shape[1] == 1:
        return z[:, 0]
    return z.mean(1) - lam * z.std(1, correction=0)
