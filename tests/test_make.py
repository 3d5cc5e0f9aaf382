"""The README is the test plan: every target `make help` lists is run by some test the way a user types it (through
`conftest.make`), or is listed in NOT_RUN with the reason; the GPU experiments' training settings run on CPU in
experiments/tiny-gpu-flags.yaml, which must learn as tiny.yaml does (its pipeline: tests/test_pipeline.py)."""

import json
import re
import shlex
import subprocess

import pytest
import yaml

from rlhf.experiment import config, stages
from rlhf.runs import records

from .conftest import ROOT, make

FLAGS = ROOT / "experiments" / "tiny-gpu-flags.yaml"

# documented targets no test runs as such, and why
NOT_RUN = {
    "test": "the suite itself: CI runs it (.ci/run)",
    "test-fast": "a subset of the suite itself (every test it runs is run by make test); its selection is checked "
                 "in test_make_test_fast_selects_the_tests_that_train_nothing",
    "bench": "7+ minutes of benchmarks against TRL in their own venvs; `make -n bench` and its collection are "
             "checked in tests/test_bench_suite.py",
    "docker-build": "no Docker engine here; the Dockerfile and the commands are checked statically (tests/test_docker.py)",
    "docker-run": "no Docker engine here (tests/test_docker.py checks the command with make -n)",
    "docker-shell": "no Docker engine here (tests/test_docker.py checks the command with make -n)",
    "gpucheck-wheels": "downloads ~56 MiB of wheels for a bare GPU host; the script's run half is rehearsed "
                       "(tests/test_gpucheck.py)",
}

# What the shipped GPU experiments set that tiny-gpu-flags.yaml does not, by why. Every key of every shipped CUDA
# experiment is either set to the same value in tiny-gpu-flags.yaml or named here.
GPU_ONLY = {
    "device": "cuda: this machine and CI have no GPU",
    "model.dtype": "bfloat16 matmuls are 14-48x slower than float32 on an AVX2-only CPU (studies/bf16_matmul.py); "
                   "the shipped 4090 settings, bf16 "
                   "included, run one step of every stage in the gpucheck dry run (tests/test_gpucheck.py)",
    "quantization.compute_dtype": "bfloat16: as model.dtype",
    "quantization.load_in_4bit": "mistral-7b-h100.yaml's false: the unquantized path runs in tests/test_memory.py",
    "memory.budget_gb": "the GPU's memory; tiny's peak is far under any budget (the gate is tests/test_memory.py)",
    "distributed.num_processes": "several GPUs; the same data-parallel code runs on 2 CPU ranks over gloo in "
                                 "tests/test_distributed.py",
    "distributed.strategy": "fsdp and zero need GPUs (NCCL); ddp runs on CPU ranks in tests/test_distributed.py",
    "quantization.quant_storage": "bfloat16 storage is for FSDP's flattening, which needs GPUs",
    "tracking.backend": "wandb needs an account; the offline W&B path runs in tests/test_repro.py",
    "tracking.project": "as tracking.backend",
}
SCALE = {  # the size of the run, not a code path: the tiny task has its own
    "model.name", "lora.r", "lora.alpha", "data.source", "data.path", "data.sft_examples", "data.pref_pairs",
    "data.ppo_prompts", "data.eval_examples", "data.max_length", "data.max_prompt_length", "ppo.steps",
    "ppo.rollout_batch", "ppo.minibatch", "ppo.micro_batch", "ppo.forward_batch", "ppo.num_ppo_epochs", "ppo.target_kl",
    "ppo.kl_horizon", "ppo.response_length", "ppo.save_steps", "eval.prompts", "eval.max_new_tokens", "eval.batch_size",
    # the KL budget is the task's (how far its reward model can be trusted); the same code reads it at any value
    "ppo.kl_band", "grpo.kl_band", "rloo.kl_band",
    *(f"{s}.{k}" for s in ("sft", "rm", "dpo", "kto", "ppo") for k in (
        "learning_rate", "epochs", "batch_size", "grad_accum", "logging_steps", "eval_steps", "save_steps")),
    *(f"{s}.{k}" for s in ("grpo", "rloo") for k in (
        "steps", "rollout_batch", "num_generations", "minibatch", "micro_batch", "forward_batch", "num_iterations",
        "learning_rate", "max_completion_length", "save_steps")),
}


def help_targets() -> list[str]:
    """The documented targets (`## ` lines of the Makefile), each checked to appear in `make help`'s output."""
    documented = re.findall(r"^([a-z][a-z-]*):.*## ", "".join((ROOT / f).read_text() for f in (stages.MAKEFILE,
                                                                                              "Makefile")), re.M)
    shown = make("help").stdout
    assert all(re.search(rf"^  {re.escape(t)} ", shown, re.M) for t in documented), shown
    return documented


def test_every_documented_target_is_run_by_a_test():
    targets = help_targets()
    assert {"sft", "rm", "dpo", "ppo", "eval", "pipeline", "export", "memplan", "compare"} <= set(targets)
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "README.md is the front door and the test plan: depth goes to docs/"
    documented = set(re.findall(r"`make ([a-z][a-z-]*)", readme))
    assert documented <= set(targets), f"README documents targets make help does not list: {documented - set(targets)}"
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    untested = [t for t in targets if t not in NOT_RUN and f'make("{t}"' not in sources]
    assert not untested, f"documented make targets that no test runs (add one, or a reason to NOT_RUN): {untested}"
    assert set(NOT_RUN) <= set(targets), "NOT_RUN names a target make help does not list"


def test_every_path_the_readme_and_docs_name_exists():
    """A file or folder of the repository that the README or a doc names in backticks (`rlhf/rl/online.py`,
    `make ppo EXP=experiments/tiny.yaml`, a bare file name such as `online.py` or `llama2-7b-hh-4090.yaml`; a stem that
    a glob or `{json,md}` ends) is tracked by git: a moved module cannot leave its old place in the docs, and a file
    that exists only where it was written does not count. Run outputs are not checked: results/ less its tracked
    reference folders, and the files a run writes (summary.json, config.json, ...)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    names, paths = {p.rsplit("/", 1)[-1] for p in tracked}, set(tracked)
    reference = ("results/gpu/", "results/bench/", "results/calibration/")  # tracked; results/ is otherwise output
    written = {"summary.json", "config.json", "state.json", "rlhf_state.json", "config.yaml", "env.json", "owner.json",
               "lineage.json", "metrics.jsonl"}

    def known(path: str, stem: bool) -> bool:  # a tracked file, a folder holding one, or a stem{...} / stem* of one
        prefix = path if stem else path.rstrip("/") + "/"
        return path in paths or any(p.startswith(prefix) for p in tracked)

    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for span in re.findall(r"`([^`\n]+)`", doc.read_text()):
            for path, more in re.findall(r"(?<![\w./-])((?:rlhf|tests|scripts|studies|configs|experiments|bench|docs|"
                                         r"results)/[\w./-]*)([*{]?)", span):
                path = path.rstrip(".")
                if path.startswith("results/") and not path.startswith(reference):
                    continue
                if not known(path, bool(more)):
                    missing.append((doc.name, path))
            for name in re.findall(r"(?<![\w./-])([\w-]+\.(?:py|yaml|sh|mk))(?![\w./-])", span):
                if name not in names and name not in written:
                    missing.append((doc.name, name))
    assert not missing, f"the docs name paths that are not in the repository: {missing}"


def test_make_runs_each_training_stage_with_the_command_line_stages_command_builds():
    """The Makefile cannot call rlhf.experiment.stages.command: the last line of each stage's target must be what it returns
    (memcheck, gpucheck and sweeps run a stage with it), so the two cannot drift."""
    for st in stages.training():
        last = make("-n", st, "EXP=x.yaml", "ARGS=a=1 b.c=2").stdout.strip().splitlines()[-1]
        assert last == " ".join(stages.command(st, "x.yaml", ["a=1", "b.c=2"], python=".venv/bin/python")), st


def test_make_test_fast_selects_the_tests_that_train_nothing():
    """`make test-fast` is `make test` without the tests marked slow (they train a model end to end): the same
    command, one more marker, every other test collected."""
    fast, full = (make("-n", target).stdout.strip().splitlines()[-1] for target in ("test-fast", "test"))
    assert fast.replace(' and not slow"', '"') == full and "-n 2 --dist loadfile" in full

    # one collection: the fast command's test ids (make's -q: one a line) and its count of the full suite's
    proc = subprocess.run([*shlex.split(fast.replace("-n 2", "-n 0")), "--collect-only"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    n_fast = sum("::" in line for line in proc.stdout.splitlines())
    counted = re.search(r"^(\d+)/(\d+) tests collected \((\d+) deselected\)", proc.stdout, re.M)
    assert counted, proc.stdout[-500:]
    selected, n_full, _ = map(int, counted.groups())  # n_full: all of tests/, which holds no bench test (bench/)
    assert selected == n_fast and 100 <= n_fast < n_full


def test_make_install_is_a_no_op_when_installed():
    proc = make("install")
    assert "scripts/install.sh" not in proc.stdout and (ROOT / ".venv" / "bin" / "python").exists()


def test_make_clean_removes_the_tiny_records_and_keeps_the_venv(tmp_path):
    venv, results = tmp_path / "venv", tmp_path / "results"
    for d in (venv / "bin", results / "tiny" / "sft", results / "other"):
        d.mkdir(parents=True)
    make("clean", f"VENV={venv}", f"RESULTS={results}")
    assert (venv / "bin").exists() and not (results / "tiny").exists() and (results / "other").exists()


def test_make_distclean_also_removes_the_venv(tmp_path):
    venv, results = tmp_path / "venv", tmp_path / "results"
    for d in (venv / "bin", results / "tiny" / "sft", results / "other"):
        d.mkdir(parents=True)
    make("distclean", f"VENV={venv}", f"RESULTS={results}")
    assert not venv.exists() and not (results / "tiny").exists() and (results / "other").exists()


def test_make_memplan_prints_a_plan_for_a_shipped_gpu_experiment():
    out = make("memplan", "EXP=experiments/llama2-7b-hh-4090.yaml").stdout
    fits = next(line for line in out.splitlines() if line.startswith("fits budget"))
    assert "predicted peak" in out and fits.split()[2:] == ["yes"] * len(stages.training())  # every training stage


def test_make_memcheck_and_memcheck_update_on_a_copy_of_the_baseline(tmp_path):
    """`make memcheck-update` rewrites the measured stage in the given file only (a planted figure is replaced, the
    other stages and the shipped baseline are untouched); `make memcheck` then passes against it."""
    real = ROOT / "configs" / "memcheck-baseline.json"
    shipped = real.read_bytes()
    baseline = tmp_path / "baseline.json"
    planted = json.loads(shipped)
    planted["stages"]["sft"]["peak_mb"] = 1e-3
    baseline.write_text(json.dumps(planted))
    make("memcheck-update", f"ARGS=--stages sft --baseline {baseline}")
    after = json.loads(baseline.read_text())
    assert after.keys() == planted.keys() and after["stages"]["sft"]["peak_mb"] > 1
    assert after["stages"]["rm"] == planted["stages"]["rm"] and real.read_bytes() == shipped
    out = make("memcheck", f"ARGS=--stages sft --baseline {baseline}").stdout
    assert "memcheck: passed" in out


# ------------------------------------------------------------------------------------------------- GPU settings
_flat = config.flatten


def test_every_setting_of_the_gpu_experiments_runs_on_cpu_or_is_listed_gpu_only():
    """Each key a shipped CUDA experiment sets is a size (SCALE), GPU-only (with the reason), or has the same value in
    one of the two experiments CI trains (tiny-gpu-flags.yaml, or tiny.yaml for the defaults such as adamw_torch);
    LoRA target modules are covered when tiny-gpu-flags.yaml targets at least the same projections by name."""
    ci_runs = {p.name: _flat(config.to_dict(config.load(p))) for p in (FLAGS, ROOT / "experiments" / "tiny.yaml")}
    gpu = [p for p in sorted((ROOT / "experiments").glob("*.yaml")) if yaml.safe_load(p.read_text()).get("device") == "cuda"]
    assert len(gpu) >= 3
    for path in gpu:
        exp = config.load(path)
        for key, value in _flat(yaml.safe_load(path.read_text())).items():
            if key in GPU_ONLY or key in SCALE or key == "name":
                continue
            if key == "lora.target_modules":
                assert set(value) <= set(ci_runs[FLAGS.name][key]), f"{path.name}: {key}={value}"
                continue
            ours = {name: flat.get(key) for name, flat in ci_runs.items()}
            assert value in ours.values(), (f"{path.name}: {key}={value} runs in no CI experiment ({ours}); set it in "
                                            f"tiny-gpu-flags.yaml or list it in GPU_ONLY with the reason")
        # the settings that change code paths, whether or not the YAML spells them out
        resolved = config.load(FLAGS)
        assert resolved.model.gradient_checkpointing == exp.model.gradient_checkpointing
        assert resolved.ppo.value_model == exp.ppo.value_model and resolved.ppo.reference == exp.ppo.reference
        assert (exp.lora.dropout > 0) <= (resolved.lora.dropout > 0)
        assert resolved.ppo.micro_batch < resolved.ppo.minibatch and resolved.ppo.forward_batch < resolved.ppo.rollout_batch
        for stage in ("grpo", "rloo"):
            ours, theirs = getattr(resolved, stage), getattr(exp, stage)
            assert ours.micro_batch < ours.minibatch and ours.forward_batch < ours.rollout_batch
            assert (ours.reference, ours.kl_penalty, ours.loss_type, ours.scale_rewards, ours.beta > 0) == \
                (theirs.reference, theirs.kl_penalty, theirs.loss_type, theirs.scale_rewards, theirs.beta > 0)


# what `make pipeline` is given below: every stage for a few steps (learning is asserted on the GPU settings' pipeline,
# trained once in tests/test_pipeline.py; this run is the default experiment's settings and the target itself)
SHORT = ("data.sft_examples=64", "data.pref_pairs=64", "data.ppo_prompts=64", "data.eval_examples=16",
         "eval.prompts=16", "sft.max_steps=4", "rm.max_steps=4", "dpo.max_steps=4", "kto.max_steps=4",
         *(f"{s}.{k}" for s in ("ppo", "grpo", "rloo") for k in ("steps=2", "rollout_batch=16", "minibatch=8",
                                                                   "micro_batch=8")),
         "grpo.num_generations=4", "rloo.num_generations=4")


@pytest.mark.slow
def test_make_pipeline_runs_every_stage_then_eval_on_one_sft_run(tmp_path):
    """`make pipeline` with the default experiment (tiny.yaml): its settings (AdamW, all-linear LoRA, no
    checkpointing) through every stage, each consuming this run's SFT, and eval's table over every policy."""
    out = make("pipeline", f"ARGS=results_dir={tmp_path} {' '.join(SHORT)}").stdout
    exp = config.load(ROOT / "experiments" / "tiny.yaml", [f"results_dir={tmp_path}", *SHORT])
    s = {st: records.latest(exp, st, "test")[1] for st in (*stages.training(), "eval")}
    assert "reusing" not in out  # make pipeline trains every stage
    for stage in (st for st in stages.training() if "sft" in stages.get(st).upstream):
        assert s[stage]["lineage"]["upstream"]["sft"]["run"] == s["sft"]["run_dir"], stage
        cfg = yaml.safe_load((records.Path(s[stage]["run_dir"]) / "config.yaml").read_text())
        assert cfg["model"]["gradient_checkpointing"] is False and cfg[stage]["optim"] == "adamw_torch", stage
    assert s["ppo"]["lineage"]["upstream"]["rm"]["run"] == s["rm"]["run_dir"]
    assert set(s["eval"]["lineage"]["upstream"]) == {"sft", "dpo", "kto", "ppo", "grpo", "rloo"}
    table = records.Path(s["eval"]["samples"]).read_text()
    assert "| prompt | sft | dpo | kto | ppo | grpo | rloo |" in table
