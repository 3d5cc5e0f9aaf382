import gzip
import json
import subprocess
import sys

import pytest

from rlhf.inputs import data, formats, models
from rlhf.inputs.data import DataError

from .conftest import HH_FILE, ROOT, TINY, tiny


def test_gt_reward_by_hand():
    prompt = data.synthetic_prompt(["a", "c"])
    assert data.gt_reward(prompt, " a c a c") == 1.0
    assert data.gt_reward(prompt, " a b c d e") == pytest.approx((2 - 3) / 5)
    assert data.gt_reward(prompt, " a") == pytest.approx(1 / 4)  # shorter than min_len: scored as if 4 long
    assert data.gt_reward(prompt, "") == 0.0


def test_synthetic_pairs_are_deterministic_and_ordered_by_ground_truth(tmp_path):
    exp = tiny(tmp_path)
    a, b = data.load(exp), data.load(exp)
    assert a.train == b.train and a.eval == b.eval
    assert {r["id"] for r in a.train}.isdisjoint({r["id"] for r in a.eval}) and len(a.eval) == 200
    for r in a.train[:300]:
        assert data.gt_reward(r["prompt"], r["chosen"]) > data.gt_reward(r["prompt"], r["rejected"])
    other = data.load(tiny(tmp_path, "seed=1"))
    assert other.eval != a.eval


def test_hh_split_by_hand():
    p = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant:"
    pair, why = formats.split_hh(p + " fine", p + " bad")
    assert why is None and pair == {"prompt": p, "chosen": " fine", "rejected": " bad"}
    assert formats.split_hh(p + " ", p + " bad") == (None, "empty response")
    assert formats.split_hh("\n\nHuman: a\n\nAssistant: x", "\n\nHuman: b\n\nAssistant: y") == (None, "no shared prompt")
    twice = "\n\nHuman: a\n\nHuman: b\n\nAssistant:"
    assert formats.split_hh(twice + " x", twice + " y") == (None, "non-alternating turns")


@pytest.mark.skipif(not HH_FILE.exists(), reason="../shared/data/hh-rlhf is absent")
def test_hh_loader_on_the_real_file():
    rows, skipped = formats.hh_pairs(str(HH_FILE))
    assert len(rows) == 2299
    assert dict(skipped) == {"empty response": 4, "non-alternating turns": 4, "no shared prompt": 5}
    assert skipped.at == {"empty response": f"{HH_FILE}:87", "non-alternating turns": f"{HH_FILE}:668",
                          "no shared prompt": f"{HH_FILE}:1255"}  # where the first of each is, to look at
    assert len(rows) + sum(skipped.values()) == 2312
    for r in rows:
        assert r["prompt"].endswith("\n\nAssistant:") and r["chosen"].strip() and r["rejected"].strip()
        assert "\n\nHuman:" not in r["chosen"] and "\n\nHuman:" not in r["rejected"]


@pytest.mark.skipif(not HH_FILE.exists(), reason="../shared/data/hh-rlhf is absent")
def test_hh_experiment_splits_the_real_file(tmp_path):
    exp = tiny(tmp_path, "data.source=hh-rlhf", f"data.path={HH_FILE}", "data.eval_examples=100")
    s = data.load(exp)
    assert len(s.eval) == 100 and len(s.train) == 2199 and sum(s.skipped.values()) == 13


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_bad_jsonl_names_file_line_and_field(tmp_path):
    good = json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"})
    with pytest.raises(DataError, match=r"bad.jsonl:2: malformed JSON"):
        formats.jsonl_pairs(str(_write(tmp_path / "bad.jsonl", [good, '{"prompt": "p",'])))
    with pytest.raises(DataError, match=r"miss.jsonl:3: missing field 'rejected'"):
        formats.jsonl_pairs(str(_write(tmp_path / "miss.jsonl", [good, good, json.dumps({"prompt": "p", "chosen": "c"})])))
    with pytest.raises(DataError, match=r"type.jsonl:1: field 'chosen' must be a string or a list of messages, got int"):
        formats.jsonl_pairs(str(_write(tmp_path / "type.jsonl", [json.dumps({"prompt": "p", "chosen": 3, "rejected": "r"})])))
    with pytest.raises(DataError, match=r"empty.jsonl: empty dataset"):
        formats.jsonl_pairs(str(_write(tmp_path / "empty.jsonl", [])))
    ctl = '{"prompt": "p\x01", "chosen": "c", "rejected": "r"}'  # json's message ends in " at" itself
    with pytest.raises(DataError, match=r"ctl.jsonl:1: malformed JSON \(Invalid control character at column 14\); each "
                                        r"line holds one whole JSON object: a line cut short, or a newline or tab typed "
                                        r"inside a string \(JSON writes them \\n, \\t\), breaks it$"):
        formats.jsonl_pairs(str(_write(tmp_path / "ctl.jsonl", [ctl])))
    ok = _write(tmp_path / "ok.jsonl", [good, json.dumps({"prompt": "q", "chosen": "c", "rejected": "r"})])
    for key in ("path", "eval_path", "prompts_path"):  # a file that is not there names the key that names it
        with pytest.raises(DataError, match=rf"^{tmp_path}/gone.jsonl: no such file \(data.{key}\)$"):
            data.load(tiny(tmp_path, "data.source=jsonl", f"data.path={ok}", "data.eval_examples=1",
                           f"data.{key}={tmp_path / 'gone.jsonl'}"))
    with pytest.raises(DataError, match=r"sft.jsonl:1: missing field 'output'"):
        formats.jsonl_sft(str(_write(tmp_path / "sft.jsonl", [json.dumps({"instruction": "do"})])))


def test_gz_and_generic_sft_format(tmp_path):
    path = tmp_path / "sft.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"instruction": "Say hi", "input": "politely", "output": "Hello"}) + "\n")
    (row,) = formats.jsonl_sft(str(path))
    assert row["prompt"] == "\n\nHuman: Say hi\n\npolitely\n\nAssistant:" and row["completion"] == " Hello"


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "p", "chosen": "c"'], "malformed JSON"),
    (['{"prompt": "p", "chosen": "c"}'], "missing field 'rejected'"),
    ([], "empty dataset"),
])
def test_cli_bad_data_is_one_line_before_any_model(tmp_path, lines, message):
    path = _write(tmp_path / "d.jsonl", lines)
    out = subprocess.run([sys.executable, "-m", "rlhf", "sft", "--exp", str(TINY), f"results_dir={tmp_path}/r",
                          "data.source=jsonl", f"data.path={path}"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: ") and out.stderr.strip().count("\n") == 0 and message in out.stderr
    assert not (tmp_path / "r").exists()  # failed before a run record (or a model) was made


def test_sft_from_the_pool_never_trains_on_the_judges_pairs():
    """The judge's pairs (data.judge_fraction of the pool's first pref_pairs) are left out of SFT's examples, which
    still number data.sft_examples (the synthetic pool is drawn that much larger); an SFT file is taken as given."""
    from rlhf.experiment import config

    exp = config.load(TINY, ["data.sft_examples=300", "data.pref_pairs=200", "data.ppo_prompts=100",
                             "data.eval_examples=50", "data.judge_fraction=0.25"])
    train, _, splits = data.load_sft(exp)
    _, judge = data.judge_split(splits.pairs(200), 0.25, exp.seed)
    assert len(judge) == 50 and len(train) == 300
    assert not {r["id"] for r in train} & {p["id"] for p in judge}
    assert {p["id"] for p in judge} <= {r["id"] for r in splits.train[:350]}  # they were in SFT's reach
    none = config.load(TINY, ["data.sft_examples=300", "data.pref_pairs=200", "data.eval_examples=50",
                              "data.judge_fraction=0"])
    assert len(data.load_sft(none)[0]) == 300


def test_an_sft_file_made_from_the_same_pairs_is_said_to_train_on_what_grades_it(tmp_path):
    """A user's SFT file holding the prompt and chosen response of every pair of data.path (and of the held-out file):
    SFT trains on the judge's pairs and the held-out ones, which SFT from the pool leaves out; each said once, with
    the count and what to do. A file of other examples says nothing, nor does SFT from the pool."""
    pairs = [{"prompt": f"ask q{i}", "chosen": f" good{i} yes", "rejected": f" bad{i} no"} for i in range(100)]
    path, held, sft_file = tmp_path / "pairs.jsonl", tmp_path / "eval.jsonl", tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in pairs[:80]))
    held.write_text("".join(json.dumps(r) + "\n" for r in pairs[80:]))
    sft_file.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["chosen"] + " "}) + "\n"
                                for r in pairs))
    base = ["data.source=jsonl", f"data.path={path}", f"data.eval_path={held}", "data.sft_examples=100",
            "data.pref_pairs=80", "data.eval_examples=20", "data.judge_fraction=0.25"]
    _, _, splits = data.load_sft(tiny(tmp_path, *base, f"data.sft_path={sft_file}"))
    assert splits.repeats == [
        "sft: 20 of the 100 training examples of data.sft_path are held-out pairs' prompt and chosen response (20 "
        "held-out pairs): the held-out checks then grade responses SFT learned by heart; leave them out of "
        "data.sft_path, or unset it (SFT then takes the chosen side of data.path's pairs less those)",
        "sft: 20 of the 100 training examples of data.sft_path are judge pairs' prompt and chosen response (20 judge "
        "pairs): the judge, fit on those pairs apart so that it grades what no stage trained on, then grades "
        "responses SFT learned; leave them out of data.sft_path, or unset it (SFT then takes the chosen side of "
        "data.path's pairs less those)"]
    sft_file.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": " other"}) + "\n" for r in pairs))
    assert data.load_sft(tiny(tmp_path, *base, f"data.sft_path={sft_file}"))[2].repeats == []
    assert data.load_sft(tiny(tmp_path, *base, "data.sft_examples=40"))[2].repeats == []


def test_the_tiny_tokenizer_knows_every_word_of_every_row_any_stage_reads(tmp_path):
    """SFT trains on part of the pool; the other pairs' prompts and chosen responses have words of their own: the
    tokenizer built from the data knows every word of every pair, on both sides (a word lost to <unk> on the chosen
    side alone would tell the reward model, DPO and the judge which side is chosen), and the words of the texts it
    always took keep their ids (a task whose SFT rows hold every word trains as before), and every id has its row."""
    from rlhf.recipes import sft

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"ask q{i} now", "chosen": f" good{i} yes",
                                        "rejected": f" bad{i} no"}) + "\n" for i in range(80)))
    exp = tiny(tmp_path, "data.source=jsonl", f"data.path={path}", "data.sft_examples=10", "data.pref_pairs=60",
               "data.eval_examples=10", "data.judge_fraction=0.2")
    train_rows, eval_rows, splits = data.load_sft(exp)
    assert len(train_rows) == 10 and len(splits.train + splits.eval) == 80

    def texts(groups):
        return ["".join(r[f] for f in fields) for rows, fields in groups for r in rows]

    first, more = sft.vocabulary(train_rows, eval_rows, splits)
    tok = models.build_tokenizer(texts(first), texts(more))
    for r in splits.train + splits.eval:
        for f in ("prompt", "chosen", "rejected"):
            assert tok.unk_token_id not in tok(r[f], add_special_tokens=False)["input_ids"], (r["id"], f, r[f])
    before = models.build_tokenizer(texts(first)).get_vocab()
    assert {w: tok.get_vocab()[w] for w in before} == before and len(tok.get_vocab()) > len(before)
    # one id each, 0 to len - 1: the tiny base's embedding has len(tok) rows (the appended words once took every
    # other id, past the rows: the judge's batch, the first to read them, failed in the embedding on real data)
    assert sorted(tok.get_vocab().values()) == list(range(len(tok)))


def test_a_word_before_a_special_token_is_learned_alone():
    """Rendered chat rows put </s> right after the last word (`here.</s><|assistant|>`): the vocabulary is built with
    the special tokens split out, as encoding splits them, so `.` and `?` are words of their own (they were learned
    as `.</` and `?</`, and encoded as <unk>), in the texts and in `more` alike."""
    tok = models.build_tokenizer(["<|user|> Where is it?</s><|assistant|> It is here.</s>"], ["Bring it!</s>"])
    vocab = tok.get_vocab()
    assert {".", "?", "!", "<|", "|>"} <= set(vocab) and not any("</" in w and w != "</s>" for w in vocab)
    ids = tok("<|user|> Where is it?</s><|assistant|> Bring it!</s>")["input_ids"]
    assert tok.unk_token_id not in ids and tok.convert_ids_to_tokens(ids)[-3:] == ["it", "!", "</s>"]


def _hh(prompt: str, chosen: str, rejected: str) -> str:
    return json.dumps({"chosen": f"\n\nHuman: {prompt}\n\nAssistant: {chosen}",
                       "rejected": f"\n\nHuman: {prompt}\n\nAssistant: {rejected}"}) + "\n"


def test_hh_subsets_of_one_file_name_keep_every_record_apart_and_a_held_out_file_is_split_as_hh(tmp_path):
    """hh-rlhf's subsets are each `test.jsonl.gz`: two of them in data.path give every record its own id (before, the
    second file's ids were the first's, and SFT dropped the rows whose id matched a judge pair's); an hh-rlhf file as
    data.eval_path is split at its last assistant turn, as the pool is (not at the two responses' common prefix,
    which ends inside a response that starts alike, and keeps malformed records)."""
    paths = []
    for subset in ("harmless-base", "helpful-base"):
        (tmp_path / subset).mkdir()
        paths.append(tmp_path / subset / "test.jsonl.gz")
        with gzip.open(paths[-1], "wt") as f:
            f.writelines(_hh(f"{subset} question {i}?", f"Sure, yes {i}.", f"Sure, no {i}.") for i in range(30))
    held = tmp_path / "held" / "test.jsonl.gz"
    held.parent.mkdir()
    with gzip.open(held, "wt") as f:
        f.writelines(_hh(f"held {i}?", f"Sure, fine {i}.", f"Sure, bad {i}.") for i in range(12))
        f.write(json.dumps({"chosen": "\n\nHuman: hi\n\nAssistant: ", "rejected": "\n\nHuman: hi\n\nAssistant: x"}))
    exp = tiny(tmp_path, "data.source=hh-rlhf", f"data.path={paths[0]},{paths[1]}", f"data.eval_path={held}",
               "data.eval_examples=10", "data.sft_examples=20", "data.pref_pairs=40", "data.ppo_prompts=20")
    splits = data.load(exp)
    ids = [r["id"] for r in splits.train]
    assert len(ids) == len(set(ids)) == 60
    assert {i.rsplit(":", 1)[0] for i in ids} == {"harmless-base/test.jsonl.gz", "helpful-base/test.jsonl.gz"}
    assert len(splits.eval) == 10 and all(r["prompt"].endswith("\n\nAssistant:") for r in splits.eval)
    assert all(r["chosen"].startswith(" Sure, fine") for r in splits.eval)
    assert splits.skipped == {"eval: empty response": 1} and splits.skipped.at == {"eval: empty response": f"{held}:13"}
    sft_rows, _, _ = data.load_sft(exp)
    assert len(sft_rows) == 20
    for key in ("path", "eval_path"):  # a misspelt file: named with the key that names it, as jsonl's are
        with pytest.raises(DataError, match=rf"^{tmp_path}/tset.jsonl.gz: no such file \(data.{key}\)$"):
            data.load(tiny(tmp_path, "data.source=hh-rlhf", f"data.path={paths[0]}",
                           f"data.{key}={tmp_path}/tset.jsonl.gz"))
    without_gz = str(held).removesuffix(".gz")  # hh-rlhf's files are .jsonl.gz: the one meant is named
    with pytest.raises(DataError, match=rf"^{without_gz}: no such file \(data.path\); did you mean {held}\?$"):
        data.load(tiny(tmp_path, "data.source=hh-rlhf", f"data.path={without_gz}"))


def test_an_hh_hub_held_out_split_is_read_from_data_eval_split(tmp_path, monkeypatch):
    """data.eval_path naming the hub's hh-rlhf reads data.eval_split (test), not the pool's train split: held-out rows
    that SFT trained on would grade nothing."""
    from rlhf.inputs import formats

    def hub(path, split):
        tag = {"train": "pool", "test": "held"}[split]
        return [json.loads(_hh(f"{tag} {i}?", f"yes {i}", f"no {i}")) for i in range(60)]

    monkeypatch.setattr(formats, "hub_dataset", hub)
    exp = tiny(tmp_path, "data.source=hh-rlhf", "data.path=Anthropic/hh-rlhf", "data.eval_path=Anthropic/hh-rlhf",
               "data.eval_examples=10", "data.sft_examples=20", "data.pref_pairs=30", "data.ppo_prompts=20")
    splits = data.load(exp)
    assert all("held" in r["prompt"] for r in splits.eval) and all("pool" in r["prompt"] for r in splits.train)
    assert {r["id"].rsplit(":", 2)[1] for r in splits.eval} == {"test"} and not {r["id"] for r in splits.eval} & {
        r["id"] for r in splits.train}
