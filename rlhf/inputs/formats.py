"""The files of each data role, in TRL's formats, and Anthropic's hh-rlhf transcripts (rlhf/inputs/data.py picks and splits
them). Every record is checked and normalized to {id, prompt, chosen, rejected} (preference, eval), {id, prompt,
completion} (sft) or {id, prompt} (prompts); its other plain fields are kept as `columns` for reward functions. Bad
input fails with DataError naming the file, the line and the field: every bad record of a file in one error
(BadRecords)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import zlib
from collections import Counter
from pathlib import Path
from typing import Callable

ASSISTANT = "\n\nAssistant:"
HUMAN = "\n\nHuman:"


class DataError(ValueError):
    """Invalid dataset input; the message names the file, line and field. `kind`: the fault whatever the record
    (a missing field's name, malformed JSON's message without its column): what BadRecords groups records by."""

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        self.kind = kind


# ------------------------------------------------------------------------------------------------------------- files
ROLES = ("preference", "sft", "eval", "prompts")
FORMATS = {
    "preference": "preference {prompt, chosen, rejected} or implicit-prompt {chosen, rejected}, standard (strings) or "
                  "conversational (lists of {role, content} messages)",
    "sft": "prompt-completion {prompt, completion}, language modeling {text} or {messages}, "
           "{instruction, input, output}, or preference (the chosen side)",
    "prompts": "prompt-only {prompt} (or any record with a prompt), or {messages} ending with a user turn",
}
FORMATS["eval"] = FORMATS["preference"]
_GZIP_ERRORS = (EOFError, OSError, zlib.error)


class BadRecords:
    """A source's bad records: every one is counted and said in one DataError (`check`), so a file with several is
    mended in one pass, not one record per run. Records with the same fault (DataError.kind, else the same reason)
    are said once, at the first, with where the next few are and how many more; when a source's first SHOWN records
    are all bad (a wrong file, or a wrong data.columns), it is read no further."""

    SHOWN = 10
    """How many faults are said (the rest counted), and how many bad records with no good one stop the reading."""
    NAMED = 5
    """How many more records of a fault are named beside its first."""

    def __init__(self, source: str):
        self.source, self.n, self.good = source, 0, 0
        self.faults: dict[str, Fault] = {}

    def add(self, where: str, e: DataError) -> None:
        said = str(e)
        reason = said[len(where) + 2:] if said.startswith(f"{where}: ") else said
        fault = self.faults.setdefault(e.kind or reason, Fault(where, reason))
        if fault.count and len(fault.more) < self.NAMED:
            fault.more.append(self._short(where))
        fault.count += 1
        self.n += 1
        if self.n >= self.SHOWN and not self.good:
            self.check(stopped=True)

    def _short(self, where: str) -> str:
        """A record's place without its source: a file's line number, a hub dataset's `row i`."""
        if where.startswith(f"{self.source}:"):
            return where[len(self.source) + 1:]
        return where.split("] ", 1)[1] if where.startswith(f"{self.source}[") and "] " in where else where

    def check(self, stopped: bool = False) -> None:
        if not self.n:
            return
        if self.n == 1:
            (fault,) = self.faults.values()
            raise DataError(f"{fault.where}: {fault.reason}")
        said = [f"  {f.where}{f' and {f.count - 1} more like it ({f.named()})' if f.count > 1 else ''}: {f.reason}"
                for f in list(self.faults.values())[:self.SHOWN]]
        if len(self.faults) > self.SHOWN:
            said.append(f"  and {sum(f.count for f in list(self.faults.values())[self.SHOWN:])} more")
        head = (f"its first {self.n} records are bad, so it is read no further; check that it is the file meant and "
                f"what data.columns maps, and rerun" if stopped else f"{self.n} bad records; mend each and rerun")
        raise DataError(f"{self.source}: {head}:\n" + "\n".join(said))


@dataclasses.dataclass
class Fault:
    """One fault of a source's records (BadRecords): its first record and reason, how many records have it, and
    where the next few are."""

    where: str
    reason: str
    count: int = 0
    more: list[str] = dataclasses.field(default_factory=list)

    def named(self) -> str:
        return ", ".join(self.more) + (", ..." if self.count - 1 > len(self.more) else "")


def no_such_file(path: str, field: str = "") -> DataError:
    """A data file that is not there, named with the config `field` naming it, and the file it may have meant (the
    same name with or without .gz: hh-rlhf's files are .jsonl.gz)."""
    near = next((q for q in (f"{path}.gz", path.removesuffix(".gz")) if q != path and Path(q).is_file()), None)
    return DataError(f"{path}: no such file{f' ({field})' if field else ''}" + (f"; did you mean {near}?" if near else ""))


def read_jsonl(path: str | Path, bad: BadRecords | None = None):
    """Yield (line_number, record) from a .jsonl or .jsonl.gz file. A UTF-8 byte-order mark is skipped; malformed
    JSON, invalid UTF-8 and a truncated or corrupt gzip raise DataError naming the file and line, or, given `bad`,
    are added to it (the file is read on past the line; a broken gzip ends it). A first line that is not UTF-8 (a
    file in another encoding, or compressed) fails the file at once."""
    path = Path(path)
    if not path.exists():
        raise no_such_file(str(path))
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a .jsonl or .jsonl.gz file")

    def fail(where: str, e: DataError) -> None:
        if bad is None:
            raise e
        bad.add(where, e)

    opener = gzip.open if path.suffix == ".gz" else open
    n, i = 0, 0
    with opener(path, "rb") as f:
        lines = iter(f)
        while True:
            try:
                raw = next(lines)
            except StopIteration:
                break
            except _GZIP_ERRORS as e:
                fail(f"{path}:{i + 1}", DataError(f"{path}:{i + 1}: truncated or corrupt gzip ({_one_line(e)})"))
                break
            i += 1
            if i == 1 and raw.startswith(b"\xef\xbb\xbf"):  # byte-order mark
                raw = raw[3:]
            try:
                line = raw.decode("utf-8").rstrip("\r\n")  # a line cut short ends in its string, not in a newline
            except UnicodeDecodeError as e:
                what = (" (it is gzip-compressed: name it .jsonl.gz)" if raw.startswith(b"\x1f\x8b") else
                        " (it is UTF-16: save it as UTF-8)" if raw.startswith((b"\xff\xfe", b"\xfe\xff")) else
                        " (the file is not UTF-8: save it as UTF-8)" if i == 1 else "")
                error = DataError(f"{path}:{i}: invalid UTF-8 (byte {e.start + 1} of the line){what}", "invalid UTF-8")
                if i == 1:
                    raise error from None
                fail(f"{path}:{i}", error)
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                at = e.msg if e.msg.endswith(" at") else f"{e.msg} at"  # json's "Invalid control character at"
                fail(f"{path}:{i}", DataError(
                    f"{path}:{i}: malformed JSON ({at} column {e.colno}); each line holds one whole JSON object: a "
                    f"line cut short, or a newline or tab typed inside a string (JSON writes them \\n, \\t), "
                    f"breaks it", f"malformed JSON: {e.msg}"))
                continue
            if not isinstance(rec, dict):
                fail(f"{path}:{i}", DataError(f"{path}:{i}: expected a JSON object, got {type(rec).__name__}"))
                continue
            n += 1
            yield i, rec
    if n == 0 and not (bad and bad.n):
        raise DataError(f"{path}: empty dataset (no records)")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def _field(rec: dict, name: str, where: str, required: bool = True) -> str:
    if name not in rec:
        if not required:
            return ""
        present = ", ".join(sorted(map(str, rec))) or "none"
        raise DataError(f"{where}: missing field '{name}' (fields present: {present})", f"missing field '{name}'")
    value = rec[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{name}' must be a string, got {type(value).__name__}")
    return value


EMPTY = "; give it text, or remove the record"
"""What to do about an empty field, said after it."""


def _text_or_messages(rec: dict, name: str, where: str, nonempty: bool = True):
    """A field that is a string (standard) or a list of {role, content} messages (conversational)."""
    value = rec[name]
    if isinstance(value, str):
        if nonempty and not value.strip():
            raise DataError(f"{where}: field '{name}' is empty{EMPTY}")
        return value
    if isinstance(value, list):
        if not value:
            raise DataError(f"{where}: field '{name}' is an empty list of messages")
        if nonempty and all(isinstance(m, dict) and isinstance(m.get("content"), str) and not m["content"].strip()
                            for m in value):  # as empty as "" is in the standard format
            raise DataError(f"{where}: field '{name}' is empty (its messages have no content){EMPTY}")
        for j, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: field '{name}'[{j}] must be a message {{role: str, content: str}}, "
                                f"got {_short(m)}")
            if m["role"] not in ROLES_CHAT:
                raise DataError(f"{where}: field '{name}'[{j}] has role '{_short(m['role'])}' "
                                f"(expected one of {', '.join(ROLES_CHAT)})")
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(f"{where}: field '{name}' must be a string or a list of messages, got {type(value).__name__}")


ROLES_CHAT = ("system", "user", "assistant", "tool")


def _short(v) -> str:
    s = json.dumps(v, ensure_ascii=True) if not isinstance(v, str) else v
    s = " ".join(s.split())
    return s if len(s) <= 60 else s[:57] + "..."


def _is_conv(v) -> bool:
    return isinstance(v, list)


def _common_prefix_text(a: str, b: str) -> str:
    """The longest common prefix, cut back to a word boundary (the implicit prompt of standard preference records)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    prefix = a[:n]
    # cut inside a word, or one string the start of the other (it would have no response: its last word is it)
    if prefix and (n == min(len(a), len(b)) or not prefix[-1].isspace()):
        body = prefix.rstrip()  # a space or newline it ends with is no word boundary to cut at
        cut = max(body.rfind(" "), body.rfind("\n"))
        prefix = body[: cut + 1] if cut >= 0 else ""
    return prefix.rstrip()  # the whitespace before the responses belongs to them (" Yes", as in hh-rlhf)


def missing(where: str, name: str, rec: dict, expected: str) -> DataError:
    """A record without a field its format needs: what it has, what was expected, and the mapping that renames."""
    return DataError(f"{where}: missing field '{name}' (fields present: {', '.join(sorted(map(str, rec))) or 'none'}; "
                     f"expected {expected}); a file that names it otherwise maps it with data.columns={{<its name>: "
                     f"{name}}}", f"missing field '{name}'")


def _preference(rec: dict, where: str) -> dict:
    for k in ("chosen", "rejected"):
        if k not in rec:
            raise missing(where, k, rec, FORMATS["preference"])
    chosen, rejected = _text_or_messages(rec, "chosen", where), _text_or_messages(rec, "rejected", where)
    if _is_conv(chosen) != _is_conv(rejected):
        raise DataError(f"{where}: fields 'chosen' and 'rejected' must both be strings or both be message lists")
    prompt = _text_or_messages(rec, "prompt", where) if rec.get("prompt") is not None else None
    if _is_conv(chosen):
        if isinstance(prompt, str) and chosen[0]["role"] != "assistant":
            prompt = None  # e.g. HuggingFaceH4/ultrafeedback_binarized: the prompt is also inside chosen/rejected
        elif isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if prompt is None:  # implicit prompt: the messages chosen and rejected share
            n = 0
            while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
                n += 1
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
            if not prompt:
                raise DataError(f"{where}: fields 'chosen' and 'rejected' share no prompt messages (and there is "
                                f"no 'prompt' field)")
        for k, v in (("chosen", chosen), ("rejected", rejected)):
            if v[0]["role"] != "assistant":
                raise DataError(f"{where}: field '{k}': the response must start with an assistant message, "
                                f"got role '{v[0]['role']}'")
    else:
        if _is_conv(prompt):
            raise DataError(f"{where}: field 'prompt' is a message list but 'chosen'/'rejected' are strings")
        if prompt is None and chosen == rejected:  # nothing apart to prefer: skipped as identical (_kept)
            return {"prompt": chosen, "chosen": "", "rejected": ""}
        if prompt is None:
            prompt = _common_prefix_text(chosen, rejected)
            if not prompt.strip() and chosen != rejected:
                raise DataError(f"{where}: fields 'chosen' and 'rejected' share no prompt (and there is no 'prompt' "
                                f"field)")
            chosen, rejected = chosen[len(prompt):], rejected[len(prompt):]
            for k, v, other in (("chosen", chosen, "rejected"), ("rejected", rejected, "chosen")):
                if not v.strip():
                    raise DataError(f"{where}: field '{k}' is empty once the prompt it shares with '{other}' is "
                                    f"taken out (no 'prompt' field: the shared start is the prompt); give the prompt "
                                    f"as its own field")
    if not prompt:
        raise DataError(f"{where}: field 'prompt' is empty{EMPTY}")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _split_messages(messages: list, where: str, name: str = "messages") -> tuple[list, list]:
    """A conversation ending with an assistant turn -> (prompt messages, [final assistant message])."""
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: field '{name}' must hold a prompt and end with an assistant message")
    return messages[:-1], messages[-1:]


def _sft(rec: dict, where: str) -> dict:
    if "completion" in rec and "prompt" in rec:
        prompt = _text_or_messages(rec, "prompt", where)
        completion = _text_or_messages(rec, "completion", where)
        if _is_conv(prompt) != _is_conv(completion):
            raise DataError(f"{where}: fields 'prompt' and 'completion' must both be strings or both message lists")
        if _is_conv(completion) and completion[0]["role"] != "assistant":
            raise DataError(f"{where}: field 'completion' must start with an assistant message")
        return {"prompt": prompt, "completion": completion}
    if "messages" in rec:
        messages = _text_or_messages(rec, "messages", where)
        if not _is_conv(messages):
            raise DataError(f"{where}: field 'messages' must be a list of messages, got str")
        prompt, completion = _split_messages(messages, where)
        return {"prompt": prompt, "completion": completion}
    if "text" in rec:
        text = _text_or_messages(rec, "text", where)
        if _is_conv(text):
            raise DataError(f"{where}: field 'text' must be a string (use 'messages' for a conversation)")
        return {"prompt": "", "completion": text}
    if "instruction" in rec or "output" in rec:
        instruction, extra = _field(rec, "instruction", where), _field(rec, "input", where, required=False)
        output = _field(rec, "output", where)
        for name, value in (("instruction", instruction), ("output", output)):
            if not value.strip():
                raise DataError(f"{where}: field '{name}' is empty{EMPTY}")
        human = instruction + (f"\n\n{extra}" if extra else "")
        return {"prompt": f"{HUMAN} {human}{ASSISTANT}", "completion": " " + output}
    if "chosen" in rec:
        pair = _preference(rec, where)
        return {"prompt": pair["prompt"], "completion": pair["chosen"]}
    raise DataError(f"{where}: no SFT format matches (fields present: {', '.join(sorted(map(str, rec))) or 'none'}; "
                    f"expected {FORMATS['sft']}); a file that names them otherwise maps them with "
                    f"data.columns={{<its name>: prompt, <its name>: completion}}", "no SFT format")


def _prompt_only(rec: dict, where: str) -> dict:
    if "prompt" in rec:
        return {"prompt": _text_or_messages(rec, "prompt", where)}
    if "messages" in rec:
        messages = _text_or_messages(rec, "messages", where)
        if not _is_conv(messages) or messages[-1]["role"] != "user":
            raise DataError(f"{where}: field 'messages' must be a list of messages ending with a user message")
        return {"prompt": messages}
    if "chosen" in rec:
        return {"prompt": _preference(rec, where)["prompt"]}
    raise missing(where, "prompt", rec, FORMATS["prompts"])


PARSERS = {"preference": _preference, "eval": _preference, "sft": _sft, "prompts": _prompt_only}


def id_names(paths: list[str]) -> dict[str, str]:
    """The name each file's record ids start with (`<name>:<line>`): its file name, or, where files of one data
    section share a name (hh-rlhf's subsets are each `train.jsonl.gz`), as many of its last path parts as tell them
    apart, so no two records share an id (the judge's, SFT's and the held-out rows are told apart by id)."""
    parts = {p: Path(p).parts for p in dict.fromkeys(paths)}
    names = {}
    for p, own in parts.items():
        k = 1
        while k < len(own) and any(q != p and other[-k:] == own[-k:] for q, other in parts.items()):
            k += 1
        names[p] = "/".join(own[-k:])
    return names


def _records(path: str, split: str, field: str = "", name: str | None = None, bad: BadRecords | None = None):
    """(id, where, record) from a local .jsonl(.gz) file (ids named `name`, else the file's name: id_names; its bad
    lines added to `bad`), or from `datasets.load_dataset(path, split=split)` for a hub id or a local dataset
    directory. A local file that is not there is named with the config `field` naming it."""
    p = Path(path)
    if p.is_file() or (not p.exists() and (path.endswith((".jsonl", ".gz", ".json")) or path.startswith(("/", ".")))):
        if field and not p.exists():
            raise no_such_file(path, field)
        for i, rec in read_jsonl(p, bad):
            yield f"{name or p.name}:{i}", f"{path}:{i}", rec
        return
    for i, rec in enumerate(hub_dataset(path, split)):
        yield f"{path}:{split}:{i}", f"{path}[{split}] row {i}", rec


def hub_dataset(path: str, split: str):
    """`datasets.load_dataset(path, split=split)`: a hub id (needs network or the local hub cache) or a local dataset
    directory; any failure, or no record, is a DataError in one line."""
    try:
        import datasets

        ds = datasets.load_dataset(path, split=split)
    except Exception as e:  # noqa: BLE001 - any loader failure is a data error for the user
        raise DataError(f"{path}: cannot load dataset split '{split}' ({type(e).__name__}: {_one_line(e)}); without "
                        f"the hub, point the data section at local .jsonl files") from None
    if len(ds) == 0:
        raise DataError(f"{path}[{split}]: empty dataset (no records)")
    return ds


def load_file(path: str, role: str, split: str = "train", columns: dict | None = None,
              parse: Callable[[dict, str], dict] | None = None, field: str = "", name: str | None = None
              ) -> tuple[list[dict], Skipped]:
    """Records of one file (or hub dataset) for a role (see FORMATS), normalized to {id, prompt, chosen, rejected}
    (preference, eval), {id, prompt, completion} (sft) or {id, prompt} (prompts); fields are strings (standard) or
    message lists (conversational, rendered later with the tokenizer's chat template). `parse(record, where)`: a
    stage's own format instead of the role's (a normalized row, or DataError naming `where` and the field). Preference
    pairs whose chosen equals rejected, and exact duplicates, are counted in the returned Skipped and skipped.
    `field`: the config key that names `path` (a missing file says it); `name`: what its ids start with (id_names)."""
    parse = parse or PARSERS[role]
    skipped = Skipped()
    seen: set[str] = set()
    out = []
    kinds: dict[bool, list[str]] = {}  # conversational or not -> where its records are
    bad = BadRecords(path)
    for rid, where, rec in _records(path, split, field, name, bad):
        if columns:
            rec = {columns.get(k, k): v for k, v in rec.items()}
        try:
            row = parse(rec, where)
        except DataError as e:
            bad.add(where, e)
            continue
        bad.good += 1
        conv = any(isinstance(row.get(k), list) for k in ("prompt", "chosen", "completion"))
        kinds.setdefault(conv, []).append(where)
        extra = {k: v for k, v in rec.items() if k not in FIELDS and k not in row and _plain(v)}
        if extra:  # the record's other fields (an answer key, say): reward functions get them as columns
            row["columns"] = extra
        if _kept(row, seen, skipped, where):
            out.append({"id": rid, **row})
    if len(kinds) == 2:  # a file holds one format, as a TRL dataset's column has one type: the fewer are bad
        few = min(kinds, key=lambda c: (len(kinds[c]), -list(kinds).index(c)))  # the fewer; of as many, the later
        names, other = ("standard (strings)", "conversational (message lists)"), kinds[not few]
        for where in kinds[few]:
            bad.add(where, DataError(f"{where}: {names[few]}, but {len(other)} {'is' if len(other) == 1 else 'are'} "
                                     f"{names[not few]} (the first: {other[0]}): one file holds one format (a TRL "
                                     f"dataset's column has one type); convert the rows of the other", "one format"))
    bad.check()
    if not out:
        raise DataError(f"{path}: empty dataset (no usable records; skipped: {dict(skipped) or 'none'})")
    return out, skipped


FIELDS = {"prompt", "chosen", "rejected", "completion", "text", "messages", "instruction", "input", "output"}


def _plain(v) -> bool:
    """A JSON scalar, or a list of them: what a record may pass on to reward functions."""
    return v is None or isinstance(v, (str, int, float, bool)) or (isinstance(v, list) and all(map(_plain, v)))


def jsonl_pairs(path: str) -> list[dict]:
    return load_file(path, "preference")[0]


def jsonl_sft(path: str) -> list[dict]:
    return load_file(path, "sft")[0]


# ----------------------------------------------------------------------------------------------------------- hh-rlhf
_TURN = re.compile(r"\n\n(Human|Assistant):")


class Skipped(Counter):
    """The records a loader skipped, counted by reason, and where the first of each was (`at`: {reason: file:line});
    `+=` keeps each reason's first place."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.at: dict[str, str] = {}

    def add(self, reason: str, where: str) -> None:
        self[reason] += 1
        self.at.setdefault(reason, where)

    def __iadd__(self, other):
        super().__iadd__(other)
        for reason, where in getattr(other, "at", {}).items():
            self.at.setdefault(reason, where)
        return self

    def renamed(self, rename) -> "Skipped":
        """The same counts and places under the reasons `rename(reason)` gives."""
        out = Skipped({rename(k): v for k, v in self.items()})
        out.at = {rename(k): v for k, v in self.at.items()}
        return out


def _kept(row: dict, seen: set, skipped: Skipped, where: str) -> bool:
    """False (and counted in `skipped`, at `where`) for a pair whose chosen equals its rejected, or a row seen
    before."""
    if "rejected" in row and row["chosen"] == row["rejected"]:
        skipped.add("identical chosen and rejected", where)
        return False
    key = json.dumps(row, sort_keys=True)
    if key in seen:
        skipped.add("duplicate", where)
        return False
    seen.add(key)
    return True


def split_hh(chosen: str, rejected: str) -> tuple[dict | None, str | None]:
    """Split an hh-rlhf pair into the shared multi-turn prompt (up to and including the final "\\n\\nAssistant:")
    and the two final responses. Returns (pair, None) or (None, reason) for a record that does not fit."""
    cut = chosen.rfind(ASSISTANT)
    if cut < 0:
        return None, "no assistant turn"
    prompt = chosen[: cut + len(ASSISTANT)]
    if not rejected.startswith(prompt):
        return None, "no shared prompt"
    c, r = chosen[len(prompt):], rejected[len(prompt):]
    if _TURN.search(r):
        return None, "no shared prompt"  # rejected continues past the chosen's last turn
    roles = _TURN.findall(prompt)
    if not prompt.startswith(HUMAN) or any(a == b for a, b in zip(roles, roles[1:])) or roles[-1] != "Assistant":
        return None, "non-alternating turns"
    if not c.strip() or not r.strip():
        return None, "empty response"
    return {"prompt": prompt, "chosen": c, "rejected": r}, None


def hh_paths(path: str) -> list[str]:
    """The files (or hub ids) of a comma-separated data.path."""
    return [s.strip() for s in path.split(",") if s.strip()]


def hh_pairs(path: str, names: dict[str, str] | None = None, field: str = "data.path",
             split: str = "train") -> tuple[list[dict], Skipped]:
    """Local .jsonl(.gz) files (comma separated; each file's ids named as `names` says, else by id_names over them)
    or a hub id's `split` (needs network). A local file that is not there is named with the config `field` naming
    it."""
    skipped = Skipped()
    seen: set[str] = set()
    out = []
    names = names or id_names(hh_paths(path))
    for p in hh_paths(path):
        bad = BadRecords(p)
        if Path(p).exists() or p.endswith((".jsonl", ".gz")):
            if not Path(p).exists():
                raise no_such_file(p, field)
            rows = ((f"{names[p]}:{i}", f"{p}:{i}", rec) for i, rec in read_jsonl(p, bad))
        else:  # hub loading: the real path on a networked host
            at = "" if split == "train" else f"{split}:"  # the pool's train ids as they were
            rows = ((f"{p}:{at}{i}", f"{p}[{split}] row {i}", rec) for i, rec in enumerate(hub_dataset(p, split)))
        for rid, where, rec in rows:
            try:
                chosen, rejected = _field(rec, "chosen", where), _field(rec, "rejected", where)
            except DataError as e:
                bad.add(where, DataError(f"{e}: an hh-rlhf record is two transcripts, 'chosen' and 'rejected' (\\n\\n"
                                         f"Human: ... \\n\\nAssistant: ...); records of another format load with "
                                         f"data.source: jsonl (docs/data.md)", e.kind))
                continue
            bad.good += 1
            pair, reason = split_hh(chosen, rejected)
            if pair is None:
                skipped.add(reason, where)
                continue
            if _kept(pair, seen, skipped, where):
                out.append({"id": rid, **pair})
        bad.check()
    return out, skipped
