"""The default tiny experiment end to end on CPU: every stage learns what it should. One pipeline per session."""

import json
import subprocess
import sys

import pytest
import torch

from rlhf import dpo, evaluate, export, losses, ppo, records, rm, sft

from .conftest import ROOT, TINY, tiny

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    exp = tiny(root)
    out = {"exp": exp, "root": root}
    for name, fn in (("sft", sft.train), ("rm", rm.train), ("dpo", dpo.train), ("ppo", ppo.train),
                     ("eval", evaluate.train)):
        out[name] = fn(exp)
    return out


def test_sft_lowers_eval_perplexity(pipeline):
    m = pipeline["sft"]["metrics"]
    assert m["eval_perplexity"] < 0.5 * m["eval_perplexity_before"]


def test_run_record_is_complete(pipeline):
    run = records.Path(pipeline["sft"]["run_dir"])
    for f in ("config.yaml", "env.json", "metrics.jsonl", "summary.json"):
        assert (run / f).exists(), f
    env = json.loads((run / "env.json").read_text())
    assert env["packages"]["trl"] and env["packages"]["torch"]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in s for s in steps) and all("step" in s for s in steps)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["memory"]["peak_gb"] > 0 and summary["throughput"]["tokens_per_s"] > 0
    assert not list(run.glob(".*.tmp")) and not list(run.glob(".summary.json.*"))


def test_reward_model_ranks_held_out_pairs(pipeline):
    m = pipeline["rm"]["metrics"]
    assert m["eval_accuracy"] >= 0.90 and m["eval_accuracy_before"] < 0.75
    assert m["eval_chosen_mean"] > m["eval_rejected_mean"]
    assert pipeline["rm"]["reward_stats"]["std"] > 0


def test_dpo_beats_sft_under_ground_truth(pipeline):
    wr = pipeline["eval"]["metrics"]["dpo"]["win_rate_vs_sft_ground_truth"]
    assert wr["n"] >= 200 and wr["win_rate"] >= 0.60
    assert pipeline["dpo"]["metrics"]["eval_rewards_accuracies"] > 0.8


def test_ppo_beats_sft_with_bounded_kl(pipeline):
    exp, m = pipeline["exp"], pipeline["ppo"]["metrics"]
    assert m["eval_prompts"] >= 200 and m["eval_win_rate_vs_sft"] >= 0.65
    lo, hi = exp.ppo.kl_band
    assert lo <= m["train_kl_ref_last5"] <= hi
    wr = pipeline["eval"]["metrics"]["ppo"]["win_rate_vs_sft_ground_truth"]
    assert wr["win_rate"] >= 0.6


def test_ppo_first_rollout_has_zero_kl_and_logs_diagnostics(pipeline):
    run = records.Path(pipeline["ppo"]["run_dir"])
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["kl/ref"] == 0.0
    for key in ("approx_kl", "clipfrac", "explained_variance", "entropy", "value_loss", "policy_loss", "kl/beta",
                "reward/mean", "reward/std", "response/length", "time/rollout_s", "time/update_s", "tokens_per_s"):
        assert key in first, key


def test_eval_writes_a_sample_table(pipeline):
    table = records.Path(pipeline["eval"]["samples"]).read_text()
    assert "| prompt | sft | dpo | ppo |" in table and "win rate vs SFT" in table


def test_export_merge_round_trip(pipeline):
    summary = export.export(pipeline["exp"], "dpo", merge=True)
    assert summary["metrics"]["greedy_tokens_match"] is True
    merged = records.Path(summary["metrics"]["merged"])
    assert (merged / "model.safetensors").exists() and (merged / "config.json").exists()


def test_stages_refuse_missing_input(tmp_path):
    exp = tiny(tmp_path)
    for fn in (rm.train, dpo.train, ppo.train):
        with pytest.raises(records.StageInputError, match="needs a finished sft run"):
            fn(exp)
    out = subprocess.run([sys.executable, "-m", "rlhf", "rm", "--exp", str(TINY), f"results_dir={tmp_path}"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.startswith("error: rm needs a finished sft run")
    assert "Traceback" not in out.stderr


def test_stages_refuse_another_base_or_tokenizer(pipeline, tmp_path):
    exp = pipeline["exp"]
    other = tiny(pipeline["root"], "model.name=some/other-model")
    with pytest.raises(records.StageInputError, match="trained on base 'tiny'"):
        rm.train(other)
    run_dir, summary = records.latest(exp, "sft", "test")
    tampered = json.loads((run_dir / "summary.json").read_text())
    tampered["model"]["tokenizer_hash"] = "0" * 16
    original = (run_dir / "summary.json").read_text()
    (run_dir / "summary.json").write_text(json.dumps(tampered))
    try:
        with pytest.raises(records.StageInputError, match="another tokenizer"):
            dpo.train(exp)
    finally:
        (run_dir / "summary.json").write_text(original)


def test_dpo_reference_equals_policy_before_training_and_only_lora_moves(pipeline):
    exp = pipeline["exp"]
    sft_dir, sft_summary = records.latest(exp, "sft", "test")
    from rlhf.runtime import Session, upstream_sft

    _, sft_summary, tok = upstream_sft(exp, "test")
    session = Session.start(tiny(pipeline["root"], "dpo.max_steps=5", "name=dpo-check"), "dpo")
    rows = evaluate.data.load(exp)
    trainer = dpo.build_trainer(session.exp, session, sft_summary, tok, rows.pairs(64), rows.eval[:16])
    model = trainer.model
    assert set(model.peft_config) == {"default", "ref"}
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    with torch.no_grad():
        model.set_adapter("default")
        pol = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        model.set_adapter("ref")
        ref = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        model.set_adapter("default")
    assert torch.equal(pol, ref)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n and "modules_to_save" not in n}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if ".default." in n}
    trainer.train()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base.items()), "a base weight changed"
    assert sum(not torch.equal(after[n], v) for n, v in lora.items()) > len(lora) // 2, "LoRA weights did not move"
    for n, p in model.named_parameters():
        if ".ref." in n:
            assert not p.requires_grad
    # TRL's DPO loss on a batch equals ours (rlhf.losses.dpo_sigmoid) on log-probs summed by hand
    model.eval()
    with torch.no_grad():
        trl_loss = trainer.compute_loss(model, dict(batch)).item()
        labels, keep = batch["input_ids"][:, 1:], batch["completion_mask"][:, 1:].float()

        def summed(adapter):
            model.set_adapter(adapter)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            return (losses.logprobs_from_logits(logits, labels) * keep).sum(1).chunk(2)

        pc, pr = summed("default")
        rc, rr = summed("ref")
    ours, _, _ = losses.dpo_sigmoid(pc, pr, rc, rr, session.exp.dpo.beta)
    assert trl_loss == pytest.approx(ours.item(), rel=1e-4, abs=1e-5)


def test_nan_reward_stops_ppo_naming_the_step_and_keeps_the_last_checkpoint(pipeline, monkeypatch):
    exp = tiny(pipeline["root"], "ppo.steps=3", "ppo.save_steps=1", "ppo.rollout_batch=16", "ppo.minibatch=16",
               "ppo.micro_batch=16")
    real = ppo.Roles.score
    calls = {"n": 0}

    def flaky(self, r):
        calls["n"] += 1
        out = real(self, r)
        return out * float("nan") if calls["n"] == 2 else out

    monkeypatch.setattr(ppo.Roles, "score", flaky)
    with pytest.raises(ppo.NonFiniteError, match=r"PPO step 2: reward is NaN/inf"):
        ppo.train(exp)
    (run,) = [d for d in (pipeline["root"] / exp.name / "ppo").glob("2*") if not (d / "summary.json").exists()]
    assert (run / "checkpoints" / "step-1" / "state.pt").exists()
    assert (run / "checkpoints" / "last").read_text().strip() == "step-1"


@pytest.mark.parametrize("value_model, reference", [("shared", "sft"), ("separate", "base")])
def test_ppo_variants_run(pipeline, value_model, reference):
    exp = tiny(pipeline["root"], "ppo.steps=2", "ppo.rollout_batch=16", "ppo.minibatch=8", "ppo.micro_batch=4",
               f"ppo.value_model={value_model}", f"ppo.reference={reference}", "eval.prompts=16")
    s = ppo.train(exp)
    run = records.Path(s["run_dir"])
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"kl/ref"' in line]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(st["value_loss"])) for st in steps)
    if reference == "sft":
        assert steps[0]["kl/ref"] == 0.0
    else:  # the base with adapters disabled is not the SFT policy
        assert steps[0]["kl/ref"] != 0.0


def test_every_record_names_what_it_consumed(pipeline):
    """Lineage: each run's upstream runs with their fingerprints and adapter hashes, chained SFT -> RM -> PPO."""
    from rlhf import lineage

    sft_l, rm_l, ppo_l = (pipeline[s]["lineage"] for s in ("sft", "rm", "ppo"))
    assert sft_l["upstream"] == {} and len(sft_l["fingerprint"]) == 20
    assert sft_l["adapter_sha256"] == lineage.adapter_sha256(pipeline["sft"]["model"]["adapter"])
    for stage in ("rm", "dpo", "ppo"):
        up = pipeline[stage]["lineage"]["upstream"]["sft"]
        assert up == {"run": pipeline["sft"]["run_dir"], "fingerprint": sft_l["fingerprint"],
                      "adapter_sha256": sft_l["adapter_sha256"]}
    assert ppo_l["upstream"]["rm"]["fingerprint"] == rm_l["fingerprint"]
    ev = pipeline["eval"]["lineage"]["upstream"]
    assert set(ev) == {"sft", "dpo", "ppo"}
    assert ev["ppo"]["adapter_sha256"] == ppo_l["adapter_sha256"] is not None
    on_disk = json.loads((records.Path(pipeline["ppo"]["run_dir"]) / "lineage.json").read_text())
    assert on_disk["fingerprint"] == ppo_l["fingerprint"] and on_disk["config_hash"] == ppo_l["config_hash"]
