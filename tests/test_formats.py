"""TRL's dataset formats, files per role, chat templates and malformed input (rlhf/inputs/data.py). All offline and cheap."""

import copy
import gzip
import json
import signal

import pytest

from rlhf import cli
from rlhf.experiment import config
from rlhf.inputs import data, formats, models
from rlhf.inputs.data import DataError

from .conftest import TINY, tiny

U = [{"role": "user", "content": "x y"}]
A = [{"role": "assistant", "content": "a a b"}]
B = [{"role": "assistant", "content": "c d"}]
TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")

# one valid record per accepted format, by role (the role's config key reads it)
FORMATS = {
    "preference/standard": ("path", {"prompt": "Q: x y\nA:", "chosen": " a a b", "rejected": " c d"}),
    "preference/standard-implicit": ("path", {"chosen": "Q: x y\nA: a a b", "rejected": "Q: x y\nA: c d"}),
    "preference/conversational": ("path", {"prompt": U, "chosen": A, "rejected": B}),
    "preference/conversational-implicit": ("path", {"chosen": U + A, "rejected": U + B}),
    "sft/prompt-completion": ("sft_path", {"prompt": "Q: x y\nA:", "completion": " a a b"}),
    "sft/prompt-completion-conversational": ("sft_path", {"prompt": U, "completion": A}),
    "sft/text": ("sft_path", {"text": "x y a a b"}),
    "sft/messages": ("sft_path", {"messages": U + A}),
    "sft/instruction": ("sft_path", {"instruction": "say x y", "input": "twice", "output": "a a"}),
    "prompts/standard": ("prompts_path", {"prompt": "Q: x y\nA:"}),
    "prompts/conversational": ("prompts_path", {"prompt": U}),
    "eval/standard": ("eval_path", {"prompt": "Q: x y\nA:", "chosen": " a a b", "rejected": " c d"}),
}
ROLE = {"path": "preference", "sft_path": "sft", "prompts_path": "prompts", "eval_path": "eval"}


def _variants(rec: dict, n: int) -> list[dict]:
    """n distinct valid records of a format (distinct so that no duplicate is skipped)."""
    return [json.loads(json.dumps(rec).replace("x y", f"x y {chr(97 + i)}")) for i in range(n)]


def _conv(rec: dict) -> bool:
    return any(isinstance(v, list) for v in rec.values())


def _jsonl(path, records, raw_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(raw_lines))
    return path


def _exp(tmp_path, key, path, *more):
    extra = ["data.source=jsonl", f"data.path={path}"] if key == "path" else []
    n_eval = 0 if key == "eval_path" else 1  # with an eval file: all of it
    return tiny(tmp_path / "r", f"data.{key}={path}", *extra, f"data.eval_examples={n_eval}", *more)


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_loads_for_its_role(tmp_path, name):
    key, rec = FORMATS[name]
    path = _jsonl(tmp_path / "d.jsonl", _variants(rec, 4))
    rows, skipped = formats.load_file(str(path), ROLE[key])
    assert len(rows) == 4 and not skipped
    r = rows[0]
    conversational = "conversational" in name or name == "sft/messages"
    assert isinstance(r["prompt"], list) == conversational
    if ROLE[key] in ("preference", "eval"):
        if conversational:
            assert r["prompt"][0]["content"].startswith("x y") and r["chosen"] == A and r["rejected"] == B
        else:
            assert r["prompt"].startswith("Q: x y") and r["prompt"].endswith("A:")
            assert (r["chosen"], r["rejected"]) == (" a a b", " c d")
    elif ROLE[key] == "sft":
        assert r["completion"] in (" a a b", A, " a a") or r["completion"].startswith("x y")
    splits = data.load(_exp(tmp_path, key, path))
    got = {"path": splits.train + splits.eval, "sft_path": splits.sft_rows, "prompts_path": splits.prompt_rows,
           "eval_path": splits.eval}[key]
    assert sorted(x["id"] for x in got) == sorted(x["id"] for x in rows)


def test_roles_are_used_by_the_stages_that_consume_them(tmp_path):
    pref = _jsonl(tmp_path / "pref.jsonl", [dict(FORMATS["preference/standard"][1], prompt=f"Q{i}:") for i in range(6)])
    sft_file = _jsonl(tmp_path / "sft.jsonl", [{"prompt": f"P{i}:", "completion": " x"} for i in range(3)])
    ev = _jsonl(tmp_path / "ev.jsonl", [{"prompt": "E:", "chosen": " y", "rejected": " z"}])
    prompts = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"R{i}:"} for i in range(2)])
    exp = tiny(tmp_path, "data.source=jsonl", f"data.path={pref}", f"data.sft_path={sft_file}",
               f"data.eval_path={ev}", f"data.prompts_path={prompts}")
    s = data.load(exp)
    assert len(s.train) == 6 and [r["prompt"] for r in s.eval] == ["E:"]  # no split of the pool with an eval file
    assert sorted(r["prompt"] for r in s.sft(0)) == ["P0:", "P1:", "P2:"]
    assert sorted(r["prompt"] for r in s.prompts(0)) == ["R0:", "R1:"]
    train, held_out, _ = data.load_sft(exp)
    assert len(train) == 3 and held_out == [{"id": "ev.jsonl:1", "prompt": "E:", "completion": " y"}]
    from rlhf.recipes import sft

    inputs = sft.prepare(exp).inputs  # the SFT run's record names the file it trained on, beside the pool's
    assert (inputs["data"], inputs["sft_path"]) == (str(pref), str(sft_file))
    # without the role files: the seeded split of the pool, SFT on its chosen side, PPO on its prompts
    s = data.load(tiny(tmp_path, "data.source=jsonl", f"data.path={pref}", "data.eval_examples=2"))
    assert len(s.train) == 4 and len(s.eval) == 2 and s.sft(0)[0]["completion"] == " a a b"


def test_an_implicit_prompt_leaves_each_response_a_word_or_fails_naming_the_field(tmp_path):
    """Standard implicit-prompt pairs: the shared start is the prompt, cut back to a word boundary, also where one
    string is the start of the other (it would leave that response empty); nothing left of one is a one-line error."""
    path = _jsonl(tmp_path / "i.jsonl", [{"chosen": "What is 1+1? 2", "rejected": "What is 1+1? 2 3"},
                                         {"chosen": "What is 2+2? 4", "rejected": "What is 2+2? 5"},
                                         {"chosen": "Q: Sure.\n", "rejected": "Q: Sure.\nHere"},
                                         {"chosen": "x", "rejected": "x"}])
    rows, skipped = formats.load_file(str(path), "preference")
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in rows] == [
        ("What is 1+1?", " 2", " 2 3"), ("What is 2+2?", " 4", " 5"), ("Q:", " Sure.\n", " Sure.\nHere")]
    assert skipped == {"identical chosen and rejected": 1}  # as ever, not an error
    bad = _jsonl(tmp_path / "b.jsonl", [{"chosen": "Q: x  ", "rejected": "Q: x y"}])  # chosen adds only spaces
    with pytest.raises(DataError, match=r"^.*b.jsonl:1: field 'chosen' is empty once the prompt it shares with "
                                        r"'rejected' is taken out .* give the prompt as its own field$"):
        formats.load_file(str(bad), "preference")


def test_a_conversational_response_with_no_text_is_as_empty_as_an_empty_string(tmp_path):
    """A chosen response of messages whose content is all empty was taken (SFT trained on it without a word), where
    the standard format's "" is refused: both are a one-line error naming the file, line and field."""
    user = [{"role": "user", "content": "hi"}]
    good = {"prompt": user, "chosen": [{"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "assistant", "content": "go"}]}
    bad = _jsonl(tmp_path / "c.jsonl", [good, dict(good, chosen=[{"role": "assistant", "content": " "}])])
    with pytest.raises(DataError, match=r"^.*c.jsonl:2: field 'chosen' is empty \(its messages have no content\); "
                                        r"give it text, or remove the record$"):
        formats.load_file(str(bad), "preference")
    assert len(formats.load_file(str(_jsonl(tmp_path / "g.jsonl", [good])), "preference")[0]) == 1


def test_every_bad_record_of_a_file_is_said_in_one_error(tmp_path, capsys):
    """A file with several bad records says them all at once (each reason at its first record, with how many more), so
    it is mended in one pass: before, each run stopped at the first, one record per run. hh-rlhf's transcripts the
    same; a wrong file or column mapping stops after ten records, a mix of formats is said once."""
    good = _variants(FORMATS["preference/standard"][1], 20)
    lines = [json.dumps(r) + "\n" for r in good]
    lines[3] = '{"prompt": "p", "chosen": "c"\n'
    lines[7] = json.dumps({"prompt": "x", "chosen": "", "rejected": "b"}) + "\n"
    lines[9] = json.dumps({"prompt": "x", "rejected": "b"}) + "\n"
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(lines))
    with pytest.raises(DataError) as e:
        formats.load_file(str(path), "preference")
    said = str(e.value).splitlines()
    assert said[0] == f"{path}: 3 bad records; mend each and rerun:"
    assert [line.split(": ")[0] for line in said[1:]] == [f"  {path}:{i}" for i in (4, 8, 10)]
    assert "malformed JSON" in said[1] and "'chosen' is empty" in said[2] and "missing field 'chosen'" in said[3]
    # the same reason is said once, at its first record, naming the next few; past ten reasons, how many more
    many = tmp_path / "many.jsonl"
    faults = ["[1]", "1", '"s"', "1.5", "true", "null", '{"a": }', '{"a" 1}', '{"a": 1 "b": 2}', '{"a": 1} x', "{x}"]
    _jsonl(many, good[:2] + [{"prompt": f"x{i}", "chosen": "", "rejected": "b"} for i in range(7)]
           + [{"prompt": "x", "rejected": "b", f"k{i:02d}": 1} for i in range(3)], [f"{f}\n" for f in faults])
    with pytest.raises(DataError) as e:
        formats.load_file(str(many), "preference")
    said = str(e.value).splitlines()
    assert said[0] == f"{many}: 21 bad records; mend each and rerun:" and len(said) == 12 and said[-1] == "  and 3 more"
    assert said[1] == f"  {many}:3 and 6 more like it (4, 5, 6, 7, 8, ...): field 'chosen' is empty{formats.EMPTY}"
    assert said[2].startswith(f"  {many}:10 and 2 more like it (11, 12): missing field 'chosen' (fields present: k00,")
    assert [line.split(": ")[0] for line in said[3:-1]] == [f"  {many}:{i}" for i in range(13, 21)]
    # lines cut short (or broken by a raw newline) are one fault, whatever column each breaks at, said as JSON sees it
    cut = tmp_path / "cut.jsonl"
    whole = json.dumps(good[0])
    _jsonl(cut, good[1:3], [whole[:n] + "\n" for n in (20, 30, 40)])
    with pytest.raises(DataError) as e:
        formats.load_file(str(cut), "preference")
    said = str(e.value).splitlines()
    assert said[0] == f"{cut}: 3 bad records; mend each and rerun:" and len(said) == 2, said
    assert said[1].startswith(f"  {cut}:3 and 2 more like it (4, 5): malformed JSON (Unterminated string starting at "
                              f"column "), said
    # a file whose first ten records are all bad (here a wrong data.columns) is read no further, and says the mapping
    wrong = _jsonl(tmp_path / "wrong.jsonl", good)
    with pytest.raises(DataError) as e:
        formats.load_file(str(wrong), "preference", columns={"chosen": "better"})
    assert str(e.value).splitlines() == [
        f"{wrong}: its first 10 records are bad, so it is read no further; check that it is the file meant and what "
        "data.columns maps, and rerun:",
        f"  {wrong}:1 and 9 more like it (2, 3, 4, 5, 6, ...): missing field 'chosen' (fields present: better, prompt, "
        f"rejected; expected {formats.FORMATS['preference']}); a file that names it otherwise maps it with "
        "data.columns={<its name>: chosen}"]
    # records of both kinds: the fewer are the bad ones, said as one fault
    mixed = _jsonl(tmp_path / "mixed.jsonl", good[:5] + [{"prompt": U, "chosen": A, "rejected": B}] * 2)
    with pytest.raises(DataError) as e:
        formats.load_file(str(mixed), "preference")
    assert str(e.value).splitlines() == [
        f"{mixed}: 2 bad records; mend each and rerun:",
        f"  {mixed}:6 and 1 more like it (7): conversational (message lists), but 5 are standard (strings) (the first: "
        f"{mixed}:1): one file holds one format (a TRL dataset's column has one type); convert the rows of the other"]
    # a file that is not UTF-8 fails at its first line, saying what it is
    packed = tmp_path / "packed.jsonl"
    packed.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in good).encode()))
    with pytest.raises(DataError, match=rf"^{packed}:1: invalid UTF-8 .* \(it is gzip-compressed: name it .jsonl.gz\)$"):
        formats.load_file(str(packed), "preference")
    wide = tmp_path / "utf16.jsonl"
    wide.write_bytes("".join(json.dumps(r) + "\n" for r in good).encode("utf-16"))
    with pytest.raises(DataError, match=rf"^{wide}:1: invalid UTF-8 .* \(it is UTF-16: save it as UTF-8\)$"):
        formats.load_file(str(wide), "preference")
    # hh-rlhf's transcripts: a cut line and a record without 'rejected', both said
    hh = tmp_path / "hh.jsonl"
    pair = {"chosen": "\n\nHuman: hi\n\nAssistant: a", "rejected": "\n\nHuman: hi\n\nAssistant: b"}
    _jsonl(hh, [pair, {"chosen": pair["chosen"]}], ['{"chosen": "\n'])
    with pytest.raises(DataError) as e:
        formats.hh_pairs(str(hh))
    said = str(e.value).splitlines()
    assert said[0] == f"{hh}: 2 bad records; mend each and rerun:" and len(said) == 3
    assert said[1].startswith(f"  {hh}:2: missing field 'rejected'") and said[2].startswith(f"  {hh}:3: malformed")
    assert said[1].endswith("an hh-rlhf record is two transcripts, 'chosen' and 'rejected' (\\n\\nHuman: ... "
                            "\\n\\nAssistant: ...); records of another format load with data.source: jsonl "
                            "(docs/data.md)"), said[1]
    # the command: exit 2, every record said, nothing written
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = cli.main(["sft", "--exp", str(TINY), f"results_dir={tmp_path}/r", "data.source=jsonl",
                         f"data.path={path}", "data.eval_examples=1"])
    finally:  # the CLI installs its stop handlers in this process
        for sig, h in handlers.items():
            signal.signal(sig, h)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {path}: 3 bad records") and err.count("\n") == 4, err
    assert not (tmp_path / "r").exists()


def test_identical_and_duplicate_pairs_are_skipped_and_counted(tmp_path):
    good = FORMATS["preference/standard"][1]
    same = {"prompt": "Q:", "chosen": " x", "rejected": " x"}
    path = _jsonl(tmp_path / "d.jsonl", [good, same, good, dict(good, chosen=" b"), same])
    rows, skipped = formats.load_file(str(path), "preference")
    assert [r["id"] for r in rows] == ["d.jsonl:1", "d.jsonl:4"]
    assert skipped == {"identical chosen and rejected": 2, "duplicate": 1}
    assert skipped.at == {"identical chosen and rejected": f"{path}:2", "duplicate": f"{path}:3"}  # each one's first
    s = data.load(tiny(tmp_path, "data.source=jsonl", f"data.path={path}", "data.eval_examples=1"))
    assert s.skipped == skipped and s.skipped.at == skipped.at
    # each offline stage says it (the run record's inputs.skipped has the counts, inputs.skipped_at each one's first
    # place); KTO with what is left of each label
    assert data.skipped_said("kto", data.skipped_record(skipped), str(path), {"desirable": 84, "undesirable": 192}) == (
        f"kto: 3 records are skipped (in {path}: identical chosen and rejected 2 (the first: {path}:2), duplicate 1 "
        f"({path}:3)); left: desirable 84, undesirable 192: an exact duplicate counts once, a pair whose chosen equals "
        "its rejected not at all (docs/data.md)")
    assert data.skipped_said("dpo", {"skipped": {"duplicate": 1, "eval: duplicate": 2}}, "p.jsonl").startswith(
        "dpo: 3 records are skipped (in p.jsonl: duplicate 1; in data.eval_path: duplicate 2)")  # each file named
    assert data.skipped_said("sft", {"skipped": {"no shared prompt": 5, "empty response": 4}}, "hh.jsonl.gz") == (
        "sft: 9 records are skipped (in hh.jsonl.gz: no shared prompt 5, empty response 4) (docs/data.md)")
    assert data.skipped_said("sft", {"skipped": {"empty response": 1}}, "hh.jsonl.gz").startswith(
        "sft: 1 record is skipped")
    assert data.skipped_said("sft", {}, str(path)) is None
    assert data.skipped_said("dpo", {"skipped": {"sft: duplicate": 3}}, str(path), other=("sft",)) is None  # not DPO's


def test_bom_loads_and_column_mapping_applies(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"question": "Q:", "good": " a", "bad": " b"}).encode() + b"\n")
    rows, _ = formats.load_file(str(path), "preference", columns={"question": "prompt", "good": "chosen",
                                                               "bad": "rejected"})
    assert rows == [{"id": "bom.jsonl:1", "prompt": "Q:", "chosen": " a", "rejected": " b"}]


def test_hub_dataset_by_id_offline_with_split_and_columns(tmp_path, monkeypatch):
    """The datasets.load_dataset path, on a local dataset directory with the schema of trl-lib/ultrafeedback_binarized
    (implicit-prompt conversational pairs plus score columns) and of a renamed-column dataset."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "ultrafeedback"
    d.mkdir()
    recs = [{"chosen": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "good"}],
             "rejected": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "bad"}],
             "score_chosen": 8.0, "score_rejected": 2.0} for i in range(5)]
    _jsonl(d / "train.jsonl", recs)
    _jsonl(d / "test.jsonl", recs[:2])
    exp = tiny(tmp_path, "data.source=hub", f"data.path={d}", f"data.eval_path={d}", "data.eval_split=test")
    s = data.load(exp)
    assert len(s.train) == 5 and len(s.eval) == 2
    assert s.eval[0]["prompt"] == [{"role": "user", "content": "q 0"}]
    assert s.eval[0]["chosen"] == [{"role": "assistant", "content": "good"}]
    with pytest.raises(DataError, match=r"cannot load dataset split 'nope'"):
        data.load(tiny(tmp_path, "data.source=hub", f"data.path={d}", "data.split=nope"))
    # the hh-rlhf source's hub id on a host without the hub (the shipped 7B experiments' data.path): one line, the
    # loader's reason and what to do; no traceback
    import datasets

    def unreachable(path, split):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    with monkeypatch.context() as m:
        m.setattr(datasets, "load_dataset", unreachable)
        with pytest.raises(DataError, match=r"^Anthropic/hh-rlhf: cannot load dataset split 'train' \(ConnectionError: "
                                            r"Couldn't reach .*\); without the hub, point the data section at local"):
            formats.hh_pairs("Anthropic/hh-rlhf")
    # HuggingFaceH4/ultrafeedback_binarized: a string prompt next to chosen/rejected conversations that contain it
    h4 = [{"prompt": "q", "chosen": U + A, "rejected": U + B, "messages": U + A}]
    rows, _ = formats.load_file(str(_jsonl(tmp_path / "h4.jsonl", h4)), "preference")
    assert rows[0]["prompt"] == U and rows[0]["chosen"] == A
    rows, _ = formats.load_file(str(tmp_path / "h4.jsonl"), "sft")
    assert rows[0]["prompt"] == U and rows[0]["completion"] == A


# ------------------------------------------------------------------------------------------------- chat templates
CHATML = TEMPLATE.replace("+ eos_token }}", "+ eos_token + '\\n' }}")
"""A template whose turns end with the EOS and a newline after it, as ChatML's <|im_end|>\\n (Qwen's)."""


def _chat_tokenizer(template: str = TEMPLATE):
    renderer = models.build_tokenizer([])
    renderer.chat_template = template
    texts = [r["prompt"] + r["completion"] for r in data.render([{"id": "x", "prompt": U, "completion": A},
                                                                  {"id": "y", "prompt": U, "completion": B}], renderer)]
    tok = models.build_tokenizer(texts)
    tok.chat_template = template
    return tok


def test_render_uses_the_template_and_leaves_plain_text_alone():
    tok = _chat_tokenizer()
    rows = [{"id": "c", "prompt": copy.deepcopy(U), "chosen": A, "rejected": B},
            {"id": "s", "prompt": "Q:", "chosen": " a", "rejected": " b"}]
    data.render(rows, tok)
    assert rows[0] == {"id": "c", "prompt": "<|user|> x y</s><|assistant|>", "chosen": " a a b</s>",
                       "rejected": " c d</s>", "prompt_messages": U}  # the messages, for reward functions
    assert rows[1] == {"id": "s", "prompt": "Q:", "chosen": " a", "rejected": " b"}
    tok.chat_template = None
    with pytest.raises(DataError, match="set data.chat_template"):
        data.render([{"id": "c", "prompt": U, "completion": A}], tok)


@pytest.mark.parametrize("template", [TEMPLATE, CHATML], ids=["eos", "eos-newline"])
def test_sft_loss_mask_covers_exactly_the_assistant_tokens(tmp_path, template):
    """TRL trains the reply and one EOS, also where the template writes a newline after the turn's EOS (ChatML): the
    rendered response ends at its EOS (data.render), as the stages sample it; TRL, given text that did not end with
    it, appended a second EOS after the newline."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    tok = _chat_tokenizer(template)
    if template == CHATML:
        (row,) = data.render([{"id": "x", "prompt": U, "completion": A}], tok)
        assert row["completion"] == " a a b</s>" and row["prompt"] == "<|user|> x y</s>\n<|assistant|>"
    rows = data.render([{"id": "x", "prompt": U, "completion": A}, {"id": "y", "prompt": U, "completion": B}], tok)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    args = SFTConfig(output_dir=str(tmp_path), completion_only_loss=True, max_length=32, report_to="none",
                     use_cpu=True, activation_checkpointing=False)  # TRL's default: on, by its deprecated name
    trainer = SFTTrainer(model=LlamaForCausalLM(cfg), args=args, processing_class=tok,
                         train_dataset=Dataset.from_list([{k: r[k] for k in ("prompt", "completion")} for r in rows]))
    for i, content in enumerate(("a a b", "c d")):
        ex = trainer.train_dataset[i]
        ids = ex["input_ids"]
        labels = trainer.data_collator([ex])["labels"][0].tolist()  # what the loss sees (-100 = masked)
        trained = tok.convert_ids_to_tokens([t for t, lab in zip(ids, labels) if lab != -100])
        assert trained == content.split() + ["</s>"]  # exactly the reply and its end of turn
        masked = tok.convert_ids_to_tokens([t for t, lab in zip(ids, labels) if lab == -100])
        assert masked == ["<s>", "<|", "user", "|>", "x", "y", "</s>", "<|", "assistant", "|>"]


# ---------------------------------------------------------------------------------------------------- bad input
GOOD_LINES = 2  # the malformed record is line 3 (after two good ones) where the mutation is a record's


def _field_mutations(rec: dict) -> list[tuple[str, object]]:
    out = []
    for f in rec:
        if f == "input":
            continue
        msg = rec[f] if isinstance(rec[f], list) else [{"role": "user", "content": "x"}]
        for label, value in (("missing", KeyError), ("int", 3), ("null", None), ("empty", ""), ("empty-list", []),
                             ("dict", {"a": 1}), ("bool", True), ("list-of-str", ["a", "b"]),
                             ("no-content", [{"role": msg[0]["role"]}]),
                             ("bad-role", [{"role": "robot", "content": "x"}]),
                             ("int-content", [{"role": msg[0]["role"], "content": 5}]), ("float", 1.5)):
            out.append((f"{f}-{label}", (f, value)))
    return out


def _corpus(tmp_path, name: str) -> list:
    """Malformed files of one format: (path, expected line or None for a file-level error)."""
    key, rec = FORMATS[name]
    base = tmp_path / name.replace("/", "_")
    base.mkdir()
    good = _variants(rec, GOOD_LINES)
    files = []
    for label, (f, value) in _field_mutations(rec):
        bad = dict(rec)
        if value is KeyError:
            del bad[f]
        else:
            bad[f] = value
        if ROLE[key] == "sft" and f == "prompt" and value is None and "completion" in rec:
            continue
        files.append((_jsonl(base / f"{label}.jsonl", good + [bad]), GOOD_LINES + 1))
    raw = {
        "truncated-json": ('{"prompt": "p", "chosen": "c"\n', 3),
        "array-line": ("[1, 2]\n", 3),
        "string-line": ('"just a string"\n', 3),
        "trailing-garbage": (json.dumps(rec) + " xyz\n", 3),
        "bom-then-garbage": (None, 1),
        "invalid-utf8": (None, 3),
        "utf16": (None, 1),
        "empty": (None, None),
        "blank-lines": (None, None),
    }
    for label, (text, line) in raw.items():
        p = base / f"{label}.jsonl"
        if label == "bom-then-garbage":
            p.write_bytes(b"\xef\xbb\xbf{not json\n")
        elif label == "invalid-utf8":
            p.write_bytes("".join(json.dumps(r) + "\n" for r in good).encode() + b'{"prompt": "caf\xe9"}\n')
        elif label == "utf16":
            p.write_bytes((json.dumps(rec) + "\n").encode("utf-16"))
        elif label == "empty":
            p.write_text("")
        elif label == "blank-lines":
            p.write_text("\n  \n\n")
        else:
            _jsonl(p, good, [text])
        files.append((p, line))
    gz = base / "truncated.jsonl.gz"
    blob = gzip.compress("".join(json.dumps(r) + "\n" for r in _variants(rec, 200)).encode())
    gz.write_bytes(blob[: len(blob) // 2])
    files.append((gz, "any"))
    notgz = base / "plain.jsonl.gz"
    notgz.write_text(json.dumps(rec) + "\n")
    files.append((notgz, 1))
    files.append((base / "missing.jsonl", None))
    # a record of the other kind (conversational among standard ones, or the reverse): one file, one format
    kind = {"eval": "preference"}.get(ROLE[key], ROLE[key])
    other = next(r for k, r in FORMATS.values() if ROLE[k] == kind and _conv(r) != _conv(rec))
    files.append((_jsonl(base / "mixed-format.jsonl", good + [other]), GOOD_LINES + 1))
    if ROLE[key] in ("preference", "eval"):
        same = [dict(rec, chosen=rec["chosen"], rejected=rec["chosen"])] * 2
        files.append((_jsonl(base / "all-identical.jsonl", same), None))
    return key, files


@pytest.mark.parametrize("name", FORMATS)
def test_malformed_corpus_exits_2_with_one_line_naming_file_and_line(tmp_path, capsys, name):
    key, files = _corpus(tmp_path, name)
    assert len(files) >= 20
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _run_corpus(tmp_path, capsys, key, files, template)
    finally:  # the CLI installs its stop handlers in this process
        for sig, h in handlers.items():
            signal.signal(sig, h)


def _run_corpus(tmp_path, capsys, key, files, template):
    for path, line in files:
        extra = ["data.source=jsonl", f"data.path={path}"] if key == "path" else []
        extra.append(f"data.chat_template={template}")
        argv = ["sft", "--exp", str(TINY), f"results_dir={tmp_path}/r", f"data.{key}={path}", *extra,
                "data.eval_examples=1", "data.sft_examples=4", "data.pref_pairs=4", "data.ppo_prompts=4"]
        code = cli.main(argv)
        err = capsys.readouterr().err
        assert code == 2, (path, err)
        assert err.startswith("error: ") and err.count("\n") == 1, (path, err)
        assert str(path) in err, (path, err)
        if line == "any":
            assert f"{path}:" in err and "gzip" in err, err
        elif line is not None:
            assert f"{path}:{line}:" in err, (path, err)
        assert "Traceback" not in err
        assert not (tmp_path / "r").exists()  # nothing written, let alone something that looks finished


# ------------------------------------------------------------------------------------- tokenizers as they come
def _pad_is_eos_model():
    from .conftest import tiny_llama

    tok = _chat_tokenizer()
    tok.pad_token = tok.eos_token  # Llama-3 style: no pad token of its own
    assert tok.pad_token_id == tok.eos_token_id
    return tiny_llama(tok), tok


def test_conversational_records_without_a_chat_template_name_the_first_record_and_the_tokenizer(tmp_path):
    tok = models.build_tokenizer(["a b c"])
    tok.save_pretrained(tmp_path)
    rows = [{"id": "p.jsonl:1", "prompt": "plain"},
            {"id": "p.jsonl:2", "prompt": [{"role": "user", "content": "a"}], "chosen": "b"}]
    with pytest.raises(DataError) as e:
        data.render(rows, models.load_tokenizer(str(tmp_path)))
    assert str(e.value) == (f"conversational records (p.jsonl:2, the first) need a chat template, and the tokenizer of "
                            f"{tmp_path} has none: set data.chat_template (a Jinja string or file)")


def test_a_tokenizer_with_ids_past_the_models_embedding_is_refused_in_one_line(tmp_path):
    """A base whose tokenizer has a token the embedding has no row for (a pad token added past the vocabulary, as
    transformers' Qwen2 tokenizer class adds '<|endoftext|>' to a BPE folder without one): refused as SFT resolves
    the base, naming the token and its id, before any weight loads (the lookup failed mid-eval before)."""
    from transformers import LlamaConfig

    tok = models.build_tokenizer(["a b c"])
    LlamaConfig(vocab_size=len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    models.check_vocabulary(models.load_tokenizer(str(tmp_path)), str(tmp_path))  # every id has its row
    tok.add_special_tokens({"pad_token": "<|endoftext|>"})
    tok.save_pretrained(tmp_path)
    with pytest.raises(config.ConfigError) as e:
        models.check_vocabulary(models.load_tokenizer(str(tmp_path)), str(tmp_path))
    n = len(tok)
    assert str(e.value).startswith(f"model.name {tmp_path}: its tokenizer has {n} tokens ('<|endoftext|>' is id "
                                   f"{n - 1}), but the model's embedding has {n - 1} rows (vocab_size)"), e.value
    tok.add_tokens(["zzz"])  # a plain token past the rows too
    tok.save_pretrained(tmp_path)
    with pytest.raises(config.ConfigError, match=rf"has {n + 1} tokens \('<\|endoftext\|>' is id {n - 1}\)"):
        models.check_vocabulary(models.load_tokenizer(str(tmp_path)), str(tmp_path))


def test_a_model_folder_without_its_tokenizer_is_one_line_saying_to_save_it(tmp_path):
    """A user's model folder with its config and weights but no tokenizer files: one error naming the folder and what
    to do (transformers built the architecture's tokenizer class from nothing and said to install sentencepiece, a
    traceback and exit 1); files it cannot make a tokenizer of are its own first line, as one error too."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=8).save_pretrained(tmp_path)
    with pytest.raises(models.ModelLoadError) as e:
        models.load_tokenizer(str(tmp_path))
    assert str(e.value) == (f"{tmp_path}: cannot load its tokenizer (the folder holds none of its files: tokenizer.json, "
                            "tokenizer_config.json, tokenizer.model, vocab.json, ...). Save the model's tokenizer into it "
                            "(tokenizer.save_pretrained(folder)), as a checkpoint ships it")
    from rlhf.recipes import sft  # and `make sft` says it before it makes a run folder (it was left for a rerun)

    with pytest.raises(models.ModelLoadError, match="Save the model's tokenizer into it"):
        sft.prepare(tiny(tmp_path / "results", f"model.name={tmp_path}"))
    assert not (tmp_path / "results").exists()
    tok = models.build_tokenizer(["a b c"])
    tok.save_pretrained(tmp_path / "saved")
    loaded = models.load_tokenizer(str(tmp_path / "saved"))  # and saved again, as each adapter and export saves it:
    loaded.save_pretrained(tmp_path / "again")  # without how transformers loaded it (an export made offline said
    assert not {"is_local", "local_files_only"} & set(json.loads((tmp_path / "again" / "tokenizer_config.json")
                                                                .read_text()))  # local_files_only: true)
    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(models.ModelLoadError, match="Its files are not a tokenizer transformers can load here"):
        models.load_tokenizer(str(tmp_path))


def test_pad_equal_to_eos_keeps_generation_and_masks_right():
    """A left-padded prompt (padded with the EOS id) generates what it generates alone; the response mask stops at
    the first EOS and treats nothing before it as padding."""
    import torch

    from rlhf.rl import generation

    model, tok = _pad_is_eos_model()
    short, long = [data.render_prompt(tok, [{"role": "user", "content": c}]) for c in ("x", "x y x y x y")]
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, max_prompt_length=32, do_sample=False)
    both = generation.generate(model, tok, [short, long], **kw)
    alone = generation.generate(model, tok, [short], **kw)
    assert both.query_mask[0, 0] == 0 and both.query[0, 0] == tok.eos_token_id  # left-padded with the EOS id
    assert torch.equal(both.response[0], alone.response[0]) and torch.equal(both.mask[0], alone.mask[0])
    # the same tokens could come from a model that attends the padding (a random one's greedy tokens barely depend
    # on the prompt); the log-probs would not: attending the EOS padding moves them by ~0.02
    with torch.no_grad():
        lb, la = (generation.response_logprobs(model, r)[0][0] for r in (both, alone))
    torch.testing.assert_close(lb[both.mask[0].bool()], la[alone.mask[0].bool()], atol=1e-5, rtol=1e-5)
    eos = tok.eos_token_id
    resp = torch.tensor([[5, eos, eos, eos], [5, 6, 7, 8], [eos, eos, eos, eos]])
    assert generation.response_mask(resp, eos).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_pad_equal_to_eos_sft_still_learns_the_end_of_turn(tmp_path):
    """With pad == EOS the completion's closing EOS must stay in the loss (else the model never learns to stop)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tok = _pad_is_eos_model()
    rows = data.render([{"id": "x", "prompt": U, "completion": A}, {"id": "y", "prompt": U, "completion": B}], tok)
    args = SFTConfig(output_dir=str(tmp_path), completion_only_loss=True, max_length=32, report_to="none",
                     use_cpu=True, activation_checkpointing=False)  # TRL's default: on, by its deprecated name
    trainer = SFTTrainer(model=model, args=args, processing_class=tok,
                         train_dataset=Dataset.from_list([{k: r[k] for k in ("prompt", "completion")} for r in rows]))
    batch = trainer.data_collator([trainer.train_dataset[0], trainer.train_dataset[1]])  # row 1 is right-padded
    for i, content in enumerate(("a a b", "c d")):
        ids, labels = batch["input_ids"][i].tolist(), batch["labels"][i].tolist()
        trained = tok.convert_ids_to_tokens([t for t, lab in zip(ids, labels) if lab != -100])
        assert trained == content.split() + ["</s>"]


def test_a_conversational_sft_runs_lineage_carries_the_rendering_rule(tmp_path, monkeypatch):
    """The rule conversational rows are rendered by is in an SFT run's fingerprint (data.RENDERING): `--reuse` does not
    take up a run rendered by an earlier rule (a ChatML turn trained with two EOS); plain-text runs do not carry it."""
    from rlhf.recipes import sft

    rows = [{"prompt": [{"role": "user", "content": f"x {c}"}], "chosen": A, "rejected": B} for c in "abcdef"]
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    conv = tiny(tmp_path, "data.source=jsonl", f"data.path={_jsonl(tmp_path / 'c.jsonl', rows)}",
                "data.eval_examples=2", f"data.chat_template={tmp_path / 'chat.jinja'}")
    plain = tiny(tmp_path, "data.source=jsonl", "data.eval_examples=2",
                 f"data.path={_jsonl(tmp_path / 'p.jsonl', [dict(FORMATS['preference/standard'][1], prompt=f'Q{i}:') for i in range(6)])}")
    before = {name: sft.prepare(e).lineage["fingerprint"] for name, e in (("conv", conv), ("plain", plain))}
    monkeypatch.setattr(data, "RENDERING", "an earlier rule")
    after = {name: sft.prepare(e).lineage["fingerprint"] for name, e in (("conv", conv), ("plain", plain))}
    assert before["conv"] != after["conv"] and before["plain"] == after["plain"]


def test_a_chat_template_over_plain_text_records_is_refused_before_it_ships_with_the_tokenizer(tmp_path):
    """data.chat_template with records that are plain text (hh-rlhf transcripts, text prompts) rendered none of them,
    and every adapter and export then carried it as the model's format: refused in one line, before any run folder
    (a user's hh-rlhf config copied from tiny-chat.yaml)."""
    from rlhf.recipes import sft

    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    path = _jsonl(tmp_path / "p.jsonl", [dict(FORMATS["preference/standard"][1], prompt=f"Q{i}:") for i in range(6)])
    plain = tiny(tmp_path / "r", "data.source=jsonl", f"data.path={path}", "data.eval_examples=2",
                 f"data.chat_template={tmp_path / 'chat.jinja'}")
    with pytest.raises(DataError, match=rf"^data.chat_template is set, but the records of {path} are plain text, "
                                        r"not messages: .* Remove data.chat_template, or give the records as messages"):
        sft.prepare(plain)
    assert not (tmp_path / "r").exists()


def test_a_graders_pairs_are_the_responses_as_sampled():
    """The independent grader ranks held-out pairs as the stages' rollouts reach it: a conversational response's
    content without the template's EOS (decoded without special tokens) and its token ids through one EOS
    (checks.pair_margins, generation.as_sampled); it was handed the rendered text, markup and all, and ids with two."""
    from rlhf.rl import checks, rewards

    tok = _chat_tokenizer(CHATML)
    rows = data.render([{"id": "c", "prompt": copy.deepcopy(U), "chosen": A, "rejected": B}], tok)
    seen = []

    def grader(prompts, completions, completion_ids, **kwargs):
        seen.append((completions[0][0]["content"], tok.convert_ids_to_tokens(completion_ids[0])))
        return [float(len(completions[0][0]["content"]))]

    assert checks.pair_margins([rewards.RewardFn("t:grader", grader)], rows, tok) == [5.0 - 3.0]
    assert seen == [("a a b", ["a", "a", "b", "</s>"]), ("c d", ["c", "d", "</s>"])]


def test_a_template_that_writes_the_bos_does_not_double_it():
    tok = _chat_tokenizer()
    tok.chat_template = "{{ bos_token }}" + TEMPLATE
    (row,) = data.render([{"id": "c", "prompt": U, "completion": A}], tok)
    assert row["prompt"] == "<|user|> x y</s><|assistant|>" and row["completion"] == " a a b</s>"
    ids = tok(row["prompt"] + row["completion"]).input_ids
    assert ids.count(tok.bos_token_id) == 1


def test_collapse_flags_and_dpo_loss_list(tmp_path):
    import torch

    from rlhf.rl import checks

    ok = {"eval_kl_ref": 0.3, "eval_terminated": 0.94, "eval_terminated_sft": 0.94}
    assert checks.collapse_flags("dpo", ok, 8.0, 0.5) == []
    bad = {"eval_kl_ref": 11.7, "eval_terminated": 0.17, "eval_terminated_sft": 0.94}
    kl, term = checks.collapse_flags("dpo", bad, 8.0, 0.5)
    assert "11.70 nats" in kl and "dpo.max_kl_ref=8" in kl and "17%" in term and "dpo.min_terminated" in term
    assert checks.collapse_flags("dpo", bad, 0.0, 0.0) == []  # bounds off
    # SFT's responses end as rarely (cut at eval.max_new_tokens): the stage lost nothing; below SFT's, it did
    cut = {"eval_terminated": 0.08, "eval_terminated_sft": 0.04}
    assert checks.collapse_flags("dpo", cut, 8.0, 0.5) == []
    assert "only 3% of held-out responses end with EOS (SFT: 4%)" in checks.collapse_flags(
        "dpo", {**cut, "eval_terminated": 0.03}, 8.0, 0.5)[0]
    # the EOS rate comes with its Wilson interval: 3 of 4 -> [0.301, 0.954] (by hand: centre 0.75 + z^2/8, ...)
    ended = checks.terminated(torch.tensor([True, True, False, True]))
    assert ended["eval_terminated"] == 0.75 and [round(x, 3) for x in ended["eval_terminated_ci95"]] == [0.301, 0.954]
    exp = tiny(tmp_path, "dpo.loss_type=[sigmoid, sft]", "dpo.loss_weights=[1.0, 0.5]")
    assert exp.dpo.loss_type == ["sigmoid", "sft"] and exp.dpo.loss_weights == [1.0, 0.5]
    with pytest.raises(config.ConfigError, match="one weight per dpo.loss_type"):
        tiny(tmp_path, "dpo.loss_type=[sigmoid, sft]", "dpo.loss_weights=[1.0]")


def test_a_base_the_hub_cannot_give_is_one_line_with_what_to_do(tmp_path, monkeypatch, capsys):
    """model.name a hub id on a host without the hub (or a gated model without HF_TOKEN): transformers' OSError after
    its retries becomes one line; an OSError of the machine (an errno: a full disk) keeps its own path (faults.py)."""
    import transformers

    def unreachable(path, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in "
                      "the cached files.\nCheck your internet connection or see how to run the library in offline mode")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreachable)
    argv = ["sft", "--exp", str(TINY), f"results_dir={tmp_path}", "model.name=meta-llama/Llama-2-7b-hf",
            "memory.preflight=false"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: meta-llama/Llama-2-7b-hf: cannot load its tokenizer (We couldn't connect to 'https://huggingface.co' "
        "to load the files, and couldn't find them in the cached files.). Check the network, HF_TOKEN for a gated "
        "model, or set model.name to a local directory")
    with pytest.raises(OSError, match="No space left"):
        with models.hub_errors("x", "weights"):
            raise OSError(28, "No space left on device")
    # a judge or grader model names its own field, not model.name
    with pytest.raises(models.ModelLoadError, match=r"^org/judge: cannot load its weights \(gone\)\. Check the network, "
                                                    r"HF_TOKEN for a gated model, or set reward.grader_model to a local"):
        with models.hub_errors("org/judge", "weights", "reward.grader_model"):
            raise OSError("gone\nmore")
    from rlhf.experiment.config import ConfigError
    from rlhf.rl import rewards

    with pytest.raises(ConfigError, match=r"^reward.judge_model: cannot load 'org/judge' \(We couldn't connect to "
                                          r"'https://huggingface.co' .*\); name a local directory or a hub id this"):
        rewards.ModelJudge(models.loading(tiny(tmp_path)), "org/judge", "reward.judge_model", 8)
    (tmp_path / "judge").mkdir()  # a folder of the user's without its tokenizer: the same advice as model.name's
    with pytest.raises(ConfigError, match=r"^reward.grader_model: cannot load '.*judge' \(the folder holds none of "
                                          r"its files: .*\); save the model's tokenizer into it"):
        rewards.ModelJudge(models.loading(tiny(tmp_path)), str(tmp_path / "judge"), "reward.grader_model", 8)
