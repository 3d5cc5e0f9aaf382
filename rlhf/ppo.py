"""PPO stage, top to bottom. One (4-bit) base is loaded once and serves four roles through LoRA adapters (policy,
reference, reward, value: rlhf/roles.py, shared with GRPO/RLOO; the loop's shared helpers in rlhf/online.py).

Each iteration: sample a rollout batch, score it, compute per-token KL-penalized rewards and GAE advantages once (no
grad), then run `epochs` passes of clipped policy + value updates over shuffled minibatches."""

from __future__ import annotations

import time

import torch

from . import dist, generation, losses, models, online
from .config import Experiment
from .online import Timer, Trajectory, check_finite, in_chunks, policy_plan, reward_metrics
from .roles import Roles, reward_scale
from .runtime import Plan


def make_roles(exp: Experiment, sft: dict, rm: dict, tok) -> Roles:
    """PPO's four roles: policy, reference, reward and value."""
    p = exp.ppo
    return Roles(exp, sft, rm, tok, reference=p.reference, value=p.value_model, value_scale=reward_scale(p, rm))


def rollout_stats(roles: Roles, r: generation.Rollout, temperature: float, rows: int = 0,
                  timer: Timer | None = None) -> Trajectory:
    """Everything the update needs that is computed once per rollout, without gradients, `rows` sequences per pass
    (0 = all at once): old log-probs and entropy, values, reference log-probs, the exact per-token KL to the
    reference (losses.exact_kl, from both distributions), reward. `timer` gets the seconds of each pass (policy,
    value, ref, score)."""
    timer = timer or Timer()

    @torch.no_grad()
    def passes(part: generation.Rollout) -> Trajectory:
        with timer("policy"):
            policy, hidden = generation.response_log_softmax(roles.model, part, temperature,
                                                             with_hidden=roles.exp.ppo.value_model == "shared")
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
        if roles.exp.reward.model:
            with timer("score"):
                out.raw_score = roles.score(part)
        return out

    return in_chunks(passes, r, rows)


def micro_step(roles: Roles, r: generation.Rollout, old: Trajectory, adv: torch.Tensor, returns: torch.Tensor,
               m: torch.Tensor, weight: float, step: int = 0, timer: Timer | None = None) -> dict:
    """One micro-batch's PPO losses, backpropagated with `weight` (its share of the minibatch's tokens). With a
    separate value model the policy loss is backpropagated under the policy adapter and the value loss under the
    value adapter, each inside its own block (see Roles.active); the sum's gradient is the same, since neither loss
    depends on the other's parameters. Returns the micro-batch's statistics; `timer` gets the seconds of each
    forward + backward (update_policy, update_value)."""
    p = roles.exp.ppo
    shared = p.value_model == "shared"
    timer = timer or Timer()
    with timer("update_policy"):
        logp, entropy, hidden = generation.response_logprobs(roles.model, r, p.temperature, shared,
                                                             entropy_grad=p.ent_coef != 0)
        pg, stats = losses.policy_loss(logp, old.logp, adv, m, p.clip_range)
        loss = pg - p.ent_coef * losses.masked_mean(entropy, m)
        if shared:
            vf, vf_stats = losses.value_loss(roles.values(r, hidden), old.values, returns, m, p.clip_range_value)
            loss = loss + p.vf_coef * vf
        check_finite("ppo", step, loss=loss)
        (loss * weight).backward()
    if not shared:
        with timer("update_value"), roles.active("value"):
            vf, vf_stats = losses.value_loss(roles.values(r), old.values, returns, m, p.clip_range_value)
            check_finite("ppo", step, loss=vf)
            (p.vf_coef * vf * weight).backward()
    return {"policy_loss": pg.item(), "value_loss": vf.item(), **stats, **vf_stats}


PARTS = ("generate", "policy", "value", "ref", "score", "reward_fns", "judge", "update_policy", "update_value",
         "optimizer")
"""The timed parts of a PPO iteration (throughput's `<part>_s_per_step`): reward_fns is the reward functions' time
(roles.Scorer times it inside the scoring)."""


def prepare(exp: Experiment) -> Plan:
    return policy_plan(exp, "ppo", with_rm=True)  # the value model starts from the RM, whatever reward.model says


def train(exp: Experiment, resume: bool = True) -> dict:
    p = exp.ppo
    s = online.setup(exp, "ppo", p, resume, prepare=lambda: prepare(exp),
                     make_roles=lambda d: make_roles(exp, d.sft, d.rm, d.tok))
    tok, prompts = s.data.tok, s.data.prompts
    session, roles, opt, scorer, order = s.session, s.roles, s.opt, s.scorer, s.order
    rb, mb_rows, micro_rows, gen_kwargs, bar = s.rb, s.mb_rows, s.micro_rows, s.gen_kwargs, s.bar
    kl_ctl = losses.KLController(p.kl_coef, p.target_kl, p.kl_horizon, p.adaptive_kl)
    if s.state:  # resumed: the controller's beta as checkpointed
        kl_ctl.beta = s.state["kl_beta"]
    with models.dequantized(roles.model, s.copy):  # a run-long dequantized base, where it fits (memplan)
        for step in bar:
            t0 = time.time()
            # ---- rollout: sample responses, then score them once (old log-probs, reference, values, reward)
            rows = dist.local_rows([prompts[i] for i in order.take(p.rollout_batch)], p.rollout_batch)
            batch = [row["prompt"] for row in rows]
            timer = Timer()
            with session.probe.phase("rollout"):
                with timer("generate"):
                    r = generation.generate(roles.model, tok, batch, **gen_kwargs, do_sample=not p.greedy,
                                            desc="rollout")
                st = rollout_stats(roles, r, p.temperature, s.score_rows, timer)
            mask = r.mask.float()
            gap = online.sampler_gap(r.sample_logp, st.logp, mask)
            texts = generation.decode(tok, r)
            score, parts = scorer(st.raw_score, rows, texts, timer, generation.response_ids(r), step)
            with timer("judge"):  # every judge_every iterations, before the update (keep=judge may keep this policy)
                judged = s.judge.measure(step)
            score = score - p.missing_eos_penalty * (~r.ended).float()
            # the per-token penalty is beta x the sampled log-ratio (k1); the KL logged and controlled is the exact one
            rewards, k1 = losses.kl_penalized_rewards(score, st.logp, st.ref_logp, mask, kl_ctl.beta)
            penalty, kl = kl_ctl.beta * k1.sum(1), st.kl
            adv, returns = losses.gae(rewards, st.values, mask, p.gamma, p.lam)
            if p.whiten_advantages:
                adv = dist.whiten_global(adv, mask) if dist.active() else losses.masked_whiten(adv, mask)
            check_finite("ppo", step, reward=score, kl=kl, advantages=adv)
            t_rollout = time.time() - t0

            # ---- update: PPO epochs over shuffled minibatches, gradient accumulation over micro-batches
            t1 = time.time()
            grad_norms: list[float] = []
            weighted: dict[str, float] = {"_w": 0.0}  # micro-batch stats x their token counts (global means)
            roles.model.train()  # gradient checkpointing (when configured) acts in train mode only; dropout is off
            epochs_run = 0
            with session.probe.phase("update"):
                for _epoch in range(p.epochs):
                    epoch_kl = [0.0, 0.0]  # approx_kl x tokens, tokens
                    perm = torch.randperm(rb)
                    for mb in perm.split(mb_rows):
                        opt.zero_grad(set_to_none=True)
                        # each micro-batch's token-mean loss is weighted by its share of the minibatch's tokens (over all
                        # ranks): the update is the same whatever the split into micro-batches and ranks
                        mb_tokens = float(dist.all_reduce_(mask[mb].sum().double()))
                        for micro in mb.split(micro_rows):
                            m = mask[micro]
                            w = float(m.sum())
                            out = micro_step(roles, r.slice(micro), st.rows(micro), adv[micro], returns[micro], m,
                                             w / max(mb_tokens, 1.0), step, timer)
                            weighted["_w"] += w
                            epoch_kl[0] += out["approx_kl"] * w
                            epoch_kl[1] += w
                            for k, v in out.items():
                                weighted[k] = weighted.get(k, 0.0) + v * w
                        with timer("optimizer"):
                            dist.average_gradients(roles.trainable)
                            grad_norm = torch.nn.utils.clip_grad_norm_(roles.trainable, p.max_grad_norm)
                            grad_norms.append(float(grad_norm))
                            opt.step()
                    epochs_run += 1
                    # early stop on the epoch's approx_kl: token-weighted over all its micro-batches and ranks
                    kl_epoch = dist.all_reduce_(torch.tensor(epoch_kl, dtype=torch.float64)).tolist()
                    if p.target_kl_stop and kl_epoch[0] / max(kl_epoch[1], 1.0) > p.target_kl_stop:
                        break
            roles.model.eval()
            t_update = time.time() - t1

            # ---- bookkeeping: KL controller, diagnostics, samples, checkpoints (over the global rollout batch)
            g = {k: dist.all_gather_rows(v) for k, v in {
                "kl": kl, "mask": mask, "ended": r.ended.float(),
                "entropy": st.entropy, "values": st.values, "returns": returns}.items()}
            seq_kl = g["kl"].sum(1).mean().item()
            kl_ctl.update(seq_kl, p.rollout_batch)
            n_tokens = int(dist.all_reduce_(r.attention_mask.sum().double()))
            # the update's loss statistics: token-weighted over every micro-batch of every rank (what one process
            # running the whole rollout batch as one micro-batch would log); grad_norm is the same on every rank
            local = {**dist.global_means(weighted), "grad_norm": sum(grad_norms) / len(grad_norms), "epochs": epochs_run}
            parts = scorer.metrics(parts)  # reward/<component>, reward/<function>/none, reward_fn/<logged>
            metrics = {
                **reward_metrics(score, penalty),  # before the KL penalty, and the penalty on its own
                **({"reward/raw_mean": dist.all_gather_rows(st.raw_score[:, 0]).mean().item()} if st.raw_score is not None
                   else {}),
                "kl/ref": seq_kl, "kl/beta": kl_ctl.beta,
                "entropy": losses.masked_mean(g["entropy"], g["mask"]).item(),
                "response/length": g["mask"].sum(1).mean().item(), "response/eos_frac": g["ended"].mean().item(),
                "explained_variance": losses.explained_variance(g["values"], g["returns"], g["mask"]),
                **local, "time/rollout_s": t_rollout, "time/update_s": t_update,
                **{f"time/{k}_s": v for k, v in timer.s.items()},
                "tokens_per_s": n_tokens / (t_rollout + t_update), **gap, **parts, **judged,
            }
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", kl=f"{seq_kl:.2f}", beta=f"{kl_ctl.beta:.3f}")
            samples = ("score", [[q, a, round(float(s), 3)] for q, a, s in zip(batch[:4], texts[:4], score[:4])],
                       scorer.log.extra)  # + the columns reward functions logged with log_extra
            if s.end_iteration(step, t0, metrics, samples, kl_beta=kl_ctl.beta):
                break  # the judge fell significantly from its peak (overopt_stop)

    # ---- final: the trained policy against the starting (SFT) policy on held-out prompts
    return s.finish(PARTS, {"kl_beta_final": kl_ctl.beta}, {"value_model": p.value_model})


