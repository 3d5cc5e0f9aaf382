"""A base whose output head is its input embedding's weight (model.tie_embeddings; Gemma, Qwen2.5's small sizes)
under tiny.yaml's lora.modules_to_save [embed_tokens, lm_head]: the adapter trains one copy of the two, every adapter
loaded beside it on one base stays tied, and a merged export is tied as its base is (models.lora_config,
models.load_adapter). Without it peft warns, trains two copies that drift apart and exports an untied model."""

import json
import warnings

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file

from rlhf.experiment import config
from rlhf.inputs import models
from rlhf.runs import records

from .conftest import TINY, make

pytestmark = pytest.mark.slow
SHORT = ["model.tie_embeddings=true", "data.sft_examples=256", "data.pref_pairs=64", "data.eval_examples=16",
         "eval.prompts=16", "sft.max_steps=24", "sft.save_steps=0", "dpo.max_steps=2", "dpo.save_steps=0"]
TIE_WARNINGS = ("tie_word_embeddings", "ensure_weight_tying")


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """`make sft`, `make dpo` and `make export STAGE=sft MERGE=1` on a tied tiny base: their summaries and consoles."""
    root = tmp_path_factory.mktemp("results")
    args = f"ARGS=results_dir={root} {' '.join(SHORT)}"
    procs = {"sft": make("sft", args), "dpo": make("dpo", args), "export": make("export", "STAGE=sft", "MERGE=1", args)}
    exp = config.load(TINY, [f"results_dir={root}", *SHORT])
    return {"exp": exp, "stderr": {s: p.stderr for s, p in procs.items()},
            **{s: records.latest(exp, s, "test")[1] for s in procs}}


def embedding_and_head(adapter_dir) -> tuple[torch.Tensor, torch.Tensor]:
    saved = load_file(str(records.Path(adapter_dir) / "adapter_model.safetensors"))
    (emb,) = [v for k, v in saved.items() if k.endswith("embed_tokens.weight")]
    (head,) = [v for k, v in saved.items() if k.endswith("lm_head.weight")]
    return emb, head


def test_the_trained_embedding_and_head_stay_one_matrix(tied):
    for stage in ("sft", "dpo"):
        assert not any(w in tied["stderr"][stage] for w in TIE_WARNINGS), tied["stderr"][stage][-2000:]
        emb, head = embedding_and_head(tied[stage]["model"]["adapter"])
        assert torch.equal(emb, head), stage
        cfg = json.loads((records.Path(tied[stage]["model"]["adapter"]) / "adapter_config.json").read_text())
        assert cfg["ensure_weight_tying"] is True, stage
    base = load_file(str(records.Path(tied["sft"]["model"]["base_path"]) / "model.safetensors"))
    trained, _ = embedding_and_head(tied["sft"]["model"]["adapter"])
    assert not torch.equal(trained, base["model.embed_tokens.weight"])  # the copy trained, not the base's


def test_the_merged_export_is_tied_with_one_matrix(tied):
    merged = records.Path(tied["export"]["metrics"]["merged"])
    assert tied["export"]["metrics"]["greedy_tokens_match"] is True
    assert json.loads((merged / "config.json").read_text())["tie_word_embeddings"] is True
    weights = load_file(str(merged / "model.safetensors"))
    assert "lm_head.weight" not in weights
    trained, _ = embedding_and_head(tied["sft"]["model"]["adapter"])
    assert torch.equal(weights["model.embed_tokens.weight"], trained)


def test_adapters_loaded_beside_the_first_stay_tied(tied):
    """PPO's and the checks' way: the SFT adapter as the trainable policy and again as the frozen reference on one
    4-bit base, a reward adapter (a classifier's: its embedding alone) beside them, and the copy TRL's DPOTrainer
    makes of the policy by its config (models.copying_tied_adapters): no warning, each causal adapter's head its own
    embedding copy, the reference computing what the policy does."""
    exp, sft = tied["exp"], tied["sft"]
    tok = models.load_tokenizer(sft["model"]["adapter"])
    rm_dir = records.Path(sft["run_dir"]).parent / "rm-adapter"
    classifier = models.load_base(models.loading(exp), sft["model"]["base_path"], "reward", tok)
    get_peft_model(classifier, models.lora_config(exp.lora, "SEQ_CLS")).save_pretrained(rm_dir)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = models.load_base(models.loading(exp), sft["model"]["base_path"], "causal", tok)
        model = models.load_adapter(model, sft["model"]["adapter"], "policy", trainable=True)
        models.load_adapter(model, sft["model"]["adapter"], "ref")
        models.load_adapter(model, rm_dir, "reward")
        with models.copying_tied_adapters():
            model.add_adapter("copy", model.peft_config["policy"])
    assert not [w for w in seen if any(t in str(w.message) for t in TIE_WARNINGS)], [str(w.message) for w in seen]
    ids = tok(["a b c d"], return_tensors="pt").input_ids
    logits = {}
    for name in ("policy", "ref", "copy"):
        model.set_adapter(name)
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, name
        with torch.no_grad():
            logits[name] = model(input_ids=ids).logits
    assert torch.equal(logits["policy"], logits["ref"])
    model.set_adapter("policy")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert trainable == ["base_model.model.model.embed_tokens.modules_to_save.policy.weight"]
