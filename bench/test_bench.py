"""`make bench`: our stages against their plain TRL/peft/transformers equivalents, in the same process and run, on the
tiny config and a ~50M-parameter one; our PPO against TRL 0.25.1's PPOTrainer (own venv, subprocess); the memory
predictor's run time. Each test stores its figures in conftest.RESULTS (written to results/bench/ at the end).

The machine is shared, so every comparison is made inside one test, the variants run round-robin (a different one
first in each round) and the best round of each counts."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from rlhf.inputs import data, models
from rlhf.recipes import dpo, rm, sft
from rlhf.runs import records
from rlhf.memory import memplan

from .conftest import ROOT, TINY, ensure_peer_venv, exp_for, record, run_measured
from .shapes import RECIPES, SHAPES, build_bpe_base

pytestmark = pytest.mark.bench

ROUNDS = {"tiny": int(os.environ.get("BENCH_ROUNDS_TINY", 3)), "small": int(os.environ.get("BENCH_ROUNDS_SMALL", 2))}
STAGE_DATA = {  # enough steps to time, few enough for the suite to stay under 10 minutes on 2 busy cores
    "tiny": ["data.sft_examples=256", "data.pref_pairs=256", "data.eval_examples=32",
             "sft.epochs=1", "rm.epochs=1", "dpo.epochs=1"],
    "small": ["data.sft_examples=24", "data.pref_pairs=24", "data.eval_examples=8", "sft.batch_size=8",
              "rm.batch_size=8", "dpo.batch_size=8", "sft.epochs=1", "rm.epochs=1", "dpo.epochs=1"],
}
PPO_UPSTREAM = ("sft.epochs=2", "rm.epochs=1")
PPO_STEPS = int(os.environ.get("BENCH_PPO_STEPS", 8))
SEEDS = int(os.environ.get("BENCH_SEEDS", 1))
"""Seeds of each PPO/GRPO/RLOO comparison against its peer (BENCH_SEEDS): the ground truth's gain over SFT is one
noisy draw per seed (200 held-out prompts sampled once), so a difference between the sides needs several."""


def interleaved(sides: dict, seeds: list[int]) -> dict:
    """Each side's runs (side -> fn(seed)), seed by seed, the side that goes first alternating: a machine whose
    speed drifts over the hours a comparison takes tilts neither side (both run in every stretch of it)."""
    runs = {side: [] for side in sides}
    for k, seed in enumerate(seeds):
        for side in (list(sides) if k % 2 == 0 else list(sides)[::-1]):
            runs[side].append(sides[side](seed))
    return {side: over_seeds(r) for side, r in runs.items()}


def over_seeds(runs: list[dict]) -> dict:
    """One side's runs over seeds: the first run's record, with the means of its time, ground truth, and (GRPO/RLOO)
    clipped fraction and training reward of the last three batches, the largest peak memory and each seed's gain
    over SFT."""
    means = [k for k in ("step_s", "gt_policy", "gt_sft", "clip_frac", "train_reward_last3", "generate_share",
                         "judge_share") if k in runs[0]]
    return {**runs[0], **{k: sum(r[k] for r in runs) / len(runs) for k in means},
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "gains": [r["gt_policy"] - r["gt_sft"] for r in runs]}


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


def _exp(root, size, *extra):
    return exp_for(root / size, size, *STAGE_DATA[size], *extra)


def _ensure_sft(root, size):
    exp = _exp(root, size)
    try:
        records.latest(exp, "sft", "bench")
    except records.StageInputError:
        sft.train(exp)
    return records.latest(exp, "sft", "bench")[1]


def _plain(stage, exp, root, size, trl_defaults=False):
    from . import plain

    out = str(root / size / f"plain-{stage}")
    if stage == "sft":
        train_rows, eval_rows, splits = data.load_sft(exp)
        texts = [r["prompt"] + r["completion"] for r in train_rows + eval_rows]
        texts += [r["rejected"] for r in splits.train + splits.eval]  # as sft.train builds the tiny base
        base = root / size / "plain-base"
        if not (base / "config.json").exists():
            models.build_tiny_base(exp.model, exp.seed, texts, base)
        return plain.sft(exp, str(base), train_rows, out, trl_defaults)
    s = records.latest(exp, "sft", "bench")[1]
    pairs = data.load(exp).pairs(exp.data.pref_pairs)
    fn = plain.rm if stage == "rm" else plain.dpo
    return fn(exp, s["model"]["base_path"], s["model"]["adapter"], pairs, out, trl_defaults)


def _ours(stage, exp):
    summary = {"sft": sft.train, "rm": rm.train, "dpo": dpo.train}[stage](exp)
    return summary["throughput"]


@pytest.mark.parametrize("size", ["tiny", "small"])
@pytest.mark.parametrize("stage", ["sft", "rm", "dpo"])
def test_stage_throughput(benchmark, root, stage, size):
    if stage != "sft":
        _ensure_sft(root, size)
    variants = {
        "plain": lambda: _plain(stage, _exp(root, size), root, size),
        "ours": lambda: _ours(stage, _exp(root, size, "memory.track_tensors=true")),
        "ours_untracked": lambda: _ours(stage, _exp(root, size, "memory.track_tensors=false")),
    }
    names = list(variants)
    samples: dict[str, list[float]] = {n: [] for n in names}

    def rounds():
        for i in range(ROUNDS[size]):
            for name in names[i % len(names):] + names[:i % len(names)]:
                samples[name].append(variants[name]()["trained_tokens_per_s"])

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    if size == "tiny":  # TRL's own defaults (bf16 autocast, also on a CPU), once, for the record: too slow for small
        defaults = _plain(stage, _exp(root, size), root, size, True)
        samples["plain_trl_defaults"] = [defaults["trained_tokens_per_s"]]
    best = {n: max(v) for n, v in samples.items()}
    res = {"kind": "stage", "stage": stage, "config": size, "plain": best["plain"], "ours": best["ours"],
           "ours_untracked": best["ours_untracked"], "ratio": round(best["ours"] / best["plain"], 3),
           "ratio_untracked": round(best["ours_untracked"] / best["plain"], 3), "samples_tokens_per_s": samples,
           "plain_trl_defaults": best.get("plain_trl_defaults")}
    benchmark.extra_info.update({k: v for k, v in res.items() if k != "samples_tokens_per_s"})
    record(f"{stage}_{size}", res)


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_memplan_runtime(benchmark, root, size):
    exp = _exp(root, size)
    memplan.plans(exp)  # warm: imports, the synthetic vocabulary
    t0 = time.perf_counter()
    benchmark.pedantic(memplan.plans, args=(exp,), rounds=5, iterations=1)
    mean_ms = (time.perf_counter() - t0) / 5 * 1000
    record(f"memplan_{size}", {"kind": "memplan", "config": size, "mean_ms": round(mean_ms, 2)})


# ------------------------------------------------------------------------------------------------------------- PPO
_INPUTS: dict = {}


def shape_overrides(root, shape: str) -> list[str]:
    """The shape's overrides of tiny.yaml, with its local base directory (built once) for the BPE shapes."""
    s = SHAPES[shape]
    out = [*PPO_UPSTREAM, *s.overrides]
    if s.bpe:
        base = build_bpe_base(exp_for(root / "bpe-base", "tiny", *out), s.bpe, root / "bpe-base" / "model")
        out.append(f"model.name={base}")
    return out


@pytest.fixture(scope="session")
def ppo_inputs(root):
    """Per shape: a tiny SFT policy and RM good enough for PPO to have something to learn (fewer epochs than the
    default pipeline to keep the suite short), and their dense copies for the TRL peer."""
    from . import peer_models

    def get(shape: str = "tiny"):
        if shape not in _INPUTS:
            overrides = shape_overrides(root, shape)
            exp = exp_for(root / f"ppo-{shape}", "tiny", *overrides)
            sft.train(exp)
            rm.train(exp)
            _, s = records.latest(exp, "sft", "bench")
            _, r = records.latest(exp, "rm", "bench")
            tok = models.load_tokenizer(s["model"]["adapter"])
            dense = peer_models.export(exp, s, r, tok, root / f"ppo-{shape}" / "peer")
            prompts = [q["prompt"] for q in data.load(exp).eval[:16]]
            dense["max_logprob_diff"] = peer_models.check_policy(exp, s, tok, dense["policy"], prompts)
            assert dense["max_logprob_diff"] < 1e-3, dense
            _INPUTS[shape] = exp, overrides, dense
        return _INPUTS[shape]

    return get


PPO_PARTS = ("generate", "policy", "value", "ref", "score", "judge", "update_policy", "update_value", "optimizer")


def _ours_ppo(exp, overrides: list[str], seed: int, *extra: str) -> dict:
    """Ours as shipped, its judge's measurements included in the time, but trained to the end and graded on its last
    policy as the peer is (keep=last, no early stop: equal episodes, the same policy's ground truth)."""
    cmd = [sys.executable, "-m", "rlhf", "ppo", "--exp", str(TINY), f"results_dir={exp.results_dir}",
           *overrides, f"ppo.steps={PPO_STEPS}", "ppo.save_steps=0", "ppo.log_samples_every=0", "ppo.keep=last",
           "ppo.overopt_stop=false", f"seed={seed}", *extra]
    run = run_measured(cmd, env={"PYTHONPATH": str(ROOT)})
    assert run["rc"] == 0, run["output"][-3000:]
    _, summary = records.latest(exp, "ppo", "bench")
    th, m = summary["throughput"], summary["metrics"]
    phases = {k: th[f"{k}_s_per_step"] for k in PPO_PARTS}
    phases["other"] = th["step_s"] - sum(phases.values())  # Python bookkeeping, the loss maths, decoding, logging
    return {"step_s": th["step_s"], "peak_rss_mb": run["peak_rss_bytes"] / 2**20, "wall_s": run["wall_s"],
            "gt_policy": m["eval_score_policy"], "gt_sft": m["eval_score_sft"], "phases": phases,
            **sampling_shares(th)}


def sampling_shares(th: dict) -> dict:
    """Generation's and the judge's shares of an iteration of ours (the run's throughput means)."""
    return {f"{k}_share": round(th.get(f"{k}_s_per_step", 0.0) / th["step_s"], 4) for k in ("generate", "judge")}


def _peer_ppo(exp, dense: dict, root, seed: int) -> dict:
    py = ensure_peer_venv()
    p = exp.ppo
    splits = data.load(exp)
    evals = [r["prompt"] for r in splits.eval[: exp.eval.prompts]]
    spec = {"policy": dense["policy"], "reward": dense["reward"], "seed": seed, "output_dir": str(root / "trl025"),
            "prompts": [q["prompt"] for q in splits.prompts(exp.data.ppo_prompts)], "eval_prompts": evals,
            "max_prompt_length": exp.data.max_prompt_length, "eval_max_new_tokens": exp.eval.max_new_tokens,
            "eval_temperature": exp.eval.temperature, "out": str(root / "trl025.json"),
            "lora": {"r": exp.lora.r, "alpha": exp.lora.alpha, "modules_to_save": list(exp.lora.modules_to_save)},
            "ppo": {"steps": PPO_STEPS, "rollout_batch": p.rollout_batch, "minibatch": p.minibatch,
                    "epochs": p.epochs, "learning_rate": p.learning_rate, "max_new_tokens": p.max_new_tokens,
                    "temperature": p.temperature, "missing_eos_penalty": p.missing_eos_penalty,
                    "kl_coef": p.kl_coef, "clip_range": p.clip_range, "clip_range_value": p.cliprange_value,
                    "vf_coef": p.vf_coef, "gamma": p.gamma, "lam": p.lam}}
    (root / "trl025-spec.json").write_text(json.dumps(spec))
    run = run_measured([str(py), str(ROOT / "bench" / "trl025_ppo.py"), str(root / "trl025-spec.json")],
                       env={"PYTHONPATH": ""})
    assert run["rc"] == 0, run["output"][-3000:]
    out = json.loads((root / "trl025.json").read_text())
    n = exp.data.synthetic.response_len_min
    gt = {k: sum(data.gt_reward(q, a, n) for q, a in zip(evals, v)) / len(evals) for k, v in out["responses"].items()}
    step_s = out["train_s"] / out["updates"]
    phases = {k: v / out["updates"] for k, v in out["parts_s"].items()}
    phases["other"] = step_s - sum(phases.values())
    return {"step_s": step_s, "peak_rss_mb": run["peak_rss_bytes"] / 2**20,
            "wall_s": run["wall_s"], "gt_policy": gt["policy"], "gt_sft": gt["sft"], "versions": out["versions"],
            "self_reported_peak_rss_mb": out["peak_rss_bytes"] / 2**20, "phases": phases}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_ppo_vs_trl025(benchmark, root, ppo_inputs, shape):
    """Ours (the shipped settings: a separate value adapter, the tracker off) and TRL 0.25.1, one after the other on
    one thread each; ours with value_model=shared too (no value trunk: what a faster PPO step costs in another
    algorithm setting, for the record)."""
    exp, overrides, dense = ppo_inputs(shape)
    res = {}

    def run_all():  # each seed: the training run's seed on both sides; value_model=shared on the first seed only
        res.update(interleaved({"ours": lambda s: _ours_ppo(exp, overrides, s),
                                "trl025": lambda s: _peer_ppo(exp, dense, root / f"ppo-{shape}", s)},
                               [exp.seed + k for k in range(SEEDS)]))
        res["ours_shared_value"] = _ours_ppo(exp, overrides, exp.seed, "ppo.value_model=shared")

    benchmark.pedantic(run_all, rounds=1, iterations=1)
    t = res["trl025"]
    out = {"kind": "ppo", "shape": shape, "about": SHAPES[shape].about, "steps": PPO_STEPS,
           "rollout_batch": exp.ppo.rollout_batch, "episodes": PPO_STEPS * exp.ppo.rollout_batch, **res,
           "speedup": round(t["step_s"] / res["ours"]["step_s"], 3),
           "speedup_shared_value": round(t["step_s"] / res["ours_shared_value"]["step_s"], 3),
           "dense_copy_max_logprob_diff": dense["max_logprob_diff"],
           "setup": "peer: dense float32 policy (the base, dequantized when NF4, + SFT LoRA merged) with a fresh LoRA "
                    "adapter of our shape, reference = adapters disabled; reward = our RM merged, head / RM std; "
                    "value = our RM merged, trained whole; float32 (bf16=False; its default is bf16 autocast), fixed "
                    "kl_coef (ours too: fixed beta, the default), constant LR. Ours: experiments/tiny.yaml with the "
                    "shape's overrides (4 roles as adapters on one base). Peak memory: RSS of each process sampled "
                    "every 10 ms by the benchmark."}
    benchmark.extra_info.update({"speedup": out["speedup"]})
    record(f"ppo_vs_trl025_{shape}", out)


# -------------------------------------------------------------------------------------------------- the pipeline
PIPELINE = ("sft", "rm", "dpo", "ppo")
PIPE_ARGS = ("dpo.epochs=1",)


@pytest.mark.parametrize("shape", ["tiny", "bpe", "wide"])
def test_pipeline_wall_vs_trl(benchmark, root, shape):
    """SFT -> RM -> DPO -> PPO end to end, one process per stage, wall time from launch to exit: ours
    (`python -m rlhf <stage>`, what `make pipeline` runs stage by stage) against the same stages written directly
    against TRL (bench/plain_pipeline.py: TRL 1.16's trainers, the merge, then TRL 0.25.1's PPOTrainer), with the
    same base, data, LoRA, epochs, batch sizes and PPO settings."""
    overrides = [*shape_overrides(root, shape), *PIPE_ARGS]
    exp = exp_for(root / f"pipe-{shape}", "tiny", *overrides)
    res: dict = {"ours": {}, "trl": {}}

    def run_all():
        for stage in PIPELINE:
            extra = [f"ppo.steps={PPO_STEPS}", "ppo.save_steps=0", "ppo.log_samples_every=0"] if stage == "ppo" else []
            run = run_measured([sys.executable, "-m", "rlhf", stage, "--exp", str(TINY),
                                f"results_dir={exp.results_dir}", *overrides, *extra], env={"PYTHONPATH": str(ROOT)})
            assert run["rc"] == 0, run["output"][-3000:]
            res["ours"][stage] = {"wall_s": run["wall_s"], "peak_rss_mb": run["peak_rss_bytes"] / 2**20}
        out = root / f"pipe-{shape}" / "trl"
        out.mkdir(parents=True, exist_ok=True)
        base = next((o.split("=", 1)[1] for o in overrides if o.startswith("model.name=")), None)
        spec = out / "spec.json"
        spec.write_text(json.dumps({"exp": str(TINY), "overrides": [f"results_dir={out}", *overrides],
                                    "out": str(out), "base": base}))
        for stage in ("sft", "rm", "dpo", "merge"):
            run = run_measured([sys.executable, str(ROOT / "bench" / "plain_pipeline.py"), stage, str(spec)],
                               env={"PYTHONPATH": str(ROOT)})
            assert run["rc"] == 0, run["output"][-3000:]
            res["trl"][stage] = {"wall_s": run["wall_s"], "peak_rss_mb": run["peak_rss_bytes"] / 2**20}
        dense = json.loads((out / "merge.json").read_text())
        peer = _peer_ppo(exp, dense, out)
        res["trl"]["ppo"] = {"wall_s": peer["wall_s"], "peak_rss_mb": peer["peak_rss_mb"],
                             "gt_policy": peer["gt_policy"], "gt_sft": peer["gt_sft"]}

    benchmark.pedantic(run_all, rounds=1, iterations=1)
    _, summary = records.latest(exp, "ppo", "bench")
    res["ours"]["ppo"].update(gt_policy=summary["metrics"]["eval_score_policy"],
                              gt_sft=summary["metrics"]["eval_score_sft"])
    total = {side: sum(v["wall_s"] for v in res[side].values()) for side in res}
    record(f"pipeline_{shape}", {
        "kind": "pipeline", "shape": shape, "about": SHAPES[shape].about, **res,
        "total_wall_s": total, "speedup": round(total["trl"] / total["ours"], 3), "ppo_steps": PPO_STEPS,
        "settings": [*PPO_UPSTREAM, *PIPE_ARGS, f"ppo.steps={PPO_STEPS}"],
        "setup": "one process per stage, wall time from launch to exit (imports, data, model loading, training, "
                 "each stage's held-out check, saving). Ours: python -m rlhf sft|rm|dpo|ppo. TRL: "
                 "bench/plain_pipeline.py sft|rm|dpo|merge (TRL 1.16) then bench/trl025_ppo.py (TRL 0.25.1)."})


# ----------------------------------------------------------------------------------------------------- GRPO, RLOO
GROUP_STEPS = int(os.environ.get("BENCH_GROUP_STEPS", 10))
OURS_ARGS = os.environ.get("BENCH_OURS_ARGS", "").split()
"""Extra overrides for our GRPO/RLOO runs (BENCH_OURS_ARGS='grpo.use_bias_correction_kl=false'), to try a setting
against the peer."""
OURS_START = os.environ.get("BENCH_OURS_START", "sft")
"""Where our GRPO/RLOO runs start: `sft`, the shipped way (the policy adapter continues the SFT adapter, the
reference is that adapter frozen), or `fresh`, the peer's way (a new LoRA adapter, seeded by the run's seed, on the
dense merged SFT policy as the base; the reference is that base). `fresh` drops NF4 (the merged policy is float32)."""
GT = "rlhf.inputs.data:letters_reward"
# the same reward function for both sides: the task's ground truth by import path (no reward model, no EOS penalty,
# which TRL's trainers do not have)
GROUP_ARGS = ("reward.model=0", f"reward.functions={{{GT}: 1}}")


def _fresh_start(exp, overrides: list[str], dense: dict, seed: int) -> tuple:
    """(experiment, overrides) of an SFT "run" that is the merged SFT policy with a new, untrained LoRA adapter drawn
    with `seed` (one step at a learning rate of 1e-12): what the peer starts from (OURS_START=fresh)."""
    ov = [o for o in overrides if not o.startswith(("model.name=", "quantization.load_in_4bit="))] + [
        f"model.name={dense['policy']}", "quantization.load_in_4bit=false", "sft.learning_rate=1e-12",
        "sft.max_steps=1", f"seed={seed}"]
    fresh = exp_for(Path(exp.results_dir) / f"fresh-{seed}", "tiny", *ov)
    sft.train(fresh)
    return fresh, ov


def _ours_group(stage: str, exp, overrides: list[str], seed: int, recipe: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "rlhf", stage, "--exp", str(TINY), f"results_dir={exp.results_dir}", *overrides,
           f"seed={seed}", *GROUP_ARGS, f"{stage}.steps={GROUP_STEPS}", f"{stage}.missing_eos_penalty=0",
           f"{stage}.save_steps=0", f"{stage}.log_samples_every=0", "memory.track_tensors=false", *OURS_ARGS,
           *(f"{stage}.{k}={json.dumps(v)}" for k, v in (recipe or {}).items())]  # TRL's keywords as the section's
    run = run_measured(cmd, env={"PYTHONPATH": str(ROOT)})
    assert run["rc"] == 0, run["output"][-3000:]
    _, summary = records.latest(exp, stage, "bench")
    th, m = summary["throughput"], summary["metrics"]
    lines = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    clip = [x["clipfrac"] for x in lines if "clipfrac" in x]
    reward = [x["reward/mean"] for x in lines if "reward/mean" in x]
    return {"step_s": th["step_s"], "peak_rss_mb": run["peak_rss_bytes"] / 2**20, "wall_s": run["wall_s"],
            "gt_policy": m["eval_score_policy"], "gt_sft": m["eval_score_sft"], "clip_frac": sum(clip) / len(clip),
            "train_reward_last3": sum(reward[-3:]) / len(reward[-3:]),
            "phases": {k: th[f"{k}_s_per_step"] for k in ("generate", "policy", "ref", "reward_fns")}
            | {"update": th["update_s_per_step"]}, **sampling_shares(th)}


def _peer_group(stage: str, exp, dense: dict, root, seed: int, recipe: dict | None = None) -> dict:
    g = getattr(exp, stage)
    splits = data.load(exp)
    evals = splits.eval[: exp.eval.prompts]
    rows = [{"prompt": q["prompt"], **q["columns"]} for q in splits.prompts(exp.data.ppo_prompts)]
    out_path = root / f"trl-{stage}.json"
    spec = {"kind": stage, "policy": dense["policy"], "seed": seed, "output_dir": str(root / f"trl-{stage}"),
            "rows": rows, "eval_prompts": [r["prompt"] for r in evals], "reward_function": GT,
            "eval_max_new_tokens": exp.eval.max_new_tokens, "eval_temperature": exp.eval.temperature,
            "out": str(out_path), "recipe": recipe or {},
            "lora": {"r": exp.lora.r, "alpha": exp.lora.alpha, "modules_to_save": list(exp.lora.modules_to_save)},
            "settings": {"steps": GROUP_STEPS, **{k: getattr(g, k) for k in (
                "rollout_batch", "num_generations", "minibatch", "num_iterations", "learning_rate", "beta",
                "epsilon", "max_completion_length", "temperature", "scale_rewards", "loss_type", "max_grad_norm")}}}
    (root / f"trl-{stage}-spec.json").write_text(json.dumps(spec))
    run = run_measured([sys.executable, str(ROOT / "bench" / "trl_grpo.py"), str(root / f"trl-{stage}-spec.json")],
                       env={"PYTHONPATH": str(ROOT)})
    assert run["rc"] == 0, run["output"][-3000:]
    out = json.loads(out_path.read_text())
    gt = {k: sum(data.letters_reward([r["prompt"] for r in evals], v, [r["columns"]["response_len_min"]
                                                                      for r in evals])) / len(evals)
          for k, v in out["responses"].items()}
    return {"step_s": out["train_s"] / out["generations"], "peak_rss_mb": run["peak_rss_bytes"] / 2**20,
            "wall_s": run["wall_s"], "gt_policy": gt["policy"], "gt_sft": gt["sft"],
            "optimizer_steps": out["optimizer_steps"], "clip_frac": out["clip_frac"],
            "train_reward_last3": sum(out["train_reward"][-3:]) / len(out["train_reward"][-3:])}


def _group_vs_trl(benchmark, root, ppo_inputs, stage: str, shape: str, recipe: str | None = None) -> dict:
    """Ours against TRL 1.16's GRPOTrainer / RLOOTrainer: same SFT policy, prompts, reward function, G, episodes,
    epochs, minibatch, learning rate, beta and response length (and a recipe's keywords on both sides); one thread
    each, one after the other."""
    exp, overrides, dense = ppo_inputs(shape)
    keys = RECIPES[recipe] if recipe else None
    res = {}

    def run_all():  # each seed: the training run's seed on both sides (the SFT policy and its reading are shared)
        res.update(interleaved({"trl": lambda s: _peer_group(stage, exp, dense, root / f"ppo-{shape}", s, keys),
                                "ours": lambda s: _ours_group(stage, *(_fresh_start(exp, overrides, dense, s)
                                                                      if OURS_START == "fresh" else (exp, overrides)),
                                                              s, keys)},
                               [exp.seed + k for k in range(SEEDS)]))

    benchmark.pedantic(run_all, rounds=1, iterations=1)
    g = getattr(exp, stage)
    out = {"kind": "group", "stage": stage, "shape": shape, "about": SHAPES[shape].about, "steps": GROUP_STEPS,
           "rollout_batch": g.rollout_batch, "recipe": recipe, "recipe_keywords": keys,
           "num_generations": g.num_generations, "episodes": GROUP_STEPS * g.rollout_batch, **res,
           "speedup": round(res["trl"]["step_s"] / res["ours"]["step_s"], 3),
           "ours_start": OURS_START, "ours_args": OURS_ARGS,
           "setup": f"peer: TRL {stage.upper()}Trainer on the dense float32 SFT policy with a fresh LoRA adapter of "
                    "our shape, reference = adapters disabled; both: the ground truth by import path as the only "
                    "reward, no EOS penalty. Ours: experiments/tiny.yaml with the shape's overrides (policy and SFT "
                    "reference as adapters on one base)."}
    benchmark.extra_info.update({"speedup": out["speedup"]})
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("stage", ["grpo", "rloo"])
def test_group_rl_vs_trl(benchmark, root, ppo_inputs, stage, shape):
    """GRPO and RLOO as the shipped sections set them, against TRL's trainers."""
    record(f"{stage}_vs_trl_{shape}", _group_vs_trl(benchmark, root, ppo_inputs, stage, shape))


@pytest.mark.parametrize("shape", ["tiny", "bpe", "wide"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_grpo_recipes_vs_trl(benchmark, root, ppo_inputs, recipe, shape):
    """A TRL recipe's GRPOConfig keywords (DAPO, GSPO), the same dict on both sides: ours as the grpo section's keys."""
    record(f"grpo_{recipe}_vs_trl_{shape}", _group_vs_trl(benchmark, root, ppo_inputs, "grpo", shape, recipe))
