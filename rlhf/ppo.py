"""PPO stage, top to bottom. One (4-bit) base is loaded once and serves four roles through LoRA adapters:

    policy    = base + "policy" adapter (starts as the SFT adapter, trained)
    reference = base + frozen SFT adapter "ref" (ppo.reference=sft) or the base with adapters disabled (=base)
    reward    = base + frozen RM adapter "reward" + the RM's score head
    value     = base + "value" adapter (starts as the RM adapter, trained) + value head (starts as the RM head),
                or (ppo.value_model=shared) a value head on the policy's own final hidden states

Each iteration: sample a rollout batch, score it, compute per-token KL-penalized rewards and GAE advantages once (no
grad), then run `epochs` passes of clipped policy + value updates over shuffled minibatches."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from . import data, dist, generation, lineage, losses, models, records
from .config import Experiment
from .runtime import Interrupted, Plan, Session, stop_requested, upstream_sft


class NonFiniteError(RuntimeError):
    pass


class KLController:
    """beta of the KL penalty: fixed, or adapted toward target_kl (Ziegler et al. 2019, proportional control)."""

    def __init__(self, beta: float, target: float, horizon: int, adaptive: bool):
        self.beta, self.target, self.horizon, self.adaptive = beta, target, horizon, adaptive

    def update(self, kl: float, n: int) -> None:
        if self.adaptive:
            error = max(-0.2, min(0.2, kl / self.target - 1))
            self.beta *= 1 + error * n / self.horizon


class Roles:
    """The policy, reference, reward and value on one base; switches adapters and keeps only ours trainable."""

    def __init__(self, exp: Experiment, sft: dict, rm: dict, tok):
        p = exp.ppo
        self.exp, self.tok = exp, tok
        base = models.load_base(exp, sft["model"]["base_path"], "causal", tok)
        self.model = models.load_adapter(base, sft["model"]["adapter"], "policy", trainable=True)
        if p.reference == "sft":
            models.load_adapter(self.model, sft["model"]["adapter"], "ref")
        models.load_adapter(self.model, rm["model"]["adapter"], "reward")
        dev, dtype = models.device(exp), models.DTYPES[exp.model.dtype]
        self.reward_head = models.reward_head(rm["model"]["adapter"], dev)
        head = self.reward_head.weight.data
        if p.value_model == "separate":
            models.load_adapter(self.model, rm["model"]["adapter"], "value", trainable=True)
        # the value head starts as the RM head on PPO's reward scale: (raw - mean) / std needs a bias as well
        mean, std = reward_scale(exp, rm)
        self.value_head = torch.nn.Linear(head.shape[1], 1, bias=True).to(dev, torch.float32)
        self.value_head.weight.data.copy_(head / std)
        self.value_head.bias.data.fill_(-mean / std)
        for m in self.model.modules():  # PPO's ratio needs the same function at rollout and update time
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        self.trainable = [p for n, p in self.model.named_parameters()
                          if ".policy." in n or (".value." in n and exp.ppo.value_model == "separate")]
        self.trainable += list(self.value_head.parameters())
        self.use("policy")
        self.dtype = dtype

    def use(self, adapter: str) -> None:
        """Activate an adapter and restore which parameters train."""
        self.model.base_model.set_adapter(adapter)
        ids = {id(p) for p in self.trainable}
        for prm in self.model.parameters():
            prm.requires_grad_(id(prm) in ids)

    @contextlib.contextmanager
    def active(self, adapter: str | None):
        """Run under `adapter` (None: adapters disabled) and come back to the policy after. A backward pass through
        a graph built under an adapter must run inside the same block: gradient checkpointing recomputes each
        layer's forward during the backward with whichever adapter is active then."""
        try:
            if adapter is None:
                with self.model.disable_adapter():
                    yield
            else:
                self.use(adapter)
                yield
        finally:
            self.use("policy")

    def trunk(self):
        return models.trunk(self.model)

    @torch.no_grad()
    def score(self, r: generation.Rollout) -> torch.Tensor:
        """The frozen reward model's raw score of each prompt + response."""
        with self.active("reward"):
            return generation.reward_score(self.trunk(), self.reward_head, r, self.tok.pad_token_id)

    def values(self, r: generation.Rollout, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Value (B, R) at each position that predicts a response token: the value head on `hidden` (the policy's
        own hidden states, value_model=shared) or on a forward pass under the active adapter (the caller activates
        "value" and keeps it active through the backward)."""
        if hidden is None:
            hidden = generation.trunk_hidden(self.trunk(), r)[:, -r.response.shape[1] - 1:-1]
        return self.value_head(hidden.float()).squeeze(-1)

    @torch.no_grad()
    def ref_logprobs(self, r: generation.Rollout, temperature: float) -> torch.Tensor:
        with self.active("ref" if self.exp.ppo.reference == "sft" else None):
            logp, _, _ = generation.response_logprobs(self.model, r, temperature)
        return logp


def reward_scale(exp: Experiment, rm: dict) -> tuple[float, float]:
    """(mean, std) that PPO normalizes the RM's raw score with (the RM stage's held-out statistics)."""
    return (rm["reward_stats"]["mean"], rm["reward_stats"]["std"]) if exp.ppo.normalize_reward else (0.0, 1.0)


def make_optimizer(params, p) -> torch.optim.Optimizer:
    if p.optim == "paged_adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW8bit(params, lr=p.learning_rate)
    return torch.optim.AdamW(params, lr=p.learning_rate, eps=1e-5, weight_decay=0.0)


def _finite(step: int, **tensors) -> None:
    """Stop on NaN/inf - on every rank together when data parallel (a lone rank stopping would hang the others)."""
    for name, t in tensors.items():
        if dist.any_rank(not bool(torch.isfinite(torch.as_tensor(t)).all())):
            raise NonFiniteError(f"PPO step {step}: {name} is NaN/inf; stopping (the last good checkpoint is kept)")


def whiten_global(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """losses.masked_whiten with the mean and variance over every rank's rows (the global rollout batch)."""
    s = dist.all_reduce_(torch.stack([(x * mask).sum(), mask.sum()]).double())
    mean = (s[0] / s[1].clamp(min=1)).to(x.dtype)
    v = dist.all_reduce_(torch.stack([((x - mean) ** 2 * mask).sum(), mask.sum()]).double())
    var = (v[0] / v[1].clamp(min=1)).to(x.dtype)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def average_gradients(params: list[torch.Tensor]) -> None:
    """Sum the trainable parameters' gradients over ranks, in one flat buffer. Each rank's loss is already divided by
    the minibatch's global token count, so the sum is the gradient of the global minibatch loss."""
    if not dist.active():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = dist.all_reduce_(torch.cat([g.reshape(-1).float() for g in grads]))
    i = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[i:i + n].view_as(g).to(g.dtype)
        i += n


class Timer:
    """Seconds spent per named part of a step (`with timer("ref"): ...`), summed until reset."""

    def __init__(self):
        self.s: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t0


def rollout_stats(roles: Roles, r: generation.Rollout, temperature: float, rows: int = 0,
                  timer: Timer | None = None) -> dict:
    """Everything the update needs that is computed once per rollout, without gradients, `rows` sequences per pass
    (0 = all at once): old log-probs and entropy, values, reference log-probs, reward. `timer` gets the seconds of
    each pass (policy, value, ref, score)."""
    n = r.input_ids.shape[0]
    timer = timer or Timer()
    if rows and rows < n:
        parts = [rollout_stats(roles, r.slice(torch.arange(i, min(i + rows, n))), temperature, timer=timer)
                 for i in range(0, n, rows)]
        return {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
    with torch.no_grad():
        with timer("policy"):
            logp, entropy, hidden = generation.response_logprobs(roles.model, r, temperature,
                                                                 with_hidden=roles.exp.ppo.value_model == "shared")
        with timer("value"):
            if hidden is not None:
                values = roles.values(r, hidden)
            else:
                with roles.active("value"):
                    values = roles.values(r)
        with timer("ref"):
            ref_logp = roles.ref_logprobs(r, temperature)
        with timer("score"):
            score = roles.score(r)
    return {"logp": logp, "entropy": entropy, "values": values, "ref_logp": ref_logp, "raw_score": score}


def micro_step(roles: Roles, r: generation.Rollout, old: dict, adv: torch.Tensor, returns: torch.Tensor,
               m: torch.Tensor, weight: float, step: int = 0) -> dict:
    """One micro-batch's PPO losses, backpropagated with `weight` (its share of the minibatch's tokens). With a
    separate value model the policy loss is backpropagated under the policy adapter and the value loss under the
    value adapter, each inside its own block (see Roles.active); the sum's gradient is the same, since neither loss
    depends on the other's parameters. Returns the micro-batch's statistics."""
    p = roles.exp.ppo
    shared = p.value_model == "shared"
    logp, entropy, hidden = generation.response_logprobs(roles.model, r, p.temperature, shared,
                                                         entropy_grad=p.ent_coef != 0)
    pg, stats = losses.policy_loss(logp, old["logp"], adv, m, p.clip_range)
    loss = pg - p.ent_coef * losses.masked_mean(entropy, m)
    if shared:
        vf, vf_stats = losses.value_loss(roles.values(r, hidden), old["values"], returns, m, p.clip_range_value)
        loss = loss + p.vf_coef * vf
    _finite(step, loss=loss)
    (loss * weight).backward()
    if not shared:
        with roles.active("value"):
            vf, vf_stats = losses.value_loss(roles.values(r), old["values"], returns, m, p.clip_range_value)
            _finite(step, loss=vf)
            (p.vf_coef * vf * weight).backward()
    return {"policy_loss": pg.item(), "value_loss": vf.item(), **stats, **vf_stats}


def prepare(exp: Experiment) -> Plan:
    splits = data.load(exp)
    sft_dir, sft, tok = upstream_sft(exp, "ppo")
    splits.render(tok)  # conversational prompts -> text with the SFT tokenizer's chat template
    rm_dir, rm = records.latest(exp, "rm", "ppo")
    records.check_same_base(exp, rm, "rm", "ppo", models.tokenizer_hash(tok))
    rm_sft = rm.get("lineage", {}).get("upstream", {}).get("sft", {}).get("adapter_sha256")
    sft_sha = lineage.adapter_sha256(sft["model"]["adapter"])
    if rm_sft and sft_sha and rm_sft != sft_sha:
        raise records.StageInputError(f"ppo: the reward model {rm_dir} was trained from another SFT adapter than the "
                                      f"latest SFT run {sft_dir}. Rerun `make rm` (or `make ppo`).")
    prompts = splits.prompts(exp.data.ppo_prompts)
    ids = {"train": [q["id"] for q in prompts], "eval": [r["id"] for r in splits.eval[: exp.eval.prompts]]}
    return Plan.make(exp, "ppo", {"sft_run": str(sft_dir), "rm_run": str(rm_dir), "data": splits.source,
                                  "train_ids": ids["train"]}, ids, {"sft": (sft_dir, sft), "rm": (rm_dir, rm)},
                     sft=sft, rm=rm, tok=tok, prompts=prompts, splits=splits)


def train(exp: Experiment, resume: bool = True) -> dict:
    p = exp.ppo
    where = exp.source or "config"
    # data parallel: each rank samples its share of every global rollout batch and updates on its share of each
    # minibatch; gradients and the statistics that must be global (whitening, KL, metrics) are reduced over ranks
    rb, mb_rows, micro_rows = (dist.per_device(getattr(p, k), f"ppo.{k}", where)
                               for k in ("rollout_batch", "minibatch", "micro_batch"))
    plan = prepare(exp)
    sft, rm, tok, prompts, splits = (plan.ctx[k] for k in ("sft", "rm", "tok", "prompts", "splits"))
    session = Session.start(exp, plan, resume=resume)
    with session.probe.phase("load"):
        roles = Roles(exp, sft, rm, tok)
    opt = make_optimizer(roles.trainable, p)
    kl_ctl = KLController(p.kl_coef, p.target_kl, p.kl_horizon, p.adaptive_kl)
    mean, std = reward_scale(exp, rm)
    rng = random.Random(exp.seed)  # the prompt order; sampling and minibatch shuffles use torch's seeded RNG
    order: list[int] = []
    gen_kwargs = dict(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                      max_prompt_length=exp.data.max_prompt_length, batch_size=p.forward_batch or rb,
                      do_sample=not p.greedy)
    ckpt_dir = session.run.dir / "checkpoints"
    history: list[dict] = []
    first = 1
    if session.checkpoint:
        state = load_checkpoint(roles, opt, kl_ctl, rng, session.checkpoint)
        order, history, first = state["order"], state["history"], state["step"] + 1
    bar = tqdm(range(first, p.steps + 1), desc="ppo", unit="it", initial=first - 1, total=p.steps,
               disable=not dist.is_main())
    for step in bar:
        t0 = time.time()
        # ---- rollout: sample responses, then score them once (old log-probs, reference, values, reward)
        if len(order) < p.rollout_batch:
            extra = list(range(len(prompts)))
            rng.shuffle(extra)
            order += extra
        batch, order = [prompts[i]["prompt"] for i in order[:p.rollout_batch]], order[p.rollout_batch:]
        batch = dist.local_rows(batch, p.rollout_batch)
        timer = Timer()
        with session.probe.phase("rollout"):
            with timer("generate"):
                r = generation.generate(roles.model, tok, batch, **gen_kwargs)
            st = rollout_stats(roles, r, p.temperature, p.forward_batch, timer)
        mask = r.mask.float()
        score = (st["raw_score"] - mean) / std
        score = score - p.missing_eos_penalty * (~r.ended).float()
        rewards, kl = losses.kl_penalized_rewards(score, st["logp"], st["ref_logp"], mask, kl_ctl.beta)
        adv, returns = losses.gae(rewards, st["values"], mask, p.gamma, p.lam)
        if p.whiten_advantages:
            adv = whiten_global(adv, mask) if dist.active() else losses.masked_whiten(adv, mask)
        _finite(step, reward=score, kl=kl, advantages=adv)
        t_rollout = time.time() - t0

        # ---- update: PPO epochs over shuffled minibatches, gradient accumulation over micro-batches
        t1 = time.time()
        grad_norms: list[float] = []
        weighted: dict[str, float] = {"_tokens": 0.0}  # micro-batch stats x their token counts (global means)
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
                        out = micro_step(roles, r.slice(micro), {k: v[micro] for k, v in st.items()}, adv[micro],
                                         returns[micro], m, w / max(mb_tokens, 1.0), step)
                        weighted["_tokens"] += w
                        epoch_kl[0] += out["approx_kl"] * w
                        epoch_kl[1] += w
                        for k, v in out.items():
                            weighted[k] = weighted.get(k, 0.0) + v * w
                    average_gradients(roles.trainable)
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
        texts = generation.decode(tok, r)
        g = {k: dist.all_gather_rows(v) for k, v in {
            "score": score, "raw": st["raw_score"], "kl": kl, "mask": mask, "ended": r.ended.float(),
            "entropy": st["entropy"], "values": st["values"], "returns": returns}.items()}
        seq_kl = g["kl"].sum(1).mean().item()
        kl_ctl.update(seq_kl, p.rollout_batch)
        n_tokens = int(dist.all_reduce_(r.attention_mask.sum().double()))
        # the update's loss statistics: token-weighted over every micro-batch of every rank (what one process
        # running the whole rollout batch as one micro-batch would log); grad_norm is the same on every rank
        keys = sorted(weighted)
        sums = dist.all_reduce_(torch.tensor([weighted[k] for k in keys], dtype=torch.float64)).tolist()
        tot = dict(zip(keys, sums))
        local = {k: tot[k] / max(tot["_tokens"], 1.0) for k in keys if k != "_tokens"}
        local["grad_norm"] = sum(grad_norms) / len(grad_norms)
        local["epochs"] = epochs_run
        if exp.data.source == "synthetic":  # every rank scores the same number of rows: the mean of means is global
            local["reward/ground_truth"] = sum(
                data.gt_reward(q, a, exp.data.synthetic.response_len_min) for q, a in zip(batch, texts)) / len(texts)
        local = {**local, **dist.mean_scalars({k: v for k, v in local.items() if k == "reward/ground_truth"})}
        metrics = {
            "reward/mean": g["score"].mean().item(), "reward/std": g["score"].std().item(),
            "reward/raw_mean": g["raw"].mean().item(), "kl/ref": seq_kl, "kl/beta": kl_ctl.beta,
            "entropy": losses.masked_mean(g["entropy"], g["mask"]).item(),
            "response/length": g["mask"].sum(1).mean().item(), "response/eos_frac": g["ended"].mean().item(),
            "explained_variance": losses.explained_variance(g["values"], g["returns"], g["mask"]),
            **{k: v for k, v in local.items() if k != "reward/ground_truth"},
            "time/rollout_s": t_rollout, "time/update_s": t_update,
            **{f"time/{k}_s": v for k, v in timer.s.items()},
            "tokens_per_s": n_tokens / (t_rollout + t_update),
        }
        if "reward/ground_truth" in local:
            metrics["reward/ground_truth"] = local["reward/ground_truth"]
        session.probe.sample(step)
        for k, v in session.probe.read().items():
            metrics[f"memory/{k}"] = v
        session.log(step, metrics)
        history.append(metrics)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", kl=f"{seq_kl:.2f}", beta=f"{kl_ctl.beta:.3f}")
        if p.log_samples_every and step % p.log_samples_every == 0:
            rows = [[q, a, round(float(s), 3)] for q, a, s in zip(batch[:4], texts[:4], score[:4])]
            session.tracker.table("samples", ["prompt", "response", "score"], rows)
            session.run.log(step, {"samples": rows})
        metrics["time/step_s"] = time.time() - t0  # the whole iteration: rollout, update, bookkeeping
        stop = dist.any_rank(stop_requested()) and step < p.steps  # every rank stops at the same step
        if ((p.save_steps and step % p.save_steps == 0) or step == p.steps or stop) and dist.is_main():
            save_checkpoint(roles, opt, kl_ctl, step, ckpt_dir, rng=rng, order=order, history=history,
                            metrics_lines=session.run.lines)  # the ranks hold the same state: one copy
        if stop:
            raise Interrupted(f"ppo stopped at step {step} with a checkpoint in {ckpt_dir}; rerun the same command "
                              f"to resume")

    # ---- final: the trained policy against the starting (SFT) policy on held-out prompts
    from . import evaluate

    adapter = session.run.dir / "adapter"
    final = {}
    if dist.is_main():  # the final comparison is rank 0's (the other ranks hold the same policy)
        roles.model.save_pretrained(adapter, selected_adapters=["policy"])
        tok.save_pretrained(adapter / "policy")  # the adapter dir the summary names loads on its own
        with session.probe.phase("eval"):
            final = evaluate.policy_vs_sft(exp, roles, tok, splits.eval[: exp.eval.prompts])
    last = history[-min(5, len(history)):]
    kl_last = sum(h["kl/ref"] for h in last) / len(last)
    return session.finish({
        "metrics": {**final, "train_kl_ref_last5": kl_last,
                    "kl_within_band": p.kl_band[0] <= kl_last <= p.kl_band[1],
                    "train_reward_last5": sum(h["reward/mean"] for h in last) / len(last),
                    "kl_beta_final": kl_ctl.beta, "steps": p.steps, "episodes": p.steps * p.rollout_batch},
        "throughput": {"tokens_per_s": sum(h["tokens_per_s"] for h in history) / len(history),
                       "rollout_s_per_step": sum(h["time/rollout_s"] for h in history) / len(history),
                       "update_s_per_step": sum(h["time/update_s"] for h in history) / len(history),
                       "step_s": sum(h["time/step_s"] for h in history) / len(history),
                       **{f"{k[5:-2]}_s_per_step": sum(h[k] for h in history) / len(history)
                          for k in ("time/generate_s", "time/policy_s", "time/value_s", "time/ref_s", "time/score_s")}},
        "model": {**sft["model"], "adapter": str(adapter) + "/policy", "reference": p.reference,
                  "value_model": p.value_model},
    })


def rng_states() -> tuple[dict, dict]:
    """Every RNG's state as (tensors, JSON): nothing in a checkpoint needs pickle to load."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(keys.astype(np.int64))}
    if torch.cuda.is_available():
        tensors.update({f"cuda{i}": t for i, t in enumerate(torch.cuda.get_rng_state_all())})
    return tensors, {"numpy": [kind, int(pos), int(has_gauss), float(gauss)], "python": random.getstate()}


def set_rng_states(tensors: dict, js: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    kind, pos, has_gauss, gauss = js["numpy"]
    np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, state, gauss_next = js["python"]
    random.setstate((version, tuple(state), gauss_next))
    if torch.cuda.is_available() and "cuda0" in tensors:
        torch.cuda.set_rng_state_all([tensors[f"cuda{i}"] for i in range(torch.cuda.device_count())])


def save_checkpoint(roles: Roles, opt, kl_ctl: KLController, step: int, ckpt_dir: Path, *, rng: random.Random,
                    order: list[int], history: list[dict], metrics_lines: int) -> None:
    """Everything the next iteration depends on: the trained adapters and value head, the optimizer, the KL
    controller's beta, the prompt order (position + its RNG), every RNG, the history the summary averages and how
    many metrics lines were written. Tensors go to safetensors (the optimizer's state to a tensors-only torch file,
    loaded with weights_only=True), the rest to JSON: loading a checkpoint never runs code. Written into a temp dir
    and renamed, so a kill never leaves a half-written one."""
    tmp = ckpt_dir / f".step-{step}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    names = ["policy"] + (["value"] if roles.exp.ppo.value_model == "separate" else [])
    roles.model.save_pretrained(tmp, selected_adapters=names)
    save_file({k: v.detach().cpu().contiguous() for k, v in roles.value_head.state_dict().items()},
              str(tmp / "value_head.safetensors"))
    rng_tensors, rng_json = rng_states()
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    torch.save(opt.state_dict(), tmp / "optimizer.pt")
    records.atomic_write(tmp / "state.json", json.dumps({
        "kl_beta": kl_ctl.beta, "step": step, "order": list(order), "prompt_rng": rng.getstate(), "rng": rng_json,
        "history": history, "metrics_lines": metrics_lines}))
    final = ckpt_dir / f"step-{step}"
    if final.exists():  # a resumed run passing a step it had checkpointed before it was killed
        shutil.rmtree(final)
    tmp.rename(final)
    records.atomic_write(ckpt_dir / "last", final.name + "\n")


def load_checkpoint(roles: Roles, opt, kl_ctl: KLController, rng: random.Random, path: Path) -> dict:
    """Restore what save_checkpoint wrote; returns its state (step, order, history)."""
    names = ["policy"] + (["value"] if roles.exp.ppo.value_model == "separate" else [])
    for name in names:
        sub = path / name if (path / name / "adapter_model.safetensors").exists() else path
        weights = load_file(str(sub / "adapter_model.safetensors"), device=str(models.device(roles.exp)))
        unexpected = set_peft_model_state_dict(roles.model, weights, adapter_name=name).unexpected_keys
        if unexpected:
            raise RuntimeError(f"{path}: unexpected keys in the {name} adapter: {unexpected[:3]}")
    roles.value_head.load_state_dict(load_file(str(path / "value_head.safetensors")))
    state = json.loads((path / "state.json").read_text())
    opt.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    kl_ctl.beta = state["kl_beta"]
    version, inner, gauss_next = state["prompt_rng"]
    rng.setstate((version, tuple(inner), gauss_next))
    set_rng_states(load_file(str(path / "rng.safetensors")), state["rng"])
    roles.use("policy")
    return state
