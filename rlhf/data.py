"""Datasets: every loader returns plain dicts with `id`, `prompt`, `chosen`, `rejected` (preference pairs).

SFT trains on {prompt, completion} = the chosen side; PPO and eval use the prompts. Sources:
- synthetic: an offline task with a programmatic ground-truth reward (`gt_reward`), the default;
- hh-rlhf: Anthropic's transcripts from the hub or local .jsonl/.jsonl.gz, split into shared prompt + two responses;
- jsonl: {prompt, chosen, rejected} records (and {instruction, input, output} for SFT).
Bad input fails with DataError naming file, line and field, before any model is loaded.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .config import DataConfig, Experiment

ASSISTANT = "\n\nAssistant:"
HUMAN = "\n\nHuman:"


class DataError(ValueError):
    """Invalid dataset input; the message names the file, line and field."""


@dataclass
class Splits:
    """Held-out `eval` pairs and the pool the training subsets are drawn from, with what was skipped and why."""

    train: list[dict]
    eval: list[dict]
    skipped: Counter = field(default_factory=Counter)
    source: str = ""

    def sft(self, n: int) -> list[dict]:
        return [{"id": r["id"], "prompt": r["prompt"], "completion": r["chosen"]} for r in _take(self.train, n)]

    def pairs(self, n: int) -> list[dict]:
        return _take(self.train, n)

    def prompts(self, n: int) -> list[dict]:
        return [{"id": r["id"], "prompt": r["prompt"]} for r in _take(self.train, n)]


def _take(rows, n):
    return rows if n <= 0 else rows[:n]


# ----------------------------------------------------------------------------------------------------------- synthetic
def letters(cfg) -> list[str]:
    return list(string.ascii_lowercase[: cfg.alphabet])


def synthetic_prompt(chars: list[str]) -> str:
    return f"{HUMAN} {' '.join(chars)}{ASSISTANT}"


def _prompt_letters(prompt: str) -> set[str]:
    body = prompt.rsplit(ASSISTANT, 1)[0].rsplit("Human:", 1)[-1]
    return set(body.split())


def gt_reward(prompt: str, response: str, min_len: int = 4) -> float:
    """Ground truth of the synthetic task: (#response words in the prompt's letter set - #others) / max(n, min_len).

    In [-1, 1]; 1 = every word is one of the prompt's letters and the response is at least min_len long.
    """
    allowed = _prompt_letters(prompt)
    words = response.split()
    good = sum(w in allowed for w in words)
    return (good - (len(words) - good)) / max(len(words), min_len)


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
        out.append({"id": f"synthetic:{len(out)}", "prompt": prompt, "chosen": a, "rejected": b})
    return out


# ------------------------------------------------------------------------------------------------------------- jsonl
def read_jsonl(path: str | Path):
    """Yield (line_number, record) from a .jsonl or .jsonl.gz file; malformed lines raise DataError."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    n = 0
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{i}: expected a JSON object, got {type(rec).__name__}")
            n += 1
            yield i, rec
    if n == 0:
        raise DataError(f"{path}: empty dataset (no records)")


def _field(rec: dict, name: str, where: str, required: bool = True) -> str:
    if name not in rec:
        if not required:
            return ""
        raise DataError(f"{where}: missing field '{name}' (fields present: {', '.join(sorted(rec)) or 'none'})")
    value = rec[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{name}' must be a string, got {type(value).__name__}")
    return value


def jsonl_pairs(path: str) -> list[dict]:
    out = []
    for i, rec in read_jsonl(path):
        where = f"{path}:{i}"
        out.append({"id": f"{Path(path).name}:{i}", "prompt": _field(rec, "prompt", where),
                    "chosen": _field(rec, "chosen", where), "rejected": _field(rec, "rejected", where)})
    return out


def jsonl_sft(path: str) -> list[dict]:
    """{instruction, input (optional), output} records -> {prompt, completion} in the hh transcript format."""
    out = []
    for i, rec in read_jsonl(path):
        where = f"{path}:{i}"
        instruction, extra = _field(rec, "instruction", where), _field(rec, "input", where, required=False)
        output = _field(rec, "output", where)
        if not output.strip():
            raise DataError(f"{where}: field 'output' is empty")
        human = instruction + (f"\n\n{extra}" if extra else "")
        out.append({"id": f"{Path(path).name}:{i}", "prompt": f"{HUMAN} {human}{ASSISTANT}", "completion": " " + output})
    return out


# ----------------------------------------------------------------------------------------------------------- hh-rlhf
_TURN = re.compile(r"\n\n(Human|Assistant):")


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


def hh_pairs(path: str) -> tuple[list[dict], Counter]:
    """Local .jsonl(.gz) files (comma separated) or a hub id (needs network)."""
    skipped: Counter = Counter()
    out = []
    for p in [s.strip() for s in path.split(",") if s.strip()]:
        if Path(p).exists() or p.endswith((".jsonl", ".gz")):
            rows = ((f"{Path(p).name}:{i}", f"{p}:{i}", rec) for i, rec in read_jsonl(p))
        else:
            import datasets  # hub loading: the real path on a networked host

            ds = datasets.load_dataset(p, split="train")
            rows = ((f"{p}:{i}", f"{p}[{i}]", rec) for i, rec in enumerate(ds))
        for rid, where, rec in rows:
            chosen, rejected = _field(rec, "chosen", where), _field(rec, "rejected", where)
            pair, reason = split_hh(chosen, rejected)
            if pair is None:
                skipped[reason] += 1
                continue
            out.append({"id": rid, **pair})
    return out, skipped


# ------------------------------------------------------------------------------------------------------------- entry
def load(exp: Experiment) -> Splits:
    """Load the experiment's data and split it deterministically (seeded) into eval and train pools."""
    d: DataConfig = exp.data
    need = d.eval_examples + max(d.sft_examples, d.pref_pairs, d.ppo_prompts)
    skipped: Counter = Counter()
    if d.source == "synthetic":
        rows = synthetic_pairs(d.synthetic, need, exp.seed)
        source = "synthetic"
    elif d.source == "hh-rlhf":
        rows, skipped = hh_pairs(d.path or "Anthropic/hh-rlhf")
        source = d.path or "Anthropic/hh-rlhf"
    else:
        rows = jsonl_pairs(d.path)
        source = d.path
    if not rows:
        raise DataError(f"{source}: empty dataset (no usable records; skipped: {dict(skipped) or 'none'})")
    if len(rows) <= d.eval_examples:
        raise DataError(f"{source}: {len(rows)} usable records, but data.eval_examples={d.eval_examples} "
                        f"leaves none for training; lower data.eval_examples")
    rows = list(rows)
    random.Random(exp.seed).shuffle(rows)
    return Splits(train=rows[d.eval_examples:], eval=rows[: d.eval_examples], skipped=skipped, source=source)


def load_sft(exp: Experiment) -> tuple[list[dict], list[dict], Splits]:
    """SFT train and eval examples ({id, prompt, completion}); an explicit SFT jsonl file wins over the pairs."""
    splits = load(exp)
    if exp.data.source == "jsonl" and exp.data.sft_path:
        rows = jsonl_sft(exp.data.sft_path)
        random.Random(exp.seed).shuffle(rows)
        n_eval = min(exp.data.eval_examples, len(rows) // 5) or 1
        return _take(rows[n_eval:], exp.data.sft_examples), rows[:n_eval], splits
    ev = [{"id": r["id"], "prompt": r["prompt"], "completion": r["chosen"]} for r in splits.eval]
    return splits.sft(exp.data.sft_examples), ev, splits
