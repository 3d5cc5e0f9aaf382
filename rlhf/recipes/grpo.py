"""GRPO and RLOO, top to bottom: online RL without a critic, on the roles of rlhf/rl/roles.py (policy, reference,
reward on one base; no value adapter) and the loop's shared helpers in rlhf/rl/online.py. Each iteration samples
`num_generations` (G) responses per prompt in one batch, scores them with the `reward` section (reward model and/or
reward functions), turns each reward into an advantage relative to its group (GRPO: (r - group mean) / group std;
RLOO: r - mean of the group's other responses), then runs `epochs` passes of the clipped surrogate over shuffled
minibatches, with beta * KL to the reference as a per-token loss term (kl_penalty=loss) or subtracted from the reward
(kl_penalty=reward). The stages' own config sections are `grpo` and `rloo`; their maths is in rlhf/maths/losses.py
(group_advantages, group_policy_loss)."""

from __future__ import annotations

import torch

from rlhf.infra import dist
from rlhf.rl import generation, online, online_plan
from rlhf.maths import losses
from rlhf.experiment import online_sections
from rlhf.experiment.config import Experiment
from rlhf.rl.roles import Roles
from rlhf.runs.runtime import Plan, Session
from rlhf.rl.trajectory import Timer, Trajectory, check_finite, in_chunks, reward_metrics, sampler_correction

BASELINE = {"grpo": "mean", "rloo": "loo"}


def prepare(exp: Experiment, stage: str = "grpo") -> Plan:
    return online_plan.policy_plan(exp, stage, with_rm=bool(exp.reward.model))  # the RM's adapter only when it takes part


def prepare_rloo(exp: Experiment) -> Plan:
    return prepare(exp, "rloo")


def needs_old_logprobs(g) -> bool:
    """The sampling policy's log-probs need their own no-grad pass only when the policy moves before the update
    reaches a response (several epochs or minibatches), or when the KL is part of the reward."""
    return g.num_iterations > 1 or g.minibatch < g.rollout_batch or (g.beta > 0 and g.kl_penalty == "reward")


def rollout_stats(roles: Roles, r: generation.Rollout, g, rows: int, timer: Timer) -> Trajectory:
    """What the update needs from the sampled batch, `rows` sequences per pass: the old log-probs (when
    needs_old_logprobs), the reference's and the exact per-token KL to it (when beta > 0: the policy's pass runs
    then too, for its whole distribution) and the reward model's raw score (when it takes part)."""

    @torch.no_grad()
    def passes(part: generation.Rollout) -> Trajectory:
        out, policy = Trajectory(), None
        if needs_old_logprobs(g) or g.beta:
            with timer("policy"):
                policy, _ = generation.response_log_softmax(roles.model, part, g.temperature)
            if needs_old_logprobs(g):
                out.logp = losses.token_logprobs(policy, part.response)
        if g.beta:
            with timer("ref"):
                out.ref_logp, out.kl = roles.ref_logprobs(part, g.temperature, policy)
        del policy
        if roles.reward_head is not None:
            with timer("score"):
                out.raw_score = roles.score(part)
        return out

    return in_chunks(passes, r, rows)


def kl_reward_penalty(g, st: Trajectory, mask: torch.Tensor) -> torch.Tensor:
    """What kl_penalty=reward subtracts from each response's reward before the advantages (losses.kl_reward_penalty);
    zeros otherwise."""
    if not (g.beta and g.kl_penalty == "reward"):
        return torch.zeros(mask.shape[0], device=mask.device)
    return losses.kl_reward_penalty(st.logp, st.ref_logp, mask, g.beta)


PARTS = ("generate", "policy", "ref", "score", "reward_fns", "judge", "optimizer")
"""The timed parts of a GRPO/RLOO iteration (throughput's `<part>_s_per_step`; the update's forward and backward
passes are timed with it, as update_s)."""


def train(exp: Experiment, resume: bool = True, stage: str = "grpo") -> dict:
    g = getattr(exp, stage)
    G = g.num_generations
    plan = online_plan.resolve(exp, stage, g, prepare=lambda: prepare(exp, stage), group=G)  # known before loading
    # beta 0 loads the reference only for the guard's KL budget (the judge measures the KL)
    reference = g.reference if g.beta or online_sections.guarded(exp, g) else None
    s = online.setup(plan, Session.start(exp, plan.inputs, resume=resume),
                     lambda q: Roles(q.loading, q.data.sft, q.data.rm, q.data.tok, reference=reference,
                                     ensemble=q.ensemble))
    roles = s.roles
    n_prompts = g.rollout_batch // G
    for step in s.iterations():
        # ---- rollout: G responses per prompt (each group's rows adjacent), scored once, advantages per group
        rows = [row for row in s.prompts(n_prompts) for _ in range(G)]
        with s.rollout():
            r = s.generate(rows, top_k=g.top_k, min_p=g.min_p, repetition_penalty=g.repetition_penalty)
            st = rollout_stats(roles, r, g, s.score_rows, s.timer)
        mask = r.mask.float()
        scored = s.score(st.raw_score, rows, r, step)
        judged = s.measure(step)  # the judge measures this policy, before its update (every judge_every iterations)
        # the reward logged: before any KL penalty
        eos_penalty = g.missing_eos_penalty * (~r.ended).float()
        reward = scored.total - eos_penalty
        if g.reward_clip_range is not None:
            reward = reward.clamp(*g.reward_clip_range)
        penalty = kl_reward_penalty(g, st, mask)
        if g.multi_objective_aggregation == "normalize_then_sum":  # TRL's GDPO: each reward normalized in its group
            cols, w = s.scorer.columns(st.raw_score, scored.parts)  # the EOS penalty: one more reward, weight 1
            cols = torch.cat([cols, -eos_penalty[:, None]], 1)
            summed = losses.normalize_then_sum(cols, torch.cat([w, w.new_ones(1)]), G)
            adv = losses.whitened(summed, s.gather(summed))
        else:
            batch_std = s.gather(reward - penalty).std() if g.scale_rewards == "batch" else None
            adv = losses.group_advantages(reward - penalty, G, BASELINE[stage], g.scale_rewards, batch_std=batch_std)
        if g.normalize_advantages:
            adv = losses.whitened(adv, s.gather(adv))
        check_finite(stage, step, reward=reward, advantages=adv)

        # ---- update: `epochs` passes over shuffled minibatches, gradient accumulation over micro-batches
        with s.update():
            loss_sum = 0.0
            entropy = torch.zeros_like(mask)  # first pass: the sampler's own
            old_seen = st.logp if st.logp is not None else torch.zeros_like(mask)  # pi_old, for the sampler's gap
            beta_loss = g.beta if g.kl_penalty == "loss" else 0.0
            # the tokens the loss counts: without the truncated responses' (mask_truncated_completions)
            loss_mask = mask * r.ended.unsqueeze(1).float() if g.mask_truncated_completions else mask
            micro_batches = -(-s.mb_rows // s.micro_rows) * s.ranks  # a minibatch's, over every rank
            rollout_tokens = s.total(loss_mask.sum())
            for epoch in range(g.num_iterations):
                for mb in torch.randperm(s.rb).split(s.mb_rows):
                    s.opt.zero_grad(set_to_none=True)
                    responses = s.total(float(len(mb)))  # the minibatch's, over every rank
                    for micro in mb.split(s.micro_rows):
                        m = loss_mask[micro]
                        denom = losses.loss_denominator(g.loss_type, float(m.sum()), responses, rollout_tokens,
                                                        float(g.rollout_batch), micro_batches,
                                                        g.max_completion_length)
                        logp, ent, _ = generation.response_logprobs(roles.model, r.slice(micro), g.temperature,
                                                                    entropy_grad=g.entropy_coef != 0)
                        old = st.logp[micro] if st.logp is not None else logp.detach()
                        ref = st.ref_logp[micro] if st.ref_logp is not None else None  # its k3 is logged either way
                        top = losses.high_entropy_mask(ent.detach(), m, g.top_entropy_quantile, dist.all_gather_varlen)
                        keep = top if g.top_entropy_quantile < 1 else None  # the tokens the policy terms count on
                        if g.off_policy_mask_threshold is not None:
                            opsm = losses.off_policy_mask(adv[micro], logp, r.sample_logp[micro], m,
                                                          g.off_policy_mask_threshold)
                            keep = opsm if keep is None else keep * opsm
                        is_weight = sampler_correction(g, old, r.sample_logp[micro], m)
                        loss, stats = losses.group_policy_loss(
                            logp, old, adv[micro], m, g.epsilon, ref, beta_loss, g.loss_type, denom,
                            g.use_bias_correction_kl, epsilon_high=g.epsilon_high, delta=g.delta,
                            level=g.importance_sampling_level,
                            sapo_temperatures=(g.sapo_temperature_pos, g.sapo_temperature_neg),
                            token_mask=keep, is_weight=is_weight)
                        if g.entropy_coef:
                            loss = loss - g.entropy_coef * losses.entropy_bonus(ent, top, micro_batches)
                        check_finite(stage, step, loss=loss)
                        loss.backward()
                        if epoch == 0:
                            entropy[micro] = ent.detach()
                            if st.logp is None:  # on-policy: this pass is pi_old's
                                old_seen[micro] = logp.detach()
                        loss_sum += loss.item()  # the micro-batches' parts add up to the minibatch's loss
                        s.accumulate(stats, m)
                    s.optimizer_step(g.max_grad_norm)

        # ---- what the iteration logs (over the global rollout batch)
        seq_kl = st.kl.sum(1) if st.kl is not None else torch.zeros_like(reward)  # exact, per response
        metrics = {
            **reward_metrics(reward, penalty, G),  # before the KL penalty, and the penalty on its own
            "kl/ref": s.gather(seq_kl).mean().item(), **s.responses(r, entropy),
            "policy_loss": s.total(torch.tensor(loss_sum)) / s.optimizer_steps,
            **s.update_stats(), **s.logged(r, old_seen, scored, judged),
        }
        if s.end_iteration(step, metrics, rows, scored, ("reward", reward)):
            break  # the judge fell significantly from its peak (overopt_stop)

    # ---- final: the trained policy against the starting (SFT) policy on held-out prompts
    no_kl = {} if g.beta else {"train_kl_ref_last5": None, "kl_within_band": None}  # no reference pass: no KL
    return s.finish(PARTS, no_kl, {})


def train_rloo(exp: Experiment, resume: bool = True) -> dict:
    return train(exp, resume, "rloo")
