"""`rlhf compare` / `make compare`: two tiny DPO runs with different beta -> a table of what differs and a PNG."""

import json
import subprocess

import matplotlib.image
import pytest

from rlhf import cli
from rlhf.runs import compare
from rlhf.recipes import dpo, sft

from .conftest import ROOT, tiny

DATA = ("data.sft_examples=64", "data.pref_pairs=32", "data.ppo_prompts=32", "data.eval_examples=16")


@pytest.fixture(scope="module")
def two_dpo_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    sft.train(tiny(root, *DATA, "sft.max_steps=4", "sft.batch_size=8"))
    runs = [dpo.train(tiny(root, *DATA, "dpo.epochs=1", "dpo.batch_size=4", "dpo.logging_steps=1", f"dpo.beta={b}"))
            for b in (0.1, 0.5)]
    return root, runs


@pytest.mark.slow
def test_compare_two_dpo_runs_writes_table_and_png(two_dpo_runs, capsys):
    root, runs = two_dpo_runs
    assert cli.main(["compare", "--results", str(root), "tiny/dpo/*"]) == 0
    printed = capsys.readouterr().out
    (out,) = (root / "compare").iterdir()
    md = (out / "compare.md").read_text()
    for text in (printed, md):
        assert "config: dpo.beta" in text and "0.1" in text and "0.5" in text
        assert "config: dpo.learning_rate" not in text  # only the keys that differ
        for row in ("eval_loss", "eval_rewards_accuracies", "peak memory (GB)", "wall time (s)", "fingerprint"):
            assert row in text, row
    # a nested figure (the check's win rates by grader) is a row per figure, its interval, n and won/tied/lost in its
    # cell, in the console as in compare.md (each was a row of its own: four rows to read one figure)
    table = printed[: printed.index("\nwrote ")]
    for text in (table, md):
        assert "eval_win_rates.ground_truth.win_rate " in text and "eval_win_rates.ground_truth.ci95 " not in text
        assert "{'" not in text  # no dict printed whole
    w = runs[0]["metrics"]["eval_win_rates"]["ground_truth"]
    cell = (f"{compare.fmt(w['win_rate'])} [{compare.fmt(w['ci95'][0])}, {compare.fmt(w['ci95'][1])}] n={w['n']}: "
            f"{w['wins']} won, {w['ties']} tied, {w['n'] - w['wins'] - w['ties']} lost")
    row = next(line for line in md.splitlines() if line.startswith("| eval_win_rates.ground_truth.win_rate |"))
    assert cell in row, (cell, row)
    m = runs[0]["metrics"]  # DPO's rewards/accuracies: its interval, n (and effective n) beside it
    acc = next(line for line in md.splitlines() if line.startswith("| eval_rewards_accuracies |"))
    assert f"{compare.fmt(m['eval_rewards_accuracies'])} [{compare.fmt(m['eval_rewards_accuracies_ci95'][0])}, " \
           f"{compare.fmt(m['eval_rewards_accuracies_ci95'][1])}] n={m['eval_rewards_accuracies_n']}" in acc, acc
    assert "| eval_rewards_accuracies_ci95 |" not in md and "| eval_rewards_accuracies_n |" not in md
    assert max(map(len, table.splitlines())) <= 3 * compare.CELL + 4
    beta_row = next(line for line in md.splitlines() if line.startswith("| config: dpo.beta"))
    assert beta_row.split("|")[2:4] == [" 0.1 ", " 0.5 "]
    for r in runs:
        assert f"{r['run_dir'].rsplit('/', 1)[1]} (dpo.beta=" in md  # the legend/label names the run and its beta
    png = matplotlib.image.imread(out / "curves.png")
    assert png.shape[0] > 600 and png.shape[1] > 1000
    assert "![curves](curves.png)" in md


@pytest.mark.slow
def test_compare_panels_and_labels(two_dpo_runs):
    root, runs = two_dpo_runs
    loaded = [compare.load_run(d) for d in compare.resolve(["tiny/dpo/*"], str(root))[0]]
    assert [str(r["dir"]) for r in loaded] == sorted(r["run_dir"] for r in runs)
    diff = compare.config_diff(loaded)
    assert diff == ["dpo.beta"]
    labels = [compare.label(r, diff, loaded) for r in loaded]
    assert labels[0].endswith("(dpo.beta=0.1)") and labels[1].endswith("(dpo.beta=0.5)")
    keys = compare.panels(loaded)
    assert keys[0] == "loss" and "memory/peak_gb" in keys and any("reward" in k for k in keys)
    x, y = compare.series(loaded[0], "loss")
    assert x == sorted(x) and len(x) == runs[0]["metrics"]["train_steps"]
    # a stage's `latest` pointer names its newest run (README's layout)
    dirs, none = compare.resolve(["tiny/dpo/latest", "tiny/sft/latest"], str(root))
    assert dirs[0] == root / "tiny" / "dpo" / (root / "tiny" / "dpo" / "latest").read_text().strip()
    assert len(dirs) == 2 and none == []


def test_compare_needs_two_runs(tmp_path, capsys):
    assert cli.main(["compare", "--results", str(tmp_path)]) == 2  # `make compare` without RUNS: one line, not usage
    assert capsys.readouterr().err.splitlines() == [
        f'error: compare needs the runs to compare: RUNS="tiny/dpo/*" (make compare), or run directories or globs '
        f'after `rlhf compare` (paths, or relative to --results {tmp_path})']
    assert cli.main(["compare", "--results", str(tmp_path), "tiny/dpo/*"]) == 2
    assert capsys.readouterr().err == (f"error: tiny/dpo/*: no run directory (a run directory holds a config.yaml; a "
                                       f"name that is not a path is looked for under --results {tmp_path})\n")
    for name in ("a", "b"):
        (tmp_path / "tiny" / "dpo" / name).mkdir(parents=True)
        (tmp_path / "tiny" / "dpo" / name / "config.yaml").write_text("seed: 0\n")
    # a typo beside two runs was dropped from the table, exit 0 (a new user's); it is said, exit 2
    assert cli.main(["compare", "--results", str(tmp_path), "tiny/dpo/a", "tiny/dpo/b", "tiny/dpo/typo-run"]) == 2
    assert capsys.readouterr().err.startswith("error: tiny/dpo/typo-run: no run directory")
    assert cli.main(["compare", "--results", str(tmp_path), "tiny/dpo/a"]) == 2  # one run: nothing to compare
    assert "at least two run directories; tiny/dpo/a named 1" in capsys.readouterr().err


def test_compare_shows_the_ranks_where_runs_had_different_numbers_of_them(tmp_path):
    """A 2-rank run records num_processes as its config has it (1: the memory plan's, outside the launch) and the
    same fingerprint as a 1-rank run; the ranks it had are its summary's world_size, a row where the runs differ."""
    def run(name: str, summary: dict | None) -> dict:
        d = tmp_path / "tiny" / "dpo" / name
        d.mkdir(parents=True)
        (d / "config.yaml").write_text("distributed:\n  num_processes: 1\n")
        if summary is not None:
            (d / "summary.json").write_text(json.dumps({"metrics": {"loss": 0.5}, **summary}))
        return compare.load_run(d)

    one, two, same, killed = (run("a", {"world_size": 1}), run("b", {"world_size": 2}), run("c", {"world_size": 1}),
                              run("d", None))
    assert ["ranks (world_size)", "1", "2", "-"] in compare.table([one, two, killed], [])[1]
    assert not any(row[0].startswith("ranks") for row in compare.table([one, same, killed], [])[1])


def test_compare_refuses_a_step_window_that_holds_no_step(two_dpo_runs, capsys):
    root, _ = two_dpo_runs
    for steps in ("5:1", "0:3", "a:b"):
        assert cli.main(["compare", "--results", str(root), "tiny/dpo/*", "--steps", steps]) == 2
        assert f"--steps takes A:B, two step numbers from 1 with A <= B, got '{steps}'" in capsys.readouterr().err


def test_make_compare_and_reuse_wiring():
    out = subprocess.run(["make", "-n", "compare", "RUNS=tiny/dpo/a tiny/dpo/b", "VENV=/venv"], cwd=ROOT,
                         capture_output=True, text=True)
    assert "/venv/bin/python -m rlhf compare --results results tiny/dpo/a tiny/dpo/b" in out.stdout
    out = subprocess.run(["make", "-n", "ppo", "VENV=/venv"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "rlhf sft --exp experiments/tiny.yaml --reuse" in out and "rlhf rm --exp experiments/tiny.yaml --reuse" in out
    assert "rlhf ppo --exp experiments/tiny.yaml" in out and "rlhf ppo --exp experiments/tiny.yaml --reuse" not in out
    assert "compare" in subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True).stdout


def test_the_console_table_cuts_a_long_cell_and_compare_md_keeps_it():
    header, rows = ["", "a", "b"], [["judge_unconfirmed", "[" + "x" * 100 + "]", "-"]]
    lines = compare.text(header, rows).splitlines()
    assert lines[2].split()[1] == "[" + "x" * (compare.CELL - 2) + "…" and len(lines[2].split()[1]) == compare.CELL
    assert "[" + "x" * 100 + "]" in compare.markdown(header, rows, ["a", "b"])
