"""The SFT -> RM -> DPO -> PPO pipeline written directly against TRL, one process per stage as a user's own scripts
would run it: TRL 1.16's SFTTrainer, RewardTrainer and DPOTrainer (bench/plain.py: the same base, rows, LoRA and
settings as ours, each saving its adapter), then the merge TRL 0.25.1's PPOTrainer needs (dense policy and reward
models from that SFT adapter and RM), then that PPOTrainer (bench/trl025_ppo.py, in its own venv, run by the bench).

    python bench/plain_pipeline.py STAGE SPEC.json      STAGE: sft | rm | dpo | merge

SPEC: {"exp": experiment file, "overrides": [...], "out": directory, "base": model directory or null (null: the
tiny model is built from the data, as our SFT stage builds it)}. The RM's head is left as trained (TRL's pipeline
has no reward normalization)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(stage: str, spec_path: str) -> None:
    from bench import peer_models, plain
    from rlhf.experiment import config
    from rlhf.inputs import data, models

    spec = json.loads(Path(spec_path).read_text())
    exp = config.load(spec["exp"], spec["overrides"])
    out = Path(spec["out"])
    base = spec["base"] or str(out / "base")
    if stage == "sft":
        train_rows, eval_rows, splits = data.load_sft(exp)
        if not spec["base"]:  # the word-level tokenizer knows every word of the pool, as ours
            texts = [r["prompt"] + r["completion"] for r in train_rows + eval_rows]
            texts += [r["rejected"] for r in splits.train + splits.eval]
            models.build_tiny_base(exp.model, exp.seed, texts, Path(base))
        result = plain.sft(exp, base, train_rows, str(out / "sft-run"), save=str(out / "sft"))
    elif stage in ("rm", "dpo"):
        pairs = data.load(exp).pairs(exp.data.pref_pairs)
        fn = plain.rm if stage == "rm" else plain.dpo
        result = fn(exp, base, str(out / "sft"), pairs, str(out / f"{stage}-run"), save=str(out / stage))
    elif stage == "merge":
        tok = models.load_tokenizer(str(out / "sft"))
        result = peer_models.export(exp, {"model": {"base_path": base, "adapter": str(out / "sft")}},
                                    {"model": {"adapter": str(out / "rm")}, "reward_stats": {"std": 1.0}}, tok,
                                    out / "dense")
    else:
        raise SystemExit(f"unknown stage {stage!r}: sft | rm | dpo | merge")
    (out / f"{stage}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main(sys.argv[1], sys.argv[2])
