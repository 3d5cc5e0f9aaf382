"""`make eval`: every trained policy that exists (SFT, DPO, PPO, GRPO, RLOO) generates for the same held-out prompts
under the same sampling settings and seed; responses are scored by the reward model and by the experiment's reward
functions (or the task's own ground truth: the synthetic task's).
Reports mean scores, win rates against SFT with a 95% interval, response lengths, and a side-by-side sample table."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf.inputs import data, models
from rlhf.rl import generation
from rlhf.runs import lineage, records
from rlhf.infra import dist
from rlhf.maths import guard
from rlhf.rl import checks
from rlhf.rl.checks import reward_scores, rm_adapters, win_rate
from rlhf.rl.rewards import own_judge, trained_functions
from rlhf.experiment import config, stages
from rlhf.experiment.config import Experiment
from rlhf.experiment.sections import RewardConfig
from rlhf.runs.runtime import Plan, Session, upstream_sft


def sample(c: checks.Check, model, tok, prompts: list[str]) -> tuple[list[str], list[list[int]]]:
    """Responses (texts, token ids) under the eval sampling settings of `c`, re-seeded so every policy sees the same
    random stream."""
    torch.manual_seed(c.seed)
    e = c.eval
    r = generation.generate(model, tok, prompts, max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                            top_p=e.top_p, max_prompt_length=c.max_prompt_length, batch_size=c.planned,
                            copy_bytes=c.copy, desc="eval")
    return generation.decode(tok, r), generation.response_ids(r)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "⏎").strip()


def train(exp: Experiment) -> dict:
    """`make eval`: compare every finished policy of this experiment on the same held-out prompts."""
    splits = data.load(exp)
    sft_dir, sft, tok = upstream_sft(exp, "eval", splits.eval)
    splits.render(tok)
    found = {}
    for stage in stages.policies():
        try:
            run_dir, summary = records.latest(exp, stage, "eval")
        except records.StageInputError:
            continue
        found[stage] = (run_dir, summary)
    elsewhere = other_sft(found, sft_dir, sft)
    rows = splits.eval[: exp.eval.prompts]
    prompts = [r["prompt"] for r in rows]
    check = checks.plan(exp, "eval", rows)  # its sampling settings and copy, its graders and the user's judge
    plan = Plan.make(exp, "eval", {k: str(v[0]) for k, v in found.items()}, {"eval": [r["id"] for r in rows]}, found)
    sampling = checks.said(check, rows, tok)  # what sampling will cut, said before it starts
    session = Session.start(exp, plan, resume=False)
    with session.probe.phase("load"):
        model = models.load_base(check.loading, sft["model"]["base_path"], "causal", tok, train=False)
        for stage, (_, summary) in found.items():
            model = models.load_adapter(model, summary["model"]["adapter"], stage)
    texts, ids = {}, {}
    with session.probe.phase("generate"):
        for stage in found:
            model.set_adapter(stage)
            texts[stage], ids[stage] = sample(check, model, tok, prompts)
    scores: dict[str, dict[str, list[float]]] = {s: {} for s in found}
    # its adapters and heads on the same base, as the checks score
    rm_dir, rm_summary, rm_warning = checks.latest_rm(exp, "eval", sft_dir, sft, tok)
    warnings = sampling + dist.warn(rm_warning)
    for said in elsewhere + kept_sft(found):
        warnings += dist.warn(said)
    rm_graders, rm_sha = {}, None  # eval's graders that are this RM run's adapters (the user's judge functions are not)
    if rm_dir:
        session.run.inputs["rm"] = str(rm_dir)
        rm_graders = {k: str(rm_dir) for k in ("reward_model", "judge")
                      if k == "reward_model" or not own_judge(exp.reward)}
        rm_sha = lineage.adapter_sha256(rm_summary["model"]["adapter"])
    with session.probe.phase("score"):
        for name, adapter in rm_adapters(rm_summary).items():
            head = models.load_scorer(model, adapter, name, check.loading.device)
            model.set_adapter(name)
            for s in found:
                scores[s][name] = reward_scores(model, head, tok, prompts, texts[s], exp.eval.batch_size)
        grader = checks.independent_grader(check)  # the user's independent grader, as in each stage's check
    del model
    for s in found:
        gt, by = checks.grader_scores(check, rows, texts[s], ids[s])
        if gt is not None:
            scores[s][by] = gt
        judged = checks.judge_scores(check, rows, texts[s], ids[s])  # the user's judge functions replace the adapter
        if judged is not None:
            scores[s]["judge"] = judged
        graded = checks.function_scores(grader, rows, texts[s], ids[s])
        if graded is not None:
            scores[s]["grader"] = graded
    report: dict = {}
    for s in found:
        report[s] = {f"mean_{k}": sum(v) / len(v) for k, v in scores[s].items()}
        report[s]["mean_length_words"] = sum(len(t.split()) for t in texts[s]) / len(texts[s])
        if s != "sft":
            roles = grader_roles(s, *found[s], list(scores[s]), rm_graders, rm_sha, exp.reward)
            for k in scores[s]:
                report[s][f"win_rate_vs_sft_{k}"] = {**win_rate(scores[s][k], scores["sft"][k]),
                                                     **({"grader": roles[k]} if roles[k] else {})}
    path = session.run.dir / "samples.md"
    write_table(path, prompts, texts, scores, exp.eval.samples_in_table, report)
    session.tracker.table("samples", ["prompt", *found], [[p, *(texts[s][i] for s in found)]
                                                         for i, p in enumerate(prompts[: exp.eval.samples_in_table])])
    return session.finish({"metrics": report, "warnings": warnings, "samples": str(path), "prompts": len(prompts),
                           "sampling": {"temperature": exp.eval.temperature, "top_p": exp.eval.top_p,
                                        "max_new_tokens": exp.eval.max_new_tokens, "seed": exp.seed}})


def other_sft(found: dict, sft_dir: Path, sft: dict) -> list[str]:
    """The policies of `found` ({stage: (run dir, summary)}, pruned in place) trained from another SFT adapter than
    the SFT run `sft_dir` (its summary `sft`) that eval loads their adapters onto and compares them with, as what to
    say of each: their rows would be another base's and another SFT's."""
    said, policies = [], [s for s in found if s != "sft"]
    sha = lineage.adapter_sha256(sft["model"]["adapter"]) if policies else None  # hashed once, for all
    for stage in policies:
        run_dir, summary = found[stage]
        if lineage.from_other_sft(summary, sha):
            del found[stage]
            said.append(f"{stage}: its run {run_dir} was trained from another SFT run "
                        f"({lineage.upstream(summary, 'sft').get('run')}) than the latest, {sft_dir}, which eval "
                        f"compares with: left out; rerun `make {stage}` to evaluate it")
    return said


def saw_rm(summary: dict, rm_dir: str, rm_sha: str | None) -> bool:
    """Whether the online run of `summary` scored with the reward model run `rm_dir` (its adapter's sha256 `rm_sha`):
    the same adapter, by its sha256 where the run recorded it (a rerun of the same RM is the same reward), else the
    same run folder."""
    recorded = lineage.upstream(summary, "rm").get("adapter_sha256")
    if recorded and rm_sha:
        return recorded == rm_sha
    return (summary.get("inputs") or {}).get("rm_run") == rm_dir


def kept_sft(found: dict) -> list[str]:
    """What to say of each policy (`found`: {stage: (run dir, summary)}) whose online run's guard kept the policy it
    started from: its win rates are SFT's against itself."""
    return [f"{s}: its run kept the SFT policy (after 0 updates; its summary's flags and warnings say why): its rows "
            f"here are SFT against itself" for s, (_, summary) in found.items()
            if ((summary.get("model") or {}).get("kept") or {}).get("iteration") == 1]


def grader_roles(stage: str, run_dir: Path, summary: dict, graders: list[str],
                 rm_graders: dict[str, str], rm_sha: str | None = None, mine: RewardConfig | None = None
                 ) -> dict[str, str | None]:
    """Each grader's role for the policy of `stage` (checks.grader_role: trained against, fit on the same pairs,
    selected and graded by the same judge, independent), from the config that policy was trained with (its run's
    config.yaml, read once; None when it no longer loads). `rm_graders`: eval's graders that are a reward model run's
    adapters (the reward model, the RM stage's judge), to that run's folder (`rm_sha`: its adapter's sha256): an
    online policy saw them only if its run scored with that adapter (saw_rm); one it never saw is independent. `mine`:
    eval's reward section, whose functions (and own judge) grade as reward_functions (and judge): an online policy
    saw them only where its run's reward or judge named one of them (functions_role). Where it saw them, the role its
    own check recorded (metrics.eval_win_rates), which knows whether the judge chose the policy or stopped the run."""
    online = stages.get(stage).online
    recorded = (summary.get("metrics") or {}).get("eval_win_rates") or {}
    kept = online and (summary.get("model") or {}).get("kept")  # a policy the judge chose, as the stage labels it
    trained_with = None
    out = {}
    for grader in graders:
        if online and grader in rm_graders and not saw_rm(summary, rm_graders[grader], rm_sha):
            out[grader] = "independent"
            continue
        if trained_with is None:
            try:
                trained_with = config.load(run_dir / "config.yaml")
            except config.ConfigError:
                trained_with = False
        role = functions_role(grader, mine, trained_with.reward) if online and mine and trained_with else None
        if role == "judge":  # eval's functions are the run's judge: the judge's role, as its check recorded it
            out[grader] = (recorded.get("judge", {}).get("grader")
                           or checks.grader_role(trained_with, stage, "judge", "judge" if kept else None))
        elif role:
            out[grader] = role
        elif online and recorded.get(grader, {}).get("grader"):
            out[grader] = recorded[grader]["grader"]
        else:
            out[grader] = (checks.grader_role(trained_with, stage, grader, "judge" if kept else None)
                           if trained_with else None)
    return out


def functions_role(grader: str, mine: RewardConfig, theirs: RewardConfig) -> str | None:
    """The role of eval's reward functions (grader reward_functions) or own judge (grader judge: its judge_functions
    and judge_model), `mine`, for an online policy trained with the reward section `theirs`: "trained against" when
    one of them took part in its reward (rewards.trained_functions), "independent" when none took part in its reward
    or its judge; "judge" where the run's judge is among them (the run's record of its judge's role says the rest);
    None for any other grader."""
    if grader == "reward_functions":
        functions, model = set(mine.functions), None
    elif grader == "judge" and own_judge(mine):
        functions, model = set(mine.judge_functions), mine.judge_model
    else:
        return None
    if functions & trained_functions(theirs):
        return "trained against"
    if functions & set(theirs.judge_functions) or (model and records.same_base(theirs.judge_model, model)):
        return "judge"
    return "independent"


def write_table(path: Path, prompts, texts, scores, n: int, report: dict) -> None:
    stages = list(texts)
    lines = [f"# Samples ({len(prompts)} held-out prompts, same seed and sampling for every policy)", ""]
    lines += ["| policy | " + " | ".join(k for k in report[stages[0]] if k.startswith("mean"))
              + f" | win rate vs SFT by grader (its role), 95% interval, n={len(prompts)} |",
              "|---|" + "---|" * (sum(k.startswith("mean") for k in report[stages[0]]) + 1)]
    for s in stages:
        wr = [f"{k.removeprefix('win_rate_vs_sft_')}" + (f" ({v['grader']})" if v.get("grader") else "")
              + f": {v['win_rate']:.2f} [{v['ci_low']:.2f}, {v['ci_high']:.2f}] ({guard.won_tied_lost(v)})"
              for k, v in report[s].items() if k.startswith("win_rate")]
        lines.append(f"| {s} | " + " | ".join(f"{v:.3f}" for k, v in report[s].items() if k.startswith("mean"))
                     + f" | {'; '.join(wr) or '-'} |")
    lines += ["", "| prompt | " + " | ".join(stages) + " |", "|---|" + "---|" * len(stages)]
    for i in range(min(n, len(prompts))):
        cells = []
        for s in stages:
            sc = ", ".join(f"{k}={v[i]:.2f}" for k, v in scores[s].items())
            cells.append(f"{_md(texts[s][i])} ({sc})")
        lines.append(f"| {_md(prompts[i])} | " + " | ".join(cells) + " |")
    records.atomic_write(path, "\n".join(lines) + "\n")
