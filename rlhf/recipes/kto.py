"""KTO stage: TRL's KTOTrainer on unpaired feedback (each completion desirable or not, with no pair), LoRA continuing
from the SFT adapter on the same base. The reference is the frozen SFT adapter (kto.reference=sft, default) or the
base with adapters disabled (kto.reference=base), as DPO's (trainers.continuing_sft).

Its rows are TRL's unpaired preference format {prompt, completion, label}: kto.path's (standard or conversational;
a bad row fails naming the file, the line and the field), or by default the preference pool's training pairs
unpaired (chosen: label true, rejected: false), so every experiment with pairs runs it. Either way they are shuffled
with the experiment's seed: TRL's KTOTrainer takes its batches in order and estimates its reference point, the
KL(policy || reference), from each batch's completions under the batch's other prompts, so a batch must mix
desirable and undesirable completions of different prompts (a pair unpaired in place puts its two side by side).

Per step (loss_type kto) TRL 1.16 runs the policy without gradients over those mismatched sequences, with gradients
over the batch, then the reference over both: one sequence per example through the trained pass (the memory plan's
preference shape, a sequence per row)."""

from __future__ import annotations

import random

from trl import KTOConfig, KTOTrainer

from rlhf.inputs import data
from rlhf.infra import dist
from rlhf.recipes import preference
from rlhf.experiment.config import ConfigError, Experiment
from rlhf.inputs.formats import DataError, _is_conv, _text_or_messages, load_file, missing
from rlhf.runs.runtime import Plan, preference_plan, upstream_sft
from rlhf.experiment.sections import KTOConfig as KTOSection

EVAL_KEYS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "loss")
"""What TRL's KTOTrainer reports on the held-out rows (rewards: beta x the log-ratio to the reference; chosen: the
desirable completions, rejected: the undesirable ones; kl: its reference point)."""
FORMAT = ("TRL's unpaired preference format {prompt, completion, label}: label true for a desirable completion, "
          "false for an undesirable one; prompt and completion both strings or both lists of messages")


def unpaired_row(rec: dict, where: str) -> dict:
    """A record of kto.path as {prompt, completion, label}; DataError naming `where`, the field and the fix."""
    if "label" not in rec and {"chosen", "rejected"} <= rec.keys():
        raise DataError(f"{where}: a preference pair (chosen, rejected), not an unpaired row: give the pairs as "
                        f"data.path and leave kto.path unset (KTO unpairs them: chosen desirable, rejected not)")
    for k in ("prompt", "completion", "label"):
        if k not in rec:
            raise missing(where, k, rec, FORMAT)
    if not isinstance(rec["label"], bool):
        raise DataError(f"{where}: field 'label' must be true (a desirable completion) or false (an undesirable "
                        f"one), got {type(rec['label']).__name__} {rec['label']!r}")
    prompt, completion = _text_or_messages(rec, "prompt", where), _text_or_messages(rec, "completion", where)
    if _is_conv(prompt) != _is_conv(completion):
        raise DataError(f"{where}: fields 'prompt' and 'completion' must both be strings or both be message lists")
    if _is_conv(completion) and completion[0]["role"] != "assistant":
        raise DataError(f"{where}: field 'completion' must start with an assistant message, got role "
                        f"'{completion[0]['role']}'")
    return {"prompt": prompt, "completion": completion, "label": rec["label"]}


def unpaired(pairs: list[dict]) -> list[dict]:
    """Preference pairs as unpaired rows (TRL's unpair_preference_dataset): the chosen completion desirable, the
    rejected one not, each with the pair's columns."""
    return [{"id": f"{p['id']}:{side}", "prompt": p["prompt"], "completion": p[side], "label": side == "chosen",
             **({"columns": p["columns"]} if "columns" in p else {})} for p in pairs for side in ("chosen", "rejected")]


def shuffled(rows: list[dict], seed: int) -> list[dict]:
    """`rows` in a seeded order (the module docstring: each of TRL's in-order batches mixes labels and prompts)."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows


def check_batch(o: KTOSection, where: str) -> None:
    """loss_type kto estimates its KL from a batch's other rows: each process needs at least 2 (TRL 1.16 refuses
    fewer only once the model is loaded)."""
    if o.loss_type == "kto" and dist.per_device(o.batch_size, "kto.batch_size", where) < 2:
        raise ConfigError(f"{where}: kto.batch_size={o.batch_size} gives each of {dist.world_size()} process(es) "
                          f"fewer than 2 rows, and loss_type kto estimates its KL from a batch's other rows; raise "
                          f"kto.batch_size (kto.grad_accum keeps the step's size) or set kto.loss_type="
                          f"apo_zero_unpaired")


def prepare(exp: Experiment) -> Plan:
    """KTO's inputs, before any model loads: the SFT run, its training rows (kto.path's, else the pool's pairs less
    the judge's, unpaired) and the held-out pairs (unpaired for the trainer's evaluation; whole for the check)."""
    o, where = exp.kto, exp.source or "config"
    check_batch(o, where)
    if o.path is None:
        plan = preference_plan(exp, "kto")
        plan.data.train_rows = shuffled(unpaired(plan.data.pairs), exp.seed)
    else:
        rows, skipped = load_file(o.path, "unpaired", exp.data.split, exp.data.columns or None, parse=unpaired_row,
                                  field="kto.path")
        splits = data.load(exp)
        sft_dir, sft, tok = upstream_sft(exp, "kto", splits.eval)
        splits.render(tok)  # conversational records -> text with the SFT tokenizer's chat template
        ids = {"train": [r["id"] for r in rows], "eval": [p["id"] for p in splits.eval]}
        inputs = {"sft_run": str(sft_dir), "data": o.path, "train_ids": ids["train"],
                  **data.skipped_record(skipped)}
        plan = Plan.make(exp, "kto", inputs, ids, {"sft": (sft_dir, sft)}, sft=sft, tok=tok, splits=splits,
                         eval_pairs=splits.eval, train_rows=shuffled(data.render(rows, tok), exp.seed))
    plan.data.eval_rows = shuffled(unpaired(plan.data.eval_pairs), exp.seed)
    return plan


def loss_args(o: KTOSection, where: str) -> dict:
    """The `kto` section's loss settings as KTOConfig's arguments."""
    return dict(beta=o.beta, loss_type=o.loss_type, desirable_weight=o.desirable_weight,
                undesirable_weight=o.undesirable_weight)


def labels(rows: list[dict]) -> dict:
    """The training rows by label, for the summary."""
    desirable = sum(r["label"] for r in rows)
    return {"desirable": desirable, "undesirable": len(rows) - desirable}


METHOD = preference.Method(trainer=KTOTrainer, config=KTOConfig, columns=("prompt", "completion", "label"),
                           eval_keys=EVAL_KEYS, before="rewards/margins", args=loss_args, counts=labels)


def train(exp: Experiment, resume: bool = True) -> dict:
    return preference.train(METHOD, exp.kto, prepare(exp), exp, resume)
