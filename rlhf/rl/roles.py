"""The roles of an online RL stage (PPO, GRPO, RLOO) on one (4-bit) base through LoRA adapters, and the scoring
of a rollout: the reward model's score on the stage's scale plus the reward functions'.

    policy    = base + "policy" adapter (starts as the SFT adapter, trained)
    reference = base + frozen SFT adapter "ref" (reference=sft), the base with adapters disabled (=base), or none
    reward    = base + frozen RM adapter "reward" + the RM's score head (when the reward model is used); with
                rm.ensemble = K, also "reward-1" ... "reward-<K-1>", each with its head
    judge     = base + frozen judge adapter "judge" + its head (when the RM run trained one: data.judge_fraction):
                never part of the reward; it grades the samples (overopt/judge) and the held-out check
    value     = PPO only: base + "value" adapter (starts as the RM adapter, trained) + value head (starts as the RM
                head), or (value_model=shared) a value head on the policy's own final hidden states"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from rlhf.infra import dist
from rlhf.rl import generation, rewards
from rlhf.maths import losses
from rlhf.inputs import models
from rlhf.runs import records
from rlhf.experiment.sections import RewardConfig


class Roles:
    """The policy, reference, reward and value on one base; switches adapters and keeps only ours trainable.
    `rm` is the reward model's run summary (None: no reward model); `value` is None (no critic), "separate" or
    "shared"; `value_scale` the (mean, std) the value head's start divides the RM head by."""

    def __init__(self, ld: models.Loading, sft: dict, rm: dict | None, tok, *, reference: str | None,
                 value: str | None = None, value_scale: tuple[float, float] = (0.0, 1.0), ensemble: int = 1):
        self.tok, self.reference, self.value = tok, reference, value
        base = models.load_base(ld, sft["model"]["base_path"], "causal", tok)
        self.model = models.load_adapter(base, sft["model"]["adapter"], "policy", trainable=True)
        if reference == "sft":
            models.load_adapter(self.model, sft["model"]["adapter"], "ref")
        dev, self.dtype = ld.device, models.DTYPES[ld.model.dtype]
        self.device = dev
        """Where the roles compute (and a rollout's tensors live)."""
        self.reward_head = self.value_head = self.judge_head = None
        self.members: list[tuple[str, torch.nn.Linear]] = []
        """The reward model's members (adapter, head): "reward" first (rm.ensemble: K of them)."""
        if rm is not None:
            self.reward_head = models.load_scorer(self.model, rm["model"]["adapter"], "reward", dev)
            self.members = [("reward", self.reward_head)] + [
                (f"reward-{k}", models.load_scorer(self.model, m["adapter"], f"reward-{k}", dev))
                for k, m in enumerate(ensemble_members(rm, ensemble), 1)]
            if rm.get("judge"):
                self.judge_head = models.load_scorer(self.model, rm["judge"]["adapter"], "judge", dev)
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
        """The frozen reward model's raw scores (B, K) of each prompt + response, one column per member (K = 1
        without an ensemble)."""
        return torch.stack([self.score_by(r, name, head) for name, head in self.members], 1)

    @torch.no_grad()
    def score_by(self, r: generation.Rollout, adapter: str, head: torch.nn.Linear) -> torch.Tensor:
        """The raw score (B,) of each prompt + response by one frozen reward adapter and its head, a response cut
        at max_new_tokens with an EOS appended as the reward model was trained (generation.as_scored)."""
        with self.active(adapter):
            return generation.reward_score(self.trunk(), head, generation.as_scored(r, self.tok.eos_token_id,
                                                                                    self.tok.pad_token_id),
                                           self.tok.pad_token_id)

    def values(self, r: generation.Rollout, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Value (B, R) at each position that predicts a response token: the value head on `hidden` (the policy's
        own hidden states, value_model=shared) or on a forward pass under the active adapter (the caller activates
        "value" and keeps it active through the backward)."""
        if hidden is None:
            hidden = generation.trunk_hidden(self.trunk(), r)[:, -r.response.shape[1] - 1:-1]
        return self.value_head(hidden.float()).squeeze(-1)

    @torch.no_grad()
    def ref_logprobs(self, r: generation.Rollout, temperature: float,
                     policy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the reference's log-probs (B, R) of the response tokens at `temperature`, the exact per-token
        KL(policy || reference), 0 outside the mask: the one KL every stage logs); `policy` is the policy's
        log-softmax at the same positions and temperature (generation.response_log_softmax)."""
        with self.active("ref" if self.reference == "sft" else None):
            ref_all, _ = generation.response_log_softmax(self.model, r, temperature)
        kl = losses.exact_kl(policy, ref_all) * r.mask
        return losses.token_logprobs(ref_all, r.response), kl


@dataclass(frozen=True)
class Scoring:
    """What a rollout's reward is made of, resolved from the experiment once (scoring): reward.model's weight and
    reward.ensemble_lambda, the (mean, std) of each reward member's raw score on the stage's scale (reward_scales),
    the experiment's reward functions and, when it names none, the task's ground truth (logged, not rewarded), and
    the stage's steps and steps per epoch over its prompt pool (the functions' trainer_state)."""

    model: float
    ensemble_lambda: float
    scale: tuple[tuple[float, float], ...]
    functions: tuple[rewards.RewardFn, ...]
    graders: tuple[rewards.RewardFn, ...]
    steps: int = 0
    steps_per_epoch: float = 0.0


def scoring(r: RewardConfig, source: str, scale: list[tuple[float, float]] | None = None, section=None,
            pool: int = 0) -> Scoring:
    """The Scoring of reward section `r` for a stage on data source `source` (its ground truth): `scale` its reward
    members' scales (reward_scales; None: the raw score), `section` and `pool` (the stage's section and its number of
    prompts) give the functions' trainer_state its steps and epoch."""
    fns = rewards.configured(r)
    graders, _ = rewards.graders(r, source)
    per_step = getattr(section, "rollout_batch", 0) // getattr(section, "num_generations", 1)
    return Scoring(r.model, r.ensemble_lambda, tuple(map(tuple, scale or [(0.0, 1.0)])), tuple(fns),
                   tuple(graders if not fns else []), getattr(section, "steps", 0),
                   pool / per_step if pool and per_step else 0.0)


class Scorer:
    """A rollout's reward: reward.model x the RM's score on the stage's scale ((raw - mean) / std) plus each reward
    function x its weight (functions that return None for a response are left out of its sum, as TRL does). Also
    scores the task's ground truth (when the experiment names no functions of its own) for the log. What it adds up is
    its Scoring (scoring), resolved before anything loads."""

    def __init__(self, s: Scoring, roles: Roles | None = None):
        self.roles, self.w_model, self.lam = roles, s.model, s.ensemble_lambda
        self.scale = torch.tensor(s.scale, dtype=torch.float32)
        """(mean, std) of each reward member's raw score on the stage's scale (reward_scales)."""
        # the rollout's: function scores join the RM's and the EOS penalty there (no roles: reward functions alone)
        self.device = roles.device if roles is not None else torch.device("cpu")
        self.fns, self.graders = list(s.functions), list(s.graders)
        self.steps, self.steps_per_epoch = s.steps, s.steps_per_epoch
        self.log = rewards.Log()
        """What the functions logged in the last call (log_metric, log_extra)."""

    def __call__(self, raw: torch.Tensor | None, rows: list[dict], texts: list[str], timer: Callable,
                 completion_ids: list[list[int]] | None = None, step: int = 1):
        """(total (B,), {component: per-row scores, None where a function does not apply}) of `rows`' responses
        `texts` (token ids `completion_ids`) at iteration `step`; `raw` is the RM's raw score (Roles.score, None when
        reward.model is 0); `timer` (a trajectory.Timer) gets the reward functions' seconds."""
        total, parts, self.log = None, {}, rewards.Log()
        model = self.model_score(raw, self.scale) if self.w_model else None
        if self.w_model:
            total = model * self.w_model
        if self.fns or self.graders:
            done = step - 1  # iterations finished before this rollout (TRL: optimizer steps so far)
            epoch = done / self.steps_per_epoch if self.steps_per_epoch else 0.0
            state = rewards.trainer_state(done, self.steps, epoch)
            prompts = [row["prompt"] for row in rows]
            with timer("reward_fns"):
                scores = rewards.score(self.fns + self.graders, prompts, texts, rows, completion_ids=completion_ids,
                                       state=state, log=self.log)
            parts = {f.name: scores[f.path] for f in self.fns}
            if self.fns:
                summed = rewards.weighted_sum(self.fns, scores, prompts, unscored_ok=total is not None)
                extra = torch.tensor([0.0 if x is None else x for x in summed], dtype=torch.float32,
                                     device=self.device)
                total = extra if total is None else total + extra.to(total.dtype)
            if self.graders:  # logged under the name win rates use
                parts["ground_truth"] = scores[self.graders[0].path]
        if self.fns and self.w_model:  # the reward model's part, on the stage's scale, beside the functions'
            parts["model"] = model.tolist()
        if self.w_model and raw.shape[1] > 1:  # how much the ensemble's members disagree
            parts["ensemble_std"] = self.normalized(raw, self.scale).std(1, correction=0).tolist()
        return total, parts

    def columns(self, raw: torch.Tensor | None, parts: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
        """The reward's parts one column each, unweighted, NaN where a function does not apply ((B, K)), and their
        weights ((K,)): the reward model's score on the stage's scale (reward.model), then each reward function's
        (reward.functions), from a call's `raw` and `parts` (multi_objective_aggregation="normalize_then_sum")."""
        cols, weights = [], []
        if self.w_model:
            cols.append(self.model_score(raw, self.scale).float())
            weights.append(self.w_model)
        for f in self.fns:
            cols.append(torch.tensor([math.nan if x is None else float(x) for x in parts[f.name]],
                                     dtype=torch.float32, device=self.device))
            weights.append(f.weight)
        return torch.stack(cols, 1), torch.tensor(weights, dtype=torch.float32, device=self.device)

    @staticmethod
    def normalized(raw: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Raw member scores (B, K) on their scales ((K, 2): mean, std)."""
        scale = scale.to(raw.device)
        return (raw - scale[:, 0]) / scale[:, 1]

    def model_score(self, raw: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The reward model's score (B,) from the members' raw scores (B, K) on `scale`: the member's own (K = 1),
        else mean - reward.ensemble_lambda x std over the members (Coste et al. 2023)."""
        return losses.conservative_score(self.normalized(raw, scale), self.lam)

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


def reward_scale(section, rm: dict | None) -> tuple[float, float]:
    """(mean, std) an online stage's `section` puts the RM's raw score on: the RM stage's held-out statistics when
    section.normalize_reward (and there is a reward model), else (0, 1)."""
    if rm is None or not section.normalize_reward:
        return 0.0, 1.0
    return rm["reward_stats"]["mean"], rm["reward_stats"]["std"]


def reward_scales(section, rm: dict | None, ensemble: int, heldout: bool = False) -> list[tuple[float, float]]:
    """reward_scale of each of the reward model's `ensemble` members (rm.ensemble); `heldout`: each one's held-out statistics
    whatever section.normalize_reward says (the scale of overopt/proxy)."""
    if rm is None:
        return [(0.0, 1.0)]
    stats = [rm["reward_stats"]] + [m["reward_stats"] for m in ensemble_members(rm, ensemble)]
    if not (heldout or section.normalize_reward):
        return [(0.0, 1.0)] * len(stats)
    return [(st["mean"], st["std"]) for st in stats]


def ensemble_members(rm: dict, ensemble: int) -> list[dict]:
    """The records of the reward model's members after the first (`ensemble` - 1 of them: rm.ensemble), from its
    run `rm`."""
    found = rm.get("ensemble") or []
    if len(found) < ensemble - 1:
        raise records.StageInputError(f"rm.ensemble={ensemble} but the reward model run has "
                                      f"{len(found) + 1} member(s); rerun `make rm`")
    return found[: ensemble - 1]
