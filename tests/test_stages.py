"""The stage registry is the one place a stage is named: a dummy stage added in one entry is seen by the CLI,
lineage, the memory planner, the memory gate, evaluation, export and the Makefile's check; a training stage without
a memory plan cannot be registered."""

import re

import pytest

from rlhf import cli
from rlhf.recipes import evaluate, export
from rlhf.runs import lineage
from rlhf.experiment import stages
from rlhf.tools import memcheck
from rlhf.memory import memplan

from .conftest import ROOT, make, tiny


@pytest.fixture
def dummy(monkeypatch):
    entry = stages.Stage("dummy", "sft", upstream=("sft", "rm"), section="dpo", sequences=2, consumes=("pref_pairs",),
                         policy=True, exports=True, memplan="preference", help="a stage of one entry")
    monkeypatch.setitem(stages.REGISTRY, "dummy", entry)
    return entry


def test_a_stage_added_in_one_entry_is_seen_everywhere(dummy, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "dummy" in capsys.readouterr().out  # the CLI's stage choices
    exp = tiny(tmp_path)
    assert "dpo" in lineage.stage_config(exp, "dummy")  # lineage hashes its sections
    assert "dummy" in stages.training() and "dummy" in stages.policies() and "dummy" in stages.exportable()
    assert memplan.plan(exp, "dummy").peak_gb > 0  # planned with its shape, not skipped
    # planned from its own section's batch-size field, however its plan shape is named
    assert memplan.plan(exp, "dummy").peak_gb == memplan.plan(exp, "dpo").peak_gb
    assert memplan.plan(tiny(tmp_path, "dpo.batch_size=64"), "dummy").peak_gb > memplan.plan(exp, "dummy").peak_gb
    assert "\ndummy: install  ## a stage of one entry\n" in stages.makefile()  # and a make target
    ran = []

    class Done:
        returncode, stderr = 1, "stop"

    monkeypatch.setattr(memcheck.subprocess, "run", lambda cmd, **kw: ran.append(cmd[3]) or Done())
    with pytest.raises(RuntimeError):
        memcheck.measure(memcheck.GATED, [f"results_dir={tmp_path}"], ["dummy"])
    assert ran == ["sft"] and stages.with_upstream(["dummy"]) == ["sft", "rm", "dummy"]
    with pytest.raises(export.records.StageInputError, match="needs a finished dummy run"):
        export.export(exp, "dummy")
    # `make eval` asks for every policy's latest run, the new one included (stopped before any model loads)
    import types

    class Stop(Exception):
        pass

    asked = []

    def latest(exp, stage, who):
        asked.append(stage)
        raise evaluate.records.StageInputError(stage)

    monkeypatch.setattr(evaluate, "upstream_sft", lambda exp, who, held_out=(): (None, {}, None))
    monkeypatch.setattr(evaluate.data, "load", lambda exp: types.SimpleNamespace(render=lambda tok: None, eval=[]))
    monkeypatch.setattr(evaluate.records, "latest", latest)
    monkeypatch.setattr(evaluate, "Plan", types.SimpleNamespace(make=lambda *a, **k: (_ for _ in ()).throw(Stop())))
    with pytest.raises(Stop):
        evaluate.train(exp)
    assert asked == list(stages.policies()) and asked[-1] == "dummy"


def test_a_training_stage_without_a_memory_plan_is_refused():
    with pytest.raises(ValueError, match="no memory plan"):
        stages.register(stages.Stage("nomem", "sft"))
    with pytest.raises(ValueError, match="unknown upstream"):
        stages.register(stages.Stage("orphan", "sft", upstream=("nope",), memplan="lm"))
    with pytest.raises(ValueError, match="no batch-size field 'rollout_batch'"):
        stages.register(stages.Stage("nobatch", "sft", section="sft", batch="rollout_batch", memplan="lm"))
    assert not {"nomem", "orphan", "nobatch"} & set(stages.REGISTRY)


def test_a_stage_name_is_a_make_target_and_a_training_stage_names_its_section():
    help_pattern = re.search(r"grep -hE '\^(\[[^]]+\]\+):", (ROOT / "Makefile").read_text()).group(1)  # [a-z-]+
    for name in ("rm", "dpo", "best-of-n"):
        assert stages.NAME.fullmatch(name) and re.fullmatch(help_pattern, name)
    for bad in ("RM", "best_of_n", "rm2", "-rm", "rm.v2", ""):
        with pytest.raises(ValueError, match="lowercase letters and dashes"):
            stages.register(stages.Stage(bad, "sft", trains=False))
    with pytest.raises(ValueError, match="no 'orpo' section"):
        stages.register(stages.Stage("orpo", "sft", memplan="preference"))
    assert all(stages.NAME.fullmatch(n) for n in stages.REGISTRY)
    assert not {"RM", "best_of_n", "rm2", "-rm", "rm.v2", "", "orpo"} & set(stages.REGISTRY)


def test_every_stage_has_a_make_target_that_trains_its_upstream_chain_as_the_registry_says():
    """`make <stage>` (dry run) runs, in order, each upstream stage the registry names (registry.with_upstream) with
    --reuse (and --for <stage> where the reward model is optional), then the stage: the Makefile's chain is not a
    second home for which stage needs which."""
    targets = set(re.findall(r"^  ([a-z][a-z-]*) ", make("help").stdout, re.M))
    assert set(stages.REGISTRY) <= targets
    for st in stages.training():
        lines = make("-n", st, "EXP=x.yaml").stdout.strip().splitlines()
        lines = [line.split(" -m rlhf ", 1)[1] for line in lines if " -m rlhf " in line]
        chain = stages.with_upstream([st])
        expected = [f"{u} --exp x.yaml --reuse" + (f" --for {st}" if stages.get(st).rm_optional and u == "rm" else "")
                    for u in chain[:-1]] + [f"{st} --exp x.yaml"]
        assert [line.strip() for line in lines] == expected, (st, lines)


def test_the_stage_targets_are_written_from_the_registry_and_the_makefile_runs_no_stage_itself():
    """stages.mk, which the Makefile includes, is what the registry writes (`python -m rlhf.experiment.stages > stages.mk`),
    so a registered stage has a target (the dummy above gets one); a target the Makefile writes by hand runs a CLI
    tool or compare, never a stage, nor a name the CLI does not know."""
    assert (ROOT / stages.MAKEFILE).read_text() == stages.makefile()
    makefile = (ROOT / "Makefile").read_text()
    assert "\ninclude $(STAGES_MK)\n" in makefile and f"STAGES_MK := {stages.MAKEFILE}\n" in makefile
    run = re.findall(r"^\t\$\(RLHF1?\) ([a-z][a-z-]*)", makefile, re.M)
    assert run and set(run) <= {*cli.TOOLS, "compare"}, run
    generated = re.findall(r"^([a-z][a-z-]*): install  ## ", stages.makefile(), re.M)
    assert sorted(generated) == sorted([*stages.REGISTRY, "pipeline"])


def test_what_a_stage_loads_is_typed_and_every_stage_fills_only_known_fields(tmp_path):
    from rlhf.runs import runtime

    assert runtime.Inputs(sft={"model": {}}).sft == {"model": {}}
    with pytest.raises(TypeError, match="promts"):
        runtime.Inputs(promts=[])  # a misspelt input fails where the stage builds its plan, not deep in train()
    plan = stages.get("sft").prepare(tiny(tmp_path))
    assert isinstance(plan.data, runtime.Inputs) and plan.data.train_rows and plan.data.splits is not None


def test_a_finished_stage_prints_a_short_table_of_what_decides():
    """What the CLI prints last (cli.console_summary), read from any stage's summary: each grader's win rate against
    SFT with its interval, role and n; the KL; where the guard stopped the run and the policy it kept (of the updates
    made); every flag and warning, one a line; where the
    adapter and the run are; the wall time. Nothing else of summary.json (scripts read that)."""
    ppo = {"experiment": "tiny", "stage": "ppo", "run_dir": "/r/tiny/ppo/1", "wall_time_s": 754.2,
           "metrics": {"eval_win_rates": {
               "ground_truth": {"win_rate": 0.715, "ci95": [0.6661, 0.7639], "n": 200, "grader": "independent"},
               "reward_model": {"win_rate": 0.8825, "ci95": [0.8386, 0.9264], "n": 200, "grader": "trained against",
                                "wins": 175, "ties": 3}},  # a tie counts a half: said, so 0.35 of ties reads right
               "eval_win_rate_vs_sft": 0.715, "eval_win_rate_vs_sft_ci95": [0.6661, 0.7639], "eval_kl_ref": 2.676,
               "eval_kl_ref_se": 0.1134, "eval_kl_reference": "sft", "train_kl_ref_last5": 6.913, "kl_within_band": False,
               "eval_terminated": 0.975, "eval_terminated_ci95": [0.9428, 0.9893], "eval_prompts": 200,
               "eval_terminated_sft": 0.99, "steps": 60, "overopt_judge_peak": 1.2,
               "stopped_early": {"iteration": 41, "steps_saved": 19, "compute_saved": 0.3167},
               "kl_budget_left": {"iteration": 41, "kl_ref": 6.6, "window": 5, "budget": 6.0}},
           "flags": ["ppo: left its KL budget", "ppo: the judge fell"], "warnings": [],
           "throughput": {"step_s": 0.3}, "memory": {"peak_gb": 0.1},
           "model": {"adapter": "/r/tiny/ppo/1/adapter/policy", "kept": {"keep": "judge", "iteration": 36}}}
    assert cli.console_summary(ppo).splitlines() == [
        "ppo (tiny) finished in 12 min 34 s",
        "  win rate vs SFT  0.715 [0.666, 0.764] by ground_truth (independent, n=200)",
        "                   0.882 [0.839, 0.926] by reward_model (trained against, n=200: 175 won, 3 tied, 22 lost)",
        "  KL to reference  2.68 ± 0.11 (s.e.) nats on held-out prompts (to sft, n=200); 6.91 in training (mean over "
        "the last 5 iterations, outside kl_band); left its budget (6) at iteration 41: 6.6, mean of the last 5 iterations",
        "  ends with EOS    97.5% [94.3%, 98.9%] of 200 (SFT 99.0%)",
        "  stopped early    after 41 of 60 iterations, 19 not run (see flags)",
        "  kept policy      after 35 of 41 updates (judge)",
        "  flags            ppo: left its KL budget",
        "                   ppo: the judge fell",
        "  warnings         none",
        "  adapter          /r/tiny/ppo/1/adapter/policy",
        "  run              /r/tiny/ppo/1 (summary.json: every figure)"]
    short = {**ppo, "metrics": {**ppo["metrics"], "train_kl_ref_window": 2}}  # a run of 2 iterations
    assert "6.91 in training (mean over the last 2 iterations, outside kl_band)" in cli.console_summary(short)
    short["metrics"]["train_kl_ref_window"] = 1
    assert "6.91 in training (mean over its one iteration, outside kl_band)" in cli.console_summary(short)
    sft = {"experiment": "tiny", "stage": "sft", "run_dir": "/r/s", "wall_time_s": 7.71, "model": {"adapter": "/r/a"},
           "metrics": {"eval_loss_before": 3.156, "eval_loss": 2.003, "eval_perplexity_before": 23.48,
                       "eval_perplexity": 7.409, "eval_terminated": 0.99}}
    assert cli.console_summary(sft).splitlines() == [
        "sft (tiny) finished in 7.7 s",
        "  held-out loss  3.156 -> 2.003 (perplexity 23.48 -> 7.409)",
        "  ends with EOS  99.0%",
        "  adapter        /r/a",
        "  run            /r/s (summary.json: every figure)"]
    sft["world_size"] = 1  # one process: no row; data parallel: the ranks, which config.yaml does not record
    assert "ranks" not in cli.console_summary(sft)
    sft["world_size"] = 2
    assert cli.console_summary(sft).splitlines()[-2:] == ["  ranks          2 data-parallel processes",
                                                         "  run            /r/s (summary.json: every figure)"]
    del sft["world_size"]
    sft["resumed_from"] = {"checkpoint": "/r/s/checkpoints/checkpoint-100", "step": 100,
                           "changed": ["eval.prompts: 200 -> 40"]}  # a killed run, taken up again
    assert cli.console_summary(sft).splitlines()[-1] == (
        "  resumed        from step 100 (checkpoint-100); changed since it started: eval.prompts: 200 -> 40")
    del sft["resumed_from"]  # a task with a grader: SFT's own held-out score, with its interval (the policies start from it)
    sft["metrics"].update(eval_score_policy=0.1372, eval_score_policy_ci95=[0.101, 0.1734],
                          eval_scored_by="ground_truth", eval_prompts=200)
    assert "  held-out score  0.137 [0.101, 0.173] mean by ground_truth, n=200" in cli.console_summary(sft).splitlines()
    rm = {"experiment": "tiny", "stage": "rm", "run_dir": "/r/m", "wall_time_s": 41.0, "model": {"adapter": "/r/a"},
          "metrics": {"eval_accuracy_before": 0.52, "eval_accuracy": 0.81, "eval_accuracy_ci95": [0.7502, 0.8584],
                      "eval_pairs": 200, "eval_judge_accuracy": 0.78, "eval_judge_accuracy_ci95": [0.7178, 0.8309]}}
    assert cli.console_summary(rm).splitlines()[1] == (
        "  pair accuracy  0.520 -> 0.810 [0.750, 0.858] of 200 held-out pairs; judge 0.780 [0.718, 0.831]")
    for key in ("eval_accuracy_ci95", "eval_pairs", "eval_judge_accuracy_ci95"):  # a summary from before they were
        del rm["metrics"][key]
    assert cli.console_summary(rm).splitlines()[1] == "  pair accuracy  0.520 -> 0.810; judge 0.780"
    # DPO: TRL's held-out rewards/accuracies with its interval; a check nothing could grade says so, not a blank
    dpo = {"experiment": "mine", "stage": "dpo", "run_dir": "/r/d", "wall_time_s": 60.0, "model": {"adapter": "/r/a"},
           "metrics": {"eval_scored_by": None, "eval_kl_ref": 0.445, "eval_kl_ref_se": 0.032, "eval_prompts": 40,
                       "eval_kl_reference": "sft", "eval_rewards_accuracies": 0.95,
                       "eval_rewards_accuracies_ci95": [0.83, 0.9862]}}
    assert cli.console_summary(dpo).splitlines()[1:4] == [
        "  win rate vs SFT     - (nothing grades it: the data has no ground truth, no reward model of this SFT run, no "
        "reward.functions, reward.grader_* or reward.judge_*)",
        "  KL to reference     0.445 ± 0.032 (s.e.) nats on held-out prompts (to sft, n=40)",
        "  rewards/accuracies  0.950 [0.830, 0.986] of held-out pairs ranked right by the implicit reward"]
    # with its n, and the effective n its interval is at when a short last batch weighs as a whole one
    dpo["metrics"].update(eval_rewards_accuracies_n=100, eval_rewards_accuracies_n_effective=92.2)
    assert cli.console_summary(dpo).splitlines()[3] == (
        "  rewards/accuracies  0.950 [0.830, 0.986] of 100 held-out pairs ranked right by the implicit reward (TRL "
        "averages its batches' rates, a short last batch as a whole one: the interval is at an effective n of 92)")
    dpo["metrics"]["eval_rewards_accuracies_n_effective"] = 100
    assert cli.console_summary(dpo).splitlines()[3] == (
        "  rewards/accuracies  0.950 [0.830, 0.986] of 100 held-out pairs ranked right by the implicit reward")
    # a figure not measured (GRPO without a reference pass: no KL in training) is -, not a crash after the run
    ppo["metrics"].update(eval_kl_ref=0.0, train_kl_ref_last5=None, kl_within_band=None)
    del ppo["metrics"]["eval_kl_ref_se"], ppo["metrics"]["kl_budget_left"]  # a summary from before the KL's error
    assert "  KL to reference  0 nats on held-out prompts (to sft, n=200)" in cli.console_summary(ppo).splitlines()
    ppo["metrics"]["eval_win_rates"]["ground_truth"]["ci95"] = None
    assert "0.715 [-, -] by ground_truth (independent, n=200)" in cli.console_summary(ppo)
    # export: the exported adapter and the merged model, not the source run's (its summary copies the source's model)
    export = {"experiment": "tiny", "stage": "export", "run_dir": "/r/x", "wall_time_s": 3.0,
              "metrics": {"adapter": "/r/x/adapter", "merged": "/r/x/merged", "greedy_tokens_match": True},
              "inputs": {"run": "/r/tiny/ppo/1", "stage": "ppo"},
              "model": {"adapter": "/r/tiny/ppo/1/adapter/policy", "kept": {"keep": "judge", "iteration": 36},
                        "exported_from": "ppo"}}
    assert cli.console_summary(export).splitlines() == [
        "export (tiny) finished in 3.0 s",
        "  exported      ppo's adapter from /r/tiny/ppo/1 (the policy that run kept after 35 updates)",
        "  adapter       /r/x/adapter",
        "  merged model  /r/x/merged (greedy tokens as the adapter's)",
        "  run           /r/x (summary.json: every figure)"]
    export["metrics"] = {"adapter": "/r/x/adapter", "merged": "/r/x/merged", "score_max_abs_diff": 1.8e-07,
                         "pairs_ranked_alike": 32, "pairs": 32}  # a reward model's
    assert cli.console_summary(export).splitlines()[3] == (
        "  merged model  /r/x/merged (32 of 32 held-out pairs ranked as the adapter's, scores within 1.8e-07)")
    win = {"win_rate": 0.77, "ci_low": 0.711, "ci_high": 0.829, "n": 200, "wins": 150, "ties": 8}
    ev = {"experiment": "tiny", "stage": "eval", "run_dir": "/r/e", "wall_time_s": 7300, "samples": "/r/e/samples.md",
          "metrics": {"sft": {"mean_ground_truth": 0.4}, "dpo": {"mean_ground_truth": 0.6, "win_rate_vs_sft_reward": win,
                                                                 "win_rate_vs_sft_ground_truth": win}}}
    assert cli.console_summary(ev).splitlines() == [
        "eval (tiny) finished in 2 h 1 min",
        "  dpo vs SFT  0.770 [0.711, 0.829] by reward (n=200: 150 won, 8 tied, 42 lost)",
        "              0.770 [0.711, 0.829] by ground_truth (n=200: 150 won, 8 tied, 42 lost)",
        "  samples     /r/e/samples.md",
        "  run         /r/e (summary.json: every figure)"]



def stage_name_collections(root, stage_names) -> list[str]:
    """Every literal tuple, list or set (and dict's keys) in the package at `root` outside its experiment/stages.py whose
    strings are two or more stage names, as `file:line: literal`; a module may name its own stages (grpo.py: grpo and
    rloo), and TRL's loss_type names (losses.LOSS_TYPES: grpo and rloo are also GRPO's losses) are not stages."""
    import ast

    from rlhf.maths import losses

    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "experiment" / "stages.py":
            continue
        own = {n for n, s in stages.REGISTRY.items() if path == root / "recipes" / f"{s.module}.py"}
        for node in ast.walk(ast.parse(path.read_text())):
            items = (node.keys if isinstance(node, ast.Dict) else node.elts
                     if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else None)
            strings = [e.value for e in items or () if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            named = set(strings) & set(stage_names)
            if len(named) < 2 or len(named) < len(strings) or named <= own or named <= set(losses.LOSS_TYPES):
                continue
            found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_tuple_of_stage_names_outside_the_registry(tmp_path):
    """rlhf/experiment/stages.py is the one place a stage is named: the planner, the trainers' glue, gpucheck and the
    rest ask the registry (a stage's section, plan shape, batch-size field, whether it runs our online loop), never a list
    of names of their own, which a new stage would silently miss. The check bites: a tuple planted in a copy of the
    package is found, and so is a dict keyed by stage names."""
    assert stage_name_collections(ROOT / "rlhf", stages.REGISTRY) == []
    import shutil

    copy = tmp_path / "rlhf"
    shutil.copytree(ROOT / "rlhf", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "tools" / "planted.py").write_text('TRAINED = ("sft", "rm", "dpo")\nBATCH = {"ppo": 1, "grpo": 2}\n')
    assert stage_name_collections(copy, stages.REGISTRY) == [
        "rlhf/tools/planted.py:1: ('sft', 'rm', 'dpo')", "rlhf/tools/planted.py:2: {'ppo': 1, 'grpo': 2}"]


LAYERS = ("experiment", "infra", "inputs", "maths", "memory", "runs", "rl", "sweeps", "recipes", "tools", "cli",
          "launch", "__main__")
"""rlhf's folders (and its three top-level modules) from the ground up, as docs/architecture.md draws them: a module
imports only from its own folder or one below."""


def import_faults(root) -> list[str]:
    """Every import in the package at `root` (those inside functions too) that reaches a higher layer than its own
    module's, and every cycle of imports between modules, as readable lines."""
    import ast

    def layer(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else "__init__"

    graph, faults = {}, []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == root.name:
                # `from rlhf.rl import overopt` imports the module rlhf.rl.overopt; `from rlhf.maths.guard import x`,
                # the module rlhf.maths.guard
                for a in node.names:
                    sub = root.parent.joinpath(*node.module.split("."), a.name)
                    deps.add(f"{node.module}.{a.name}" if sub.with_suffix(".py").exists() or sub.is_dir()
                             else node.module)
        graph[module] = deps
        for dep in deps:
            here, there = layer(module), layer(dep)
            if here in LAYERS and there in LAYERS and LAYERS.index(there) > LAYERS.index(here):
                faults.append(f"{module} imports {dep}: {there}/ is above {here}/")
    state = {}

    def visit(m, trail):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if d not in graph or d == m:  # a module importing itself: forkserver, run as __main__
                continue
            if state.get(d) == "open":
                faults.append("cycle: " + " -> ".join(trail[trail.index(d):] + [d]))
            elif d not in state:
                visit(d, trail + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return faults


def test_imports_go_down_the_folders_and_never_round_a_cycle(tmp_path):
    """No module imports from a folder above its own (LAYERS), and no import cycle between modules; the check bites on
    a copy of the package with an upward import planted, and with a cycle planted inside one folder."""
    assert import_faults(ROOT / "rlhf") == []
    import shutil

    copy = tmp_path / "rlhf"
    shutil.copytree(ROOT / "rlhf", copy, ignore=shutil.ignore_patterns("__pycache__"))
    guard = copy / "maths" / "guard.py"
    guard.write_text(guard.read_text() + "\n\ndef late():\n    from rlhf.tools import bases\n")
    curves = copy / "maths" / "curves.py"
    assert "from rlhf.maths.guard import" in curves.read_text()
    guard.write_text(guard.read_text() + "\n\ndef later():\n    from rlhf.maths import curves\n")
    upward, cycle = import_faults(copy)  # the cycle is named from whichever of its modules the search met first
    assert upward == "rlhf.maths.guard imports rlhf.tools.bases: tools/ is above maths/"
    assert cycle in ("cycle: rlhf.maths.guard -> rlhf.maths.curves -> rlhf.maths.guard",
                     "cycle: rlhf.maths.curves -> rlhf.maths.guard -> rlhf.maths.curves")


def experiment_takers(package) -> set[str]:
    """The functions under `package` (a folder) that take the experiment: a parameter named exp or annotated
    Experiment; as "<file stem>.<function>"."""
    import ast

    found = set()
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(a.arg == "exp" or (a.annotation is not None and "Experiment" in ast.unparse(a.annotation))
                       for a in args):
                    found.add(f"{path.stem}.{node.name}")
    return found


RESOLVERS = {"online_plan.resolve", "online_plan.policy_plan", "online_plan.check_keep", "checks.plan",
             "checks.latest_rm", "checks.grader_role"}
"""The online core's functions that read the experiment: they resolve a stage's plan and its check before anything
loads; the run, its roles, scorer, judge and checks take what they resolved."""


def test_below_the_recipes_the_online_run_takes_its_plan_not_the_experiment(tmp_path):
    """rlhf/rl/: only the resolvers take the experiment; the check bites on a copy with one more function taking it."""
    assert experiment_takers(ROOT / "rlhf" / "rl") == RESOLVERS
    import shutil

    copy = tmp_path / "rl"
    shutil.copytree(ROOT / "rlhf" / "rl", copy, ignore=shutil.ignore_patterns("__pycache__"))
    roles = copy / "roles.py"
    roles.write_text(roles.read_text() + "\n\ndef scale_of(exp):\n    return exp.rm.ensemble\n")
    assert experiment_takers(copy) - RESOLVERS == {"roles.scale_of"}


def test_an_option_is_spelled_whole_and_refused_by_a_command_that_does_not_read_it(capsys):
    """`rlhf export --stage grpo` once exported SFT's adapter (argparse took `--stage` for `--stages`, which export
    ignores, and --from-stage stayed sft): no abbreviation, and an option only another command reads is an error."""
    for argv, says in ((["export", "--stage", "grpo"], "unrecognized arguments: --stage grpo"),
                       (["sft", "--merge"], "--merge is for `rlhf export`, not `rlhf sft`"),
                       (["dpo", "--from-stage", "dpo"], "--from-stage is for `rlhf export`"),
                       (["ppo", "--stages", "sft"], "--stages is for `rlhf memplan / memcheck`"),
                       (["export", "--update"], "--update is for `rlhf memcheck`")):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err, argv
    assert cli.parse_args(["export", "--from-stage", "grpo", "--merge"]).from_stage == "grpo"
    assert cli.parse_args(["memplan", "--stages", "sft,dpo"]).stages == "sft,dpo"
