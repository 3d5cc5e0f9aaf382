"""One entry point: `python -m rlhf <stage> --exp experiments/x.yaml [key=value ...]`, and
`python -m rlhf compare RUN_DIR_OR_GLOB ...`.

Stages: the registry's (rlhf/stages.py): sft, rm, dpo, ppo, grpo, rloo, eval, export. Expected failures (bad config,
bad data, a missing upstream stage, a memory budget, a failing reward function; a full disk, a read-only results
directory or no memory left, with what a rerun resumes from: rlhf/faults.py) print one line `error: ...` and exit
2 - no traceback, no credential (records.scrub). A stage stopped by SIGTERM/SIGINT saves a checkpoint and exits 143;
rerunning the same command resumes it (--fresh starts a new run instead). --reuse skips a stage whose latest finished
run has the same fingerprint (config, data and upstream unchanged)."""

from __future__ import annotations

import argparse
import json
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

from . import stages  # noqa: E402  (the registry imports nothing heavy)

TOOLS = ("memplan", "memcheck")


def run_stage(stage: str, exp, /, **kwargs) -> dict:
    """The stage's summary; data parallel: every rank then leaves the process group together (dist.close)."""
    summary = stages.get(stage).run(exp, **kwargs)
    from . import dist

    dist.close()
    return summary


def _expected_errors() -> tuple[type[Exception], ...]:
    from .config import ConfigError
    from .data import DataError
    from .memory.arch import MemoryPlanError
    from .memory.probe import MemoryBudgetError
    from .rewards import RewardFunctionError
    from .online import NonFiniteError
    from .records import StageInputError

    return (ConfigError, DataError, StageInputError, MemoryBudgetError, MemoryPlanError, NonFiniteError,
            RewardFunctionError)


def reusable(stage: str, exp):
    """The finished run of `stage` this config would reproduce (same fingerprint, adapter present), or None."""
    from . import lineage

    plan = stages.get(stage).prepare(exp)
    return lineage.find_finished(exp, stage, plan.lineage["fingerprint"])


# Library warnings this project has handled, each with the reason it is silenced; anything else still prints.
HANDLED_WARNINGS = (
    # transformers 5.23 renamed gradient checkpointing "activation checkpointing"; TRL 1.16 and PEFT 0.21 still
    # read and pass the old names (`model.gradient_checkpointing` is this project's config key): same behaviour
    (FutureWarning, r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated"),
)


def quiet_handled_warnings() -> None:
    import warnings

    for category, message in HANDLED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """A stage's command line; the pieces of a dict or list override that the shell split at its spaces (as `make
    ARGS=...` passes it) are joined again first (config.join_split)."""
    from .config import join_split

    ap = argparse.ArgumentParser(prog="rlhf",
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
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. sft.learning_rate=1e-4 ppo.steps=10")
    return ap.parse_intermixed_args(join_split(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:
        from . import compare

        return compare.main(argv[1:])
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_handled_warnings()
    from . import config, faults, toolchain
    from .records import scrub
    from .runtime import Interrupted, install_stop_handler

    exp = None
    try:
        if args.stage == "memcheck":
            from .memory import memcheck

            ok, report = memcheck.check(args.overrides, args.stages.split(","), args.update,
                                        **({"baseline_path": Path(args.baseline)} if args.baseline else {}))
            print(report)
            return 0 if ok else 1
        exp = config.load(args.exp, args.overrides)
        if args.stage == "memplan":
            from .memory import memplan

            print(memplan.table(exp, args.stages.split(",")))
            return 0
        if args.for_stage and args.stage not in stages.get(args.for_stage).needs(exp):
            print(f"{args.for_stage} does not use {args.stage} under {args.exp} (reward.model is 0): skipped")
            return 0
        if args.reuse and args.stage in stages.training():
            found = reusable(args.stage, exp)
            if found:
                print(f"reusing {found}")
                return 0
        toolchain.require_driver(exp.device)  # a driver too old for torch's CUDA: one line, exit 2, nothing loaded
        kwargs = {"stage": args.from_stage, "merge": args.merge} if args.stage == "export" else {}
        if args.stage in stages.training():
            kwargs["resume"] = not args.fresh
        install_stop_handler()
        summary = run_stage(args.stage, exp, **kwargs)
    except _expected_errors() as e:
        print(f"error: {scrub(str(e))}", file=sys.stderr)
        release(exp, args.stage)
        return 2
    except Interrupted as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 143
    except Exception as e:  # noqa: BLE001 - a fault of the machine is one line; anything else is raised
        fault = faults.fault_of(e)
        if fault is None:
            raise
        close_progress_bars()  # the line starts a line of its own
        print(f"error: {scrub(fault_line(fault, exp, args.stage))}", file=sys.stderr)
        release(exp, args.stage)
        return 2
    if os.environ.get("RANK", "0") != "0":  # data parallel: rank 0 reports
        return 0
    print(console_summary(summary))
    return 0


def release(exp, stage: str) -> None:
    """A stage that failed leaves its run to the rerun (lineage.release)."""
    from . import lineage

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
    from . import lineage

    line = f"{stage}: {fault}. {fault.remedy()} and rerun the same command"
    if exp is None or stage not in stages.training():
        return line
    point = lineage.resume_point(exp, stage)
    return line + (f": it resumes from {point}" if point else f": {stage} starts again (no checkpoint was complete)")


def _short(value):
    """Floats to 4 significant digits, for the console (summary.json keeps them whole)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_short(v) for v in value]
    return value


def console_summary(summary: dict) -> str:
    """What a stage prints last: its summary's stage, run_dir, metrics and wall time, one JSON object with a line
    per key (valid JSON: scripts can read it; the run's summary.json has everything)."""
    keys = [k for k in ("stage", "run_dir", "metrics", "wall_time_s") if k in summary]
    return "{" + ",\n ".join(f"{json.dumps(k)}: {json.dumps(_short(summary[k]), default=str)}" for k in keys) + "}"


if __name__ == "__main__":
    sys.exit(main())
