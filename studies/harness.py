"""The studies' harness: what the research scripts of studies/ share. Each study measures the harness itself (the
guard's error rates, the KL spent, the judge's share, the value model, the sampler, the memory predictor, where a
stage's time goes) and writes its table and figures under results/calibration/<date>-<name>.{md,json}
(results/bench/ for the speed studies); docs/algorithms.md and docs/performance.md cite them with their commands.

Shared here: their --results and --out arguments (`parse`), stages of experiments/tiny.yaml run as `make <stage>`
runs them, a seed per run as an override (rlhf.experiment.stages.command, one process each, one torch thread unless
OMP_NUM_THREADS says otherwise, reusing unchanged upstream runs: `run`), an online stage run with every measured
policy graded (`traced`, studies/guard_trace.py) and those grades read (`truth_win`, `below`), the figures over seeds
and runs (`mean_and_se`, `mean_se`, `t_interval`; Wilson's interval of a rate, `rate_interval`, and the paired
difference, `paired`, are the guard's own: rlhf/maths/guard.py), and the study's table written (`write`)."""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "experiments" / "tiny.yaml"
OUT = ROOT / "results" / "calibration"
sys.path.insert(0, str(ROOT))

from rlhf.rl import checks  # noqa: E402
from rlhf.maths import guard
from rlhf.experiment import stages
from rlhf.maths.guard import paired, wilson  # noqa: E402,F401  (the studies' intervals: the guard's own)


def run(names, overrides: list[str], exp_path: Path = TINY) -> None:
    """Each stage of `names` in turn with `overrides` (and --reuse); a failure ends the study naming the stage, its
    overrides and the end of its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for name in names:
        p = subprocess.run(stages.command(name, exp_path, ["--reuse", *overrides]), cwd=ROOT, env=env,
                           capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"{name} {' '.join(overrides)} failed:\n{p.stderr[-3000:]}")


def traced(stage: str, overrides: list[str], exp_path: Path = TINY) -> Path:
    """The online stage run as `run` runs it, with every measured policy graded on the held-out prompts
    (studies/guard_trace.py); the path of its trace (guard_trace.json in the run's directory)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    p = subprocess.run([sys.executable, str(ROOT / "studies" / "guard_trace.py"), stage, "--exp", str(exp_path),
                        *overrides], cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{stage} {' '.join(overrides)} failed:\n{p.stderr[-3000:]}")
    return Path(p.stdout.strip().splitlines()[-1])


def truth_win(point: dict, sft: dict) -> float:
    """A traced policy's ground-truth win rate against SFT (the trace's first point) on the held-out prompts, as the
    held-out check counts it (a tie is half a win)."""
    return checks.win_rate(point["truth_heldout"], sft["truth_heldout"])["win_rate"]


def below(a: dict, b: dict) -> bool:
    """Whether traced policy a's held-out ground truth is significantly below b's: the paired per-prompt difference's
    95% interval below 0 (the same prompts, sampled with the same seed)."""
    return guard.paired(a["truth_heldout"], b["truth_heldout"])["ci95"][1] < 0


T975 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Student's t at 97.5% by degrees of freedom (the interval of a mean over a few seeds; 1.96 beyond 9)."""


def mean_and_se(xs: list[float], one: float = float("nan")) -> tuple[float, float]:
    """The mean over seeds (or runs) and its standard error, sample sd / sqrt(n) (`one` for a single value)."""
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else one
    return statistics.fmean(xs), se


def mean_se(xs: list[float]) -> str:
    """"mean ± its standard error" over seeds, three decimals (nan for one seed)."""
    mean, se = mean_and_se(xs)
    return f"{mean:.3f} ± {se:.3f}"


def t_interval(xs: list[float]) -> dict:
    """The mean over seeds with its 95% t-interval (None with one seed): {"mean", "ci95"}."""
    mean, se = mean_and_se(xs)
    if len(xs) < 2:
        return {"mean": mean, "ci95": None}
    half = T975.get(len(xs) - 1, 1.96) * se
    return {"mean": mean, "ci95": [mean - half, mean + half]}


def rate_interval(k: int, n: int) -> list[float]:
    """Wilson's 95% interval of k in n (guard.wilson), rounded to four decimals as the tables print it."""
    return [round(x, 4) for x in wilson(k, n)]


def parse(ap: argparse.ArgumentParser, argv: list[str] | None, prefix: str, out: Path = OUT) -> argparse.Namespace:
    """The study's arguments, with the two every study has: --results (the run records; default a temporary
    directory, removed when the process exits) and --out (where the table and its JSON go)."""
    ap.add_argument("--results", default=None, help="run records (default: a temporary directory)")
    ap.add_argument("--out", default=str(out))
    a = ap.parse_args(argv)
    if a.results is None:  # removed when the process exits (not by the garbage collector, which warns)
        a.results = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, a.results, ignore_errors=True)
    return a


def write(out: str | Path, name: str, md: str, record: dict) -> Path:
    """The study's markdown table and its JSON record ({"argv", **record}, compact: a device call carries the tracked
    tree) as <out>/<today>-<name>.{md,json}; the stem."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{datetime.date.today().isoformat()}-{name}"
    stem.with_suffix(".md").write_text(md)
    stem.with_suffix(".json").write_text(json.dumps({"argv": sys.argv[1:], **record}, separators=(",", ":")) + "\n")
    print(f"wrote {stem}.md and {stem}.json", file=sys.stderr)
    return stem
