"""The checks every policy stage ends with and `make eval` reports: held-out generation against the SFT policy, win
rates with their 95% intervals by each grader (reward functions, the task's ground truth, the reward model, the
judge), the KL to the reference, the collapse flags, and the reward model's scores of texts on the policy's base."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf.rl import generation, rewards
from rlhf.maths import losses
from rlhf.inputs import models
from rlhf.runs import records
from rlhf.runs.runtime import check_rm
from rlhf.experiment import stages
from rlhf.experiment.config import Experiment
from rlhf.maths.guard import Z95, margin_accuracy, mean_se, paired, rm_at_chance, wilson, wins
from rlhf.experiment.online_sections import guarded
from rlhf.experiment.sections import EvalConfig, RewardConfig
from rlhf.memory import copies


@dataclass(frozen=True)
class Check:
    """How a stage's held-out check samples and grades, resolved from the experiment before anything loads (plan):
    the eval section, the seed and prompt length its samples use, the merged sampler's copy and rows (the memory
    plan's, copies.sampling), the graders of its win rates and each one's role, what loads the user's judge and
    grader models (the reward section, `loading`) when the check runs, and whether the weights will be sharded."""

    stage: str
    section: object
    """An online stage's config section (its reference and training temperature, for its KL); None offline."""
    eval: EvalConfig
    seed: int
    max_prompt_length: int
    copy: float
    """Bytes of the merged sampler's copy (0: the stage's own model samples), its `planned` rows at a time."""
    planned: int
    graders: tuple
    """The reward functions or the task's ground truth win rates are decided by (rewards.graders), `scored_by`."""
    scored_by: str | None
    roles: dict
    """Each grader's role (grader_role) when it did not select the policy."""
    reward: RewardConfig
    """The user's judge and grader (loaded by the check: rewards.judges, rewards.independent, with `loading`)."""
    loading: models.Loading
    sharding: bool
    """distributed.strategy shards the weights over ranks (FSDP / ZeRO-3): with several ranks the check is skipped
    (can_check)."""
    short: str | None = None
    """A warning when the held-out rows are fewer than eval.prompts (the check is over those there are)."""


GRADERS = ("reward_model", "judge", "reward_functions", "ground_truth", "grader")
"""The names a win rate's grader goes by (eval_win_rates' keys)."""


def plan(exp: Experiment, stage: str, rows: list[dict], sampling: tuple[float, int] | None = None,
         prompts: list[dict] = ()) -> Check:
    """The stage's Check, resolved from the experiment, the reward section's functions checked against the rows
    they will score (rewards.check_calls: the held-out `rows`, and an online stage's training `prompts`); `sampling`:
    the merged sampler's (copy bytes, rows) when the caller has them from the memory plan already (copies.sampling)."""
    d = exp.data
    held = f"the held-out rows ({d.eval_path or d.path or d.source})"
    scored = {held: rows}
    if prompts:
        scored[f"the training prompts ({d.prompts_path or d.path or d.source})"] = prompts
    rewards.check_calls(exp.reward, scored, exp.source or "config")
    short = (f"{stage}: eval.prompts = {exp.eval.prompts}, but {held} are {len(rows)}: every held-out figure is over "
             f"those {len(rows)}" if len(rows) < exp.eval.prompts else None)
    copy, planned = sampling or copies.sampling(exp, stage)  # through the merged sampler, its rows at a time
    fns, by = rewards.graders(exp.reward, exp.data.source)
    online = stages.get(stage).online
    return Check(stage, stages.get(stage).config(exp) if online else None, exp.eval, exp.seed,
                 exp.data.max_prompt_length, copy, planned, tuple(fns), by,
                 {name: grader_role(exp, stage, name) for name in GRADERS}, exp.reward, models.loading(exp),
                 exp.distributed.strategy in ("fsdp", "zero3"), short)


def said(c: Check, rows: list[dict], tok) -> list[str]:
    """The offline checks' warnings (SFT, DPO, KTO, make eval), printed once (dist.warn) and returned for the
    summary: fewer held-out `rows` than eval.prompts (c.short), held-out prompts that sampling cuts
    (generation.cut_prompts), and reference responses (the chosen, or SFT's completion) that need more new tokens
    than eval.max_new_tokens, whose cut policy responses the check counts as not ending (generation.cut_responses; the
    online stages say both with their own limit at setup)."""
    from rlhf.infra import dist

    texts = [t for t in (r.get("chosen") or r.get("completion") for r in rows) if t]
    cut = generation.cut_prompts(tok, {"held-out prompts": [r["prompt"] for r in rows]}, c.max_prompt_length)
    long = generation.cut_responses(tok, texts, {"eval.max_new_tokens": c.eval.max_new_tokens})
    return dist.warn(c.short) + dist.warn(cut and f"{c.stage}: {cut}") + dist.warn(long and f"{c.stage}: {long}")


def latest_rm(exp: Experiment, stage: str, sft_dir: Path, sft: dict, tok) -> tuple[Path | None, dict | None,
                                                                                 str | None]:
    """The latest reward model run (its folder, its summary, None), whose adapters score an offline stage's check
    (preference_check) and `make eval`; (None, None, None) when there is none; (None, None, why) when it was trained on
    another base, tokenizer or SFT adapter than the SFT run `sft_dir` (`sft`, `tok`) the policies start from: it would
    grade other data (or fail to load), so the check goes on without it, and the caller says why (dist.warn); (its
    folder, its summary, why) when it grades but is not shown to rank better than chance (guard.chance_rm): its win
    rates are noise."""
    try:
        rm_dir, rm = records.latest(exp, "rm", stage)
    except records.StageInputError:
        return None, None, None
    try:
        check_rm(exp, stage, rm_dir, rm, sft_dir, sft, tok)
    except records.StageInputError as e:
        return None, None, f"{e} The held-out check goes on without it."
    return rm_dir, rm, grading_rm_at_chance(stage, rm)


def grading_rm_at_chance(stage: str, rm: dict) -> str | None:
    """guard.rm_at_chance for a reward model that grades a check: its win rates are noise too."""
    chance = rm_at_chance(stage, rm)
    return chance and f"{chance}; its win rates (by reward_model) are no evidence either way"


def role(c: Check, name: str, selected_by: str | None = None) -> str:
    """The grader `name`'s role (grader_role), `selected_by` the grader that selected the policy."""
    return "selected and graded by the same judge" if name == selected_by else c.roles[name]


def win_rate(ours: list[float], theirs: list[float]) -> dict:
    """Win = 1, tie = 0.5, loss = 0 per prompt (guard.wins); mean with a normal-approximation 95% interval. Where every
    prompt had the same outcome v (all wins, all ties, all losses) that interval is empty ([v, v]: no spread to
    measure); the interval is then the bound the n prompts do give: at most wilson(0, n)'s upper end u of prompts would
    have another outcome, each moving the mean at most to the far end: [v - u v, v + u (1 - v)]."""
    outcomes = wins(ours, theirs)
    n = len(outcomes)
    mean = sum(outcomes) / n
    if all(o == outcomes[0] for o in outcomes):
        u = wilson(0, n)[1]
        low, high = mean - u * mean, mean + u * (1 - mean)
    else:
        half = Z95 * math.sqrt(sum((o - mean) ** 2 for o in outcomes) / (n - 1)) / math.sqrt(n)
        low, high = mean - half, mean + half
    return {"win_rate": mean, "ci_low": max(0.0, low), "ci_high": min(1.0, high), "n": n,
            "wins": sum(o == 1.0 for o in outcomes), "ties": sum(o == 0.5 for o in outcomes)}


def function_scores(fns: list, rows: list[dict], responses: list[str],
                    completion_ids: list[list[int]] | None = None) -> list[float] | None:
    """The weighted sum of reward functions `fns` over the functions that apply to each response (None: no
    functions). They are called as the reward's are, with trainer_state at step 0; what they log is dropped."""
    if not fns:
        return None
    prompts = [r["prompt"] for r in rows]
    scores = rewards.score(fns, prompts, responses, rows, completion_ids=completion_ids)
    return rewards.weighted_sum(fns, scores, prompts)


def grader_scores(c: Check, rows: list[dict], responses: list[str],
                  completion_ids: list[list[int]] | None = None) -> tuple[list[float] | None, str | None]:
    """The scores win rates are decided by, and by what: the experiment's reward functions, else the task's ground
    truth; (None, None) when there is neither (rewards.graders)."""
    fns = list(c.graders)
    return (function_scores(fns, rows, responses, completion_ids), c.scored_by) if fns else (None, None)


HEADLINE = ("reward_model", "grader", "judge")
"""Whose win rate heads a check without the task's graders (ground truth, reward functions): the reward model's,
else the user's independent grader's, else the judge's."""


def headline(task: str | None, every: dict) -> str | None:
    """The grader whose win rate is the check's eval_win_rate_vs_sft among those that scored (`every`): the task's
    (`task`: ground_truth / reward_functions) when it has one, else the first of HEADLINE; None when none scored. (A
    check graded by the user's grader alone reported no win rate, though it had scored one.)"""
    return task or next((k for k in HEADLINE if k in every), None)


def independent_grader(c: Check) -> list:
    """The user's independent grader (reward.grader_functions, reward.grader_model; loaded by the check), or []."""
    return (rewards.independent(c.reward, c.loading, c.eval.batch_size)
            if c.reward.grader_functions or c.reward.grader_model else [])


def judge_scores(c: Check, rows: list[dict], responses: list[str],
                 completion_ids: list[list[int]] | None = None) -> list[float] | None:
    """The user's judge's scores (reward.judge_functions, reward.judge_model), or None when the judge is the RM
    stage's adapter."""
    return function_scores(rewards.judges(c.reward, c.loading, c.eval.batch_size), rows, responses, completion_ids)


def policy_vs_sft(c: Check, roles, tok, rows: list[dict], sft: dict, per_pass: int = 0,
                  selected_by: str | None = None, cache: dict | None = None) -> dict:
    """An online RL stage's end-of-run check: the trained policy against the SFT adapter on held-out prompts, judged
    as `generation_check` says (reward functions, the task's ground truth, else the reward model). `per_pass`: the
    stage's own rows per pass, so the check stays within the rollout's planned memory; `selected_by` and `cache`:
    generation_check's (with a cache, each grader's per-prompt scores are returned too, as "_scores"); `sft`: the SFT
    run the policy started from."""
    model = roles.model
    if "ref" not in model.peft_config:
        models.load_adapter(model, sft["model"]["adapter"], "ref")
    section = c.section
    prompts = [r["prompt"] for r in rows]
    # the stage's own rows per pass: the check's generation and scoring stay within the rollout's planned memory
    per_pass = per_pass or c.eval.batch_size

    def scorer(adapter, head):
        def scores(texts):
            with roles.active(adapter):
                return reward_scores(model, head, tok, prompts, texts, per_pass)
        return scores
    heads = {"reward_model": ("reward", roles.reward_head), "judge": ("judge", roles.judge_head)}
    if rewards.own_judge(c.reward):  # the user's judge, scored in generation_check, replaces the adapter
        del heads["judge"]
    out = generation_check(c, model, tok, rows, roles.use,
                           {k: scorer(*v) for k, v in heads.items() if v[1] is not None},
                           per_pass=per_pass, reference=section.reference,
                           reference_ctx=lambda: roles.active("ref" if section.reference == "sft" else None),
                           temperature=section.temperature, selected_by=selected_by, cache=cache)
    roles.use("policy")
    return out


def preference_check(c: Check, reference: str, model, tok, sft: dict, rows: list[dict], rm: dict | None) -> dict:
    """The held-out generation check (generation_check) of a policy trained by a TRL preference trainer (DPO, KTO) as
    adapter "default" continuing the SFT adapter, against SFT: the trainer's frozen "ref" copy of it, or with
    `reference` base (adapters disabled: the trainer made no copy) the SFT adapter loaded now. Its KL is to its
    `reference` at temperature 1 (the trainers' log-probs); the reward model and the judge score too, when an RM run
    exists (`rm`: its summary, latest_rm), as adapters on the policy's own base (as in PPO): no second base."""
    if reference != "sft" or "ref" not in model.peft_config:
        models.load_adapter(model, sft["model"]["adapter"], "sft_check")
    names = {"policy": "default", "ref": "ref" if reference == "sft" else "sft_check"}
    prompts = [r["prompt"] for r in rows]

    def use(name):
        model.set_adapter(names[name])

    scorers = {}
    for name, adapter in rm_adapters(rm).items():
        head = models.load_scorer(model, adapter, name, c.loading.device)

        def scores(texts, name=name, head=head):
            model.set_adapter(name)
            return reward_scores(model, head, tok, prompts, texts, c.eval.batch_size)
        scorers[name] = scores

    def reference_ctx():  # the stage's own reference: the SFT adapter, or the base with adapters disabled
        return model.disable_adapter() if reference == "base" else using(use, "ref")

    out = generation_check(c, model, tok, rows, use, scorers, reference=reference,
                           reference_ctx=reference_ctx, temperature=1.0)
    use("policy")
    return out


def generation_check(c: Check, model, tok, rows: list[dict], use, scorers: dict | None = None,
                     per_pass: int = 0, *, reference: str = "sft", reference_ctx=None,
                     temperature: float = 1.0, selected_by: str | None = None, cache: dict | None = None) -> dict:
    """The held-out generation check every policy stage ends with: the policy (adapter "policy" for `use`) and the
    SFT policy ("ref") sample the same prompts under the eval settings and seed. Reports the win rate against SFT
    (by `grader_scores`, else by the reward model: scorers["reward_model"]) and, in `eval_win_rates`, by each of those
    and each of `scorers` ({name: texts -> scores}: "reward_model", "judge"), the fraction of responses that ended
    with EOS (well-terminated) for both, and `eval_kl_ref`: the stage's own KL, as its training `kl/ref` defines it
    (kl_to_reference), to its `reference` ("sft" or "base"; `reference_ctx()` a context in which the model is it,
    default: adapter "ref") at the stage's training `temperature`, on the policy's samples at that temperature.
    Each win rate comes with the paired gain over SFT per prompt on its grader's scale (`gain`) and its grader's
    role (grader_role; `selected_by`: the grader that selected the policy, labelled so); the headline's role is
    `eval_win_rate_grader`. `cache` (a dict, empty at first): SFT's samples and scores are kept in it and reused by
    the next check with the same cache (another policy on the same prompts), and each grader's per-prompt scores
    are returned as "_scores"."""
    rolls, texts = {}, {}
    prompts = [r["prompt"] for r in rows]
    per_pass = per_pass or c.eval.batch_size
    copy = c.copy  # through the merged sampler, its rows at a time, where planned
    sample_rows = c.planned if copy else per_pass
    cached = cache is not None and "roll" in cache
    e = c.eval
    for name in ("policy",) if cached else ("ref", "policy"):
        use(name)
        torch.manual_seed(c.seed)
        rolls[name] = generation.generate(model, tok, prompts, max_new_tokens=e.max_new_tokens,
                                          temperature=e.temperature, top_p=e.top_p,
                                          max_prompt_length=c.max_prompt_length,
                                          batch_size=sample_rows, copy_bytes=copy, desc=f"held-out check ({name})")
        texts[name] = generation.decode(tok, rolls[name])
    if cache is not None:
        rolls["ref"] = cache.setdefault("roll", rolls.get("ref"))
    if reference_ctx is None:
        def reference_ctx():
            return using(use, "ref")
    kl_roll = rolls["policy"]
    if temperature != e.temperature:  # the KL is the stage's: on samples at its own temperature
        use("policy")
        torch.manual_seed(c.seed)
        kl_roll = generation.generate(model, tok, prompts, max_new_tokens=e.max_new_tokens,
                                      temperature=temperature, top_p=1.0,
                                      max_prompt_length=c.max_prompt_length, batch_size=sample_rows,
                                      copy_bytes=copy, desc="held-out check (KL)")
    kl = mean_se(response_kls(model, kl_roll, use, reference_ctx, temperature, per_pass))
    use("policy")
    out = {"eval_kl_ref": kl["mean"], "eval_kl_ref_se": kl["se"], "eval_kl_reference": reference,
           **terminated(rolls["policy"].ended),
           "eval_terminated_sft": rolls["ref"].ended.float().mean().item(), "eval_prompts": len(prompts),
           "eval_mean_length_tokens": rolls["policy"].mask.sum(1).float().mean().item()}
    # SFT's samples are scored too, unless the cache holds their scores (texts then has the policy's alone)
    graded = {k: grader_scores(c, rows, v, generation.response_ids(rolls[k])) for k, v in texts.items()}
    by = graded["policy"][1]
    every = {by: {k: v[0] for k, v in graded.items()}} if by else {}
    for name, fn in (scorers or {}).items():
        every[name] = {k: fn(v) for k, v in texts.items()}
    if rewards.own_judge(c.reward):
        every["judge"] = {k: judge_scores(c, rows, v, generation.response_ids(rolls[k])) for k, v in texts.items()}
    grader = independent_grader(c)
    if grader:
        every["grader"] = {k: function_scores(grader, rows, v, generation.response_ids(rolls[k]))
                           for k, v in texts.items()}
    if cache is not None:  # SFT's scores: drawn by the first check with this cache, reused by the next
        for name, sc in every.items():
            sc["ref"] = cache.setdefault("scores", {}).setdefault(name, sc.get("ref"))
    by = headline(by, every)
    if by is None:
        return {**out, "eval_scored_by": None}
    rates = {}
    for name, sc in every.items():
        wr, gain = win_rate(sc["policy"], sc["ref"]), paired(sc["policy"], sc["ref"])
        rates[name] = {"win_rate": wr["win_rate"], "ci95": [wr["ci_low"], wr["ci_high"]], "n": wr["n"],
                       "wins": wr["wins"], "ties": wr["ties"],
                      "grader": role(c, name, selected_by),
                      "gain": {"mean": gain["mean"], "se": gain["se"], "ci95": gain["ci95"]},
                      "score_policy": sum(sc["policy"]) / len(prompts), "score_sft": sum(sc["ref"]) / len(prompts)}
    if "grader" in rates:  # how often the grader prefers the chosen side of the held-out pairs: its own reliability
        rates["grader"]["pair_accuracy"] = (cache or {}).get("grader_pairs") or pair_accuracy(grader, rows, tok)
        if cache is not None:
            cache["grader_pairs"] = rates["grader"]["pair_accuracy"]
    w = rates[by]
    return {"eval_win_rate_vs_sft": w["win_rate"], "eval_win_rate_vs_sft_ci95": w["ci95"],
            "eval_prompts": len(prompts), "eval_score_policy": w["score_policy"], "eval_score_sft": w["score_sft"], "eval_scored_by": by,
            "eval_win_rate_grader": w["grader"], "eval_win_rates": rates, **out,
            **({"_scores": {k: v["policy"] for k, v in every.items()}} if cache is not None else {})}


def pair_margins(fns: list, pairs: list[dict], tok) -> list[float]:
    """`fns`' score of each pair's chosen response less its rejected one's (each response's token ids and text as the
    stages sample them: generation.as_sampled): how reward functions or a model of the user's rank held-out
    preference pairs."""
    def scores(key: str) -> list[float]:
        sampled = [generation.as_sampled(r[key], tok) for r in pairs]
        return function_scores(fns, pairs, [text for _, text in sampled], [ids for ids, _ in sampled])
    return [a - b for a, b in zip(scores("chosen"), scores("rejected"))]


def pair_accuracy(fns: list, rows: list[dict], tok) -> dict | None:
    """The independent grader (`fns`: reward.grader_functions, reward.grader_model) on the held-out rows' preference
    pairs: how often it scores the chosen response above the rejected one (a tie counts as an error, as for the
    reward model), with n and Wilson's 95% interval; None when the rows hold no pairs."""
    pairs = [r for r in rows if r.get("chosen") is not None and r.get("rejected") is not None]
    if not pairs:
        return None
    return margin_accuracy(pair_margins(fns, pairs, tok))


def grader_role(exp: Experiment, stage: str, name: str, selected_by: str | None = None) -> str:
    """A win rate's grader's role, "independent" only for one that neither trained nor selected the saved policy:
    one the stage optimized ("trained against": the reward model, or the reward functions, in an online stage's
    reward); the reward model of DPO and KTO on the pool's pairs ("fit on the same pairs": the stage trains on the
    pairs the reward model was fit on, so it shares their preferences and shortcuts); the one that chose the policy
    among those the run measured, or where the run ended ("selected and graded by the same judge": keep=judge's
    judge, and the judge of any guarded run with overopt_stop on, whose fall test decided whether it went on; it
    grades on other prompts and samples than those that selected); or one it never saw ("independent": the task's
    ground truth, the judge of a run with keep: last and overopt_stop off, and every other grader of the offline
    stages). A win rate by a trained-against grader says how well the stage optimized it, not how good
    the policy is; by a fit-on-the-same-pairs one, how well it learned what both learned; by the selecting judge, it
    carries whatever errors of the judge the selection favoured."""
    online = stages.get(stage).online
    section = stages.get(stage).config(exp) if online else None
    if name == selected_by or (name == "judge" and online and section.overopt_stop and guarded(exp, section)):
        return "selected and graded by the same judge"
    if name == "reward_model":
        if online:
            return "trained against" if exp.reward.model else "independent"
        return "fit on the same pairs" if stage == "dpo" or (stage == "kto" and exp.kto.path is None) else "independent"
    if name == "reward_functions":
        return "trained against" if online and rewards.trained_functions(exp.reward) else "independent"
    return "independent"


def can_check(c: Check) -> bool:
    """Whether this process runs the held-out generation check: rank 0, and not while the weights are sharded over
    ranks (FSDP / ZeRO-3: a forward pass needs every rank, the check is skipped)."""
    from rlhf.infra import dist

    return dist.is_main() and not (dist.active() and c.sharding)


def terminated(ended: torch.Tensor) -> dict:
    """The fraction of held-out responses that end with EOS (`ended`: one bool per prompt) and its Wilson 95%
    interval."""
    return {"eval_terminated": ended.float().mean().item(), "eval_terminated_ci95": wilson(int(ended.sum()), len(ended))}


def sft_check(c: Check, model, tok, rows: list[dict]) -> dict:
    """The SFT stage's end of the held-out generation check (it is the policy the others are compared with): the
    fraction of well-terminated responses, their mean length and, when the task has a ground truth, their score."""
    prompts = [row["prompt"] for row in rows]
    torch.manual_seed(c.seed)
    e = c.eval
    r = generation.generate(model, tok, prompts, max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                            top_p=e.top_p, max_prompt_length=c.max_prompt_length, batch_size=e.batch_size)
    out = {**terminated(r.ended), "eval_prompts": len(prompts),
           "eval_mean_length_tokens": r.mask.sum(1).float().mean().item()}
    gt, by = grader_scores(c, rows, generation.decode(tok, r), generation.response_ids(r))
    if gt is not None:
        rate = all(x in (0, 1) for x in gt)  # a 0/1 grader's mean is a rate: Wilson's interval, inside [0, 1]
        ci = wilson(int(sum(gt)), len(gt)) if rate else mean_se(gt)["ci95"]
        out.update(eval_score_policy=sum(gt) / len(gt), eval_score_policy_ci95=ci, eval_scored_by=by)
    return out


@contextlib.contextmanager
def using(use, name: str):
    """A context in which `use(name)` is active; back to the policy after."""
    use(name)
    try:
        yield
    finally:
        use("policy")


def kl_to_reference(model, rollout, use, reference_ctx, temperature: float, batch_size: int = 64) -> float:
    """The one KL every stage reports (training `kl/ref`, held-out `eval_kl_ref`): the mean over responses of
    response_kls, in nats per response."""
    kls = response_kls(model, rollout, use, reference_ctx, temperature, batch_size)
    return sum(kls) / max(len(kls), 1)


@torch.no_grad()
def response_kls(model, rollout, use, reference_ctx, temperature: float, batch_size: int = 64) -> list[float]:
    """Each response's sum over its tokens of the exact KL(policy || reference) at `temperature` (losses.exact_kl
    from both distributions: never negative), in nats. The policy is `use("policy")`, the reference the model inside
    `reference_ctx()`; `batch_size` rows per pass."""
    kls = []
    for i in range(0, rollout.response.shape[0], batch_size):
        r = rollout.slice(slice(i, i + batch_size))
        use("policy")
        lp, _ = generation.response_log_softmax(model, r, temperature)
        with reference_ctx():
            lq, _ = generation.response_log_softmax(model, r, temperature)
        kls += (losses.exact_kl(lp, lq) * r.mask).sum(1).tolist()
        del lp, lq
    return kls


def collapse_flags(stage: str, check: dict, max_kl: float, min_terminated: float) -> list[str]:
    """Warnings for a policy that drifted too far from its reference (`eval_kl_ref` above `max_kl`) or stopped
    ending its responses: fewer end than `min_terminated` and than SFT's do (0 = bound off). SFT ending as few
    or fewer is no loss of format by the stage: its responses are cut at eval.max_new_tokens (the held-out length
    warning says how many chosen responses are longer)."""
    flags = []
    kl, term = check.get("eval_kl_ref"), check.get("eval_terminated")
    sft_term = check.get("eval_terminated_sft")
    if max_kl and kl is not None and kl > max_kl:
        flags.append(f"{stage}: the exact KL to the reference ({check.get('eval_kl_reference', 'sft')}) on held-out "
                     f"prompts is {kl:.2f} nats per response, above {stage}.max_kl_ref={max_kl:g}: the policy has "
                     f"drifted far from it (collapse?)")
    if min_terminated and term is not None and term < min_terminated and (sft_term is None or term < sft_term):
        flags.append(f"{stage}: only {term:.0%} of held-out responses end with EOS (SFT: "
                     f"{sft_term if sft_term is not None else float('nan'):.0%}), below {stage}.min_terminated="
                     f"{min_terminated:g}: the responses lost their format")
    return flags


def rm_adapters(rm: dict | None) -> dict[str, str]:
    """The scoring adapters of a reward model run (its summary `rm`, None: no run) by the name win rates use:
    "reward_model" (the RM the online stages optimize; member 0 of an ensemble) and "judge" (trained on pairs no
    stage optimizes against, when data.judge_fraction > 0)."""
    if rm is None:
        return {}
    return {"reward_model": rm["model"]["adapter"], **({"judge": rm["judge"]["adapter"]} if rm.get("judge") else {})}


@torch.no_grad()
def reward_scores(model, head, tok, prompts: list[str], responses: list[str], rows: int) -> list[float]:
    """The reward model's scores of prompt + response texts (EOS-terminated, as it was trained), `rows` at a time,
    with its adapter active on `model` (a PeftModel over the causal base: PPO's roles, DPO's policy) and its `head`
    (models.reward_head): how a policy stage scores with the RM, on its own base."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(prompts), rows):
        texts = [p + generation.eos_terminated(a, tok) for p, a in zip(prompts[i:i + rows], responses[i:i + rows])]
        q, qm = generation.encode_prompts(tok, texts, 10_000, device)
        ro = generation.Rollout(q, qm, q[:, :0], qm[:, :0], torch.ones(len(texts), dtype=torch.bool))
        out += generation.reward_score(models.trunk(model), head, ro, tok.pad_token_id).tolist()
    model.train(was_training)
    return out
