"""How old a running trial's heartbeat gets in a sweep of two workers on this host, beside 0, 1, ... busy processes,
and how long a new trial waits for its first heartbeat: the margins a grace period leaves before a live trial is
failed as stale, or as never started (rlhf/sweeps/sweep.py; tests/test_sweep.py's sweeps beat every 1 s with a grace
of 4 s). Each row is one `python -m rlhf.sweeps run --workers 2` of tiny SFT trials on SQLite, its tables read every
50 ms; a busy process multiplies matrices on two torch threads, as make test's other worker keeps the cores busy.
SQLite stores a heartbeat in whole seconds (CURRENT_TIMESTAMP), so an age read here is the true one plus 0-1 s: an
upper bound on the age Optuna compares with the grace. The first heartbeat's wait is timed on this script's clock,
from the first read that saw the trial RUNNING without one (a lower bound, by up to 50 ms).

    .venv/bin/python studies/heartbeat_lag.py --loads 0 1 2

Writes results/calibration/<date>-heartbeat-lag.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from studies.harness import ROOT, TINY, parse, write  # noqa: E402

BUSY = "import torch\ntorch.set_num_threads(2)\na = torch.randn(1500, 1500)\nwhile True:\n    a @ a\n"
AGES = """SELECT t.trial_id, (julianday('now') - julianday(h.heartbeat)) * 86400 FROM trials t
          LEFT JOIN trial_heartbeats h ON h.trial_id = t.trial_id WHERE t.state = 'RUNNING'"""


def sweep_file(where: Path, name: str, trials: int, interval: int, grace: int) -> Path:
    """A sweep of `trials` tiny SFT trials (tests/test_sweep.py's shape) whose study lives under `where`."""
    data = {"experiment": str(TINY), "stage": "sft",
            "objective": {"metric": "metrics.eval_loss", "direction": "minimize"},
            "space": {"sft.learning_rate": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}},
            "overrides": ["sft.max_steps=4", "sft.eval_steps=2", "sft.batch_size=16", "data.sft_examples=64",
                          "data.eval_examples=16", "memory.track_tensors=false"],
            "n_trials": trials, "results_dir": str(where / "results"),
            "heartbeat": {"interval": interval, "grace": grace, "max_retry": 1}}
    path = where / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def ages(path: Path, db: Path) -> tuple[list[float], list[float], dict]:
    """While the sweep runs, every 50 ms: the running trials' heartbeat ages, and for each trial the seconds from the
    first read that saw it RUNNING without a heartbeat to the first that saw one; then its trials by state."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rlhf.sweeps", "run", str(path), "--workers", "2"], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen, unbeaten, first = [], {}, []
    while proc.poll() is None:
        time.sleep(0.05)
        if not db.exists():
            continue
        try:
            with sqlite3.connect(db, timeout=1) as con:
                rows = con.execute(AGES).fetchall()
        except sqlite3.OperationalError:  # busy, or the tables not made yet
            continue
        now = time.monotonic()
        for trial, age in rows:
            if age is None:
                unbeaten.setdefault(trial, now)
                continue
            seen.append(age)
            if trial in unbeaten:
                first.append(now - unbeaten.pop(trial))
    if not db.exists():
        raise SystemExit(f"the sweep exited {proc.returncode} before it made its study ({db})")
    with sqlite3.connect(db) as con:
        states = dict(con.execute("SELECT state, count(*) FROM trials GROUP BY state").fetchall())
    return seen, first, {"exit": proc.returncode, **states}


def spread(xs: list[float]) -> dict:
    """Median, p99 and max of `xs` (NaN where there are too few)."""
    q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else [float("nan")] * 99
    return {"n": len(xs), "median_s": round(q[49], 3), "p99_s": round(q[98], 3),
            "max_s": round(max(xs, default=float("nan")), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", type=int, nargs="+", default=[0, 1, 2], help="busy processes beside the sweep")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--interval", type=int, default=1)
    ap.add_argument("--grace", type=int, default=4)
    a = parse(ap, argv, "heartbeat-lag-")
    rows = []
    for load in a.loads:
        where = Path(a.results) / f"load{load}"
        where.mkdir(parents=True)
        path = sweep_file(where, "lag", a.trials, a.interval, a.grace)
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
        try:
            seen, first, states = ages(path, where / "results" / "sweeps" / "lag.db")
        finally:
            for p in busy:
                p.kill()
                p.wait()
        rows.append({"load": load, "age": spread(seen), "first": spread(first), "trials": states})
        print(rows[-1], flush=True)
    md = (f"# Heartbeat ages in a two-worker sweep (interval {a.interval} s, grace {a.grace} s)\n\n"
          f"`.venv/bin/python studies/heartbeat_lag.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
          f"{a.trials} tiny SFT trials a row, read every 50 ms. Age: a running trial's heartbeat, whole seconds as "
          "SQLite stores it (the true age plus 0-1 s). First: from a trial seen RUNNING without a heartbeat to its "
          "first one.\n\n"
          "| busy processes | ages read | median age | p99 age | max age | margin to the grace | trials seen before "
          "their first heartbeat | max wait for it | trials |\n|---|---|---|---|---|---|---|---|---|\n")
    md += "".join(f"| {r['load']} | {r['age']['n']} | {r['age']['median_s']:.2f} s | {r['age']['p99_s']:.2f} s | "
                  f"{r['age']['max_s']:.2f} s | {a.grace - r['age']['max_s']:.2f} s | {r['first']['n']} | "
                  f"{r['first']['max_s']:.2f} s | {r['trials']} |\n" for r in rows)
    write(a.out, "heartbeat-lag", md, {"interval": a.interval, "grace": a.grace, "rows": rows})
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
