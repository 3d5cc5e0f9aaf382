"""KTO's data (rlhf/recipes/kto.py), offline and cheap: TRL's unpaired preference rows from kto.path (standard and
conversational), bad rows refused naming the file, the line and the field, the preference pool's pairs unpaired and
shuffled so that each of TRL's in-order batches mixes labels and prompts, and the batch KTO's KL estimate needs. The
stage's training is checked in tests/test_pipeline.py (make kto) and tests/test_chat_pipeline.py."""

import json
import signal

import pytest

from rlhf import cli
from rlhf.experiment import config
from rlhf.inputs import data, models
from rlhf.inputs.data import DataError
from rlhf.infra import dist
from rlhf.recipes import kto

from .conftest import TINY, tiny

U = [{"role": "user", "content": "a b"}]
A = [{"role": "assistant", "content": "a b a"}]
TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_the_pool_unpaired_is_chosen_desirable_rejected_not_and_each_batch_mixes_both():
    """data.path's pairs (tiny: the synthetic pool) become two rows each, TRL's unpair_preference_dataset's labels;
    shuffled with the seed, every batch of tiny.yaml's kto.batch_size holds both labels and TRL's KL rows (each
    completion under its batch neighbour's prompt) almost never share a prompt; unshuffled, every one would."""
    exp = config.load(TINY)
    pairs = data.load(exp).pairs(400)
    rows = kto.unpaired(pairs)
    assert len(rows) == 800 and [r["label"] for r in rows[:4]] == [True, False, True, False]
    assert rows[0] == {"id": pairs[0]["id"] + ":chosen", "prompt": pairs[0]["prompt"], "completion": pairs[0]["chosen"],
                       "label": True, "columns": pairs[0]["columns"]}
    assert rows[1]["completion"] == pairs[0]["rejected"] and rows[1]["id"].endswith(":rejected")
    mixed = kto.shuffled(rows, exp.seed)
    assert sorted(r["id"] for r in mixed) == sorted(r["id"] for r in rows) and mixed == kto.shuffled(rows, exp.seed)
    b = exp.kto.batch_size
    for i in range(0, len(mixed) - b + 1, b):
        assert {r["label"] for r in mixed[i:i + b]} == {True, False}

    def same_prompt(rows):  # TRL's KL completion of row j is row j-1's (rotated within each batch)
        return sum(rows[j]["prompt"] == rows[j - 1]["prompt"] for i in range(0, len(rows), b)
                   for j in range(i + 1, min(i + b, len(rows)))) / len(rows)
    assert same_prompt(rows) > 0.45 and same_prompt(mixed) < 0.05


def test_an_unpaired_file_loads_standard_and_conversational_rows_as_trl_writes_them(tmp_path, monkeypatch):
    """kto.path in TRL's unpaired format: standard rows as they are, conversational ones rendered by the chat
    template as the other stages render theirs; extra fields kept as columns (reward functions' answer keys)."""
    tok = models.build_tokenizer(["a b <|user|> <|assistant|>"])
    tok.chat_template = TEMPLATE
    monkeypatch.setattr(kto, "upstream_sft",
                        lambda exp, who, held_out=(): (tmp_path, {"model": {"adapter": str(tmp_path)}}, tok))
    std = _jsonl(tmp_path / "std.jsonl", [{"prompt": "Q: a b\nA:", "completion": " a", "label": True, "answer": "a"},
                                          {"prompt": "Q: a b\nA:", "completion": " c", "label": False}])
    plan = kto.prepare(tiny(tmp_path, f"kto.path={std}"))
    rows = sorted(plan.data.train_rows, key=lambda r: r["id"])
    assert [(r["prompt"], r["completion"], r["label"]) for r in rows] == [("Q: a b\nA:", " a", True),
                                                                           ("Q: a b\nA:", " c", False)]
    assert rows[0]["columns"] == {"answer": "a"} and rows[0]["id"] == "std.jsonl:1"
    assert plan.inputs["data"] == str(std) and plan.lineage["data_sizes"]["train"] == 2
    assert len(plan.data.eval_rows) == 2 * len(plan.data.eval_pairs)  # the held-out pairs, unpaired
    conv = _jsonl(tmp_path / "conv.jsonl", [{"prompt": U, "completion": A, "label": False}])
    (row,) = kto.prepare(tiny(tmp_path, f"kto.path={conv}")).data.train_rows
    assert row["prompt"] == "<|user|> a b</s><|assistant|>" and row["completion"] == " a b a</s>"
    assert row["prompt_messages"] == U and row["label"] is False


# bad rows of kto.path (line 2, after a good one), and what the one-line error must name
BAD = {
    "no label": ({"prompt": "p", "completion": " c"}, "missing field 'label'"),
    "label a string": ({"prompt": "p", "completion": " c", "label": "yes"}, "field 'label' must be true"),
    "label a number": ({"prompt": "p", "completion": " c", "label": 1}, "field 'label' must be true"),
    "no completion": ({"prompt": "p", "label": True}, "missing field 'completion'"),
    "no prompt": ({"completion": " c", "label": True}, "missing field 'prompt'"),
    "empty completion": ({"prompt": "p", "completion": " ", "label": True}, "field 'completion' is empty"),
    "mixed kinds": ({"prompt": U, "completion": " c", "label": True}, "both be strings or both be message lists"),
    "user completion": ({"prompt": U, "completion": U, "label": True}, "must start with an assistant message"),
    "bad message": ({"prompt": U, "completion": [{"role": "assistant"}], "label": True}, "field 'completion'[0]"),
    "a pair": ({"prompt": "p", "chosen": " a", "rejected": " b"}, "give the pairs as data.path and leave kto.path"),
    "not json": ("{prompt: p", "malformed JSON"),
    "not an object": ("[1, 2]", "expected a JSON object"),
}


@pytest.mark.parametrize("name", BAD)
def test_a_bad_unpaired_row_fails_in_one_line_naming_the_file_line_and_field(tmp_path, capsys, name):
    """`make kto` with kto.path naming a file with one bad row: exit 2, one line `error: <file>:<line>: ...` naming
    the field and what to do, before any model loads (no SFT run is even needed) and nothing written."""
    bad, says = BAD[name]
    path = _jsonl(tmp_path / "rows.jsonl", [{"prompt": "p", "completion": " c", "label": True}, bad])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = cli.main(["kto", "--exp", str(TINY), f"results_dir={tmp_path}/r", f"kto.path={path}"])
    finally:  # the CLI installs its stop handlers in this process
        for sig, h in handlers.items():
            signal.signal(sig, h)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {path}:2: ") and err.count("\n") == 1, err
    assert says in err and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()


def test_a_kto_path_that_is_not_there_names_the_key(tmp_path):
    with pytest.raises(DataError, match=rf"^{tmp_path}/gone.jsonl: no such file \(kto.path\)$"):
        kto.prepare(tiny(tmp_path, f"kto.path={tmp_path / 'gone.jsonl'}"))


def test_kto_refuses_a_batch_too_small_for_its_kl_estimate_before_loading(tmp_path, monkeypatch):
    with pytest.raises(config.ConfigError, match=r"kto\.batch_size=1 gives each of 1 process\(es\) fewer than 2 rows"):
        kto.prepare(tiny(tmp_path, "kto.batch_size=1"))
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    with pytest.raises(config.ConfigError, match=r"kto\.batch_size=2 gives each of 2 process\(es\)"):
        kto.check_batch(tiny(tmp_path, "kto.batch_size=2").kto, "x.yaml")
    kto.check_batch(tiny(tmp_path, "kto.batch_size=2", "kto.loss_type=apo_zero_unpaired").kto, "x.yaml")  # no KL
    with pytest.raises(config.ConfigError, match=r"kto\.loss_type: 'sigmoid' is not one of"):
        tiny(tmp_path, "kto.loss_type=sigmoid")


def test_the_studies_average_seeds_with_a_t_interval():
    """studies/harness.py's figure over seeds (studies/kto_vs_dpo.py's): the mean and its 95% t-interval (t 2.776
    at 4 degrees of freedom), by hand; one seed has no interval."""
    import math

    from studies.harness import t_interval

    got = t_interval([0.70, 0.75, 0.80, 0.65, 0.60])
    half = 2.776 * math.sqrt(((0.0**2) + 0.05**2 + 0.1**2 + 0.05**2 + 0.1**2) / 4) / math.sqrt(5)
    assert got["mean"] == pytest.approx(0.70) and got["ci95"] == pytest.approx([0.70 - half, 0.70 + half])
    assert t_interval([0.7]) == {"mean": 0.7, "ci95": None}
