"""One online stage run (ppo, grpo, rloo), as `python -m rlhf <stage>` runs it, with every policy the judge measures
also graded where nothing selects: at each measurement (rlhf/rl/overopt.py's OBSERVE_MEASUREMENTS), the measured policy
samples

- the held-out check's prompts (eval.prompts of the eval split) with the check's seed and settings, scored per prompt
  by the task's ground truth and by the judge (on its held-out scale): the kept policy's samples there are the same
  as its held-out check's, so each measured policy, kept or discarded, is graded as the check grades the saved one;
- judge_prompts fresh training prompts (those after the judge's own) with another seed, scored by the judge: a second,
  independent judge measurement, for selection rules that re-measure their candidates.

Writes guard_trace.json into the run's directory: the judge's points (with its per-prompt scores), those scores,
each iteration's kl/ref, the fall and the budget exit. Used by studies/guard_study.py and studies/flag_calibration.py:

    OMP_NUM_THREADS=1 .venv/bin/python studies/guard_trace.py ppo --exp experiments/tiny.yaml seed=1 ppo.steps=300
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from rlhf.rl import checks, generation, overopt  # noqa: E402
from rlhf import cli
from rlhf.experiment import config, stages
from rlhf.inputs import data
from rlhf.infra import dist
from rlhf.rl.roles import Scorer  # noqa: E402


class Grader:
    """The observer: grades each measured policy on the held-out prompts and on fresh training prompts."""

    def __init__(self, exp: config.Experiment, stage: str):
        self.exp, self.judge, self.graded, self.rows = exp, None, {}, None
        # the held-out check's graders and the user's judge, checked against the held-out rows they grade
        self.check = checks.plan(exp, stage, data.load(exp).eval[: exp.eval.prompts])

    def judge_scores(self, judge, rows, r) -> list[float]:
        texts, ids = generation.decode(judge.roles.tok, r), generation.response_ids(r)
        if judge.fns:
            return checks.judge_scores(self.check, rows, texts, ids)
        roles = judge.roles
        raw = torch.cat([roles.score_by(part, "judge", roles.judge_head)
                         for part in r.chunks(judge.gen_kwargs["batch_size"])])
        return Scorer.normalized(raw[:, None], judge.judge_scale)[:, 0].tolist()

    def __call__(self, judge, point) -> None:
        exp, roles = self.exp, judge.roles
        self.judge = judge
        if self.rows is None:
            splits = data.load(exp)
            splits.render(roles.tok)
            n = len(judge.rows)
            self.rows = {"heldout": splits.eval[: exp.eval.prompts],
                         "fresh": splits.prompts(exp.data.ppo_prompts)[n: 2 * n]}
        out = {}
        for name, seed in (("heldout", exp.seed), ("fresh", exp.seed + 2)):
            rows = self.rows[name]
            torch.manual_seed(seed)
            r = generation.generate(roles.model, roles.tok, [q["prompt"] for q in rows], **judge.gen_kwargs)
            out[f"judge_{name}"] = [round(x, 5) for x in self.judge_scores(judge, rows, r)]
            if name == "heldout":
                truth, _ = checks.grader_scores(self.check, rows, generation.decode(roles.tok, r), generation.response_ids(r))
                out["truth_heldout"] = truth
        roles.use("policy")
        self.graded[point["iteration"]] = out


def main(argv: list[str]) -> int:
    a = cli.parse_args(argv)
    exp = config.load(a.exp, a.overrides)
    grader = Grader(exp, a.stage)
    token = overopt.OBSERVE_MEASUREMENTS.set(grader)
    try:
        summary = stages.get(a.stage).run(exp, resume=False)
    finally:
        overopt.OBSERVE_MEASUREMENTS.reset(token)
        dist.close()
    run = Path(summary["run_dir"])
    history = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    j = grader.judge.guard if grader.judge else None  # the judge's decisions
    points = [{**{k: v for k, v in p.items() if k != "scores"}, "scores": [round(x, 5) for x in p["scores"]],
               **grader.graded.get(p["iteration"], {})} for p in (j.points if j else [])]
    trace = {"stage": a.stage, "overrides": a.overrides, "steps": getattr(exp, a.stage).steps,
             "every": getattr(exp, a.stage).judge_every, "z": j.z if j else None,
             "budget": j.budget if j else None, "kl_ref": [h["kl/ref"] for h in history if "kl/ref" in h],
             "fell": j.fell if j else None, "left": j.left if j else None, "points": points,
             "reference": [round(x, 5) for x in j.reference] if j and j.reference else None}
    (run / "guard_trace.json").write_text(json.dumps(trace) + "\n")
    print(run / "guard_trace.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
