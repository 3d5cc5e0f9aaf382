"""The memory gate: `make memcheck` (run by CI).

1. Runs every stage of a fixed small experiment (experiments/memcheck.yaml, two steps each) on CPU with the tensor
   probe and compares each stage's measured peak with configs/memcheck-baseline.json: a stage more than TOLERANCE
   above its baseline fails the gate. `make memcheck-update` rewrites the baseline file for review.
2. Asserts that the predicted peak of every stage of every shipped 7B experiment is under its budget.
Prints a table of baseline vs now (and predicted) for both.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from rlhf.experiment import config
from rlhf.runs import records
from rlhf.experiment import stages as registry
from rlhf.memory import memplan

ROOT = Path(__file__).resolve().parents[2]
GATED = ROOT / "experiments" / "memcheck.yaml"
BASELINE = ROOT / "configs" / "memcheck-baseline.json"
TOLERANCE = 0.10
MB = 1024**2


def measure(exp_path: Path, overrides: list[str], stages=registry.training()) -> dict[str, dict]:
    """Run `stages` (and the upstream stages they need), each in its own process as `make` would, and return each
    requested stage's memory summary. `overrides` must include results_dir."""
    needed = registry.with_upstream(stages)
    exp = config.load(exp_path, overrides)
    out = {}
    for st in needed:
        proc = subprocess.run(registry.command(st, exp_path, overrides), capture_output=True, text=True,
                              env={**os.environ, "RLHF_DISABLE_TRACKING": "1"})
        if proc.returncode != 0:
            raise RuntimeError(f"memcheck: `rlhf {st}` failed (exit {proc.returncode}): "
                               f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}")
        if st in stages:
            out[st] = records.latest(exp, st, "memcheck")[1]["memory"]
    return out


def shipped_7b() -> list[Path]:
    return sorted(p for p in (ROOT / "experiments").glob("*.yaml")
                  if config.load(p).model.name != "tiny")


def check(overrides: list[str] = (), stages=registry.training(), update: bool = False,
          baseline_path: Path = BASELINE) -> tuple[bool, str]:
    """Measure, compare with the baseline (or rewrite it), check the 7B plans. Returns (passed, report)."""
    with tempfile.TemporaryDirectory(prefix="memcheck-") as tmp:
        measured = measure(GATED, [f"results_dir={tmp}", *overrides], stages)
    return gate(measured, overrides, update, baseline_path)


def gate(measured: dict[str, dict], overrides: list[str] = (), update: bool = False,
         baseline_path: Path = BASELINE) -> tuple[bool, str]:
    """The gate on stages already measured (`measure(GATED, overrides, ...)`): each against its baseline (or the
    baseline rewritten), and the shipped 7B plans against their budgets. Returns (passed, report)."""
    ok, lines = True, []
    exp = config.load(GATED, list(overrides))
    predicted = {p.stage: p.peak_gb for p in memplan.plans(exp, list(measured))}
    base = json.loads(baseline_path.read_text()) if baseline_path.exists() else {"stages": {}}
    if update:
        base = {"experiment": str(GATED.relative_to(ROOT)), "overrides": list(overrides), "tolerance": TOLERANCE,
                "measure": "peak live tensor bytes on CPU (rlhf.memory.probe.TensorTracker)",
                "environment": {k: v for k, v in records.environment()["packages"].items()},
                "stages": {**base.get("stages", {}),
                           **{s: {"peak_mb": round(m["peak_gb"] * 1024, 3),
                                  "phases_mb": {k: round(v["peak_gb"] * 1024, 3) for k, v in m["phases"].items()}}
                              for s, m in measured.items()}}}
        records.write_json(baseline_path, base)
    lines.append(f"memcheck: {GATED.relative_to(ROOT)} {' '.join(overrides)} (fail when > baseline +"
                 f"{TOLERANCE:.0%}); MB of live tensors")
    lines.append(f"{'stage':<6}{'baseline':>10}{'now':>10}{'change':>9}{'predicted':>11}  verdict  (peak phase)")
    for st, m in measured.items():
        now = m["peak_gb"] * 1024
        phase = max(m["phases"], key=lambda k: m["phases"][k]["peak_gb"])
        ref = base.get("stages", {}).get(st, {}).get("peak_mb")
        if ref is None:
            verdict, change = "NO BASELINE (make memcheck-update)", float("nan")
            ok = False
        else:
            change = now / ref - 1
            verdict = "FAIL" if change > TOLERANCE else ("ok (lower: update?)" if change < -TOLERANCE else "ok")
            ok &= change <= TOLERANCE
        lines.append(f"{st:<6}{ref if ref is not None else float('nan'):>10.2f}{now:>10.2f}{change:>+9.1%}"
                     f"{predicted[st] * 1024:>11.2f}  {verdict}  ({phase})")
    lines.append("")
    lines.append("predicted peaks of the shipped GPU experiments (GB, per GPU):")
    for path in shipped_7b():
        e = config.load(path)
        ps = memplan.plans(e)
        fits = all(p.fits for p in ps)
        ok &= fits
        lines.append(f"  {path.name:<28} budget {e.memory.budget_gb:>5} GB  " +
                     "  ".join(f"{p.stage} {p.peak_gb:.2f}" for p in ps) + ("  ok" if fits else "  OVER BUDGET"))
    lines.append("memcheck: " + ("passed" if ok else "FAILED"))
    return ok, "\n".join(lines)
