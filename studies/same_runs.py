"""Whether a change of structure changed what the stages compute: runs the trained stages on the tiny experiments
into a results folder, and compares two such folders figure by figure.

    python studies/same_runs.py run OUT [--exp experiments/tiny.yaml ...] [--stages sft,rm,dpo,...]
    python studies/same_runs.py compare BEFORE AFTER

`run` runs each stage as `make <stage>` does (one process each, one torch thread, results_dir=OUT). `compare` reads
every run's summary.json metrics and metrics.jsonl lines under both folders and prints each figure that differs;
figures of time and memory (time/, memory/, tokens_per_s, *_s, throughput) are left out, since they differ from run
to run on the same code. Exit 1 when anything else differs."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlhf.experiment import stages  # noqa: E402

EXPERIMENTS = ("experiments/tiny.yaml", "experiments/tiny-gpu-flags.yaml")
STAGES = ("sft", "rm", "dpo", "kto", "ppo", "grpo", "rloo")


def timing(key: str) -> bool:
    """A figure that measures the machine, not the computation."""
    last = key.rsplit("/", 1)[-1]  # the RM logs its judge's trainer under judge/
    return (key.startswith(("time/", "memory/", "throughput")) or key.endswith(("_s", "per_s", "_s_per_step"))
            or key in {"wall_s", "started", "finished", "tokens_per_s", "step_s"}
            # the TRL trainers' log lines (SFT, RM, DPO, KTO): wall-clock and rates
            or last in {"time", "train_runtime", "eval_runtime", "eval_model_preparation_time"}
            or last.endswith(("_per_second",)))


def figures(run_dir: Path) -> dict:
    """A run's figures by name: the summary's metrics and every metrics.jsonl line's, less timing."""
    out = {}
    summary = json.loads((run_dir / "summary.json").read_text())
    for k, v in summary.get("metrics", {}).items():
        if not timing(k):
            out[f"summary/{k}"] = v
    lines = run_dir / "metrics.jsonl"
    if lines.exists():
        for i, line in enumerate(lines.read_text().splitlines()):
            rec = json.loads(line)
            for k, v in rec.items():
                if not timing(k) and k not in {"samples", "sample_columns"}:
                    out[f"line{i}/{k}"] = v
    return out


def runs(root: Path) -> dict[str, Path]:
    """experiment/stage -> the latest run's folder."""
    found = {}
    for latest in sorted(root.glob("*/*/latest")):
        found[f"{latest.parent.parent.name}/{latest.parent.name}"] = latest.parent / latest.read_text().strip()
    return found


def run(out: Path, experiments: list[str], names: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for exp in experiments:
        for name in names:
            cmd = stages.command(name, ROOT / exp, ["--reuse", f"results_dir={out}"])
            print(" ".join(map(str, cmd)), flush=True)
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(f"{exp} {name} failed:\n{p.stderr[-3000:]}")


def compare(before: Path, after: Path) -> int:
    a, b = runs(before), runs(after)
    bad = 0
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            print(f"{key}: only in {'after' if key in b else 'before'}")
            bad += 1
            continue
        fa, fb = figures(a[key]), figures(b[key])
        diff = [k for k in sorted(set(fa) | set(fb)) if fa.get(k, "<absent>") != fb.get(k, "<absent>")]
        for k in diff[:20]:
            print(f"{key} {k}: {fa.get(k, '<absent>')} -> {fb.get(k, '<absent>')}")
        print(f"{key}: {len(fa)} figures, {len(diff)} differ")
        bad += bool(diff)
    return int(bad > 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--exp", nargs="*", default=list(EXPERIMENTS))
    r.add_argument("--stages", default=",".join(STAGES))
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.out.resolve(), args.exp, args.stages.split(","))
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    raise SystemExit(main())
