"""GRPO and RLOO, top to bottom: online RL without a critic, on the roles of rlhf/rollout.py (policy, reference,
reward on one base; no value adapter). Each iteration samples `num_generations` (G) responses per prompt in one batch,
scores them with the `reward` section (reward model and/or reward functions), turns each reward into an advantage
relative to its group (GRPO: (r - group mean) / group std; RLOO: r - mean of the group's other responses), then runs
`epochs` passes of the clipped surrogate over shuffled minibatches, with beta * KL to the reference as a per-token
loss term (kl_penalty=loss) or subtracted from the reward (kl_penalty=reward). The stages' own config sections are
`grpo` and `rloo`; their maths is in rlhf/losses.py (group_advantages, group_policy_loss)."""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from . import dist, generation, losses
from .config import ConfigError, Experiment
from .rollout import (PromptOrder, Roles, Scorer, Timer, average_gradients, check_finite, end_iteration,
                      global_means, in_chunks, load_checkpoint, make_optimizer, policy_plan, reward_scale,
                      save_and_check, summarize)
from .runtime import Plan, Session

BASELINE = {"grpo": "mean", "rloo": "loo"}


def prepare(exp: Experiment, stage: str = "grpo") -> Plan:
    return policy_plan(exp, stage, with_rm=bool(exp.reward.model))  # the RM's adapter only when it takes part


def prepare_rloo(exp: Experiment) -> Plan:
    return prepare(exp, "rloo")


def needs_old_logprobs(g) -> bool:
    """The sampling policy's log-probs need their own no-grad pass only when the policy moves before the update
    reaches a response (several epochs or minibatches), or when the KL is part of the reward."""
    return g.epochs > 1 or g.minibatch < g.rollout_batch or (g.beta > 0 and g.kl_penalty == "reward")


def rollout_stats(roles: Roles, r: generation.Rollout, g, rows: int, timer: Timer) -> dict:
    """What the update needs from the sampled batch, `rows` sequences per pass: the old log-probs (when
    needs_old_logprobs), the reference's (when beta > 0) and the reward model's raw score (when it takes part)."""

    @torch.no_grad()
    def passes(part: generation.Rollout) -> dict:
        out = {}
        if needs_old_logprobs(g):
            with timer("policy"):
                out["logp"] = generation.response_logprobs(roles.model, part, g.temperature)[0]
        if g.beta:
            with timer("ref"):
                out["ref_logp"] = roles.ref_logprobs(part, g.temperature)
        if roles.reward_head is not None:
            with timer("score"):
                out["raw_score"] = roles.score(part)
        return out

    return in_chunks(passes, r, rows)


def train(exp: Experiment, resume: bool = True, stage: str = "grpo") -> dict:
    g = getattr(exp, stage)
    where = exp.source or "config"
    G = g.num_generations
    rb, mb_rows, micro_rows = (dist.per_device(getattr(g, k), f"{stage}.{k}", where)
                               for k in ("rollout_batch", "minibatch", "micro_batch"))
    if rb % G:
        raise ConfigError(f"{where}: {stage}.rollout_batch / processes ({rb}) must be a multiple of "
                          f"{stage}.num_generations ({G}): each rank samples whole groups")
    plan = prepare(exp, stage)
    d = plan.data
    sft, rm, tok, prompts, splits = d.sft, d.rm, d.tok, d.prompts, d.splits
    session = Session.start(exp, plan, resume=resume)
    with session.probe.phase("load"):
        roles = Roles(exp, sft, rm, tok, reference=g.reference if g.beta else None)
    opt = make_optimizer(roles.trainable, g)
    scorer = Scorer(exp, roles, reward_scale(g, rm))
    order = PromptOrder(len(prompts), exp.seed)  # sampling and minibatch shuffles use torch's seeded RNG
    gen_kwargs = dict(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                      max_prompt_length=exp.data.max_prompt_length, batch_size=g.forward_batch or rb)
    n_prompts = g.rollout_batch // G
    ckpt_dir = session.run.dir / "checkpoints"
    history: list[dict] = []
    first = 1
    if session.checkpoint:
        state = load_checkpoint(roles, opt, order, session.checkpoint)
        history, first = state["history"], state["step"] + 1
    bar = tqdm(range(first, g.steps + 1), desc=stage, unit="it", initial=first - 1, total=g.steps,
               disable=not dist.is_main())
    for step in bar:
        t0 = time.time()
        # ---- rollout: G responses per prompt (each group's rows adjacent), scored once, advantages per group
        rows = [row for row in dist.local_rows([prompts[i] for i in order.take(n_prompts)], n_prompts)
                for _ in range(G)]
        timer = Timer()
        with session.probe.phase("rollout"):
            with timer("generate"):
                r = generation.generate(roles.model, tok, [row["prompt"] for row in rows], **gen_kwargs)
            st = rollout_stats(roles, r, g, g.forward_batch, timer)
        mask = r.mask.float()
        texts = generation.decode(tok, r)
        reward, parts = scorer(st.get("raw_score"), rows, texts, timer)
        reward = reward - g.missing_eos_penalty * (~r.ended).float()
        if g.beta and g.kl_penalty == "reward":
            reward = reward - g.beta * ((st["logp"] - st["ref_logp"]) * mask).sum(1)
        adv = losses.group_advantages(reward, G, BASELINE[stage], g.scale_rewards)
        check_finite(stage, step, reward=reward, advantages=adv)
        t_rollout = time.time() - t0

        # ---- update: `epochs` passes over shuffled minibatches, gradient accumulation over micro-batches
        t1 = time.time()
        grad_norms: list[float] = []
        loss_sum = 0.0
        weighted: dict[str, float] = {"_w": 0.0}  # micro-batch stats x their token counts (global means)
        sampled_logp, entropy = torch.zeros_like(mask), torch.zeros_like(mask)  # first pass: the sampler's own
        loss_ref = st.get("ref_logp") if g.kl_penalty == "loss" else None
        roles.model.train()  # gradient checkpointing (when configured) acts in train mode only; dropout is off
        with session.probe.phase("update"):
            for epoch in range(g.epochs):
                for mb in torch.randperm(rb).split(mb_rows):
                    opt.zero_grad(set_to_none=True)
                    # the loss is divided by the whole minibatch's responses (or tokens) over every rank
                    denom = float(dist.all_reduce_(torch.tensor(float(len(mb)) if g.loss_norm == "sequence"
                                                                else mask[mb].sum().item(), dtype=torch.float64)))
                    for micro in mb.split(micro_rows):
                        m = mask[micro]
                        logp, ent, _ = generation.response_logprobs(roles.model, r.slice(micro), g.temperature,
                                                                    entropy_grad=False)
                        old = st["logp"][micro] if "logp" in st else logp.detach()
                        loss, stats = losses.group_policy_loss(
                            logp, old, adv[micro], m, g.clip_range, loss_ref[micro] if loss_ref is not None else None,
                            g.beta if loss_ref is not None else 0.0, g.loss_norm, max(denom, 1.0))
                        check_finite(stage, step, loss=loss)
                        loss.backward()
                        if epoch == 0:
                            sampled_logp[micro], entropy[micro] = logp.detach(), ent.detach()
                        w = float(m.sum())
                        weighted["_w"] += w
                        loss_sum += loss.item()  # the micro-batches' parts add up to the minibatch's loss
                        for k, v in stats.items():
                            weighted[k] = weighted.get(k, 0.0) + v * w
                    average_gradients(roles.trainable)
                    grad_norms.append(float(torch.nn.utils.clip_grad_norm_(roles.trainable, g.max_grad_norm)))
                    opt.step()
        roles.model.eval()
        t_update = time.time() - t1

        # ---- bookkeeping: diagnostics over the global rollout batch, samples, checkpoints
        logp0 = st.get("logp", sampled_logp)
        seq_kl = ((logp0 - st["ref_logp"]) * mask).sum(1) if "ref_logp" in st else torch.zeros_like(reward)
        a = {k: dist.all_gather_rows(v) for k, v in {"reward": reward, "kl": seq_kl, "mask": mask,
                                                     "ended": r.ended.float(), "entropy": entropy}.items()}
        group_std = a["reward"].view(-1, G).std(1)
        parts = dist.mean_scalars({f"reward/{k}": sum(v) / len(v) for k, v in parts.items()})
        n_tokens = int(dist.all_reduce_(r.attention_mask.sum().double()))
        metrics = {
            "reward/mean": a["reward"].mean().item(), "reward/std": a["reward"].std().item(),
            "reward/group_std": group_std.mean().item(), "groups/zero_std_frac": (group_std == 0).float().mean().item(),
            "kl/ref": a["kl"].mean().item(), "entropy": losses.masked_mean(a["entropy"], a["mask"]).item(),
            "response/length": a["mask"].sum(1).mean().item(), "response/eos_frac": a["ended"].mean().item(),
            **global_means(weighted), "policy_loss": float(dist.all_reduce_(torch.tensor(loss_sum))) / len(grad_norms),
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "time/rollout_s": t_rollout, "time/update_s": t_update, **{f"time/{k}_s": v for k, v in timer.s.items()},
            "tokens_per_s": n_tokens / (t_rollout + t_update), **parts,
        }
        bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", kl=f"{metrics['kl/ref']:.2f}")
        samples = ("reward", [[row["prompt"], t, round(float(x), 3)] for row, t, x in zip(rows[:4], texts[:4],
                                                                                           reward[:4])])
        end_iteration(stage, g, session, step, t0, metrics, history, samples, roles, opt, order, ckpt_dir)

    # ---- final: the trained policy against the starting (SFT) policy on held-out prompts
    adapter, final = save_and_check(exp, session, roles, splits.eval[: exp.eval.prompts], stage,
                                    g.forward_batch or g.rollout_batch)
    metrics, throughput = summarize(history, g.kl_band, ("generate", "policy", "ref", "score", "reward_fns"))
    if not g.beta:  # no reference pass: no KL to report
        metrics.update(train_kl_ref_last5=None, kl_within_band=None)
    return session.finish({
        "metrics": {**final, **metrics, "steps": g.steps, "episodes": g.steps * g.rollout_batch},
        "throughput": throughput,
        "model": {**sft["model"], "adapter": str(adapter) + "/policy", "reference": g.reference},
    })


def train_rloo(exp: Experiment, resume: bool = True) -> dict:
    return train(exp, resume, "rloo")
