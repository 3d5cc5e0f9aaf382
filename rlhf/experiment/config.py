"""Typed experiment configuration.

One YAML file per experiment (`experiments/*.yaml`) with one section per stage. Every field is declared and
documented in rlhf/experiment/sections.py (rlhf/experiment/online_sections.py: PPO, GRPO, RLOO); unknown keys and wrong types fail with the
key named (and the nearest valid key suggested). Overrides come from the command line as `section.key=value` (the
value is parsed as YAML).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

# the sections of an experiment, importable from here
from rlhf.experiment.online_sections import OnlineConfig, PPOConfig, GRPOConfig, RLOOConfig, kl_controller_error  # noqa: F401
from rlhf.experiment.sections import (  # noqa: F401
    ModelConfig, QuantizationConfig, LoraConfig, DataConfig, SFTConfig, RMConfig, DPOConfig, KTOConfig, RewardConfig,
    EvalConfig, MemoryConfig, DistributedConfig, TrackingConfig, TrainConfig)
from rlhf.experiment.trl_names import (DEPRECATED_GROUP, DEPRECATED_PPO, DPO_F_DIVERGENCES, DPO_LOSS_TYPES,
                                        GROUP_CHOICES, KTO_REFUSED, PREFERENCE_REFUSED, RM_REFUSED, SFT_LOSS_TYPES,
                                        SFT_PACKING_STRATEGIES, SFT_REFUSED, TRAIN_REFUSED, TRL_REFUSED,
                                        dpo_option_error, group_option_error, undeprecated)


class ConfigError(ValueError):
    """A config file or override is invalid. The message names the file and key; `key`, the dotted config key it is
    about where it is one, or the keys it is about together (load() then names the override, or the file's line,
    that set the first of them it finds)."""

    def __init__(self, message: str = "", key: str | tuple[str, ...] | None = None):
        super().__init__(message)
        self.key = key


def first_line(e: BaseException) -> str:
    """An exception's message's first line, as an error line quotes a library's reason (its type where it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@dataclass
class Experiment:
    name: str = "tiny"
    """Experiment name; run records go to results/<name>/<stage>/<run-id>/."""
    seed: int = 0
    """Seed for Python, NumPy, torch, data subsets and order, and sampling."""
    deterministic: bool = False
    """Deterministic algorithms only (torch.use_deterministic_algorithms + CUBLAS_WORKSPACE_CONFIG): bitwise-repeatable
    runs on GPU too, somewhat slower. CPU runs are repeatable either way. Recorded in each run's lineage."""
    device: str = "auto"
    """auto | cpu | cuda."""
    results_dir: str = "results"
    """Root of the run records."""
    model: ModelConfig = field(default_factory=ModelConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    kto: KTOConfig = field(default_factory=KTOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rloo: RLOOConfig = field(default_factory=RLOOConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    source: str | None = None
    """The YAML file this was loaded from (set by the loader)."""


def _sections_of(kind: type) -> tuple[str, ...]:
    """The Experiment's sections whose type is `kind` or derives from it, in declaration order."""
    hints = typing.get_type_hints(Experiment)
    return tuple(f.name for f in dataclasses.fields(Experiment)
                 if isinstance(hints[f.name], type) and issubclass(hints[f.name], kind))


ONLINE = _sections_of(OnlineConfig)
"""The online RL sections (ppo, grpo, rloo): rollout batch sizes and KL band checked alike."""
GROUP = _sections_of(GRPOConfig)
"""The group-advantage sections (grpo, rloo)."""
DPO = _sections_of(DPOConfig)
"""The DPO sections (dpo): TRL's DPOConfig loss fields checked alike (trl_names.dpo_option_error)."""

REFUSED = {**{s: TRL_REFUSED for s in ONLINE}, **{s: TRAIN_REFUSED for s in _sections_of(TrainConfig)},
           **{s: SFT_REFUSED for s in _sections_of(SFTConfig)}, **{s: RM_REFUSED for s in _sections_of(RMConfig)},
           **{s: PREFERENCE_REFUSED for s in DPO}, **{s: KTO_REFUSED for s in _sections_of(KTOConfig)}}
"""Each section's table of TRL's fields it refuses, {name: (why, instead)} (rlhf/experiment/trl_names.py; `<stage>`
in them is the section): a key in it that is not the section's own field fails in one line naming it (build)."""

CHOICES = {
    "model.attn_implementation": {"auto", "flash_attention_2", "sdpa", "eager"},
    "model.dtype": {"float32", "bfloat16", "float16"},
    "quantization.quant_type": {"nf4", "fp4"},
    "quantization.compute_dtype": {"float32", "bfloat16", "float16"},
    "quantization.quant_storage": {"uint8", "float32", "bfloat16", "float16"},
    "quantization.dequantized_copy": {"auto", "run", "sampling", "never"},
    "distributed.strategy": {"ddp", "fsdp", "zero2", "zero3"},
    "data.source": {"synthetic", "hh-rlhf", "jsonl", "hub"},
    "dpo.reference": {"sft", "base"},
    "kto.reference": {"sft", "base"},
    "dpo.loss_type": DPO_LOSS_TYPES,
    "dpo.f_divergence_type": DPO_F_DIVERGENCES,
    "kto.loss_type": {"kto", "apo_zero_unpaired"},
    "sft.loss_type": SFT_LOSS_TYPES,
    "sft.packing_strategy": SFT_PACKING_STRATEGIES,
    "ppo.value_model": {"separate", "shared"},
    "ppo.kl_estimator": {"k1", "k3"},
    "ppo.sampler_is_mode": GROUP_CHOICES["sampler_is_mode"],
    **{f"{s}.reference": {"sft", "base"} for s in ONLINE},
    **{f"{s}.keep": {"auto", "judge", "last"} for s in ONLINE},
    **{f"{s}.{k}": v for s in GROUP for k, v in GROUP_CHOICES.items()},
    "device": {"auto", "cpu", "cuda"},
    "tracking.backend": {"none", "wandb"},
}


RENAMED = {
    **{f"{s}.loss_norm": (f"{s}.loss_type", "TRL 1.16's names: grpo, dr_grpo, dapo, bnpo, rloo; loss_norm: sequence "
                          "was grpo, token was dapo") for s in GROUP},
    **{f"{s}.overopt_confirm": (f"{s}.overopt_z", "the flag fires on evidence: the judge's paired fall from its "
                                "peak, in standard errors") for s in ONLINE},
    "dpo.max_kl_to_sft": ("dpo.max_kl_ref", "the bound on eval_kl_ref, the exact KL to dpo.reference at temperature "
                          "1"),
}
"""Keys that were replaced: {old dotted key: (its replacement, what changed)}. A config that sets one fails, naming
the replacement."""

DEPRECATED = {**{f"ppo.{old}": f"ppo.{new}" for old, new in DEPRECATED_PPO.items()},
              **{f"{s}.{old}": f"{s}.{new}" for s in GROUP for old, new in DEPRECATED_GROUP.items()}}
"""The online sections' former names of fields now named as TRL names them ({old dotted key: the field}): they load,
with a warning (rlhf/experiment/trl_names.py)."""


def _check_type(value, tp, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _check_type(value, arg, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[0] if errors else ConfigError(f"{where}: must not be null")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        kt, vt = typing.get_args(tp)
        for k, v in value.items():  # `{mod:fn:1}`: YAML reads one key 'mod:fn:1' with no value
            if v is None and isinstance(k, str) and re.fullmatch(r".+:.+:[-+.\deE]+", k):
                raise ConfigError(f"{where}: {k!r} has no value; YAML needs a space after the colon: "
                                  f"{{{k.rsplit(':', 1)[0]}: {k.rsplit(':', 1)[1]}}}")
        return {_check_type(k, kt, f"{where} key"): _check_type(v, vt, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "2e-4" as a string
        try:
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def build(cls, data: dict, origin: str, prefix: str = ""):
    """`data` as the dataclass `cls`, every key and type checked as an experiment's are (errors name origin and key,
    and carry the dotted key as `e.key`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: {prefix.rstrip('.') or 'top level'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if not (cls is Experiment and f.name == "source")]
    data = undeprecated(data, DEPRECATED, origin, ConfigError, prefix)
    obj = cls()
    for key, value in data.items():
        where = f"{prefix}{key}"
        try:  # an error carries its key (e.key): load() names the override, or the file's line, that set it
            section = prefix.rstrip(".")
            if key not in names and key in REFUSED.get(section, {}):
                why, instead = (text.replace("<stage>", section) for text in REFUSED[section][key])
                raise ConfigError(f"{origin}: '{where}' (TRL's {key}) does not apply here: {why}; {instead}")
            if key not in names and where in RENAMED:
                new, why = RENAMED[where]
                raise ConfigError(f"{origin}: '{where}' was replaced by '{new}' ({why})")
            if key not in names:
                near = difflib.get_close_matches(str(key), names, n=1)
                hint = f" (did you mean '{prefix}{near[0]}'?)" if near else f" (valid: {', '.join(names)})"
                raise ConfigError(f"{origin}: unknown key '{where}'{hint}")
            tp = hints[key]
            if dataclasses.is_dataclass(tp):
                value = build(tp, value if value is not None else {}, origin, where + ".")
            else:
                value = _check_type(value, tp, f"{origin}: {where}")
                allowed = CHOICES.get(where)
                bad = [v for v in (value if isinstance(value, list) else [value]) if allowed and v not in allowed]
                if bad:  # a list field (dpo.loss_type) takes a list of them
                    comma = ("; a list of them is written [a, b]" if isinstance(bad[0], str) and "," in bad[0] else "")
                    raise ConfigError(f"{origin}: {where}: {bad[0]!r} is not one of {sorted(allowed, key=str)}{comma}")
        except ConfigError as e:
            e.key = e.key or where
            raise
        setattr(obj, key, value)
    return obj


class _Path(dict):
    """A mapping an override's dotted key made (`data.columns.b=x`): it goes into the file's mapping, which a mapping
    typed as a value (`data.columns={b: x}`) replaces."""


def _set_dotted(tree: dict, dotted: str, value):
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        if node.get(p) is None:
            node[p] = _Path()
        node = node[p]
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: '{p}' is not a section")
    node[parts[-1]] = value


def _open_brackets(text: str) -> int:
    """How many `{` / `[` of a YAML flow value are still open at its end (quoted text not counted)."""
    depth, quote = 0, None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return depth


def join_split(args: list[str]) -> list[str]:
    """Overrides whose dict or list value the shell split at its spaces, joined again: `make grpo
    ARGS='reward.functions={"my.mod:fn": 1.0}'` runs `... reward.functions={my.mod:fn: 1.0}`, which reaches us as
    `reward.functions={my.mod:fn:` and `1.0}`. A `key=` piece with an unclosed `{` or `[` takes the pieces after it,
    space-separated, until its brackets close."""
    out: list[str] = []
    for a in args:
        if out and "=" in out[-1] and not out[-1].startswith("-") and _open_brackets(out[-1].split("=", 1)[1]) > 0:
            out[-1] += " " + a
        else:
            out.append(a)
    return out


class _Strict(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing a mapping that names one key twice (it keeps the last without a word: a second
    `sft:` section silently replaced the first)."""


def _unique_mapping(loader: _Strict, node, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged keys an explicit one may override
            continue
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, typing.Hashable):  # an unhashable key: construct_mapping says so
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"found duplicate key {key!r}",
                                                        key_node.start_mark)
            seen.add(key)
    return loader.construct_mapping(node, deep)


_Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def yaml_value(text: str):
    """YAML text's value (safe, every key once)."""
    return yaml.load(text, Loader=_Strict)  # noqa: S506 - a SafeLoader


def parse_overrides(items: list[str]) -> dict:
    """`a.b=1` strings -> nested dict, values parsed as YAML (pieces of a value split at its spaces joined first)."""
    tree: dict = {}
    for _, key, value in _parsed(items):
        _set_dotted(tree, key, value)
    return tree


def _parsed(items: list[str]) -> list[tuple[str, str, object]]:
    """Each override as (the item as typed, its dotted key, its value parsed as YAML); pieces of a value split at its
    spaces joined first."""
    out = []
    for item in join_split(list(items)):
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value, e.g. sft.learning_rate=1e-4")
        key, raw = item.split("=", 1)
        try:
            value = yaml_value(raw) if raw != "" else None
        except yaml.YAMLError as e:
            why = getattr(e, "problem", None) or first_line(e)
            raise ConfigError(f"override '{item}': the value is not valid YAML ({why})" + (
                "" if "duplicate key" in why else "; quote a dict or list as one word, e.g. "
                "'reward.functions={my.mod:fn: 1.0}'")) from None
        out.append((item, key.strip(), value))
    return out


def overlay(a: dict, b: dict, cls=None) -> dict:
    """The file's tree `a` with the overrides' `b` (parse_overrides') on it, for the dataclass `cls` it builds (an
    experiment, a sweep file): a section (a dataclass field of `cls`), or a mapping reached by a dotted key (_Path),
    takes them key by key; any other value, a mapping typed whole such as reward.functions={...} too, is the
    override's (the file's is not kept)."""
    hints = typing.get_type_hints(cls) if cls else {}
    out = dict(a)
    for k, v in b.items():
        section = hints.get(k) if dataclasses.is_dataclass(hints.get(k)) else None
        into = isinstance(v, dict) and isinstance(out.get(k), dict) and (section or isinstance(v, _Path))
        out[k] = overlay(out[k], v, section) if into else _plain(v)
    return out


def _plain(value):
    """`value` with its _Path mappings as plain dicts (a config value is dumped to YAML, which knows no subclass)."""
    return {k: _plain(v) for k, v in value.items()} if isinstance(value, dict) else value


def _keys_set(dotted: str, value) -> list[str]:
    """The dotted keys an override `dotted=value` sets: a section's keys one by one (it merges into the file's), any
    other value whole."""
    tp = Experiment
    for part in dotted.split("."):
        tp = typing.get_type_hints(tp).get(part) if dataclasses.is_dataclass(tp) else None
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return [x for k, v in value.items() for x in _keys_set(f"{dotted}.{k}", v)]
    return [dotted]


def read_yaml(path: Path, kind: str = "experiment") -> dict:
    """The YAML of an experiment (or sweep) file; a missing file or bad YAML fails naming the file."""
    if not path.exists():
        raise ConfigError(f"{path}: no such {kind} file (see {kind}s/ for the shipped ones)")
    if path.is_dir():
        raise ConfigError(f"{path}: a directory; give the {kind}'s YAML file (see {kind}s/)")
    try:
        data = yaml_value(path.read_text())
    except yaml.YAMLError as e:  # one line: the file, where the parser stopped and why
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        why = str(getattr(e, "problem", None) or e).replace("\n", " ")
        raise ConfigError(f"{path}{at}: not valid YAML: {why}") from None
    if data is None:
        raise ConfigError(f"{path}: empty (see {kind}s/ for the shipped ones)")
    return data


def load(path: str | Path, overrides: list[str] | dict | None = None,
         check: typing.Callable[[Experiment], None] | None = None) -> Experiment:
    """Load an experiment YAML, apply overrides, validate, and return the typed config. `check(exp)`: a caller's
    further check (dist.check_split: the ranks' split of the stage's batches), whose errors are named as validate's."""
    path = Path(path)
    data = read_yaml(path)
    merged = parse_overrides(overrides) if isinstance(overrides, list) else overrides or {}
    if merged:  # each under its keys' current names first, so that an override's old name replaces the file's
        data = overlay(*(undeprecated(x, DEPRECATED, o, ConfigError) for x, o in ((data, str(path)),
                                                                                (merged, "override"))), Experiment)
    try:
        exp = build(Experiment, data, str(path))
        exp.source = str(path)
        validate(exp)
        if check:
            check(exp)
    except ConfigError as e:
        said = origin(e, path, overrides)
        if said is e:
            raise
        raise said from None
    return exp


def _given(overrides: list[str] | dict | None) -> dict[str, str]:
    """{each key an override sets, by its current name: the override as given (a caller's mapping: its key)}."""
    if isinstance(overrides, list):
        return {DEPRECATED.get(k, k): item for item, key, value in _parsed(overrides) for k in _keys_set(key, value)}
    return {DEPRECATED.get(k, k): k for top, v in (overrides or {}).items() for k in _keys_set(top, v)}


def origin(e: Exception, path: str | Path, overrides: list[str] | dict | None,
           named: str = "override {}") -> Exception:
    """A key's error (a ConfigError with `e.key`, its message starting with the file's name) named by where its value
    came from: the override of `overrides` that set the key or a key above or under it (as `named` spells it: the
    sweep's "ARGS {!r}"), else the file's line that sets it; `e` itself where neither names it. load names its errors
    so, the CLI those found once the experiment had loaded (a reward function's signature against the data's
    columns), and the sweep file's loader its own."""
    if not isinstance(e, ConfigError):
        return e
    given = _given(overrides)
    keys, said = (e.key,) if isinstance(e.key, str) else e.key, str(e)
    if not keys or not said.startswith(f"{path}: "):
        return e

    def override_of(key: str) -> str | None:
        return given.get(max((k for k in given if f"{key}.".startswith(f"{k}.")), key=len, default="")) or next(
            (given[k] for k in sorted(given) if k.startswith(f"{key}.")), None)  # under it: an unknown section's

    by = next(filter(None, map(override_of, keys)), None)
    line = None if by else next(filter(None, (_key_line(Path(path), k) for k in keys)), None)
    if by is None and line is None:
        return e
    return ConfigError(f"{named.format(by) if by else f'{path}:{line}'}: {said[len(str(path)) + 2:]}")


def _key_line(path: Path, dotted: str) -> int | None:
    """The line of the YAML file where it sets the dotted key, or its former name (DEPRECATED); None where it sets
    neither (a default, or a merge key's)."""
    root = yaml.compose(path.read_text())
    for key in (dotted, *(old for old, new in DEPRECATED.items() if new == dotted)):
        node, line = root, None
        for part in key.split("."):
            found = next((kv for kv in (node.value if isinstance(node, yaml.MappingNode) else [])
                          if getattr(kv[0], "value", None) == part), None)
            if found is None:
                break
            line, node = found[0].start_mark.line + 1, found[1]
        else:
            return line
    return None


RESERVED_REWARD_NAMES = frozenset({"mean", "std", "group_std", "raw_mean", "model", "ground_truth", "kl_penalty",
                                   "total"})
"""Names the stages log under `reward/` themselves: a reward function is never logged under one (it gets a longer
name)."""


def _suffix(path: str, k: int) -> str:
    """The function's name with the last `k` parts of its module before it (k=0: the name alone)."""
    module, attr = path.rsplit(":", 1)
    return attr if k == 0 else ".".join(module.split(".")[-k:]) + ":" + attr


def log_names(paths: list[str], where: str = "reward.functions") -> dict[str, str]:
    """Each reward function's import path's readable, unique log name (`reward/<name>`): the function's own name when
    no other path shares it and it is not RESERVED_REWARD_NAMES, else the shortest suffix of the path (`module:name`,
    `package.module:name`, ...) no other path has. ConfigError when two paths would still be logged under one name."""
    depth = max((len(p.rsplit(":", 1)[0].split(".")) for p in paths), default=0)
    named: list[tuple[str, str]] = []
    for p in paths:
        ks = [k for k in range(depth + 1)
              if _suffix(p, k) not in RESERVED_REWARD_NAMES
              and all(_suffix(q, k) != _suffix(p, k) for q in paths if q != p)]
        named.append((p, _suffix(p, ks[0]) if ks else p))
    seen: dict[str, str] = {}
    for p, name in named:
        if name in seen or name in RESERVED_REWARD_NAMES:
            other = f"{seen[name]!r} and {p!r}" if name in seen else repr(p)
            raise ConfigError(f"{where}: {other} would be logged as reward/{name}, which is taken; name each function "
                              f"once")
        seen[name] = p
    return dict(named)


POSITIVE = ("learning_rate", "batch_size", "grad_accum", "rollout_batch", "minibatch", "micro_batch")
"""Fields that are above 0 in whichever section has them (validate); a 0 or negative one failed deep in a trainer."""
BOUNDS = {
    "above 0": ("epochs", "steps", "num_ppo_epochs", "num_iterations", "cliprange", "cliprange_value", "epsilon",
                "response_length", "max_completion_length", "max_new_tokens", "desirable_weight",
                "undesirable_weight", "dpo.beta", "kto.beta", "dpo.discopop_tau"),
    "0 or above": ("kl_coef", "vf_coef", "max_grad_norm", "weight_decay", "entropy_coef", "grpo.beta", "rloo.beta"),
    "in [0, 1]": ("gamma", "lam"),
    "in [0, 1)": ("warmup_ratio", "dropout", "judge_fraction"),
    "in (0, 1]": ("top_p",),
}
"""Values no stage reads as meant outside these bounds, by field (in whichever section has it) or section.field
(validate): TRL takes a negative beta or weight and trains the other way, a clip range of 0 freezes the policy, a
warmup_ratio of 1 is read by transformers as 1 step and a dropout of 1 trains no adapter."""
_WITHIN = {"above 0": lambda v: v > 0, "0 or above": lambda v: v >= 0, "in [0, 1]": lambda v: 0 <= v <= 1,
           "in [0, 1)": lambda v: 0 <= v < 1, "in (0, 1]": lambda v: 0 < v <= 1}
ONLINE_OPTIMS = ("adamw_torch", "adamw_torch_fused", "paged_adamw_8bit")
"""The online stages' optimizers (rlhf/rl/online.py make_optimizer; TRL's default adamw_torch_fused is torch's AdamW,
the same update); any other name is refused, not read as AdamW."""


def validate(exp: Experiment) -> None:
    """Cross-field checks: fail, never silently fix."""
    where = exp.source or "config"
    for f in dataclasses.fields(exp):
        section = getattr(exp, f.name)
        for k in POSITIVE if dataclasses.is_dataclass(section) else ():
            v = getattr(section, k, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
                raise ConfigError(f"{where}: {f.name}.{k} must be above 0, got {v}", key=f"{f.name}.{k}")
        fields = {x.name for x in dataclasses.fields(section)} if dataclasses.is_dataclass(section) else set()
        for bound, keys in BOUNDS.items() if fields else ():
            for k in keys:  # its fields (not a former name's property: ppo.epochs is num_ppo_epochs)
                name = k.removeprefix(f"{f.name}.")
                v = getattr(section, name) if name in fields else None
                if isinstance(v, (int, float)) and not isinstance(v, bool) and not _WITHIN[bound](v):
                    raise ConfigError(f"{where}: {f.name}.{name} must be {bound}, got {v}", key=f"{f.name}.{name}")
    if exp.lora.r < 1 or exp.lora.alpha <= 0:
        raise ConfigError(f"{where}: lora.r must be >= 1 and lora.alpha above 0, got {exp.lora.r} and "
                          f"{exp.lora.alpha}")
    for name in ONLINE:
        o = getattr(exp, name)
        if o.optim not in ONLINE_OPTIMS:
            raise ConfigError(f"{where}: {name}.optim={o.optim!r}: the online stages train with "
                              f"{' or '.join(ONLINE_OPTIMS)}")
        if o.temperature <= 0:
            raise ConfigError(f"{where}: {name}.temperature must be above 0 (log-probs are taken at it), got "
                              f"{o.temperature}; {'ppo.greedy samples greedily' if name == 'ppo' else 'sample at 1.0'}",
                              key=f"{name}.temperature")
        if o.rollout_batch % o.minibatch or o.minibatch % o.micro_batch:
            raise ConfigError(f"{where}: {name}.rollout_batch ({o.rollout_batch}) must be a multiple of "
                              f"{name}.minibatch ({o.minibatch}), which must be a multiple of {name}.micro_batch "
                              f"({o.micro_batch})",
                              key=(f"{name}.minibatch", f"{name}.micro_batch", f"{name}.rollout_batch"))
        if len(o.kl_band) != 2 or o.kl_band[0] > o.kl_band[1]:
            raise ConfigError(f"{where}: {name}.kl_band must be [low, high] with low <= high, got {o.kl_band}",
                              key=f"{name}.kl_band")
        if o.overopt_z < 0 or not 0 < o.overopt_alpha < 1:
            raise ConfigError(f"{where}: {name}.overopt_z must be >= 0 and {name}.overopt_alpha in (0, 1)")
        if not (0 <= o.playoff_alpha < 1 and 0 <= o.playoff_margin < 1 and 0 <= o.fall_margin < 1):
            raise ConfigError(f"{where}: {name}.playoff_alpha must be in [0, 1) (0: no playoff), and "
                              f"{name}.playoff_margin and {name}.fall_margin in [0, 1) (shares of a measured gain), "
                              f"got {o.playoff_alpha}, {o.playoff_margin} and {o.fall_margin}")
        if exp.rm.ensemble > 1 and exp.reward.model and not o.normalize_reward:
            raise ConfigError(f"{where}: rm.ensemble={exp.rm.ensemble} with {name}.normalize_reward=false would mix "
                              f"the members' raw scores, each on its own scale, in mean - lambda x std; set "
                              f"{name}.normalize_reward=true (each member on its held-out scale)")
    if controller := kl_controller_error(exp.ppo):  # named by the first of its keys an override or the file sets
        why, keys = controller
        raise ConfigError(f"{where}: {why}", key=keys)
    if exp.rm.ensemble < 1:
        raise ConfigError(f"{where}: rm.ensemble must be >= 1 (reward adapters), got {exp.rm.ensemble}",
                          key="rm.ensemble")
    if exp.distributed.num_processes < 1:
        raise ConfigError(f"{where}: distributed.num_processes must be >= 1, got {exp.distributed.num_processes}",
                          key="distributed.num_processes")
    for name in GROUP:
        g = getattr(exp, name)
        if isinstance(g.scale_rewards, bool):  # TRL reads true / false as group / none
            g.scale_rewards = "group" if g.scale_rewards else "none"
        if g.num_generations < 2:
            raise ConfigError(f"{where}: {name}.num_generations must be >= 2 (advantages are relative to the group), "
                              f"got {g.num_generations}", key=f"{name}.num_generations")
        if group_option_error(g, name):
            raise ConfigError(f"{where}: {group_option_error(g, name)}")
        if g.rollout_batch % g.num_generations:
            raise ConfigError(f"{where}: {name}.rollout_batch ({g.rollout_batch}) must be a multiple of "
                              f"{name}.num_generations ({g.num_generations}): whole groups per iteration",
                              key=(f"{name}.num_generations", f"{name}.rollout_batch"))
    if not exp.reward.model and not exp.reward.functions:
        raise ConfigError(f"{where}: reward: nothing scores the responses (reward.model is 0 and reward.functions is "
                          f"empty); give the reward model a weight or name a function")
    for key in ("functions", "judge_functions", "grader_functions"):
        for fn in getattr(exp.reward, key):
            if fn.count(":") != 1 or not all(fn.split(":")):
                raise ConfigError(f"{where}: reward.{key}: {fn!r} is not an import path 'package.module:function'")
    log_names(list(exp.reward.functions), f"{where}: reward.functions")  # two functions logged under one name fail
    both = sorted(set(exp.reward.functions) & set(exp.reward.judge_functions))
    if both:
        raise ConfigError(f"{where}: reward.judge_functions: {', '.join(both)} also in reward.functions: a judge the "
                          f"stage optimizes is not independent of it; judge with functions the reward leaves out")
    shared = sorted(set(exp.reward.grader_functions) & (set(exp.reward.functions) | set(exp.reward.judge_functions)))
    if shared or (exp.reward.grader_model and exp.reward.grader_model == exp.reward.judge_model):
        raise ConfigError(f"{where}: reward.grader_functions / grader_model: {', '.join(shared) or exp.reward.grader_model}"
                          f" also trains or judges the policy: an independent grader must be neither; name another")
    for name in DPO:
        o = getattr(exp, name)
        if error := dpo_option_error(o, name):
            raise ConfigError(f"{where}: {error[1]}", key=error[0])
    if exp.data.max_prompt_length >= exp.data.max_length:
        raise ConfigError(f"{where}: data.max_prompt_length ({exp.data.max_prompt_length}) must be below "
                          f"data.max_length ({exp.data.max_length}), the longest prompt + response in training; "
                          f"lower the one or raise the other", key=("data.max_prompt_length", "data.max_length"))
    if exp.data.source in ("jsonl", "hub") and not exp.data.path:
        raise ConfigError(f"{where}: data.path is required when data.source is {exp.data.source}")
    if Path(exp.results_dir).exists() and not Path(exp.results_dir).is_dir():
        raise ConfigError(f"{where}: results_dir={exp.results_dir!r} is a file; name a folder (made if missing)")
    m = exp.model
    if m.name.startswith(("/", "./", "../")) and not Path(m.name).is_dir():
        raise ConfigError(f"{where}: model.name={m.name!r}: no such directory (a local model is a folder with its "
                          f"config.json; a hub model is 'org/name')", key="model.name")
    if m.num_kv_heads < 0 or (m.num_kv_heads and m.num_heads % m.num_kv_heads):
        raise ConfigError(f"{where}: model.num_kv_heads ({m.num_kv_heads}) must divide model.num_heads "
                          f"({m.num_heads}), or be 0 (= num_heads)")
    if m.name == "tiny":  # built here: its context is the config's, and no sequence a stage runs may pass it
        d = exp.data
        longest = max([(d.max_length, "data.max_length"), (d.max_prompt_length + exp.eval.max_new_tokens,
                                                          "data.max_prompt_length + eval.max_new_tokens")]
                      + [(d.max_prompt_length + getattr(exp, s).max_new_tokens,
                          f"data.max_prompt_length + {s}.{getattr(exp, s).length_key}") for s in ONLINE])
        if longest[0] > m.max_position_embeddings:
            raise ConfigError(f"{where}: {longest[1]} ({longest[0]}) is over model.max_position_embeddings "
                              f"({m.max_position_embeddings}), the tiny model's context: raise it or shorten the "
                              f"sequences", key=(*longest[1].split(" + "), "model.max_position_embeddings"))
    s = exp.data.synthetic
    if not (1 <= s.prompt_letters_min <= s.prompt_letters_max < s.alphabet <= 26):
        raise ConfigError(f"{where}: data.synthetic needs 1 <= prompt_letters_min <= prompt_letters_max < alphabet <= 26")


def flatten(tree, prefix: str = "", sep: str = ".") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: a nested config (or summary) as dotted keys."""
    out = {}
    for k, v in (tree or {}).items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}{sep}", sep))
        else:
            out[f"{prefix}{k}"] = v
    return out


def to_dict(exp: Experiment) -> dict:
    return dataclasses.asdict(exp)


def dump(exp: Experiment) -> str:
    """The resolved config as YAML that `load` accepts again (with `# source:` naming the file it came from)."""
    d = to_dict(exp)
    source = d.pop("source")
    return f"# source: {source}\n" + yaml.safe_dump(d, sort_keys=False)
