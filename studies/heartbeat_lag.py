"""How old a running trial's heartbeat gets in a sweep of two workers on this host, beside 0, 1, ... busy processes:
the margin a grace period leaves before a live trial is failed as stale (tests/test_sweep.py's sweeps beat every
1 s with a grace of 4 s). Each row is one `python -m rlhf.sweeps run --workers 2` of tiny SFT trials on SQLite, its
heartbeat table read every 50 ms; a busy process multiplies matrices on two torch threads, as make test's other
worker keeps the cores busy.

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
AGES = """SELECT (julianday('now') - julianday(h.heartbeat)) * 86400 FROM trials t
          JOIN trial_heartbeats h ON h.trial_id = t.trial_id WHERE t.state = 'RUNNING'"""


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


def ages(path: Path, db: Path) -> tuple[list[float], dict]:
    """The heartbeat ages of the running trials, read every 50 ms while the sweep runs; its trials by state."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rlhf.sweeps", "run", str(path), "--workers", "2"], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: list[float] = []
    while proc.poll() is None:
        time.sleep(0.05)
        if not db.exists():
            continue
        try:
            with sqlite3.connect(db, timeout=1) as con:
                seen += [a for (a,) in con.execute(AGES)]
        except sqlite3.OperationalError:  # busy, or the tables not made yet
            continue
    with sqlite3.connect(db) as con:
        states = dict(con.execute("SELECT state, count(*) FROM trials GROUP BY state").fetchall())
    return seen, {"exit": proc.returncode, **states}


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
            seen, states = ages(path, where / "results" / "sweeps" / "lag.db")
        finally:
            for p in busy:
                p.kill()
                p.wait()
        q = statistics.quantiles(seen, n=100) if len(seen) > 1 else [float("nan")] * 99
        rows.append({"load": load, "samples": len(seen), "max_s": round(max(seen, default=float("nan")), 3),
                     "p99_s": round(q[98], 3), "median_s": round(q[49], 3), "trials": states})
        print(rows[-1], flush=True)
    md = (f"# Heartbeat age in a two-worker sweep (interval {a.interval} s, grace {a.grace} s)\n\n"
          f"`.venv/bin/python studies/heartbeat_lag.py {' '.join(sys.argv[1:])}`; {a.trials} tiny SFT trials a row, "
          "the running trials' heartbeat ages read every 50 ms.\n\n"
          "| busy processes | samples | median age | p99 age | max age | margin to the grace | trials |\n"
          "|---|---|---|---|---|---|---|\n")
    md += "".join(f"| {r['load']} | {r['samples']} | {r['median_s']:.2f} s | {r['p99_s']:.2f} s | {r['max_s']:.2f} s | "
                  f"{a.grace - r['max_s']:.2f} s | {r['trials']} |\n" for r in rows)
    write(a.out, "heartbeat-lag", md, {"interval": a.interval, "grace": a.grace, "rows": rows})
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
