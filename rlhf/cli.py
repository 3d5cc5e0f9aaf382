"""One entry point: `python -m rlhf <stage> --exp experiments/x.yaml [key=value ...]`, and
`python -m rlhf compare RUN_DIR_OR_GLOB ...`.

Stages: the registry's (rlhf/experiment/stages.py): sft, rm, dpo, kto, ppo, grpo, rloo, eval, export (on NPROC ranks
through rlhf/launch.py). Expected failures (bad config, bad data, a missing upstream stage, a memory budget, a failing
reward function; a full disk, a read-only results directory or no memory left, with what a rerun resumes from:
rlhf/infra/faults.py) print one line `error: ...` and exit 2 - no traceback, no credential (records.scrub). A stage
stopped by SIGTERM/SIGINT saves a checkpoint and exits 143/130; rerunning the same command resumes it (--fresh starts
a new run instead). --reuse skips a stage whose latest finished run has the same fingerprint (config, data and
upstream unchanged). --print-config prints the resolved config and runs nothing. A finished stage prints a short table
last (console_summary); its summary.json has every figure."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

# telemetry off and nothing of the code uploaded, unless the user asked otherwise; set before any library import
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_DISABLE_CODE", "true")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")
os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rlhf.experiment import stages  # noqa: E402  (the registry imports nothing heavy)

TOOLS = ("memplan", "memcheck")


def run_stage(stage: str, exp, /, **kwargs) -> dict:
    """The stage's summary; data parallel: every rank then leaves the process group together (dist.close)."""
    summary = stages.get(stage).run(exp, **kwargs)
    from rlhf.infra import dist

    dist.close()
    return summary


def expected_errors() -> tuple[type[Exception], ...]:
    from rlhf.experiment.config import ConfigError
    from rlhf.inputs.data import DataError
    from rlhf.inputs.models import ModelLoadError
    from rlhf.memory.arch import MemoryPlanError
    from rlhf.memory.probe import MemoryBudgetError
    from rlhf.rl.rewards import RewardFunctionError
    from rlhf.rl.trajectory import NonFiniteError
    from rlhf.runs.records import StageInputError
    from rlhf.runs.tracking import TrackingError

    return (ConfigError, DataError, StageInputError, MemoryBudgetError, MemoryPlanError, NonFiniteError,
            RewardFunctionError, TrackingError, ModelLoadError)


def reusable(stage: str, exp, say_why: bool = False):
    """The finished run of `stage` this config would reproduce (same fingerprint, adapter present), or None; with
    `say_why`, why the stage's latest finished run is not it (lineage.not_reused), on stderr."""
    from rlhf.runs import lineage
    from rlhf.runs.records import scrub

    plan = stages.get(stage).prepare(exp)
    found = lineage.find_finished(exp, stage, plan.lineage["fingerprint"])
    why = None if found or not say_why else lineage.not_reused(exp, stage, plan.lineage["fingerprint"])
    if why:
        print(scrub(why), file=sys.stderr, flush=True)
    return found


def parse_args(argv: list[str]) -> argparse.Namespace:
    """A stage's command line; the pieces of a dict or list override that the shell split at its spaces (as `make
    ARGS=...` passes it) are joined again first (config.join_split)."""
    from rlhf.experiment.config import join_split

    ap = argparse.ArgumentParser(prog="rlhf", allow_abbrev=False,  # `--stage grpo` is no `--stages`
                                 description="RLHF experiment harness: " + ", ".join((*stages.REGISTRY, *TOOLS, "compare")))
    ap.add_argument("stage", choices=(*stages.REGISTRY, *TOOLS))
    ap.add_argument("--exp", default="experiments/tiny.yaml", help="experiment YAML (default: %(default)s)")
    ap.add_argument("--from-stage", default="sft", help=f"export: which stage's adapter to export ({'|'.join(stages.exportable())})")
    ap.add_argument("--merge", action="store_true", help="export: merge the adapter into the base (safetensors)")
    ap.add_argument("--reuse", action="store_true",
                    help="training stages: skip training when the latest finished run has the same fingerprint")
    ap.add_argument("--for", dest="for_stage", default=None, metavar="STAGE",
                    help="with --reuse: train (or reuse) this stage only if STAGE consumes it under this experiment "
                         "(GRPO/RLOO need no reward model when reward.model is 0)")
    ap.add_argument("--fresh", action="store_true", help="start a new run even if a killed one could be resumed")
    ap.add_argument("--update", action="store_true", help="memcheck: rewrite configs/memcheck-baseline.json")
    ap.add_argument("--baseline", default=None, help="memcheck: the baseline file (default: "
                                                      "configs/memcheck-baseline.json)")
    ap.add_argument("--stages", default=",".join(stages.training()),
                    help="memplan/memcheck: stages (default: %(default)s)")
    ap.add_argument("--print-config", action="store_true",
                    help="print the resolved config (YAML, overrides applied; config.load reads it back) and exit "
                         "without running the stage")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. sft.learning_rate=1e-4 ppo.steps=10")
    args = ap.parse_intermixed_args(join_split(argv))
    for dest, where in ONLY.items():  # an option another command reads is refused, not ignored
        if getattr(args, dest) != ap.get_default(dest) and args.stage not in where:
            ap.error(f"--{dest.replace('_', '-')} is for `rlhf {' / '.join(where)}`, not `rlhf {args.stage}`")
    return args


ONLY = {"from_stage": ("export",), "merge": ("export",), "update": ("memcheck",), "baseline": ("memcheck",),
        "stages": ("memplan", "memcheck")}
"""The options only some commands read (parse_args)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:
        from rlhf.infra import ranks
        from rlhf.runs import compare

        ranks.imported()
        return compare.main(argv[1:])
    args = parse_args(argv)
    from rlhf.infra import dist

    if "LOCAL_RANK" in os.environ:  # a rank of torchrun / accelerate launch: it dies with its launcher
        dist.die_with_launcher()
        if not dist.is_main():  # rank 0's progress bars speak for all (the libraries read these as they load)
            os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
            os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars too
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from rlhf.experiment import config
    from rlhf.infra import faults, ranks, toolchain

    toolchain.quiet_handled_warnings()
    from rlhf.runs.records import scrub
    from rlhf.runs.runtime import Interrupted, install_stop_handler, stop_requested, stopped_status

    ranks.imported()

    exp = None
    try:
        if args.stage == "memcheck":
            from rlhf.tools import memcheck

            ok, text = memcheck.check(args.overrides, args.stages.split(","), args.update,
                                        **({"baseline_path": Path(args.baseline)} if args.baseline else {}))
            print(text)
            return 0 if ok else 1
        exp = config.load(args.exp, args.overrides, check=lambda e: dist.check_split(e, args.stage))
        if args.stage == "memplan" and not args.print_config:
            from rlhf.memory import memplan

            print(memplan.table(exp, args.stages.split(",")))
            return 0
        said = answered(args, exp)
        if said is not None:
            report(said, end="")
            return 0
        toolchain.require_driver(exp.device)  # a driver too old for torch's CUDA: one line, exit 2, nothing loaded
        kwargs = {"stage": args.from_stage, "merge": args.merge} if args.stage == "export" else {}
        if args.stage in stages.training():
            kwargs["resume"] = not args.fresh
        install_stop_handler()
        summary = run_stage(args.stage, exp, **kwargs)
    except expected_errors() as e:
        if exp is not None:  # found once the experiment loaded: named by the override or line that set its key
            e = config.origin(e, exp.source, args.overrides)
        status = ranks.say(f"error: {scrub(str(e))}", 2)
        release(exp, args.stage)
        return status
    except Interrupted as e:
        return ranks.say(f"stopped: {e}", stopped_status())
    except Exception as e:  # noqa: BLE001 - a fault of the machine is one line; anything else is raised
        if dist.another_rank_said():  # data parallel: a peer failed first and said why (rlhf.launch says it)
            dist.leave(1)
        fault = faults.fault_of(e)
        if fault is None:
            if dist.peer_lost(e):  # a peer that died of a signal said nothing: the launcher says which and how
                dist.leave_for_peer(config.first_line(e))
            raise
        close_progress_bars()  # the line starts a line of its own
        status = ranks.say(f"error: {scrub(fault_line(fault, exp, args.stage))}", 2)
        release(exp, args.stage)
        return status
    report(console_summary(summary))
    if stop_requested():  # the signal came after the last training step (in the final checks): nothing stopped
        return ranks.say(f"finished: the signal came after {args.stage}'s last training step, so the run completed "
                        f"(nothing to resume)" if args.stage in stages.training() else
                        f"finished: the signal came too late to stop {args.stage}: it completed", 0)
    return 0


def report(text: str, end: str = "\n") -> None:
    """What the command prints on stdout: rank 0 prints it for all ranks (data parallel)."""
    from rlhf.infra import dist

    if dist.is_main():
        print(text, end=end)


def answered(args: argparse.Namespace, exp) -> str | None:
    """What the command prints instead of running its stage: the resolved config (--print-config; a URL's password
    never printed), that --for's stage does not use this one, or the finished run --reuse takes; None: run the stage
    (--reuse then says on stderr why the latest finished run is not taken). rlhf.launch asks it once, before any rank
    starts."""
    from rlhf.experiment import config
    from rlhf.runs.records import scrub

    if args.print_config:
        return scrub(config.dump(exp))
    if args.for_stage and args.stage not in stages.get(args.for_stage).needs(exp):
        return f"{args.for_stage} does not use {args.stage} under {args.exp} (reward.model is 0): skipped\n"
    if args.reuse and args.stage in stages.training():
        from rlhf.infra import ranks

        # the stage trains again: why is said where a user expected it taken, once (rlhf.launch asked first)
        found = reusable(args.stage, exp, say_why=not os.environ.get(ranks.RANK_LINES))
        return f"reusing {found}\n" if found else None
    return None


def release(exp, stage: str) -> None:
    """A stage that failed leaves its run to the rerun (lineage.release)."""
    from rlhf.runs import lineage

    if exp is not None and stage in stages.REGISTRY:
        lineage.release(exp, stage)


def close_progress_bars() -> None:
    """Close the progress bars a failure left open (tqdm's, under transformers' and ours), ending their lines."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def fault_line(fault, exp, stage: str) -> str:
    """A full disk, a read-only directory or no memory in one line: what happened, where, the space it needed when
    known, and the checkpoint a rerun resumes from (lineage.resume_point) or that it starts again."""
    from rlhf.runs import lineage

    line = f"{stage}: {fault}. {fault.remedy()} and rerun the same command"
    if exp is None or stage not in stages.training():
        return line
    point = lineage.resume_point(exp, stage)
    return line + (f": it resumes from {point}" if point else f": {stage} starts again (no checkpoint was complete)")


def _span(seconds: float) -> str:
    """A wall time as a person reads it: 21.6 s, 12 min 3 s, 2 h 5 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    return f"{minutes} min {int(seconds % 60)} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def _f(value, spec: str) -> str:
    """A figure for the table: a number in `spec`; anything else as it is (None, a figure not measured: -)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return "-" if value is None else str(value)


def _win(w: dict) -> str:
    """A win rate with its 95% interval: a check's (win_rate, ci95) or eval's (win_rate, ci_low, ci_high)."""
    return _rate(w.get("win_rate"), w.get("ci95") or (w.get("ci_low"), w.get("ci_high")))


def _n(w: dict) -> str | None:
    """How many prompts a win rate is of, and, where they were recorded, how many the policy won, tied and lost
    (guard.won_tied_lost)."""
    from rlhf.maths.guard import won_tied_lost

    n = w.get("n")
    if not isinstance(n, int):
        return None
    said = won_tied_lost(w)
    return f"n={n}" + (f": {said}" if said else "")


def _rate(value, ci) -> str:
    """A rate with its 95% interval (low, high)."""
    return f"{_f(value, '.3f')} [{_f(ci[0], '.3f')}, {_f(ci[1], '.3f')}]"


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """The figures that decide whether a run is good and where its result is, as (label, text) rows: win rates against
    SFT with their interval, grader and n; the KL to the reference; the held-out loss or accuracy; the EOS fraction;
    the policy the guard kept; flags and warnings; the adapter, merged model or sample table; the data-parallel ranks
    (more than one); the run directory.
    Each row where the summary has it, whichever stage wrote it; a figure that was not measured (None) shows as -."""
    m, model = summary.get("metrics") or {}, summary.get("model") or {}
    rows: list[tuple[str, str]] = []
    graders = m.get("eval_win_rates") or ({m.get("eval_scored_by", "score"): {
        "win_rate": m["eval_win_rate_vs_sft"], "ci95": m.get("eval_win_rate_vs_sft_ci95"), "n": m.get("eval_prompts")}}
        if "eval_win_rate_vs_sft" in m else {})
    for i, (grader, w) in enumerate(graders.items()):
        role = ", ".join(str(x) for x in (w.get("grader"), _n(w)) if x)
        rows.append(("win rate vs SFT" if i == 0 else "", f"{_win(w)} by {grader}" + (f" ({role})" if role else "")))
    if not graders and "eval_scored_by" in m and m["eval_scored_by"] is None:  # the check ran, and nothing graded
        rows.append(("win rate vs SFT", "- (nothing grades it: the data has no ground truth, no reward model of this "
                                        "SFT run, no reward.functions, reward.grader_* or reward.judge_*)"))
    for policy, report in m.items():  # make eval: every policy against SFT, by each grader
        wins = {k.removeprefix("win_rate_vs_sft_"): w for k, w in (report.items() if isinstance(report, dict) else ())
                if k.startswith("win_rate_vs_sft_") and isinstance(w, dict)}
        for i, (grader, w) in enumerate(wins.items()):
            role = ", ".join(x for x in (w.get("grader"), _n(w) or f"n={_f(w.get('n'), 'd')}") if x)
            rows.append((f"{policy} vs SFT" if i == 0 else "", f"{_win(w)} by {grader} ({role})"))
    if not graders and m.get("eval_scored_by") and "eval_score_policy" in m:  # SFT: its held-out responses' mean
        ci = m.get("eval_score_policy_ci95") or (None, None)  # score (the policies' win rates start from it)
        rows.append(("held-out score", f"{_f(m['eval_score_policy'], '.3g')} [{_f(ci[0], '.3g')}, {_f(ci[1], '.3g')}] "
                                       f"mean by {m['eval_scored_by']}, n={m.get('eval_prompts')}"))
    if "eval_kl_ref" in m:
        reference = m.get("eval_kl_reference", "the reference")
        se = f" ± {_f(m['eval_kl_ref_se'], '.2g')} (s.e.)" if isinstance(m.get("eval_kl_ref_se"), (int, float)) else ""
        n = f", n={m['eval_prompts']}" if isinstance(m.get("eval_prompts"), int) else ""
        kl = f"{_f(m['eval_kl_ref'], '.3g')}{se} nats on held-out prompts (to {reference}{n})"
        if isinstance(m.get("train_kl_ref_last5"), (int, float)):
            band = {True: ", inside kl_band", False: ", outside kl_band"}.get(m.get("kl_within_band"), "")
            from rlhf.maths.guard import kl_window

            kl += f"; {_f(m['train_kl_ref_last5'], '.3g')} in training (mean over {kl_window(m)}{band})"
        left = m.get("kl_budget_left")
        if isinstance(left, dict) and {"iteration", "kl_ref", "budget"} <= left.keys():  # the guard's window: the flag
            w = left.get("window") or 1
            kl += (f"; left its budget ({_f(left['budget'], 'g')}) at iteration {left['iteration']}: "
                   f"{_f(left['kl_ref'], '.3g')}" + (f", mean of the last {w} iterations" if w > 1 else
                                                    " (the judge's samples)" if left.get("measured_by") else ""))
        rows.append(("KL to reference", kl))
    if "eval_loss" in m:
        before = f"{_f(m['eval_loss_before'], '.4g')} -> " if "eval_loss_before" in m else ""
        ppl = (f" (perplexity {_f(m['eval_perplexity_before'], '.4g')} -> {_f(m['eval_perplexity'], '.4g')})"
               if {"eval_perplexity", "eval_perplexity_before"} <= m.keys() else "")
        rows.append(("held-out loss", f"{before}{_f(m['eval_loss'], '.4g')}{ppl}"))
    if "eval_accuracy" in m:
        def acc(key: str) -> str:  # an accuracy with its interval where the summary has one (written since it has)
            return _rate(m[key], m[f"{key}_ci95"]) if f"{key}_ci95" in m else _f(m[key], ".3f")
        before = f"{_f(m['eval_accuracy_before'], '.3f')} -> " if "eval_accuracy_before" in m else ""
        n = f" of {m['eval_pairs']} held-out pairs" if "eval_pairs" in m else ""
        judge = "".join(f"; {who} {acc(key)}" for who, key in (("judge", "eval_judge_accuracy"),
                                                                  ("own judge", "eval_own_judge_accuracy")) if key in m)
        rows.append(("pair accuracy", f"{before}{acc('eval_accuracy')}{n}{judge}"))
    if "eval_rewards_accuracies" in m:  # DPO's held-out pairs ranked by its implicit reward (TRL's metric)
        ci, n, n_eff = (m.get(f"eval_rewards_accuracies_{k}") for k in ("ci95", "n", "n_effective"))
        of = f" of {n} held-out pairs" if n else " of held-out pairs"
        short = (f" (TRL averages its batches' rates, a short last batch as a whole one: the interval is at an "
                 f"effective n of {n_eff:.0f})" if n and n_eff and n_eff < n - 0.5 else "")
        rows.append(("rewards/accuracies", (_rate(m["eval_rewards_accuracies"], ci) if ci else
                                            _f(m["eval_rewards_accuracies"], ".3f"))
                     + of + " ranked right by the implicit reward" + short))
    if "eval_terminated" in m:
        sft = f" (SFT {_f(m['eval_terminated_sft'], '.1%')})" if "eval_terminated_sft" in m else ""
        ci = m.get("eval_terminated_ci95") or (None, None)
        of = f" [{_f(ci[0], '.1%')}, {_f(ci[1], '.1%')}] of {m['eval_prompts']}" if "eval_prompts" in m else ""
        rows.append(("ends with EOS", f"{_f(m['eval_terminated'], '.1%')}{of}{sft}"))
    kept = model.get("kept") or {}
    ran = (m.get("stopped_early") or {}).get("iteration", m.get("steps"))  # the updates the run made
    if m.get("stopped_early"):  # the guard ended the run (its flags say why)
        rows.append(("stopped early", f"after {ran} of {m['steps']} iterations, "
                                      f"{m['stopped_early'].get('steps_saved')} not run (see flags)"))
    if "steps" in m and kept.get("iteration") is not None:  # a training run's own choice (export copies its model)
        # measured as iteration k: the policy before update k, after k - 1 of them (model.kept.iteration)
        updates = kept["iteration"] - 1
        which = {0: ": the SFT policy", ran: ": the last"}.get(updates, "")
        rows.append(("kept policy", f"after {updates} of {ran} updates{which} ({kept.get('keep')})"))
    if model.get("exported_from"):  # make export: which stage's adapter, from which of its runs
        chosen = f" (the policy that run kept after {kept['iteration'] - 1} updates)" if kept.get("iteration") else ""
        rows.append(("exported", f"{model['exported_from']}'s adapter from "
                                 f"{(summary.get('inputs') or {}).get('run')}{chosen}"))
    smp = summary.get("sampler")
    if smp:  # an online run: what its sampling decoded with
        how = "compiled" if smp.get("compiled") else f"eager ({smp.get('eager_reason')})"
        share = f", copy {_f(smp.get('copy_share'), '.0%')} of the base" if smp.get("copy_bytes") else ""
        ms = f", {_f(smp['decode_ms_per_step'], '.3g')} ms/decode step" if smp.get("decode_ms_per_step") else ""
        rows.append(("sampler", f"{smp.get('path')}: {how}{share}, {smp.get('rows')} rows{ms}"
                                + (" (FELL BACK from the plan's compiled decode)" if smp.get("fell_back") else "")))
    for key in ("flags", "warnings"):
        if key in summary:
            rows += [(key if i == 0 else "", str(text)) for i, text in enumerate(summary[key] or ["none"])]
    merged = m.get("merged") and m["merged"] + {True: " (greedy tokens as the adapter's)",
                                                False: " (greedy tokens differ)"}.get(m.get("greedy_tokens_match"), "")
    if merged and "pairs" in m:  # a reward model's: its held-out pairs ranked as the adapter model ranks them
        merged += (f" ({m['pairs_ranked_alike']} of {m['pairs']} held-out pairs ranked as the adapter's, scores "
                   f"within {_f(m['score_max_abs_diff'], '.2g')})")
    where = {"adapter": m.get("adapter") or model.get("adapter"), "merged model": merged,
             "samples": summary.get("samples")}
    rows += [(label, str(path)) for label, path in where.items() if path]
    tracked = summary.get("tracking") or {}
    if tracked.get("backend") == "wandb":
        rows.append(("W&B", tracked.get("url") or f"offline; upload with: wandb sync {tracked.get('offline_dir')}"))
    if (summary.get("world_size") or 1) > 1:  # a data-parallel run (config.yaml has the config's num_processes)
        rows.append(("ranks", f"{summary['world_size']} data-parallel processes"))
    rows.append(("run", f"{summary.get('run_dir')} (summary.json: every figure)"))
    resumed = summary.get("resumed_from")
    if resumed:  # a killed run taken up again: from which step, and what changed in between
        changed = f"; changed since it started: {'; '.join(resumed['changed'])}" if resumed.get("changed") else ""
        rows.append(("resumed", f"from step {resumed.get('step')} ({Path(resumed['checkpoint']).name}){changed}"))
    return rows


def console_summary(summary: dict) -> str:
    """What a stage prints last, for a person: `<stage> (<experiment>) finished in <time>` and a short table
    (summary_rows). Scripts read the run's summary.json, which has everything."""
    rows = summary_rows(summary)
    width = max(len(label) for label, _ in rows)
    head = f"{summary.get('stage')} ({summary.get('experiment')}) finished in {_span(summary.get('wall_time_s', 0))}"
    return "\n".join([head, *(f"  {label:<{width}}  {text}" for label, text in rows)])


if __name__ == "__main__":
    sys.exit(main())
