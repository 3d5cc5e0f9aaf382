"""The machinery online RL stages share (PPO, GRPO, RLOO): the roles on one (4-bit) base through LoRA adapters, the
prompt order, scoring a rollout with the reward model and reward functions, global whitening and gradient reduction
over ranks, NaN stops, timers, and checkpoints with every RNG. The algorithms themselves live in ppo.py and grpo.py,
their maths in losses.py.

    policy    = base + "policy" adapter (starts as the SFT adapter, trained)
    reference = base + frozen SFT adapter "ref" (reference=sft), the base with adapters disabled (=base), or none
    reward    = base + frozen RM adapter "reward" + the RM's score head (when the reward model is used)
    value     = PPO only: base + "value" adapter (starts as the RM adapter, trained) + value head (starts as the RM
                head), or (value_model=shared) a value head on the policy's own final hidden states"""

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

from . import data, dist, generation, lineage, losses, models, records, rewards
from .config import Experiment
from .runtime import Interrupted, Plan, stop_requested, upstream_sft


class NonFiniteError(RuntimeError):
    pass


def check_finite(stage: str, step: int, **tensors) -> None:
    """Stop on NaN/inf - on every rank together when data parallel (a lone rank stopping would hang the others)."""
    for name, t in tensors.items():
        if dist.any_rank(not bool(torch.isfinite(torch.as_tensor(t)).all())):
            raise NonFiniteError(f"{stage.upper()} step {step}: {name} is NaN/inf; stopping (the last good checkpoint "
                                 f"is kept)")


class Roles:
    """The policy, reference, reward and value on one base; switches adapters and keeps only ours trainable.
    `rm` is the reward model's run summary (None: no reward model); `value` is None (no critic), "separate" or
    "shared"; `value_scale` the (mean, std) the value head's start divides the RM head by."""

    def __init__(self, exp: Experiment, sft: dict, rm: dict | None, tok, *, reference: str | None,
                 value: str | None = None, value_scale: tuple[float, float] = (0.0, 1.0)):
        self.exp, self.tok, self.reference, self.value = exp, tok, reference, value
        base = models.load_base(exp, sft["model"]["base_path"], "causal", tok)
        self.model = models.load_adapter(base, sft["model"]["adapter"], "policy", trainable=True)
        if reference == "sft":
            models.load_adapter(self.model, sft["model"]["adapter"], "ref")
        dev, self.dtype = models.device(exp), models.DTYPES[exp.model.dtype]
        self.reward_head = self.value_head = None
        if rm is not None:
            models.load_adapter(self.model, rm["model"]["adapter"], "reward")
            self.reward_head = models.reward_head(rm["model"]["adapter"], dev)
        if value == "separate":
            models.load_adapter(self.model, rm["model"]["adapter"], "value", trainable=True)
        if value:  # the value head starts as the RM head on PPO's reward scale: (raw - mean) / std needs a bias too
            head = self.reward_head.weight.data
            mean, std = value_scale
            self.value_head = torch.nn.Linear(head.shape[1], 1, bias=True).to(dev, torch.float32)
            self.value_head.weight.data.copy_(head / std)
            self.value_head.bias.data.fill_(-mean / std)
        for m in self.model.modules():  # the policy ratio needs the same function at rollout and update time
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        self.adapters = ["policy"] + (["value"] if value == "separate" else [])
        """The trained adapters (checkpointed)."""
        self.trainable = [p for n, p in self.model.named_parameters() if any(f".{a}." in n for a in self.adapters)]
        if self.value_head is not None:
            self.trainable += list(self.value_head.parameters())
        self.use("policy")

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
    def ref_logprobs(self, r: generation.Rollout, temperature: float, policy: torch.Tensor | None = None):
        """The reference's log-probs (B, R) of the response tokens at `temperature`. With `policy`, the policy's
        log-softmax at the same positions and temperature (generation.response_log_softmax), returns (log-probs,
        the exact per-token KL(policy || reference), 0 outside the mask): the one KL every stage logs."""
        with self.active("ref" if self.reference == "sft" else None):
            if policy is None:
                return generation.response_logprobs(self.model, r, temperature)[0]
            ref_all, _ = generation.response_log_softmax(self.model, r, temperature)
        kl = losses.exact_kl(policy, ref_all) * r.mask
        return losses.token_logprobs(ref_all, r.response), kl


class Scorer:
    """A rollout's reward: reward.model x the RM's score on the stage's scale ((raw - mean) / std) plus each reward
    function x its weight (functions that return None for a response are left out of its sum, as TRL does). Also
    scores the task's ground truth (when the experiment names no functions of its own) for the log. `section` and
    `pool` (the stage's section and its number of prompts) give the functions' trainer_state its steps and epoch."""

    def __init__(self, exp: Experiment, roles: Roles, scale: tuple[float, float] = (0.0, 1.0), section=None,
                 pool: int = 0):
        self.roles, self.scale, self.w_model = roles, scale, exp.reward.model
        self.device = models.device(exp)  # the rollout's: function scores join the RM's and the EOS penalty there
        self.fns = rewards.configured(exp)
        judges, self.judged_by = rewards.judges(exp)
        self.judges = judges if not self.fns else []
        self.steps = getattr(section, "steps", 0)
        per_step = getattr(section, "rollout_batch", 0) // getattr(section, "num_generations", 1)
        self.steps_per_epoch = pool / per_step if pool and per_step else 0.0
        self.log = rewards.Log()
        """What the functions logged in the last call (log_metric, log_extra)."""

    def __call__(self, raw: torch.Tensor | None, rows: list[dict], texts: list[str], timer: "Timer",
                 completion_ids: list[list[int]] | None = None, step: int = 1):
        """(total (B,), {component: per-row scores, None where a function does not apply}) of `rows`' responses
        `texts` (token ids `completion_ids`) at iteration `step`; `raw` is the RM's raw score (Roles.score, None when
        reward.model is 0)."""
        total, parts, self.log = None, {}, rewards.Log()
        if self.w_model:
            total = (raw - self.scale[0]) / self.scale[1] * self.w_model
        if self.fns or self.judges:
            done = step - 1  # iterations finished before this rollout (TRL: optimizer steps so far)
            epoch = done / self.steps_per_epoch if self.steps_per_epoch else 0.0
            state = rewards.trainer_state(done, self.steps, epoch)
            prompts = [row["prompt"] for row in rows]
            with timer("reward_fns"):
                scores = rewards.score(self.fns + self.judges, prompts, texts, rows, completion_ids=completion_ids,
                                       state=state, log=self.log)
            parts = {f.name: scores[f.path] for f in self.fns}
            if self.fns:
                summed = rewards.weighted_sum(self.fns, scores, prompts, unscored_ok=total is not None)
                extra = torch.tensor([0.0 if x is None else x for x in summed], dtype=torch.float32,
                                     device=self.device)
                total = extra if total is None else total + extra.to(total.dtype)
            if self.judges:  # logged under the name win rates use
                parts["ground_truth"] = scores[self.judges[0].path]
        if self.fns and self.w_model:  # the reward model's part, on the stage's scale, beside the functions'
            parts["model"] = ((raw - self.scale[0]) / self.scale[1]).tolist()
        return total, parts

    def metrics(self, parts: dict[str, list]) -> dict[str, float]:
        """The step's reward components over every rank: `reward/<name>`, the mean over the responses a component
        applies to (absent when none), `reward/<function>/none`, how many responses a function returned None for,
        and what the functions logged with log_metric (`reward_fn/<name>`, averaged)."""
        keys = sorted(parts)
        t = torch.tensor([[sum(x for x in parts[k] if x is not None), sum(x is not None for x in parts[k]),
                           sum(x is None for x in parts[k])] for k in keys], dtype=torch.float64).reshape(-1, 3)
        dist.all_reduce_(t)
        fn_names = {f.name for f in self.fns}
        out = {}
        for k, (s, n, none) in zip(keys, t.tolist()):
            if n:
                out[f"reward/{k}"] = s / n
            if k in fn_names:
                out[f"reward/{k}/none"] = int(none)
        return {**out, **dist.mean_scalars(self.log.means())}


def reward_metrics(reward: torch.Tensor, penalty: torch.Tensor, group: int = 0) -> dict[str, float]:
    """The reward an online stage logs, over every rank's rows: `reward/mean` and `reward/std` of the reward before
    any KL penalty (the score, less the EOS penalty: comparable across PPO, GRPO and RLOO), `reward/kl_penalty` the
    mean KL penalty subtracted from it for the update (0 where the KL is a loss term); with `group` (G), also
    `reward/group_std` and `groups/zero_std_frac` (groups whose G rewards are all equal), before the penalty too."""
    a, pen = dist.all_gather_rows(reward), dist.all_gather_rows(penalty)
    out = {"reward/mean": a.mean().item(), "reward/std": a.std().item(), "reward/kl_penalty": pen.mean().item()}
    if group:
        group_std = a.view(-1, group).std(1)
        out.update({"reward/group_std": group_std.mean().item(),
                    "groups/zero_std_frac": (group_std == 0).float().mean().item()})
    return out


def reward_scale(section, rm: dict | None) -> tuple[float, float]:
    """(mean, std) an online stage's `section` puts the RM's raw score on: the RM stage's held-out statistics when
    section.normalize_reward (and there is a reward model), else (0, 1)."""
    if rm is None or not section.normalize_reward:
        return 0.0, 1.0
    return rm["reward_stats"]["mean"], rm["reward_stats"]["std"]


def in_chunks(fn, r: generation.Rollout, rows: int) -> dict:
    """fn(part) -> {name: tensor with a row per sequence} over `rows` sequences of `r` at a time (0 = all at once),
    concatenated: the no-grad passes of a rollout in bounded pieces (ppo/grpo forward_batch)."""
    n = r.input_ids.shape[0]
    rows = rows or n
    parts = [fn(r.slice(torch.arange(i, min(i + rows, n)))) for i in range(0, n, rows)]
    return {k: torch.cat([part[k] for part in parts]) for k in parts[0]}


def policy_plan(exp: Experiment, stage: str, with_rm: bool) -> Plan:
    """An online RL stage's inputs, before any model loads: the SFT run it starts from, the reward model's run (when
    `with_rm`), the prompts it samples and the held-out rows of its end-of-run check."""
    rewards.configured(exp)  # an import path that does not resolve fails here, before any model is loaded
    splits = data.load(exp)
    sft_dir, sft, tok = upstream_sft(exp, stage)
    splits.render(tok)  # conversational prompts -> text with the SFT tokenizer's chat template
    upstream, rm = {"sft": (sft_dir, sft)}, None
    if with_rm:
        rm_dir, rm = upstream_rm(exp, stage, sft_dir, sft, tok)
        upstream["rm"] = (rm_dir, rm)
    prompts = splits.prompts(exp.data.ppo_prompts)
    ids = {"train": [q["id"] for q in prompts], "eval": [r["id"] for r in splits.eval[: exp.eval.prompts]]}
    inputs = {"sft_run": str(sft_dir), "rm_run": str(upstream["rm"][0]) if rm else None, "data": splits.source,
              "train_ids": ids["train"]}
    return Plan.make(exp, stage, inputs, ids, upstream, sft=sft, rm=rm, tok=tok, prompts=prompts, splits=splits)


def save_and_check(exp: Experiment, session, roles: Roles, rows: list[dict], stage: str,
                   per_pass: int) -> tuple[Path, dict]:
    """The trained policy adapter saved (rank 0), then compared with SFT on the held-out `rows` (evaluate)."""
    from . import evaluate

    adapter, final = session.run.dir / "adapter", {}
    if dist.is_main():  # the final comparison is rank 0's (the other ranks hold the same policy)
        roles.model.save_pretrained(adapter, selected_adapters=["policy"])
        roles.tok.save_pretrained(adapter / "policy")  # the adapter dir the summary names loads on its own
        with session.probe.phase("eval"):
            final = evaluate.policy_vs_sft(exp, roles, roles.tok, rows, stage, per_pass)
    return adapter, final


def end_iteration(stage: str, o, session, step: int, t0: float, metrics: dict, history: list[dict], samples,
                  roles: Roles, opt, order: PromptOrder, ckpt_dir: Path, **state) -> None:
    """An iteration's record: memory figures, the metrics line, a few `samples` (score name, [prompt, response,
    score] rows[, {column: values} the reward functions logged with log_extra, one value per response of the batch,
    added as columns]) every o.log_samples_every, the iteration's time; then a checkpoint every o.save_steps, at the
    end or on a stop request (rank 0: the ranks hold the same state), after which a stop raises Interrupted."""
    session.probe.sample(step)
    metrics.update({f"memory/{k}": v for k, v in session.probe.read().items()})
    session.log(step, metrics)
    history.append(metrics)
    if o.log_samples_every and step % o.log_samples_every == 0:
        name, rows, extra = (*samples, {})[:3]
        columns = ["prompt", "response", name, *extra]
        rows = [[*row, *(v[i] if i < len(v) else None for v in extra.values())] for i, row in enumerate(rows)]
        session.tracker.table("samples", columns, rows)
        session.run.log(step, {"samples": rows, **({"sample_columns": columns} if extra else {})})
    metrics["time/step_s"] = time.time() - t0  # the whole iteration: rollout, update, bookkeeping
    stop = dist.any_rank(stop_requested()) and step < o.steps  # every rank stops at the same step
    if ((o.save_steps and step % o.save_steps == 0) or step == o.steps or stop) and dist.is_main():
        save_checkpoint(roles, opt, step, ckpt_dir, order=order, history=history, metrics_lines=session.run.lines,
                        **state)
    if stop:
        raise Interrupted(f"{stage} stopped at step {step} with a checkpoint in {ckpt_dir}; rerun the same command "
                          f"to resume")


def summarize(history: list[dict], kl_band: list[float], parts: tuple[str, ...]) -> tuple[dict, dict]:
    """(metrics, throughput) of a finished run: the last five iterations' mean KL to the reference (and whether it
    is inside `kl_band`) and reward; the mean seconds per iteration, in all and by part."""
    last = history[-min(5, len(history)):]
    kl_last = sum(h["kl/ref"] for h in last) / len(last)  # the exact KL to the reference (kl/ref), as kl_band

    def mean(k):
        return sum(h.get(k, 0.0) for h in history) / len(history)

    return ({"train_kl_ref_last5": kl_last, "kl_within_band": kl_band[0] <= kl_last <= kl_band[1],
             "train_reward_last5": sum(h["reward/mean"] for h in last) / len(last)},
            {"tokens_per_s": mean("tokens_per_s"), "rollout_s_per_step": mean("time/rollout_s"),
             "update_s_per_step": mean("time/update_s"), "step_s": mean("time/step_s"),
             **{f"{k}_s_per_step": mean(f"time/{k}_s") for k in parts}})


def upstream_rm(exp: Experiment, stage: str, sft_dir: Path, sft: dict, tok) -> tuple[Path, dict]:
    """The reward model's run a policy stage scores with; refused when it sits on another base or was trained from
    another SFT adapter than the one the stage starts from."""
    rm_dir, rm = records.latest(exp, "rm", stage)
    records.check_same_base(exp, rm, "rm", stage, models.tokenizer_hash(tok))
    rm_sft = rm.get("lineage", {}).get("upstream", {}).get("sft", {}).get("adapter_sha256")
    sft_sha = lineage.adapter_sha256(sft["model"]["adapter"])
    if rm_sft and sft_sha and rm_sft != sft_sha:
        raise records.StageInputError(f"{stage}: the reward model {rm_dir} was trained from another SFT adapter than "
                                      f"the latest SFT run {sft_dir}. Rerun `make rm` (or `make {stage}`).")
    return rm_dir, rm


class PromptOrder:
    """Prompts in a seeded shuffled order, reshuffled each time the pool runs out; checkpointed with its RNG."""

    def __init__(self, n: int, seed: int):
        self.n, self.rng, self.order = n, random.Random(seed), []

    def take(self, k: int) -> list[int]:
        if len(self.order) < k:
            extra = list(range(self.n))
            self.rng.shuffle(extra)
            self.order += extra
        out, self.order = self.order[:k], self.order[k:]
        return out

    def state(self) -> dict:
        return {"order": list(self.order), "prompt_rng": self.rng.getstate()}

    def restore(self, state: dict) -> None:
        version, inner, gauss_next = state["prompt_rng"]
        self.rng.setstate((version, tuple(inner), gauss_next))
        self.order = list(state["order"])


def optimizer_settings(p) -> dict:
    """An online section's AdamW settings, passed alike to either optimizer (sections.OnlineConfig)."""
    return dict(lr=p.learning_rate, betas=(p.adam_beta1, p.adam_beta2), eps=p.adam_epsilon,
                weight_decay=p.weight_decay)


def make_optimizer(params, p) -> torch.optim.Optimizer:
    """The online section `p`'s optimizer over `params`: torch's AdamW or bitsandbytes' paged 8-bit AdamW, with the
    same learning rate, betas, eps and weight decay (never either library's own defaults)."""
    if p.optim == "paged_adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW8bit(params, **optimizer_settings(p))
    # foreach: one kernel per step over all tensors (the default on CUDA only; same values on a CPU, fewer launches)
    return torch.optim.AdamW(params, **optimizer_settings(p), foreach=True)


def whiten_global(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """losses.masked_whiten with the mean and variance over every rank's rows (the global rollout batch)."""
    s = dist.all_reduce_(torch.stack([(x * mask).sum(), mask.sum()]).double())
    mean = (s[0] / s[1].clamp(min=1)).to(x.dtype)
    v = dist.all_reduce_(torch.stack([((x - mean) ** 2 * mask).sum(), mask.sum()]).double())
    var = (v[0] / v[1].clamp(min=1)).to(x.dtype)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def average_gradients(params: list[torch.Tensor]) -> None:
    """Sum the trainable parameters' gradients over ranks, in one flat buffer. Each rank's loss is already divided by
    the minibatch's global normalizer, so the sum is the gradient of the global minibatch loss."""
    if not dist.active():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = dist.all_reduce_(torch.cat([g.reshape(-1).float() for g in grads]))
    i = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[i:i + n].view_as(g).to(g.dtype)
        i += n


def global_means(weighted: dict[str, float]) -> dict[str, float]:
    """Micro-batch statistics x their weights (key "_w": the weights' sum), summed over ranks, as weighted means."""
    keys = sorted(weighted)
    tot = dict(zip(keys, dist.all_reduce_(torch.tensor([weighted[k] for k in keys], dtype=torch.float64)).tolist()))
    return {k: tot[k] / max(tot["_w"], 1.0) for k in keys if k != "_w"}


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


def save_checkpoint(roles: Roles, opt, step: int, ckpt_dir: Path, *, order: PromptOrder, history: list[dict],
                    metrics_lines: int, **state) -> None:
    """Everything the next iteration depends on: the trained adapters (and value head), the optimizer, the prompt
    order (position + its RNG), every RNG, the history the summary averages, how many metrics lines were written,
    and the stage's own `state` (PPO: the KL controller's beta). Tensors go to safetensors (the optimizer's state to
    a tensors-only torch file, loaded with weights_only=True), the rest to JSON: loading a checkpoint never runs
    code. Written into a temp dir and renamed, so a kill never leaves a half-written one."""
    tmp = ckpt_dir / f".step-{step}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    roles.model.save_pretrained(tmp, selected_adapters=roles.adapters)
    if roles.value_head is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in roles.value_head.state_dict().items()},
                  str(tmp / "value_head.safetensors"))
    rng_tensors, rng_json = rng_states()
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    torch.save(opt.state_dict(), tmp / "optimizer.pt")
    records.atomic_write(tmp / "state.json", json.dumps({
        **state, "step": step, **order.state(), "rng": rng_json, "history": history, "metrics_lines": metrics_lines}))
    final = ckpt_dir / f"step-{step}"
    if final.exists():  # a resumed run passing a step it had checkpointed before it was killed
        shutil.rmtree(final)
    tmp.rename(final)
    records.atomic_write(ckpt_dir / "last", final.name + "\n")


def load_checkpoint(roles: Roles, opt, order: PromptOrder, path: Path) -> dict:
    """Restore what save_checkpoint wrote; returns its state (step, history and the stage's own)."""
    for name in roles.adapters:
        sub = path / name if (path / name / "adapter_model.safetensors").exists() else path
        weights = load_file(str(sub / "adapter_model.safetensors"), device=str(models.device(roles.exp)))
        unexpected = set_peft_model_state_dict(roles.model, weights, adapter_name=name).unexpected_keys
        if unexpected:
            raise RuntimeError(f"{path}: unexpected keys in the {name} adapter: {unexpected[:3]}")
    if roles.value_head is not None:
        roles.value_head.load_state_dict(load_file(str(path / "value_head.safetensors")))
    state = json.loads((path / "state.json").read_text())
    opt.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    order.restore(state)
    set_rng_states(load_file(str(path / "rng.safetensors")), state["rng"])
    roles.use("policy")
    return state
