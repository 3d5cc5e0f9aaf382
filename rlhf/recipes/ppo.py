"""PPO stage, top to bottom. One (4-bit) base is loaded once and serves four roles through LoRA adapters (policy,
reference, reward, value: rlhf/rl/roles.py, shared with GRPO/RLOO; the loop's shared helpers in rlhf/rl/online.py).

Each iteration: sample a rollout batch, score it, compute per-token KL-penalized rewards and GAE advantages once (no
grad), then run `epochs` passes of clipped policy + value updates over shuffled minibatches."""

from __future__ import annotations

import torch

from rlhf.infra import dist
from rlhf.rl import generation, online, online_plan
from rlhf.maths import losses
from rlhf.experiment.config import Experiment
from rlhf.experiment.online_sections import PPOConfig
from rlhf.rl.roles import Roles, reward_scale
from rlhf.runs.runtime import Plan, Session
from rlhf.inputs import models
from rlhf.experiment.sections import RewardConfig
from rlhf.rl.trajectory import Timer, Trajectory, check_finite, in_chunks, reward_metrics, sampler_correction


def make_roles(ld: models.Loading, p: PPOConfig, sft: dict, rm: dict, tok, ensemble: int = 1) -> Roles:
    """PPO's four roles: policy, reference, reward and value (as the ppo section `p` says), loaded as `ld` says from
    the SFT and RM runs' summaries (the RM's `ensemble` members)."""
    return Roles(ld, sft, rm, tok, reference=p.reference, value=p.value_model, value_scale=reward_scale(p, rm),
                 ensemble=ensemble)


def rollout_stats(roles: Roles, r: generation.Rollout, p: PPOConfig, reward: RewardConfig, rows: int = 0,
                  timer: Timer | None = None) -> Trajectory:
    """Everything the update needs that is computed once per rollout, without gradients, `rows` sequences per pass
    (0 = all at once), at p.temperature: old log-probs and entropy, values, reference log-probs, the exact per-token
    KL to the reference (losses.exact_kl, from both distributions), and the reward model's score when it takes part
    in the `reward`. `timer` gets the seconds of each pass (policy, value, ref, score)."""
    timer, temperature = timer or Timer(), p.temperature

    @torch.no_grad()
    def passes(part: generation.Rollout) -> Trajectory:
        with timer("policy"):
            policy, hidden = generation.response_log_softmax(roles.model, part, temperature,
                                                             with_hidden=p.value_model == "shared")
            logp, entropy = losses.token_logprobs(policy, part.response), losses.entropy_from_log_softmax(policy)
        with timer("value"):
            if hidden is not None:
                values = roles.values(part, hidden)
            else:
                with roles.active("value"):
                    values = roles.values(part)
        with timer("ref"):
            ref_logp, kl = roles.ref_logprobs(part, temperature, policy)
        del policy
        out = Trajectory(logp=logp, entropy=entropy, values=values, ref_logp=ref_logp, kl=kl)
        if reward.model:
            with timer("score"):
                out.raw_score = roles.score(part)
        return out

    return in_chunks(passes, r, rows)


def micro_step(roles: Roles, p: PPOConfig, r: generation.Rollout, old: Trajectory, adv: torch.Tensor,
               returns: torch.Tensor, m: torch.Tensor, weight: float, step: int = 0, timer: Timer | None = None) -> dict:
    """One micro-batch's PPO losses, backpropagated with `weight` (its share of the minibatch's tokens). With a
    separate value model the policy loss is backpropagated under the policy adapter and the value loss under the
    value adapter, each inside its own block (see Roles.active); the sum's gradient is the same, since neither loss
    depends on the other's parameters. Returns the micro-batch's statistics; `timer` gets the seconds of each
    forward + backward (update_policy, update_value)."""
    shared = p.value_model == "shared"
    timer = timer or Timer()
    with timer("update_policy"):
        logp, entropy, hidden = generation.response_logprobs(roles.model, r, p.temperature, shared,
                                                             entropy_grad=p.ent_coef != 0)
        is_weight = sampler_correction(p, old.logp, r.sample_logp, m)
        pg, stats = losses.policy_loss(logp, old.logp, adv, m, p.cliprange, is_weight)
        loss = pg - p.ent_coef * losses.masked_mean(entropy, m)
        if shared:
            vf, vf_stats = losses.value_loss(roles.values(r, hidden), old.values, returns, m, p.cliprange_value)
            loss = loss + p.vf_coef * vf
        check_finite("ppo", step, loss=loss)
        (loss * weight).backward()
    if not shared:
        with timer("update_value"), roles.active("value"):
            vf, vf_stats = losses.value_loss(roles.values(r), old.values, returns, m, p.cliprange_value)
            check_finite("ppo", step, loss=vf)
            (p.vf_coef * vf * weight).backward()
    return {"policy_loss": pg.item(), "value_loss": vf.item(), **stats, **vf_stats}


PARTS = ("generate", "policy", "value", "ref", "score", "reward_fns", "judge", "update_policy", "update_value",
         "optimizer")
"""The timed parts of a PPO iteration (throughput's `<part>_s_per_step`): reward_fns is the reward functions' time
(roles.Scorer times it inside the scoring)."""


def prepare(exp: Experiment) -> Plan:
    return online_plan.policy_plan(exp, "ppo", with_rm=True)  # the value model starts from the RM, whatever reward.model says


def train(exp: Experiment, resume: bool = True) -> dict:
    p = exp.ppo
    plan = online_plan.resolve(exp, "ppo", p, prepare=lambda: prepare(exp))  # everything known before loading
    s = online.setup(plan, Session.start(exp, plan.inputs, resume=resume),
                     lambda q: make_roles(q.loading, p, q.data.sft, q.data.rm, q.data.tok, q.ensemble))
    roles = s.roles
    kl_ctl = losses.KLController(p.kl_coef, p.target_kl, p.kl_horizon, p.adaptive_kl)
    if s.state:  # resumed: the controller's beta as checkpointed
        kl_ctl.beta = s.state["kl_beta"]
    for step in s.iterations():
        # ---- rollout: sample responses, then score them once (old log-probs, reference, values, reward)
        rows = s.prompts(p.rollout_batch)
        with s.rollout():
            r = s.generate(rows, do_sample=not p.greedy)
            st = rollout_stats(roles, r, p, exp.reward, s.score_rows, s.timer)
        mask = r.mask.float()
        scored = s.score(st.raw_score, rows, r, step)
        judged = s.measure(step)  # the judge measures this policy, before its update (every judge_every iterations)
        score = scored.total - p.missing_eos_penalty * (~r.ended).float()
        # the per-token penalty is beta x the sampled log-ratio (k1) or k3; the KL logged and controlled: the exact one
        rewards, kl_est = losses.kl_penalized_rewards(score, st.logp, st.ref_logp, mask, kl_ctl.beta, p.kl_estimator)
        penalty, kl = kl_ctl.beta * kl_est.sum(1), st.kl
        if p.whiten_rewards:  # TRL 0.25.1's: the per-token rewards whitened, their mean kept, before GAE
            rewards = losses.masked_whiten(rewards, mask, shift_mean=False, total=dist.all_reduce_)
        adv, returns = losses.gae(rewards, st.values, mask, p.gamma, p.lam)
        if p.whiten_advantages:
            adv = losses.masked_whiten(adv, mask, total=dist.all_reduce_)
        check_finite("ppo", step, reward=score, kl=kl, advantages=adv)

        # ---- update: PPO epochs over shuffled minibatches, gradient accumulation over micro-batches
        with s.update():
            for epoch in range(p.num_ppo_epochs):
                epoch_kl = [0.0, 0.0]  # approx_kl x tokens, tokens
                for mb in torch.randperm(s.rb).split(s.mb_rows):
                    s.opt.zero_grad(set_to_none=True)
                    # each micro-batch's token-mean loss is weighted by its share of the minibatch's tokens (over all
                    # ranks): the update is the same whatever the split into micro-batches and ranks
                    mb_tokens = s.total(mask[mb].sum())
                    for micro in mb.split(s.micro_rows):
                        m = mask[micro]
                        w = float(m.sum())
                        out = micro_step(roles, p, r.slice(micro), st.rows(micro), adv[micro], returns[micro], m,
                                         w / max(mb_tokens, 1.0), step, s.timer)
                        s.accumulate(out, m)
                        epoch_kl[0] += out["approx_kl"] * w
                        epoch_kl[1] += w
                    s.optimizer_step(p.max_grad_norm)
                # early stop on the epoch's approx_kl: token-weighted over all its micro-batches and ranks
                kl_epoch = s.total(epoch_kl)
                if p.target_kl_stop and kl_epoch[0] / max(kl_epoch[1], 1.0) > p.target_kl_stop:
                    break

        # ---- the KL controller, and what the iteration logs (over the global rollout batch)
        seq_kl = s.gather(kl).sum(1).mean().item()
        kl_ctl.update(seq_kl, p.rollout_batch)
        metrics = {
            **reward_metrics(score, penalty),  # before the KL penalty, and the penalty on its own
            **({"reward/raw_mean": s.gather(st.raw_score[:, 0]).mean().item()} if st.raw_score is not None else {}),
            "kl/ref": seq_kl, "kl/beta": kl_ctl.beta, **s.responses(r, st.entropy),
            "explained_variance": losses.explained_variance(s.gather(st.values), s.gather(returns), s.gather(mask)),
            **s.update_stats(), "epochs": epoch + 1, **s.logged(r, st.logp, scored, judged),
        }
        if s.end_iteration(step, metrics, rows, scored, ("score", score), kl_beta=kl_ctl.beta):
            break  # the judge fell significantly from its peak (overopt_stop)

    # ---- final: the trained policy against the starting (SFT) policy on held-out prompts
    return s.finish(PARTS, {"kl_beta_final": kl_ctl.beta}, {"value_model": p.value_model})
