"""Base models, tokenizers, quantization and LoRA.

A base comes from a hub id or local path, or - for offline runs - is built from a tiny Llama config with a word-level
tokenizer built from the data (`build_tiny_base`). Optional NF4 4-bit storage (double quant) via bitsandbytes, LoRA
via peft, gradient checkpointing, and the best installed attention implementation.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import (PeftConfig, PeftModel, get_peft_model, get_peft_model_state_dict, prepare_model_for_kbit_training,
                  set_peft_model_state_dict)
from safetensors.torch import load_file
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast)

from rlhf.experiment.config import ConfigError, Experiment, first_line
from rlhf.experiment.sections import LoraConfig, ModelConfig, QuantizationConfig
from rlhf.infra import dist

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STORAGE = {"uint8": torch.uint8, **DTYPES}
SPECIALS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def device(requested: str = "auto") -> torch.device:
    """The experiment's `device` ("auto", "cuda" or "cpu") resolved on this machine."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but no CUDA device is visible; use device=auto or device=cpu")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


@dataclass(frozen=True)
class Loading:
    """How every model of a run is loaded (load_base), resolved once from the experiment (loading): the model
    section (dtype, attention, revision, gradient checkpointing), the quantization section and the device."""

    model: ModelConfig
    quantization: QuantizationConfig
    device: torch.device


def loading(exp: Experiment) -> Loading:
    return Loading(exp.model, exp.quantization, device(exp.device))


def attn_implementation(requested: str = "auto") -> str:
    """flash_attention_2 > sdpa > eager, by what is installed (flash-attn needs a CUDA device)."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


# ------------------------------------------------------------------------------------------------------ tokenizers
def build_tokenizer(texts, more=()) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose vocabulary is every whitespace/punctuation-split word of `texts`, most frequent
    first, then the words only `more` has, appended (so the ids `texts` alone gives are kept). The special tokens in
    the texts (a chat template's </s>) are split out first, as the tokenizer splits them when it encodes: the word
    before one is learned alone (`here.</s>` gave the word `.</`, and `.` was <unk>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    unk = SPECIALS["unk_token"]
    tok = Tokenizer(models.WordLevel(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIALS.values()), min_frequency=1, show_progress=False)
    specials = re.compile("|".join(map(re.escape, SPECIALS.values())))
    tok.train_from_iterator((specials.sub(" ", t) for t in texts), trainer)
    vocab = tok.get_vocab()
    words = {w for text in more for w, _ in tok.pre_tokenizer.pre_tokenize_str(specials.sub(" ", text))} - set(vocab)
    if words:
        first = len(vocab)  # the ids go on from the last, one each (read once: the dict grows as it is updated)
        vocab.update({w: first + i for i, w in enumerate(sorted(words))})
        tok.model = models.WordLevel(vocab=vocab, unk_token=unk)
    bos = SPECIALS["bos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=4096, **SPECIALS)


class ModelLoadError(RuntimeError):
    """A base or tokenizer that cannot be loaded: the hub unreachable, a gated model without a token, a name that is
    neither a local directory nor a hub id. `reason`: transformers' own first line."""

    def __init__(self, path: str, what: str, reason: str, field: str, advice: str = ""):
        self.reason, self.advice = reason, advice
        super().__init__(f"{path}: cannot load its {what} ({reason}). " + (advice or (
            f"Check the network, HF_TOKEN for a gated model, or set {field} to a local directory")))


@contextlib.contextmanager
def hub_errors(path: str, what: str, field: str = "model.name"):
    """transformers' OSError for a model it cannot find or reach, as one line with what to do (`field`: the config
    key that names it); an OSError with an errno is the machine's (faults.py words those)."""
    try:
        yield
    except OSError as e:
        if e.errno is not None:
            raise
        raise ModelLoadError(path, what, first_line(e), field) from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "spm.model", "sentencepiece.bpe.model", "tekken.json")
"""The files a saved tokenizer is made of, one of them at least (transformers' save_pretrained and the hub's)."""


def has_tokenizer(path: str) -> bool:
    """Whether the local folder `path` holds a saved tokenizer (one of TOKENIZER_FILES)."""
    return any((Path(path) / f).exists() for f in TOKENIZER_FILES)


def check_tokenizer_folder(path: str) -> None:
    """Refuse a local folder `path` without a saved tokenizer, in one line (else transformers builds the architecture's
    tokenizer class from nothing and advises installing sentencepiece); said before a stage makes its run folder."""
    if Path(path).is_dir() and not has_tokenizer(path):
        raise ModelLoadError(path, "tokenizer", "the folder holds none of its files: " + ", ".join(TOKENIZER_FILES[:4])
                             + ", ...", "model.name", "Save the model's tokenizer into it (tokenizer.save_pretrained("
                             "folder)), as a checkpoint ships it")


def load_tokenizer(path: str, revision: str | None = None):
    check_tokenizer_folder(path)
    with hub_errors(path, "tokenizer"):
        try:
            tok = AutoTokenizer.from_pretrained(path, revision=revision)
        except ValueError as e:  # files it cannot make a tokenizer of: transformers' first line
            raise ModelLoadError(path, "tokenizer", first_line(e), "model.name",
                                 "Its files are not a tokenizer transformers can load here") from None
    if tok.pad_token is None:  # Llama/Mistral ship without one; never train on it (labels are masked)
        tok.pad_token = tok.unk_token or tok.eos_token
    for how in ("is_local", "local_files_only"):  # how transformers loaded it, not the tokenizer: every adapter and
        tok.init_kwargs.pop(how, None)  # export would save them (an export loaded offline, local_files_only: true)
    return tok


def check_vocabulary(tok, path: str, revision: str | None = None) -> None:
    """Refuses a tokenizer with ids the base `path`'s embedding has no row for (a token added past the vocabulary, or
    a pad or unk token transformers' tokenizer class adds itself, as Qwen2's does): the first such id in a batch
    would fail the embedding's lookup mid-run (IndexError); said in one line before any weight loads."""
    with hub_errors(path, "config"):
        rows = getattr(AutoConfig.from_pretrained(path, revision=revision).get_text_config(), "vocab_size", None)
    if not rows:
        return
    top = max(tok.get_vocab().values(), default=-1)
    beyond = [f"{t!r} is id {i}" for t, i in zip(tok.all_special_tokens, tok.all_special_ids)
              if i is not None and i >= rows]
    if top >= rows or beyond:
        what = "; ".join(beyond) if beyond else f"ids up to {top}"
        raise ConfigError(f"model.name {path}: its tokenizer has {len(tok)} tokens ({what}), but the model's "
                          f"embedding has {rows} rows (vocab_size): an id past them fails the embedding's lookup "
                          "mid-run; save the model with its embeddings resized to the tokenizer "
                          "(model.resize_token_embeddings(len(tokenizer))), or the tokenizer without those tokens")


def save_tokenizer(tok, path) -> None:
    """`tok` saved as trained, without the truncation and padding its last encoding left on its fast backend
    (sampling's left side at max_prompt_length), which tokenizer.json would carry to whoever loads it next."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        backend.no_truncation()  # tok(...) sets them again on its next call that asks for them
        backend.no_padding()
    tok.save_pretrained(path)


def build_tiny_base(m: ModelConfig, seed: int, texts, out_dir: Path, chat_template: str | None = None,
                    more=()) -> Path:
    """Build the tiny Llama of model section `m` (random weights, from `seed`) and its tokenizer (with `chat_template`, if given), save both to
    out_dir, return it. The model's vocabulary is the tokenizer's, or model.vocab_size rows (padded; ids the
    tokenizer never produces); key/value heads and tied embeddings come from the model section. The vocabulary:
    build_tokenizer's of `texts` and `more`."""
    tok = build_tokenizer(texts, more)
    if chat_template:
        tok.chat_template = chat_template
    if m.vocab_size and m.vocab_size < len(tok):
        raise ValueError(f"model.vocab_size={m.vocab_size} is below the tokenizer's {len(tok)} tokens")
    cfg = LlamaConfig(
        vocab_size=m.vocab_size or len(tok), hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads or m.num_heads,
        max_position_embeddings=m.max_position_embeddings, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=m.tie_embeddings,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------------------- models
def quantization_config(q: QuantizationConfig) -> BitsAndBytesConfig | None:
    if not q.load_in_4bit:
        return None
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.quant_type,
                              bnb_4bit_use_double_quant=q.double_quant,
                              bnb_4bit_compute_dtype=DTYPES[q.compute_dtype],
                              bnb_4bit_quant_storage=STORAGE[q.quant_storage])


def load_base(ld: Loading, path: str, kind: str = "causal", tokenizer=None, train: bool = True,
              field: str = "reward.judge_model"):
    """Load the base as a causal LM (kind="causal") or a one-label sequence classifier (kind="reward"),
    quantized if `ld` (the experiment's Loading) asks for it, on its device, ready for LoRA training; or a trained one-label classifier as it is
    (kind="judge": reward.judge_model or reward.grader_model, `field` in its errors)."""
    cls = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
    m = ld.model
    kwargs = dict(dtype=DTYPES[m.dtype], attn_implementation=attn_implementation(m.attn_implementation))
    if kind == "reward":
        kwargs["num_labels"] = 1
    qc, dev = quantization_config(ld.quantization), ld.device
    if qc is not None:
        kwargs["quantization_config"] = qc
        # data parallel: each rank loads its own quantized copy onto its own GPU (LOCAL_RANK, set by the launcher)
        local = dev.index if dev.index is not None else int(os.environ.get("LOCAL_RANK", "0"))
        kwargs["device_map"] = {"": local} if dev.type == "cuda" else {"": "cpu"}
    revision = m.revision if path == m.name else None
    if Path(path).is_dir():  # a local base by its absolute path, which peft records in every adapter (loadable from
        path = str(Path(path).resolve())  # any folder); the run records keep theirs, relative, so results/ can move
    with hub_errors(path, "weights", field if kind == "judge" else "model.name"):
        if kind == "reward":
            model = _reward_model(cls, path, revision, kwargs, say=train)
        elif kind == "judge":
            model = _judge_model(cls, path, kwargs, field)
        else:
            model = cls.from_pretrained(path, revision=revision, **kwargs)
    if qc is None:
        model.to(dev)
    else:
        plain_4bit(model)
    if tokenizer is not None and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if train:
        if qc is not None:
            model = frozen_for_kbit_training(model, qc.bnb_4bit_compute_dtype)
        if m.gradient_checkpointing:
            # transformers 5.23 renamed gradient checkpointing "activation checkpointing" (the old names warn)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            if qc is None:
                model.enable_input_require_grads()
    return model


def frozen_for_kbit_training(model, compute_dtype: torch.dtype):
    """A 4-bit base made ready for LoRA training, as peft's prepare_model_for_kbit_training leaves it (gradient
    checkpointing apart: load_base turns it on by transformers' current name): every weight frozen, the unquantized
    ones (embeddings, norms, a head) upcast to float32 for float16's range. With bf16 compute they go to bf16 instead:
    bf16 has float32's range, and a float32 norm makes the whole residual stream, the activations kept for the
    backward and the KV cache float32, twice the memory (measured on an H100: a 7B PPO rollout at 13.3 GB); the norms
    still compute their variance in float32. bf16 weights stay as they are and float16 or float32 ones are cast one
    at a time, never through peft's float32 copy: that held every unquantized weight in float32 at once while the
    base loaded (Llama-3.1-8B's embedding and head: 3.9 GB; its SFT allocated 8.25 GB in the load phase against
    6.89 at its training peak, and the allocator kept the memory reserved, so the card read 10.3 GB through the load
    and the held-out check until training began: results/gpu/2026-11-25-H100-llama31-8b-hh-4090-ppo.json). The weights
    are the same bits as through peft's upcast and back."""
    if compute_dtype != torch.bfloat16:
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    for prm in model.parameters():
        prm.requires_grad = False
        if prm.dtype in (torch.float16, torch.float32) and type(prm).__name__ != "Params4bit":
            prm.data = prm.data.to(torch.bfloat16)
    return model


def plain_4bit(model) -> int:
    """Keep every bitsandbytes 4-bit layer of `model` on the one numeric path that every CPU and GPU shares; return
    how many layers it set.

    bitsandbytes 0.50, on a CPU with AVX512-BF16, repacks a Linear4bit's weight into a CPU layout the first time the
    layer runs in eval mode without gradients (generation, evaluation), rounding its scales to bf16. From then on the
    layer computes through `bitsandbytes::gemv_4bit`, which has no autograd kernel: in training, the gradient through
    the 4-bit base weight is silently dropped (only the LoRA branches and the residual stream carry it), and a
    checkpoint saved meanwhile unpacks bf16-rounded scales. The same command then learns another model on such a
    CPU, a resumed run differs from an uninterrupted one, and small layers crash the repacking. bitsandbytes decides
    per layer (`support_avx512bf16_for_cpu`, set from the CPU when the layer is built): the harness turns it off on
    every layer it loads, training or not, so results do not depend on the CPU (docs/cpu.md)."""
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m.support_avx512bf16_for_cpu = False
    return len(layers)


@contextlib.contextmanager
def dequantized(model, max_bytes: float = float("inf")):
    """Compute through a dequantized copy of `model`'s 4-bit base: inside the block each bitsandbytes 4-bit layer
    uses its weight dequantized once, on entry, to the layer's compute dtype (bf16 on a GPU, float32 on the CPU),
    instead of dequantizing it again at every call (once per generated token when sampling). The LoRA wrappers
    around the layers (whichever adapter is active) run as before, so the outputs, and gradients through the frozen
    base, are the 4-bit path's. At most `max_bytes` are copied, layers in the model's order (decoder layer by decoder
    layer: memplan's partial copy); the others stay 4-bit, as do layers an enclosing block already copied. The copy is
    freed on exit. Yields the bytes this block copied.

    The copy computes what the 4-bit layer computes (bitsandbytes dequantizes to the same dtype and multiplies):
    0 log-prob gap on the CPU (tests/test_quant.py) and on an H100 at the 7B shapes (results/gpu/).
    memplan sizes the copy (quantization.dequantized_copy)."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    layers, size = [], 0
    try:
        for m in model.modules() if max_bytes > 0 else ():
            if not isinstance(m, bnb.nn.Linear4bit) or "forward" in m.__dict__:
                continue
            dtype = m.compute_dtype or compute_dtype(model)
            if size + m.out_features * m.in_features * dtype.itemsize > max_bytes * (1 + 1e-9):
                break
            layers.append(m)
            weight = bnbf.dequantize_4bit(m.weight.data, m.weight.quant_state).to(dtype)
            bias = None if m.bias is None else m.bias.detach().to(dtype)
            m.forward = _dense_forward(weight, bias)  # an instance attribute: the class's forward is back on exit
            size += weight.numel() * weight.element_size()
        yield size
    finally:
        for m in layers:
            m.__dict__.pop("forward", None)


def _dense_forward(weight: torch.Tensor, bias: torch.Tensor | None):
    """A 4-bit layer's forward through its dequantized `weight`, with its dtype rules (input cast to the compute
    dtype, output back to the input's)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
    return forward


_REPORTED: set[str] = set()
"""The bases whose expected weight-loading report was printed (as one line) in this process."""


def _judge_model(cls, path: str, kwargs, field: str):
    """reward.judge_model, reward.grader_model (`field`): a sequence classifier whose one-label score head was trained
    (not made on loading)."""
    model, info = cls.from_pretrained(path, output_loading_info=True, **kwargs)
    new = [k for k in info.get("missing_keys", ()) if k.split(".")[0] in ("score", "classifier")]
    if new or model.config.num_labels != 1:
        raise ConfigError(f"{field}: {path} is not a trained reward model: "
                         + (f"its score head ({', '.join(sorted(new))}) is not in the checkpoint (a causal LM?)"
                            if new else f"it has {model.config.num_labels} labels, a reward model has 1")
                         + "; name a one-label sequence classifier (what TRL's RewardTrainer saves)")
    return model


def _reward_model(cls, path: str, revision, kwargs, say: bool = True):
    """The causal base loaded as a one-label classifier. transformers' weight-loading report (a table on every RM
    load) becomes one line when it says what is expected: a new `score` head, the LM head left out (`say`: for a head
    that trains; an export loads the trained one next, and says nothing); anything else is still reported in full,
    as a warning."""
    reporter = logging.getLogger("transformers.modeling_utils")  # (a filter: its level decides other checks there)
    drop_report = lambda record: "LOAD REPORT" not in str(record.msg)  # noqa: E731
    reporter.addFilter(drop_report)
    try:
        model, info = cls.from_pretrained(path, revision=revision, output_loading_info=True, **kwargs)
    finally:
        reporter.removeFilter(drop_report)
    missing, unexpected = sorted(info.get("missing_keys", ())), sorted(info.get("unexpected_keys", ()))
    if all(k.startswith("score.") for k in missing) and all(k.startswith("lm_head.") for k in unexpected) \
            and not info.get("mismatched_keys") and not info.get("error_msgs"):
        if say and path not in _REPORTED and dist.is_main():  # once: the RM stage loads the base again for the judge
            print(f"reward model: a new one-label head ({', '.join(missing) or 'none missing'}) on "
                  f"{Path(path).name}; its LM head is not used", file=sys.stderr)
            _REPORTED.add(path)
    else:
        log.warning("loading %s as a reward model: missing %s, unexpected %s, mismatched %s", path, missing,
                    unexpected, info.get("mismatched_keys"))
    return model


def compute_dtype(model) -> torch.dtype:
    """The dtype a loaded base computes in: its 4-bit compute dtype, else the dtype it was loaded in."""
    cfg = getattr(model, "config", None)
    qc = getattr(cfg, "quantization_config", None)
    dtype = getattr(qc, "bnb_4bit_compute_dtype", None) if qc is not None and not isinstance(qc, dict) else (
        (qc or {}).get("bnb_4bit_compute_dtype"))
    dtype = dtype or getattr(cfg, "dtype", None) or torch.float32
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


def autocast(model):
    """Autocast to the model's compute dtype for our own forward passes outside TRL's trainers (which autocast
    theirs): QLoRA upcasts norms and saved modules to float32 while bf16 layers hand them bf16 activations, or the
    other way round. Nothing in float32. One context per forward: never around an optimizer step (autocast caches
    the casts of trainable weights until its outermost block ends)."""
    dtype = compute_dtype(model)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)


EMBEDDINGS = {"embed_tokens", "lm_head"}
"""The modules a tied base shares one weight between (peft's EMBEDDING_LAYER_NAMES)."""


def tied_embeddings(model) -> bool:
    """The causal LM's output head is its input embedding's weight (tie_word_embeddings: Gemma, Qwen2.5's small
    sizes, model.tie_embeddings)."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def lora_config(lc: LoraConfig, task_type: str = "CAUSAL_LM", extra_modules: tuple[str, ...] = (),
                tied: bool = False) -> PeftLoraConfig:
    """The lora section `lc`'s peft config. On a `tied` base (tied_embeddings) whose embedding or head the adapter trains,
    peft's ensure_weight_tying keeps the two one trained copy: otherwise peft warns and trains two that drift apart,
    and a merged export is no longer tied (twice the table, another architecture than the base's)."""
    targets = "all-linear" if lc.target_modules == ["all-linear"] else list(lc.target_modules)
    save = list(lc.modules_to_save) + list(extra_modules)
    if task_type == "SEQ_CLS":
        save = [m for m in save if m != "lm_head"] + ["score"]
    tie = tied and task_type == "CAUSAL_LM" and bool(EMBEDDINGS & {*save, *lc.target_modules})
    return PeftLoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=targets,
                          modules_to_save=sorted(set(save)) or None, task_type=task_type, bias="none",
                          ensure_weight_tying=tie)


def add_adapter(model, lc: LoraConfig, task_type: str = "CAUSAL_LM"):
    """Wrap a base with a fresh LoRA adapter of the lora section `lc` (its embedding and head one copy on a tied base:
    lora_config)."""
    return get_peft_model(model, lora_config(lc, task_type, tied=tied_embeddings(model)))


def load_adapter(model, adapter_dir: str | Path, name: str = "default", trainable: bool = False):
    """Load a saved adapter onto a base (or an extra named adapter onto a PeftModel).

    A tied adapter (lora_config) loaded beside another keeps its head on its own embedding copy. peft 0.21 ties only
    the first adapter of a model: for the next it looks for the tie in the already wrapped model, misses it, warns,
    and leaves that adapter the base's untrained head (a reference copy of the SFT adapter then computes other
    logits than the policy it copies). The tie the first adapter found (its modules_to_tie) is given to the next."""
    if not isinstance(model, PeftModel):
        return PeftModel.from_pretrained(model, str(adapter_dir), adapter_name=name, is_trainable=trainable)
    config = PeftConfig.from_pretrained(str(adapter_dir))
    heads = next((c.modules_to_tie for c in model.peft_config.values() if getattr(c, "modules_to_tie", None)), None)
    if getattr(config, "ensure_weight_tying", False) and heads and name not in model.peft_config:
        config.ensure_weight_tying, config.modules_to_tie = False, set(heads)  # tied by modules_to_tie, no search
        config.inference_mode = not trainable
        model.add_adapter(name, config)
        config.ensure_weight_tying = True  # as saved: a copy saved again reloads tied
        if trainable:
            model.set_requires_grad(name)
    model.load_adapter(str(adapter_dir), adapter_name=name, is_trainable=trainable)
    return model


@contextlib.contextmanager
def copying_tied_adapters():
    """Inside, copying a tied adapter by its config (TRL's DPOTrainer adds its reference that way: `add_adapter("ref",
    config)`) does not print peft 0.21's "ensure_weight_tying, but no tied modules were found": peft searches the
    wrapped model for the tie and misses it (load_adapter), while the config's modules_to_tie, filled when the
    adapter was first tied, ties the copy (tests/test_tied_embeddings.py)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You have requested `ensure_weight_tying`, but no tied modules were "
                                                  "found", category=UserWarning)
        yield


def reward_head(adapter_dir: str | Path, device) -> torch.nn.Linear:
    """The reward model's score head (float32, frozen) from its saved adapter. With the RM's LoRA loaded as another
    adapter on a causal base, the head on the trunk's final hidden state scores as the RM does: no second base."""
    w = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))["base_model.model.score.weight"]
    head = torch.nn.Linear(w.shape[1], 1, bias=False).to(device, torch.float32)
    head.weight.data.copy_(w)
    return head.requires_grad_(False)


def load_scorer(model, adapter_dir: str | Path, name: str, device) -> torch.nn.Linear:
    """A reward adapter (an RM, the judge, an ensemble member) loaded frozen as adapter `name` on the causal
    PeftModel `model`, and its score head (reward_head): it scores on the policy's own base."""
    if name not in model.peft_config:
        load_adapter(model, adapter_dir, name)
    return reward_head(adapter_dir, device)


def trunk(peft_model):
    """The decoder stack (no LM head) of a PeftModel over a causal LM."""
    return peft_model.base_model.model.model


def trainable_report(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params_total": total, "params_trainable": trainable}


def tokenizer_hash(tok) -> str:
    """Content hash of a tokenizer's vocabulary and special tokens (to refuse mismatched upstream outputs)."""
    import hashlib
    import json

    payload = json.dumps([sorted(tok.get_vocab().items()), tok.pad_token, tok.eos_token, tok.bos_token])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def warm_start(model, adapter_dir: Path) -> dict:
    """Copy the SFT adapter's LoRA (and saved embedding) weights into a fresh adapter; the head stays new."""
    current = get_peft_model_state_dict(model)
    sft = load_file(str(adapter_dir / "adapter_model.safetensors"))
    copied = [k for k in sft if k in current and sft[k].shape == current[k].shape]
    set_peft_model_state_dict(model, {**current, **{k: sft[k] for k in copied}})
    return {"copied_tensors": len(copied), "new_tensors": len(current) - len(copied)}
