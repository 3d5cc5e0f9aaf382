"""Export a stage's LoRA adapter alone, or merged into the (unquantized) base as safetensors that plain transformers
loads. A merge is verified: the merged model's greedy tokens must equal the adapter model's on held-out prompts.
Nothing is left in place that did not pass: the adapter and the merged model are renamed into the run only once the
export is complete and verified (records.atomic_dir)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf.inputs import data, models
from rlhf.infra import dist, faults
from rlhf.rl import generation
from rlhf.recipes import rm
from rlhf.runs import records
from rlhf.experiment import stages
from rlhf.experiment.config import Experiment
from rlhf.memory import copies
from rlhf.runs.runtime import Plan, Session


def _unquantized(exp: Experiment) -> Experiment:
    import copy

    plain = copy.deepcopy(exp)
    plain.quantization.load_in_4bit = False  # merging into 4-bit weights would round the update away
    return plain


@torch.no_grad()
def greedy(model, tok, prompts: list[str], exp: Experiment) -> torch.Tensor:
    return generation.generate(model, tok, prompts, max_new_tokens=exp.eval.max_new_tokens, temperature=1.0,
                               top_p=1.0, max_prompt_length=exp.data.max_prompt_length, do_sample=False,
                               copy_bytes=copies.sampling(exp, "export")[0], desc="export check").response


def export(exp: Experiment, stage: str = "sft", merge: bool = False) -> dict:
    if stage not in stages.exportable():
        raise records.StageInputError(f"export: stage must be one of {stages.exportable()}, got '{stage}'")
    src_dir, src = records.latest(exp, stage, "export")
    adapter = src["model"]["adapter"]
    plan = Plan.make(exp, "export", {"run": str(src_dir), "stage": stage}, {}, {stage: (src_dir, src)})
    session = Session.start(exp, plan, resume=False)
    adapter_dir, merged_dir = session.run.dir / "adapter", session.run.dir / "merged"
    out: dict = {"adapter": str(adapter_dir)}
    # each written into a temp dir and renamed into place once the whole export has passed (the merged model its
    # greedy check): a failure, a full disk included, leaves neither (nor their space taken), a kill no adapter/ or
    # merged/ that looks finished; the run is not until its summary is written. A full disk's error states the free
    # space with the adapter's copy still taking its part of it, so "needs" less "free" is what a rerun lacks
    with records.atomic_dir(adapter_dir) as adapter_tmp:
        with faults.writing(adapter_dir, "exported adapter", needed=faults.tree_bytes(adapter), partial=adapter_tmp):
            shutil.copytree(adapter, adapter_tmp, dirs_exist_ok=True)
        if merge:
            out.update(_merge(exp, session, stage, src, adapter, merged_dir))
    return session.finish({"metrics": out, "model": {**src["model"], "exported_from": stage, "merged": merge}})


def _merge(exp: Experiment, session: Session, stage: str, src: dict, adapter: str, merged_dir: Path) -> dict:
    """The adapter merged into the unquantized base, saved to `merged_dir` only once it is verified: a policy's
    merged model, reloaded from disk, must generate the adapter model's greedy tokens on held-out prompts; a reward
    model's, reloaded as transformers' one-label classifier, is scored against the adapter model on held-out pairs
    (rm.score, rm_agreement; a pair ranked otherwise is said)."""
    plain = _unquantized(exp)
    kind = "causal" if stages.get(stage).policy else "reward"
    tok = models.load_tokenizer(adapter)
    out: dict = {"merged": str(merged_dir)}
    with records.atomic_dir(merged_dir) as tmp:
        with session.probe.phase("merge"):
            base = models.load_base(models.loading(plain), src["model"]["base_path"], kind, tok, train=False)
            model = models.load_adapter(base, adapter)
            held_out = data.load(exp).render(tok).eval[:32]
            if kind == "causal":
                prompts = [r["prompt"] for r in held_out]
                reference = greedy(model, tok, prompts, exp)
            else:  # each pair's chosen, then its rejected
                pair_prompts = [r["prompt"] for r in held_out for _ in ("chosen", "rejected")]
                responses = [r[side] for r in held_out for side in ("chosen", "rejected")]
                reference = rm.score(model, tok, pair_prompts, responses, exp.eval.batch_size).tolist()
            merged = model.merge_and_unload()
            size = sum(p.numel() * p.element_size() for p in merged.parameters())
            with faults.writing(merged_dir, "merged model", needed=size, partial=tmp):
                merged.save_pretrained(tmp, safe_serialization=True)
                models.save_tokenizer(tok, tmp)  # as trained, not as the greedy check left it
        if kind == "causal":
            reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=models.DTYPES[exp.model.dtype])
            out["greedy_tokens_match"] = bool(torch.equal(greedy(reloaded, tok, prompts, exp), reference))
            if not out["greedy_tokens_match"]:
                raise RuntimeError(f"export: the merged model does not generate what the adapter model does; it is "
                                   f"not written to {merged_dir}")
        else:
            reloaded = AutoModelForSequenceClassification.from_pretrained(tmp, num_labels=1,
                                                                         dtype=models.DTYPES[exp.model.dtype])
            merged_scores = rm.score(reloaded, tok, pair_prompts, responses, exp.eval.batch_size).tolist()
            out.update(rm_agreement(reference, merged_scores))
            if out["pairs_ranked_alike"] < out["pairs"]:
                dist.warn(f"export: the merged reward model ranks {out['pairs'] - out['pairs_ranked_alike']} of "
                          f"{out['pairs']} held-out pairs otherwise than the adapter model on the same base (scores "
                          f"apart by up to {out['score_max_abs_diff']:.3g}: the merge's rounding in "
                          f"{exp.model.dtype})")
    return out


def rm_agreement(adapter: list[float], merged: list[float]) -> dict:
    """The merged reward model against the adapter model on the same held-out texts, (chosen, rejected) in turn: the
    largest score difference, and how many pairs each ranks alike (the chosen side above, or not)."""
    alike = sum((a[0] > a[1]) == (m[0] > m[1]) for a, m in zip(zip(adapter[::2], adapter[1::2]),
                                                               zip(merged[::2], merged[1::2])))
    return {"score_max_abs_diff": max((abs(a - m) for a, m in zip(adapter, merged)), default=None),
            "pairs_ranked_alike": alike, "pairs": len(adapter) // 2}
