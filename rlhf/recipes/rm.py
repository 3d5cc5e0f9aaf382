"""Reward-model stage: a one-label sequence-classification head on the base, warm-started from the SFT adapter,
trained with TRL's RewardTrainer (Bradley-Terry loss). Reports pairwise accuracy, mean chosen/rejected scores and
margin on held-out pairs, and saves the reward mean/std so the online stages can normalize scores. On the same base
it can also train the judge (on pairs no other stage trains on: data.judge_fraction), which grades the policy
stages beside the reward model, and an ensemble of reward adapters (rm.ensemble) for conservative rewards."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import torch
from datasets import Dataset
from peft import get_peft_model
from trl import RewardConfig, RewardTrainer

from rlhf.infra import dist
from rlhf.maths import losses
from rlhf.maths.guard import chance_rm, margin_accuracy, weak_judge
from rlhf.inputs import data, models
from rlhf.rl.generation import eos_terminated
from rlhf.experiment.config import Experiment
from rlhf.rl.rewards import classifier_scores, judge_spec, judges, own_judge
from rlhf.runs.records import StageInputError
from rlhf.runs.runtime import Plan, Session, preference_plan
from rlhf.recipes.trainers import (RecordCallback, adapter_dtype_as_compute, left_out, named_bars, pair_tokens,
                                   repeated, run, settings, trainable_snapshot, training_args)


@torch.no_grad()
def score(model, tok, prompts: list[str], responses: list[str], batch_size: int = 64) -> torch.Tensor:
    """Reward of each prompt + response (EOS-terminated, as the RM was trained), with the model's active adapter: a
    one-label classifier's scores (rewards.classifier_scores)."""
    model.eval()
    texts = [p + eos_terminated(r, tok) for p, r in zip(prompts, responses)]
    return torch.tensor(classifier_scores(model, tok, texts, True, batch_size))


JUDGE_SEED = 1000
"""The judge trains with seed + JUDGE_SEED (its head's initialisation and data order): its own, apart from the reward
model's (seed) and the ensemble members' (seed + k)."""


def pair_metrics(model, tok, pairs: list[dict], batch_size: int) -> tuple[dict, list[float]]:
    """(metrics, each pair's margin chosen - rejected) of a reward adapter on held-out `pairs`."""
    prompts = [p["prompt"] for p in pairs]
    rc = score(model, tok, prompts, [p["chosen"] for p in pairs], batch_size)
    rr = score(model, tok, prompts, [p["rejected"] for p in pairs], batch_size)
    both, margins = torch.cat([rc, rr]), (rc - rr).tolist()
    return {"accuracy": margin_accuracy(margins)["accuracy"], "loss": losses.bradley_terry(rc, rr).item(),
            "chosen_mean": rc.mean().item(), "rejected_mean": rr.mean().item(), "margin": (rc - rr).mean().item(),
            "reward_mean": both.mean().item(), "reward_std": both.std().item()}, margins


def judge_independence(rm_margins: list[float], judge_margins: list[float]) -> dict:
    """How much of the reward model's errors the judge shares, on the same held-out pairs: the judge's error rate on
    the pairs the RM gets wrong (a judge with errors of its own gets about its overall error rate there; one that
    learned the RM's shortcuts gets most of them wrong too), with its n and 95% interval, beside its overall error
    rate, and Pearson's r of the two margins. `weak`: the judge is wrong on significantly more than half of the RM's
    errors (the low end of Wilson's interval above 0.5): it shares them more than it catches them. Pairs that are hard for any
    model (a small true margin) make some sharing normal: compare with the overall error rate."""
    from rlhf.maths.guard import correlation, wilson

    rm_wrong = [j for r, j in zip(rm_margins, judge_margins, strict=True) if r <= 0]
    overall = sum(j <= 0 for j in judge_margins) / len(judge_margins)
    out = {"judge_error_rate": overall, "rm_errors": len(rm_wrong),
           "margin_correlation": correlation(rm_margins, judge_margins)}
    if rm_wrong:
        k, n = sum(j <= 0 for j in rm_wrong), len(rm_wrong)
        ci = wilson(k, n)
        out.update({"judge_error_rate_on_rm_errors": k / n, "ci95": ci, "weak": ci[0] > 0.5})
    else:
        out["weak"] = False
    return out


def own_judge_check(exp: Experiment, tok, pairs: list[dict], rm_margins: list[float]) -> dict:
    """The user's own judge (reward.judge_functions, reward.judge_model) on the RM's held-out pairs: its accuracy (a
    tie counts as an error, as for the RM) and the errors it shares with the reward model (judge_independence), with
    the judge it was measured for (`judge`: the online stages use the measure only for that judge)."""
    from rlhf.rl.checks import pair_margins

    margins = pair_margins(judges(exp.reward, models.loading(exp), exp.eval.batch_size), pairs, tok)
    acc = margin_accuracy(margins)
    return {"judge": judge_spec(exp.reward), "eval_accuracy": acc["accuracy"], "eval_accuracy_ci95": acc["ci95"],
            "independence": judge_independence(rm_margins, margins)}


def prepare(exp: Experiment) -> Plan:
    return preference_plan(exp, "rm")


def reward_args(exp: Experiment, session: Session, **own) -> RewardConfig:
    """TRL's RewardConfig for the rm section: the TrainConfig fields, data.max_length, and RewardConfig's
    center_rewards_coefficient (0, no centring, as TRL's null); `own` adds to or replaces them (a member's)."""
    return training_args(RewardConfig, settings(exp), exp.rm, session, max_length=exp.data.max_length,
                         center_rewards_coefficient=exp.rm.center_rewards_coefficient or None, **own)


def fit(exp: Experiment, session: Session, sft: dict, tok, pairs: list[dict], eval_pairs: list[dict],
        member: str = "", seed: int | None = None) -> tuple[object, dict]:
    """Train one reward adapter on `pairs`, warm-started from the SFT adapter; (model, record). `member` names a
    second adapter of the same run (the judge, an ensemble member): trained from scratch with `seed` (its score
    head's initialisation and data order), its logs prefixed, saved to <run>/<member>, no checkpoints of its own
    (a killed run resumes the first adapter and trains the others again)."""
    if seed is not None:
        torch.manual_seed(seed)
    with session.probe.phase("load"):
        model = models.load_base(models.loading(exp), sft["model"]["base_path"], "reward", tok)
        model = get_peft_model(model, models.lora_config(exp.lora, "SEQ_CLS"))
        warm = models.warm_start(model, Path(sft["model"]["adapter"]))
    cols = ["prompt", "chosen", "rejected"] + (["margin"] if exp.rm.margin else [])
    train_ds = Dataset.from_list([{k: p[k] for k in cols} for p in pairs])
    own = {"output_dir": str(session.run.dir / member / "checkpoints"), "save_strategy": "no",
           "seed": seed, "data_seed": seed} if member else {}
    args = reward_args(exp, session, **own)
    snapshot = trainable_snapshot(model)
    trainer = adapter_dtype_as_compute(RewardTrainer(model=model, args=args, train_dataset=train_ds,
                                                     processing_class=tok,
                                                     callbacks=[RecordCallback(session, member=member)]),
                                       exp.quantization, snapshot)
    trained = len(trainer.train_dataset)  # TRL's RewardTrainer has left out the pairs longer than data.max_length
    if not trained:
        raise StageInputError(too_long(member, len(pairs), len(pairs), exp.data.max_length))
    warnings = dist.warn(too_long(member, len(pairs) - trained, len(pairs), exp.data.max_length))  # before it trains
    twice, repeats = ([], {}) if member else repeated("rm", "pairs", trainer)  # a member's pairs are the first's
    warnings += twice
    named_bars(trainer, "rm")
    with session.probe.phase("eval"):
        before, _ = pair_metrics(model, tok, eval_pairs, exp.rm.batch_size)
    result, throughput = run(session, trainer, pair_tokens(trainer.train_dataset, exp.rm.epochs),
                             resume=not member)
    with session.probe.phase("eval"):
        after, margins = pair_metrics(trainer.model, tok, eval_pairs, exp.rm.batch_size)
    session.log(result.global_step, {f"eval/{member + '/' if member else ''}{k}": v for k, v in after.items()},
                member=member)
    if member:
        adapter = session.run.dir / member
        if dist.is_main():
            trainer.model.save_pretrained(adapter)
            models.save_tokenizer(tok, adapter)
    else:
        adapter = session.save_adapter(trainer.model, tok)
    return trainer.model, {
        "adapter": str(adapter), "pairs": len(pairs), "pairs_trained": trained, **repeats,
        "seed": exp.seed if seed is None else seed,
        "reward_stats": {"mean": after["reward_mean"], "std": after["reward_std"]},
        "metrics": {"eval_accuracy_before": before["accuracy"], **{f"eval_{k}": v for k, v in after.items()},
                    "eval_accuracy_ci95": margin_accuracy(margins)["ci95"], "train_loss": result.training_loss,
                    "train_steps": result.global_step},
        "throughput": throughput, "warm_start": warm, "margins": margins, "warnings": warnings}


def too_long(member: str, left: int, pairs: int, max_length: int) -> str | None:
    """What TRL's RewardTrainer did with the pairs longer than data.max_length, said: it leaves them out (it filters
    its dataset)."""
    return left_out(f"rm{' ' + member if member else ''}", left, pairs, "training pairs",
                    f"are longer than data.max_length = {max_length} tokens (chosen or rejected, with the prompt and "
                    f"EOS), and TRL's RewardTrainer leaves them out")


def release() -> None:
    """Free a trained model (its trainer, optimizer state and graph) before the next one loads: the trainer and
    its callbacks hold each other, so only the cycle collector frees them."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train(exp: Experiment, resume: bool = True) -> dict:
    """The reward model (member 0, on every training pair), then rm.ensemble - 1 more members (bootstrap resamples,
    seeds seed + k) and the judge (on the judge's held-out pairs: data.judge_fraction), all on the one base."""
    plan = prepare(exp)
    d = plan.data
    skipped = dist.warn(data.skipped_said("rm", plan.inputs, plan.inputs["data"],
                                          other=("sft", "prompts")))
    session = Session.start(exp, plan, resume=resume)
    model, first = fit(exp, session, d.sft, d.tok, d.pairs, d.eval_pairs)
    report = models.trainable_report(model)
    del model
    release()
    ensemble, members = [], []
    for k in range(1, exp.rm.ensemble):
        resample = random.Random(exp.seed + k).choices(d.pairs, k=len(d.pairs))
        members.append((f"ensemble-{k}", resample, exp.seed + k))
    judge = None
    for name, rows, seed in members + ([("judge", d.judge_pairs, exp.seed + JUDGE_SEED)] if d.judge_pairs else []):
        model, rec = fit(exp, session, d.sft, d.tok, rows, d.eval_pairs, member=name, seed=seed)
        del model
        release()
        if name == "judge":
            judge = rec
        else:
            ensemble.append(rec)
    metrics = {**first["metrics"], "eval_pairs": len(d.eval_pairs)}
    warnings = skipped + [w for rec in (first, *ensemble, judge) if rec for w in rec.pop("warnings")]
    rm_margins = first.pop("margins")
    for rec in ensemble:
        del rec["margins"]
    if judge:
        metrics["eval_judge_accuracy"] = judge["metrics"]["eval_accuracy"]
        metrics["eval_judge_accuracy_ci95"] = judge["metrics"]["eval_accuracy_ci95"]
        judge["independence"] = judge_independence(rm_margins, judge.pop("margins"))
    own = own_judge_check(exp, d.tok, d.eval_pairs, rm_margins) if own_judge(exp.reward) else None
    if own:
        metrics["eval_own_judge_accuracy"] = own["eval_accuracy"]
        metrics["eval_own_judge_accuracy_ci95"] = own["eval_accuracy_ci95"]
    for measured in (judge, own):
        if measured and measured["independence"]["weak"]:
            warnings += dist.warn(weak_judge("rm", measured["independence"]))
    warnings += dist.warn(chance_rm("rm", first["metrics"]["eval_accuracy"], len(d.eval_pairs)))
    if ensemble:
        metrics["eval_ensemble_accuracies"] = [first["metrics"]["eval_accuracy"]] + [
            m["metrics"]["eval_accuracy"] for m in ensemble]
    return session.finish({
        "metrics": metrics,
        "reward_stats": first["reward_stats"],
        "throughput": first["throughput"],
        "model": {**d.sft["model"], "adapter": first["adapter"], "warm_start": first["warm_start"], **report},
        "ensemble": ensemble,
        "judge": judge,
        "own_judge": own,
        "data": {"train": len(d.pairs), "trained": first["pairs_trained"],
                 **{k: first[k] for k in ("repeated_per_epoch",) if k in first}, "judge": len(d.judge_pairs or []),
                 "eval": len(d.eval_pairs)},
        "warnings": warnings,
    })
