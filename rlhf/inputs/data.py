"""Datasets: every loader returns plain dicts with `id`, `prompt`, `chosen`, `rejected` (preference pairs),
`id`, `prompt`, `completion` (SFT) or `id`, `prompt` (prompt-only).

Sources of the preference pool:
- synthetic: an offline task with a programmatic ground-truth reward (`gt_reward`), the default;
- hh-rlhf: Anthropic's transcripts from the hub or local .jsonl/.jsonl.gz, split into shared prompt + two responses;
- jsonl / hub: a local .jsonl(.gz) file, a local dataset directory or a hub dataset id in one of TRL's formats.
Files per role: data.path (preference pairs), data.sft_path (SFT), data.eval_path (held-out pairs, otherwise a
seeded split of the pool), data.prompts_path (prompt-only, for PPO). TRL's formats, standard (strings) or
conversational (lists of {role, content} messages): language modeling {text} / {messages}, prompt-only {prompt},
prompt-completion {prompt, completion}, preference {prompt, chosen, rejected} or with the prompt implicit in
{chosen, rejected}. Conversational records are rendered with the tokenizer's chat template (`render`), once the
tokenizer is known (the files and their formats: rlhf/inputs/formats.py). Bad input fails with DataError naming file, line
and field, before any model is loaded. The synthetic task brings its ground truth as a reward function
(`letters_reward`) and an answer column (`letters`).
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass, field
from pathlib import Path

from rlhf.experiment.config import DataConfig, Experiment
from rlhf.inputs.formats import (ASSISTANT, HUMAN, DataError, Skipped, _is_conv, hh_pairs, hh_paths, id_names,
                                 load_file)

@dataclass
class Splits:
    """Held-out `eval` pairs and the pool the training subsets are drawn from, with what was skipped and why.
    `sft_rows` / `prompt_rows`: the SFT file's examples and the prompt-only file's prompts, when the experiment
    names them (otherwise SFT trains on the chosen side of the pool and PPO samples the pool's prompts)."""

    train: list[dict]
    eval: list[dict]
    skipped: Skipped = field(default_factory=Skipped)
    source: str = ""
    sft_rows: list[dict] | None = None
    prompt_rows: list[dict] | None = None
    repeats: list[str] = field(default_factory=list)
    """What to say of an SFT file that repeats held-out or judge pairs (load_sft)."""

    def sft(self, n: int, exclude: set[str] = frozenset()) -> list[dict]:
        """n SFT examples: the SFT file's, else the chosen side of the pool's pairs whose ids are not in `exclude`
        (the judge's pairs: no stage trains on them)."""
        if self.sft_rows is not None:
            return _take(self.sft_rows, n)
        pool = [r for r in self.train if r["id"] not in exclude]
        return [{"id": r["id"], "prompt": r["prompt"], "completion": r["chosen"]} for r in _take(pool, n)]

    def pairs(self, n: int) -> list[dict]:
        return _take(self.train, n)

    def prompts(self, n: int) -> list[dict]:
        rows = self.prompt_rows if self.prompt_rows is not None else self.train
        return [{"id": r["id"], "prompt": r["prompt"], "columns": r.get("columns", {}),
                 **({"prompt_messages": r["prompt_messages"]} if "prompt_messages" in r else {})}
                for r in _take(rows, n)]

    def _all(self) -> list[list[dict]]:
        return [rows for rows in (self.train, self.eval, self.sft_rows, self.prompt_rows) if rows]

    def render(self, tok) -> "Splits":
        """Render conversational records in place with the tokenizer's chat template (see `render`)."""
        for rows in self._all():
            render(rows, tok)
        return self


def judge_count(pairs: int, fraction: float) -> int:
    """How many of `pairs` preference pairs train the judge (data.judge_fraction)."""
    return round(pairs * fraction)


def judge_split(pairs: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(`pairs` less the judge's, the judge's): a seeded `fraction` of them, held out of RM and DPO training to train
    the judge (data.judge_fraction); order kept."""
    k = judge_count(len(pairs), fraction)
    judge = set(random.Random(seed).sample(range(len(pairs)), k)) if k else set()
    return [p for i, p in enumerate(pairs) if i not in judge], [p for i, p in enumerate(pairs) if i in judge]


def _take(rows, n):
    return rows if n <= 0 else rows[:n]


# ----------------------------------------------------------------------------------------------------------- synthetic
def letters(cfg) -> list[str]:
    return list(string.ascii_lowercase[: cfg.alphabet])


def synthetic_prompt(chars: list[str]) -> str:
    return f"{HUMAN} {' '.join(chars)}{ASSISTANT}"


def _prompt_letters(prompt: str) -> set[str]:
    if ASSISTANT not in prompt:  # a chat-template rendering: the words of the last turn, markup <...> removed
        turns = [t for t in re.split(r"<[^<>]*>", prompt) if t.strip()]
        return set(turns[-1].split()) if turns else set()
    body = prompt.rsplit(ASSISTANT, 1)[0].rsplit("Human:", 1)[-1]
    return set(body.split())


def gt_reward(prompt: str, response: str, min_len: int = 4) -> float:
    """Ground truth of the synthetic task: (#response words in the prompt's letter set - #others) / max(n, min_len).

    In [-1, 1]; 1 = every word is one of the prompt's letters and the response is at least min_len long.
    """
    allowed = _prompt_letters(prompt)
    words = (re.sub(r"<[^<>]*>", " ", response) if "<" in response else response).split()  # no template markup
    good = sum(w in allowed for w in words)
    return (good - (len(words) - good)) / max(len(words), min_len)


def _content(x) -> str:
    """A prompt or completion as TRL passes it (a string, or a message list: its last message's content)."""
    return x[-1]["content"] if isinstance(x, list) else x


def letters_reward(prompts: list, completions: list, response_len_min: list[int] | None = None,
                   **columns) -> list[float]:
    """The synthetic task's ground truth as a reward function (TRL's convention: strings, or message lists on
    conversational rows; the rows carry response_len_min)."""
    mins = response_len_min or [4] * len(prompts)
    return [gt_reward(_content(q), _content(a), m) for q, a, m in zip(prompts, completions, mins)]


def _sample_response(rng: random.Random, allowed: list[str], others: list[str], n: int, q: float) -> str:
    return " " + " ".join(rng.choice(allowed) if rng.random() < q else rng.choice(others) for _ in range(n))


def synthetic_pairs(cfg, n: int, seed: int) -> list[dict]:
    """n preference pairs: chosen drawn with per-word quality q~U(0.5,1), rejected with q~U(0,0.5), labelled by the
    ground truth (swapped when the draw disagrees; exact ties redrawn). SFT on the chosen side therefore gives a
    decent but imperfect policy that preference learning can improve."""
    rng = random.Random(seed)
    abc = letters(cfg)
    out = []
    while len(out) < n:
        k = rng.randint(cfg.prompt_letters_min, cfg.prompt_letters_max)
        allowed = rng.sample(abc, k)
        others = [c for c in abc if c not in allowed]
        prompt = synthetic_prompt(allowed)
        a = _sample_response(rng, allowed, others, rng.randint(cfg.response_len_min, cfg.response_len_max),
                             rng.uniform(0.5, 1.0))
        b = _sample_response(rng, allowed, others, rng.randint(cfg.response_len_min, cfg.response_len_max),
                             rng.uniform(0.0, 0.5))
        ra, rb = gt_reward(prompt, a, cfg.response_len_min), gt_reward(prompt, b, cfg.response_len_min)
        if ra == rb:
            continue
        if ra < rb:
            a, b = b, a
        out.append({"id": f"synthetic:{len(out)}", "prompt": prompt, "chosen": a, "rejected": b,
                    "columns": {"letters": " ".join(sorted(allowed)), "response_len_min": cfg.response_len_min}})
    return out


def as_conversation(row: dict) -> dict:
    """A synthetic pair in TRL's conversational preference format (explicit prompt): the same letters and responses."""
    body = row["prompt"][len(HUMAN):-len(ASSISTANT)].strip()
    return {"id": row["id"], "prompt": [{"role": "user", "content": body}],
            **{k: [{"role": "assistant", "content": row[k].strip()}] for k in ("chosen", "rejected")},
            "columns": row["columns"]}


# ------------------------------------------------------------------------------------------------------------ render
def chat_template(spec: str | None) -> str | None:
    """data.chat_template: a Jinja string, or the path of a file holding one."""
    if not spec:
        return None
    if "{" not in spec and Path(spec).is_file():
        return Path(spec).read_text()
    if "{" not in spec:
        raise DataError(f"data.chat_template: {spec}: no such file (and not a Jinja template)")
    return spec


def _strip_bos(text: str, tok) -> str:
    """Templates that write the BOS themselves: drop it when the tokenizer adds one too (no double BOS)."""
    bos = tok.bos_token
    if bos and text.startswith(bos) and tok("x").input_ids[:1] == [tok.bos_token_id]:
        return text[len(bos):]
    return text


def render_prompt(tok, messages: list) -> str:
    return _strip_bos(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), tok)


RENDERING = "a response ends at the EOS that ends its turn (2026-11-28)"
"""The rule `render` follows, in the lineage of an SFT run on conversational data (and so of every run after it):
a run rendered by an earlier rule (ChatML's turn rendered "<|im_end|>\\n", and TRL's EOS after it) is not reused."""


def render(rows: list[dict], tok) -> list[dict]:
    """Conversational records -> text, in place, with the tokenizer's chat template: the prompt with the generation
    prompt added; each response as the text the template appends after that prompt, ending at its EOS where the
    template ends the turn with it (what follows, such as ChatML's newline, is not part of a sampled response, and
    TRL, given text, would append another EOS after it). The prompt's messages are kept
    as "prompt_messages" (reward functions get them, as TRL passes them). Plain-text records are left as they are (no
    template is imposed on them)."""
    first = next((r for r in rows if _is_conv(r["prompt"])), None)
    if first is None:
        return rows
    if not getattr(tok, "chat_template", None):
        at, name = f" ({first['id']}, the first)" if first.get("id") else "", getattr(tok, "name_or_path", "")
        raise DataError(f"conversational records{at} need a chat template, and the tokenizer"
                        f"{f' of {name}' if name else ''} has none: set data.chat_template (a Jinja string or file)")
    cache: dict[str, str] = {}
    for r in rows:
        if not _is_conv(r["prompt"]):
            continue
        key = json.dumps(r["prompt"])
        if key not in cache:
            cache[key] = render_prompt(tok, r["prompt"])
        prompt = cache[key]
        for k in ("chosen", "rejected", "completion"):
            if k in r and _is_conv(r[k]):
                full = _strip_bos(tok.apply_chat_template(r["prompt"] + r[k], tokenize=False), tok)
                if not full.startswith(prompt):
                    raise DataError(f"{r['id']}: the chat template does not render the prompt (with the generation "
                                    f"prompt) as a prefix of the conversation; it cannot be split into prompt and "
                                    f"response")
                r[k] = full[len(prompt):]
                if tok.eos_token and r[k].rstrip().endswith(tok.eos_token):  # ChatML's "<|im_end|>\n": end at
                    r[k] = r[k].rstrip()  # the EOS, as the stages sample it; TRL would append a second one
        r["prompt_messages"], r["prompt"] = r["prompt"], prompt
    return rows


def skipped_record(skipped: Skipped) -> dict:
    """A run record's `inputs` entries for what the loaders skipped: {why: count} and where the first of each was."""
    return {"skipped": dict(skipped), "skipped_at": dict(skipped.at)} if skipped else {}


def skipped_said(stage: str, inputs: dict, source: str, left: dict | None = None,
                 other: tuple[str, ...] = ()) -> str | None:
    """What the loaders skipped of `source` (the run record's `inputs`: skipped, {why: count}, and skipped_at, where
    the first of each was; a role file's counts under `<role>: `, those of the `other` roles' files, which the stage
    does not read, left out), said as a warning, with what is `left` ({what: count}) when the skipping changed a
    balance the user chose; None: none."""
    at = inputs.get("skipped_at") or {}
    skipped = {k: v for k, v in (inputs.get("skipped") or {}).items()
               if not k.startswith(tuple(f"{r}: " for r in other))}
    if not skipped:
        return None
    files = {"eval": "data.eval_path", "sft": "data.sft_path", "prompts": "data.prompts_path"}
    by_file: dict[str, list[str]] = {}
    for key, n in skipped.items():  # a role file's counts, under `<role>: `, name their file
        role, sep, reason = key.partition(": ")
        where, reason = (files[role], reason) if sep and role in files else (source, key)
        first = f" (the first: {at[key]})" if key in at and n > 1 else f" ({at[key]})" if key in at else ""
        by_file.setdefault(where, []).append(f"{reason} {n}{first}")
    why = "; ".join(f"in {where}: {', '.join(reasons)}" for where, reasons in by_file.items())
    rest = f"; left: {', '.join(f'{k} {v}' for k, v in left.items())}" if left else ""
    rule = (": an exact duplicate counts once, a pair whose chosen equals its rejected not at all (docs/data.md)"
            if any(k.endswith(("duplicate", "identical chosen and rejected")) for k in skipped) else " (docs/data.md)")
    total = sum(skipped.values())
    return f"{stage}: {total} record{'s are' if total > 1 else ' is'} skipped ({why}){rest}{rule}"


# ------------------------------------------------------------------------------------------------------------- entry
def _role_file(d: DataConfig, key: str, role: str, split: str, names: dict[str, str]) -> tuple[list[dict], Skipped]:
    """The rows of the file data.<key> names, for `role` (its ids named as `names` says: formats.id_names). With
    data.source hh-rlhf, a held-out file is hh-rlhf transcripts too, split as the pool's are."""
    path = getattr(d, key)
    if d.source == "hh-rlhf" and role == "eval":
        rows, skipped = hh_pairs(path, names, f"data.{key}", split)
    else:
        rows, skipped = load_file(path, role, split, d.columns or None, field=f"data.{key}", name=names.get(path))
    return rows, skipped.renamed(lambda k: f"{role}: {k}" if role != "preference" else k)


def load(exp: Experiment) -> Splits:
    """Load the experiment's data: the preference pool split deterministically (seeded) into eval and train pools
    (or the held-out eval file, when data.eval_path names one), plus the SFT and prompt-only files when named."""
    d: DataConfig = exp.data
    # SFT from the pool skips the judge's pairs: the pool holds that many more
    judge = judge_count(d.pref_pairs, d.judge_fraction) if d.sft_path is None else 0
    need = d.eval_examples + max(d.sft_examples + judge, d.pref_pairs, d.ppo_prompts)
    skipped = Skipped()
    files = [p for p in (d.path, d.eval_path, d.sft_path, d.prompts_path) if p]
    names = id_names([f for p in files for f in (hh_paths(p) if d.source == "hh-rlhf" else [p])])
    if d.source == "synthetic":
        rows = synthetic_pairs(d.synthetic, need, exp.seed)
        if d.synthetic.conversational:
            rows = [as_conversation(r) for r in rows]
        source = "synthetic"
    elif d.source == "hh-rlhf":
        rows, skipped = hh_pairs(d.path or "Anthropic/hh-rlhf", names)
        source = d.path or "Anthropic/hh-rlhf"
    else:
        rows, skipped = _role_file(d, "path", "preference", d.split, names)
        source = d.path
    if not rows:
        raise DataError(f"{source}: empty dataset (no usable records; skipped: {dict(skipped) or 'none'})")
    held_out = None
    if d.eval_path:
        held_out, more = _role_file(d, "eval_path", "eval", d.eval_split, names)
        skipped += more
        held_out = _take(held_out, d.eval_examples)
    elif len(rows) <= d.eval_examples:
        raise DataError(f"{source}: {len(rows)} usable records, but data.eval_examples={d.eval_examples} "
                        f"leaves none for training; lower data.eval_examples")
    rows = list(rows)
    random.Random(exp.seed).shuffle(rows)
    if held_out is not None:
        splits = Splits(train=rows, eval=held_out, skipped=skipped, source=source)
    else:
        splits = Splits(train=rows[d.eval_examples:], eval=rows[: d.eval_examples], skipped=skipped, source=source)
    for attr, key, role in (("sft_rows", "sft_path", "sft"), ("prompt_rows", "prompts_path", "prompts")):
        if getattr(d, key):
            extra, more = _role_file(d, key, role, d.split, names)
            random.Random(exp.seed).shuffle(extra)
            setattr(splits, attr, extra)
            splits.skipped += more
    return splits


def load_sft(exp: Experiment) -> tuple[list[dict], list[dict], Splits]:
    """SFT train and eval examples ({id, prompt, completion}): the SFT file (data.sft_path) when named, else the
    chosen side of the preference pool less the judge's pairs; eval = the chosen side of the held-out pairs. The
    splits' `repeats`: what to say of an SFT file that repeats held-out or judge pairs (sft_repeats)."""
    splits = load(exp)
    ev = [{"id": r["id"], "prompt": r["prompt"], "completion": r["chosen"],
           **({"columns": r["columns"]} if "columns" in r else {})} for r in splits.eval]
    d = exp.data
    _, judge = judge_split(splits.pairs(d.pref_pairs), d.judge_fraction, exp.seed)
    train = splits.sft(d.sft_examples, {p["id"] for p in judge})
    if splits.sft_rows is not None:
        splits.repeats = sft_repeats(train, {"held-out": splits.eval, "judge": judge})
    return train, ev, splits


def sft_repeats(train: list[dict], pairs: dict[str, list[dict]]) -> list[str]:
    """What to say for each kind of `pairs` (held-out, the judge's) whose prompt and chosen response the SFT file's
    examples `train` repeat: a file made from the same pairs as data.path trains SFT on what grades it (SFT from the
    pool leaves both out)."""
    def key(prompt, response) -> tuple[str, str]:
        return json.dumps(prompt, sort_keys=True) if not isinstance(prompt, str) else prompt.strip(), \
            json.dumps(response, sort_keys=True) if not isinstance(response, str) else response.strip()

    said = []
    for kind, rows in pairs.items():
        keys = {key(p["prompt"], p["chosen"]) for p in rows}
        seen = sum(key(r["prompt"], r["completion"]) in keys for r in train)
        if seen:
            what = ("the held-out checks then grade responses SFT learned by heart" if kind == "held-out" else
                    "the judge, fit on those pairs apart so that it grades what no stage trained on, then grades "
                    "responses SFT learned")
            said.append(f"sft: {seen} of the {len(train)} training examples of data.sft_path are {kind} pairs' prompt "
                        f"and chosen response ({len(rows)} {kind} pairs): {what}; leave them out of data.sft_path, or "
                        f"unset it (SFT then takes the chosen side of data.path's pairs less those)")
    return said
