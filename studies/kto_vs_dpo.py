"""KTO against DPO on the tiny task, over seeds: each seed trains SFT, then DPO and KTO from it (experiments/tiny.yaml
as shipped: DPO's RPO-style [sigmoid, sft] loss, KTO on the same pairs unpaired, the same optimizer steps), then
`make eval` compares both with SFT on the same 200 held-out prompts. Reported per seed and over seeds: the
ground-truth win rate against SFT with its 95% interval, the exact KL to the reference and the fraction of responses
ending with EOS from each stage's own held-out check, and whether it was flagged.

    OMP_NUM_THREADS=1 .venv/bin/python studies/kto_vs_dpo.py --seeds 0 1 2 3 4
    OMP_NUM_THREADS=1 .venv/bin/python studies/kto_vs_dpo.py --set kto.beta=0.1 --name kto-vs-dpo-trl-beta

Writes results/calibration/<date>-<name>.{md,json} (default name kto-vs-dpo)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from studies.harness import parse, run, t_interval, write  # noqa: E402

ARMS = ("dpo", "kto")


def latest(results: Path, stage: str) -> dict:
    root = results / "tiny" / stage
    return json.loads((root / (root / "latest").read_text().strip() / "summary.json").read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every stage")
    ap.add_argument("--name", default="kto-vs-dpo", help="the output's name")
    a = parse(ap, argv, "kto-vs-dpo-")
    rows = []
    for seed in a.seeds:
        results = Path(a.results) / f"seed-{seed}"
        run(("sft", *ARMS, "eval"), [f"seed={seed}", f"results_dir={results}", *a.set])
        ev = latest(results, "eval")["metrics"]
        row = {"seed": seed}
        for arm in ARMS:
            wr, stage = ev[arm]["win_rate_vs_sft_ground_truth"], latest(results, arm)
            check = stage["metrics"]
            row[arm] = {"win_rate": wr["win_rate"], "ci95": [wr["ci_low"], wr["ci_high"]], "n": wr["n"],
                        "kl_ref": check["eval_kl_ref"], "terminated": check["eval_terminated"],
                        "mean_ground_truth": ev[arm]["mean_ground_truth"], "flags": stage["flags"]}
        row["sft_mean_ground_truth"] = ev["sft"]["mean_ground_truth"]
        rows.append(row)
        print(f"seed {seed}: " + ", ".join(f"{arm} {row[arm]['win_rate']:.3f} [{row[arm]['ci95'][0]:.3f}, "
                                           f"{row[arm]['ci95'][1]:.3f}]" for arm in ARMS), file=sys.stderr)
    summary = {arm: {k: t_interval([r[arm][k] for r in rows]) for k in ("win_rate", "kl_ref", "terminated")}
               for arm in ARMS}
    diff = t_interval([r["kto"]["win_rate"] - r["dpo"]["win_rate"] for r in rows])

    def ci(x) -> str:
        return f"[{x[0]:.3f}, {x[1]:.3f}]" if x else "-"

    md = ["# KTO against DPO on the tiny task", "",
          f"experiments/tiny.yaml as shipped{' with ' + ' '.join(a.set) if a.set else ''} (DPO: [sigmoid, sft], 2 "
          "epochs of 32 pairs a step; KTO: the same pairs unpaired, 2 epochs of 64 completions a step); each seed "
          "its own data, SFT, DPO and KTO. Win rate: `make eval`'s, against SFT by the task's ground truth on 200 "
          "held-out prompts (ties count half), 95% interval; KL: the exact KL to the SFT reference on held-out "
          "prompts, EOS: the fraction of held-out responses that end, flagged: the stage's own summary (each "
          "stage's check).", "",
          "| seed | DPO win [95%] | KTO win [95%] | DPO KL | KTO KL | DPO EOS | KTO EOS | flagged |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flagged = ", ".join(arm for arm in ARMS if r[arm]["flags"]) or "-"
        md.append(f"| {r['seed']} | {r['dpo']['win_rate']:.3f} {ci(r['dpo']['ci95'])} | {r['kto']['win_rate']:.3f} "
                  f"{ci(r['kto']['ci95'])} | {r['dpo']['kl_ref']:.2f} | {r['kto']['kl_ref']:.2f} | "
                  f"{r['dpo']['terminated']:.1%} | {r['kto']['terminated']:.1%} | {flagged} |")
    s = summary
    md.append(f"| mean over {len(rows)} seeds [95% t] | {s['dpo']['win_rate']['mean']:.3f} "
              f"{ci(s['dpo']['win_rate']['ci95'])} | {s['kto']['win_rate']['mean']:.3f} "
              f"{ci(s['kto']['win_rate']['ci95'])} | {s['dpo']['kl_ref']['mean']:.2f} | {s['kto']['kl_ref']['mean']:.2f} "
              f"| {s['dpo']['terminated']['mean']:.1%} | {s['kto']['terminated']['mean']:.1%} | "
              f"{sum(bool(r[arm]['flags']) for r in rows for arm in ARMS)} runs |")
    md += ["", f"KTO - DPO win rate, paired by seed: {diff['mean']:+.3f} {ci(diff['ci95'])} (95% t over seeds)."]
    write(a.out, a.name, "\n".join(md) + "\n", {"set": a.set, "seeds": rows, "summary": summary,
                                                 "kto_minus_dpo": diff})
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
