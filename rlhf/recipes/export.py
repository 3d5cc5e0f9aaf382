"""Export a stage's LoRA adapter alone, or merged into the (unquantized) base as safetensors that plain transformers
loads. A merge is verified: the merged model's greedy tokens must equal the adapter model's on held-out prompts."""

from __future__ import annotations

import shutil

import torch
from transformers import AutoModelForCausalLM

from rlhf.inputs import data, models
from rlhf.infra import faults
from rlhf.rl import generation
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
    out: dict = {"adapter": str(session.run.dir / "adapter")}
    with faults.writing(out["adapter"], "exported adapter", needed=faults.tree_bytes(adapter)):
        shutil.copytree(adapter, out["adapter"])
    if merge:
        plain = _unquantized(exp)
        kind = "causal" if stages.get(stage).policy else "reward"
        tok = models.load_tokenizer(adapter)
        with session.probe.phase("merge"):
            base = models.load_base(models.loading(plain), src["model"]["base_path"], kind, tok, train=False)
            model = models.load_adapter(base, adapter)
            merged_dir = session.run.dir / "merged"
            if kind == "causal":
                prompts = [r["prompt"] for r in data.load(exp).render(tok).eval[:32]]
                reference = greedy(model, tok, prompts, exp)
            merged = model.merge_and_unload()
            size = sum(p.numel() * p.element_size() for p in merged.parameters())
            with faults.writing(merged_dir, "merged model", needed=size):
                merged.save_pretrained(merged_dir, safe_serialization=True)
                models.save_tokenizer(tok, merged_dir)  # as trained, not as the greedy check left it
        out["merged"] = str(merged_dir)
        if kind == "causal":
            reloaded = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=models.DTYPES[exp.model.dtype])
            out["greedy_tokens_match"] = bool(torch.equal(greedy(reloaded, tok, prompts, exp), reference))
            if not out["greedy_tokens_match"]:
                raise RuntimeError(f"export: the merged model at {merged_dir} does not generate what the adapter "
                                   f"model does; do not use it")
    return session.finish({"metrics": out, "model": {**src["model"], "exported_from": stage, "merged": merge}})
