"""Memory predictor: each stage's peak, component by component, before any weight is loaded.

The architecture comes from the tiny fields of the config, a local config.json, or a built-in table (Llama-2,
Llama-3/3.1-8B, Mistral-7B, Qwen2.5-7B, Gemma-2-9B): vocabulary, tied or untied head, key/value heads, head width.
`make memplan EXP=...` prints the table and stages launched over budget are refused (`memory.preflight`).

What is counted (bytes, per process):
  weights      4-bit linear layers (0.5 B/param + block constants) or dense ones in model.dtype; embeddings, head, norms
  lora         LoRA A/B of every target module, and modules_to_save copies (trainable), per adapter on the base
  grads        one gradient per trainable parameter
  optimizer    AdamW: two states per trainable parameter in its dtype; paged AdamW 8-bit: 2 B/param (+ block scales)
  activations  what the backward pass keeps per token and layer; with gradient checkpointing the layer inputs plus
               one layer recomputed
  logits       TRL's fused LM head works in [min(tokens, 4096), 32768] tiles (32768 wide whatever the vocabulary;
               without Triton, on CPU, its torch fallback adds float32 temporaries as wide as the vocabulary chunk);
               our PPO keeps float32 logits of the response positions (rows x response x vocabulary)
  optimizer_step  AdamW's temporaries during the step, where they outgrow the freed graph (large saved embeddings)
  kv_cache     PPO rollouts: keys and values of every layer for prompt + response, at the key/value heads' width
Embeddings: a tied head is one table; PEFT copies a saved embed_tokens and a saved lm_head separately (tied or not),
and PPO's reward and value adapters (the reward model's) carry no lm_head.
Data parallel (distributed.num_processes = N ranks, one GPU each) - the figures are per GPU: the config's batch
sizes are global, so activations, logits and rollouts use batch / N rows, and by distributed.strategy
  ddp          every rank holds weights, adapters, grads and optimizer state, plus DDP's gradient buckets (about one
               more copy of the trainable gradients)
  zero2        gradients and optimizer state divided by N
  fsdp, zero3  weights, adapters, gradients and optimizer state divided by N, plus one gathered (unsharded) layer:
               the larger of a decoder layer with its LoRA and the embedding / head
  PPO          our own loop (rlhf/ppo.py) replicates the model on every rank whatever the strategy: planned as ddp
The per-token activation coefficients were derived by counting the tensors each layer saves (RMSNorm, the LoRA
paths, rotary, SDPA, SwiGLU) and checked against the CPU tensor probe; tests/test_memory.py asserts +/-15% against
measured stage peaks on eight shapes (vocabularies of ~40 words to 152k, tied and untied heads, fewer key/value
heads than heads, gradient checkpointing on and off).
"""

from __future__ import annotations

import json
import logging

from dataclasses import dataclass, field
from pathlib import Path

from . import stages as registry
from .config import Experiment

log = logging.getLogger(__name__)
GB = 1024**3
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TILE_TOKENS, TILE_VOCAB = 4096, 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE and the kernel's token tile
# our PPO (rlhf/generation.py, rlhf/losses.py) works on float32 logits of the response positions: copies of
# [rows, response + 1, vocab] held at once by a no-grad scoring pass and by an update's graph + backward
PPO_SCORING_LOGITS, PPO_UPDATE_LOGITS = 5, 5
GEN_SAMPLING_BYTES = 40  # per row and vocabulary entry: a generation step's float32 logits through the samplers
CPU_TILE_TEMPS = 6.5  # float32 tile-sized temporaries of the torch fold of the head's backward (_backward_tile)

# Public architecture facts of the shipped 7B bases (config.json of each hub repository).
BUILTIN = {
    "meta-llama/Llama-2-7b-hf": dict(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008),
    "meta-llama/Llama-2-13b-hf": dict(vocab=32000, hidden=5120, layers=40, heads=40, kv_heads=40, intermediate=13824),
    "meta-llama/Llama-2-70b-hf": dict(vocab=32000, hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672),
    "mistralai/Mistral-7B-v0.1": dict(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    "mistralai/Mistral-7B-Instruct-v0.2": dict(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8,
                                               intermediate=14336),
    "meta-llama/Llama-3.1-8B": dict(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    "meta-llama/Llama-3.1-8B-Instruct": dict(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8,
                                             intermediate=14336),
    "meta-llama/Meta-Llama-3-8B": dict(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    "Qwen/Qwen2.5-7B": dict(vocab=152064, hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944),
    "Qwen/Qwen2.5-7B-Instruct": dict(vocab=152064, hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944),
    "Qwen/Qwen2.5-0.5B": dict(vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, tied=True),
    # Gemma-2: head_dim 256 (heads x head_dim = 4096 > hidden), tied head; the memplan models its GeGLU MLP as the
    # gated MLP it is shaped like and ignores the extra post-norms (4 x hidden per token and layer)
    "google/gemma-2-9b": dict(vocab=256000, hidden=3584, layers=42, heads=16, kv_heads=8, intermediate=14336,
                              head_dim=256, tied=True),
}
# Sliding-window attention (Mistral-7B-v0.1, Gemma-2's local layers: 4096 tokens) only bounds the KV cache past 4096
# tokens of context; the shipped experiments stay far below, so the cache is planned over the whole sequence.


class MemoryPlanError(RuntimeError):
    """A stage's predicted peak is over memory.budget_gb."""


class UnknownArchitecture(MemoryPlanError):
    """No config.json and no built-in entry for the model: nothing to predict from."""


@dataclass
class Arch:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int = 0  # 0 = hidden // heads (Gemma-2 sets its own: 256 with hidden 3584 and 16 heads)
    tied: bool = False  # the output head is the input embedding's weight (one copy in memory)

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer (Llama/Mistral/Qwen2/Gemma-2: gated MLP)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def synthetic_vocab(exp: Experiment) -> int:
    """The tiny word-level tokenizer's size on the synthetic task (built from a sample of the data; no weights)."""
    from . import data, models

    rows = data.synthetic_pairs(exp.data.synthetic, 200, exp.seed)
    return len(models.build_tokenizer([r["prompt"] + " " + r["chosen"] + " " + r["rejected"] for r in rows]))


def arch(exp: Experiment) -> Arch:
    m = exp.model
    if m.name == "tiny":
        vocab = m.vocab_size or (synthetic_vocab(exp) if exp.data.source == "synthetic" else 32000)
        return Arch(vocab, m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads or m.num_heads,
                    m.intermediate_size, tied=m.tie_embeddings)
    cfg_file = Path(m.name) / "config.json"
    if cfg_file.exists():
        c = json.loads(cfg_file.read_text())
        c = c.get("text_config", c)  # multimodal wrappers keep the language model's config inside
        # tie_word_embeddings: transformers' default differs by family (Llama/Mistral/Qwen2 False, Gemma True)
        tied = c.get("tie_word_embeddings", c.get("model_type", "").startswith("gemma"))
        return Arch(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                    c.get("num_key_value_heads") or c["num_attention_heads"], c["intermediate_size"],
                    head_dim=c.get("head_dim") or 0, tied=bool(tied))
    if m.name in BUILTIN:
        return Arch(**BUILTIN[m.name])
    raise UnknownArchitecture(f"memplan: no architecture for model.name={m.name!r}: not a local directory with a "
                          f"config.json, and not one of {sorted(BUILTIN)}. Add it to rlhf/memplan.py BUILTIN.")


@dataclass
class Plan:
    stage: str
    components: dict[str, float] = field(default_factory=dict)  # bytes
    peak_phase: str = ""
    budget_gb: float = 24.0
    info: dict[str, float] = field(default_factory=dict)  # bytes, shown beside the table, not part of the peak

    @property
    def peak_gb(self) -> float:
        return sum(self.components.values()) / GB

    @property
    def fits(self) -> bool:
        return self.peak_gb <= self.budget_gb


def _lora_counts(a: Arch, exp: Experiment) -> tuple[int, int]:
    """(LoRA parameters, sum of ranks over the target modules of one layer x layers)."""
    names = _targets(a, exp)
    params = sum(exp.lora.r * (i + o) for i, o in names.values()) * a.layers
    return params, len(names)


def _weights(a: Arch, exp: Experiment, head: bool) -> dict[str, float]:
    """Base weights resident after loading: quantized or dense linear layers, embeddings, head, norms."""
    dt = BYTES[exp.model.dtype]
    linear = sum(i * o for i, o in a.linears().values()) * a.layers
    if exp.quantization.load_in_4bit:
        per = 0.5 + (1 / 64 + 4 / (64 * 256) if exp.quantization.double_quant else 4 / 64)
        w = {"weights_4bit": linear * per}
    else:
        w = {"weights_dense": linear * dt}
    tables = 2 if head and not a.tied else 1  # a tied head is the embedding's weight
    w["embeddings_head_norms"] = (a.vocab * a.hidden * tables + (2 * a.layers + 1) * a.hidden) * dt
    return w


def _trainable(a: Arch, exp: Experiment, head: bool) -> tuple[float, int]:
    """(bytes of one trainable adapter, its parameter count): LoRA + modules_to_save copies, in the compute dtype.
    PEFT copies each saved module separately, so tied embeddings saved as embed_tokens and lm_head are two copies."""
    lora_params, _ = _lora_counts(a, exp)
    saved = 0
    for name in exp.lora.modules_to_save:
        if name == "embed_tokens" or (name == "lm_head" and head):
            saved += a.vocab * a.hidden
    params = lora_params + saved
    dt = BYTES[exp.quantization.compute_dtype if exp.quantization.load_in_4bit else exp.model.dtype]
    return params * dt, params


def _optimizer(params: int, param_bytes: float, optim: str) -> float:
    if "8bit" in optim:
        return params * (2 + 2 * 4 / 256)
    return 2 * param_bytes  # AdamW keeps exp_avg and exp_avg_sq like the parameter


def _largest_trainable(a: Arch, exp: Experiment, head: bool) -> int:
    """Parameters of the largest trainable tensor: a saved embedding / head, else the widest LoRA matrix."""
    saved = [n for n in exp.lora.modules_to_save if n == "embed_tokens" or (n == "lm_head" and head)]
    lora = max(exp.lora.r * max(i, o) for i, o in _targets(a, exp).values())
    return a.vocab * a.hidden if saved else lora


def optimizer_step(a: Arch, exp: Experiment, optim: str, adapter_bytes: float, head: bool) -> float:
    """Transient bytes of one AdamW step beyond its states: torch's single-tensor loop (CPU) holds two
    temporaries the size of the parameter it updates, the multi-tensor (foreach) path on CUDA one temporary of
    every parameter at once; bitsandbytes' 8-bit optimizers update in place."""
    if "8bit" in optim:
        return 0.0
    if exp.device == "cpu":
        dt = BYTES[exp.quantization.compute_dtype if exp.quantization.load_in_4bit else exp.model.dtype]
        return 2 * _largest_trainable(a, exp, head) * dt
    return adapter_bytes


def _act_bytes(a: Arch, exp: Experiment) -> int:
    dt = BYTES[exp.quantization.compute_dtype if exp.quantization.load_in_4bit else exp.model.dtype]
    return dt


def generation_bytes(a: Arch, exp: Experiment, rows: int, seq: int) -> float:
    """Sampling `rows` sequences of `seq` tokens: the cache of the key/value heads (not repeated to every head), and
    each step's float32 logits of the last position through the sampling processors (temperature, top-p's sort with
    its int64 indices, softmax)."""
    return 2 * a.layers * rows * seq * a.kv_dim * _act_bytes(a, exp) + GEN_SAMPLING_BYTES * rows * a.vocab


def _targets(a: Arch, exp: Experiment) -> dict[str, tuple[int, int]]:
    targets = exp.lora.target_modules
    return a.linears() if targets == ["all-linear"] else {k: v for k, v in a.linears().items() if k in targets}


def _unpadded(exp: Experiment) -> bool:
    """Every training batch is unpadded: the synthetic task with fixed prompt and response lengths (memcheck)."""
    s = exp.data.synthetic
    return (exp.data.source == "synthetic" and s.prompt_letters_min == s.prompt_letters_max
            and s.response_len_min == s.response_len_max)


def _sdpa_kv_dim(a: Arch, exp: Experiment, padded: bool = True) -> int:
    """Width of the keys and values attention keeps for the backward pass. With fewer key/value heads than heads,
    transformers' SDPA path repeats them to every head (`repeat_kv`) whenever it needs an attention mask (padded
    batches; PPO's response masks); without one it passes enable_gqa. FlashAttention-2 reads the key/value heads as
    they are."""
    from .models import attn_implementation

    impl = attn_implementation(exp.model.attn_implementation) if exp.device != "cpu" else exp.model.attn_implementation
    return a.kv_dim if impl == "flash_attention_2" or not padded else a.q_dim


def activations(a: Arch, exp: Experiment, tokens: int, dropout: bool = False, padded: bool = True) -> float:
    """Bytes the backward pass keeps for `tokens` tokens through the decoder (see the module docstring).
    `dropout`: LoRA dropout is live (SFT; TRL's DPO and reward trainers and our PPO turn dropout off)."""
    dt = _act_bytes(a, exp)
    _, n_lora = _lora_counts(a, exp)
    h, i, q, kv = a.hidden, a.intermediate, a.q_dim, _sdpa_kv_dim(a, exp, padded)
    # per token and layer: two RMSNorms (input, output), q/k/v/o LoRA inputs and outputs, rotary q/k, SDPA q/k/v/out,
    # SwiGLU gate/up/act/product, plus the LoRA A outputs (rank r per target module)
    per_layer = (6 * h + 4 * q + 2 * kv + 4 * i + n_lora * exp.lora.r) * dt
    if dropout and exp.lora.dropout > 0:  # each LoRA module keeps its dropped input and the boolean mask
        per_layer += sum(fan_in for fan_in, _ in _targets(a, exp).values()) * (dt + 1)
    if exp.model.gradient_checkpointing:
        return tokens * (a.layers * h * dt + per_layer)
    return tokens * a.layers * per_layer


def activations_and_head(a: Arch, exp: Experiment, tokens: int, head: float, dropout: bool,
                         padded: bool = True) -> tuple[float, float]:
    """(activations, head) bytes at the peak of one forward+backward. Without checkpointing the head's buffers come
    on top of every saved activation; with it, the head's backward runs before any layer is recomputed, so the peak
    is the stored layer inputs plus the larger of the head and one recomputed layer."""
    full = activations(a, exp, tokens, dropout, padded)
    if not exp.model.gradient_checkpointing:
        return full, head
    recompute = full - tokens * a.layers * a.hidden * _act_bytes(a, exp)
    return full, max(0.0, head - recompute)  # the head's tile only counts where it outgrows the recomputed layer


def _with_ckpt(exp: Experiment, on: bool, fn):
    saved = exp.model.gradient_checkpointing
    exp.model.gradient_checkpointing = on
    try:
        return fn(exp)
    finally:
        exp.model.gradient_checkpointing = saved


def _torch_head(exp: Experiment) -> bool:
    """TRL's fused head folds each tile with Triton on CUDA; elsewhere (CPU) with whole-tile torch ops."""
    return exp.device == "cpu"


def logits_tile(a: Arch, exp: Experiment, tokens: int, head_trains: bool = False) -> float:
    """TRL 1.16's fused LM head (trl/kernels/chunked_logprob.py), at its backward's peak: one [min(tokens, 4096),
    32768] buffer in the hidden dtype whatever the vocabulary (allocated at the chunk width, sliced to the vocabulary),
    the float32 gradient of the hidden states, and, where the head trains (lm_head in modules_to_save) in a dtype
    narrower than float32, a float32 accumulator of its gradient. Without Triton (CPU) each tile is folded by torch
    ops that hold CPU_TILE_TEMPS float32 copies of the tile at the vocabulary chunk's real width."""
    n = min(tokens, TILE_TOKENS)
    b = n * TILE_VOCAB * _act_bytes(a, exp) + tokens * a.hidden * 4
    if head_trains and _act_bytes(a, exp) < 4:
        b += a.vocab * a.hidden * 4
    if _torch_head(exp):
        b += CPU_TILE_TEMPS * n * min(a.vocab, TILE_VOCAB) * 4
    return b


def ranks(exp: Experiment) -> int:
    return max(1, exp.distributed.num_processes)


def _local(rows: int, exp: Experiment) -> int:
    """A global batch's rows on one rank."""
    return max(1, rows // ranks(exp))


def _shard(p: Plan, a: Arch, exp: Experiment) -> None:
    """Per-GPU figures under the experiment's data-parallel strategy (see the module docstring)."""
    n, strategy = ranks(exp), exp.distributed.strategy
    if registry.get(p.stage).memplan in ("ppo", "grpo"):  # our online RL loops replicate the model on every rank
        strategy = "ddp"
    c = p.components
    if n == 1:
        return
    if strategy == "ddp":
        c["ddp_grad_buckets"] = c["grads"]
    elif strategy == "zero2":
        c["grads"] /= n
        c["optimizer"] /= n
        c["optimizer_step"] = c.get("optimizer_step", 0.0) / n
    else:  # fsdp / zero3: every parameter-sized component is sharded; one unit is gathered at a time
        dense = "weights_4bit" not in c
        linear = sum(i * o for i, o in a.linears().values())
        per = BYTES[exp.model.dtype] if dense else _weights(a, exp, False)["weights_4bit"] / (linear * a.layers)
        lora_layer = _lora_counts(a, exp)[0] / a.layers * BYTES[exp.quantization.compute_dtype if not dense
                                                               else exp.model.dtype]
        embed = a.vocab * a.hidden * BYTES[exp.model.dtype]
        gathered = max(linear * per + lora_layer, embed)
        for k in ("weights_4bit", "weights_dense", "embeddings_head_norms", "lora", "grads", "optimizer",
                  "optimizer_step"):
            if k in c:
                c[k] /= n
        c["gathered_layer"] = gathered


def plan(exp: Experiment, name: str) -> Plan:
    """The stage's predicted peak, by the plan shape its registry entry names (rlhf/stages.py)."""
    a = arch(exp)
    try:
        stage = registry.get(name).memplan
    except KeyError as e:
        raise MemoryPlanError(f"memplan: {e.args[0]}") from None
    if stage is None:
        raise MemoryPlanError(f"memplan: stage {name!r} does not train and has no memory plan")
    head = stage != "rm"
    p = Plan(name, budget_gb=exp.memory.budget_gb)
    c = p.components
    c.update(_weights(a, exp, head))
    adapter_bytes, adapter_params = _trainable(a, exp, head)
    S = exp.data.max_length
    if stage in ("sft", "rm", "dpo"):
        t = getattr(exp, stage)
        # preference stages run chosen and rejected together; each rank takes batch_size / N of the global batch
        rows = _local(t.batch_size, exp) * (1 if stage == "sft" else 2)
        tokens = rows * S
        c["lora"] = adapter_bytes * (2 if stage == "dpo" and exp.dpo.reference == "sft" else 1)
        c["grads"] = adapter_bytes
        c["optimizer"] = _optimizer(adapter_params, adapter_bytes, t.optim)
        trains_head = "lm_head" in exp.lora.modules_to_save
        tile = logits_tile(a, exp, rows * (S - 1), trains_head) if stage != "rm" else 0.0
        c["activations"], c["logits"] = activations_and_head(a, exp, tokens, tile, stage == "sft", not _unpadded(exp))
        # the optimizer step comes after the graph is freed: its temporaries count where they outgrow it
        step = optimizer_step(a, exp, t.optim, adapter_bytes, head)
        c["optimizer_step"] = max(0.0, step - c["activations"] - c["logits"])
        p.info["activations if gradient checkpointing were " + ("off" if exp.model.gradient_checkpointing else "on")] = \
            _with_ckpt(exp, not exp.model.gradient_checkpointing, lambda e: activations(a, e, tokens, stage == "sft"))
        p.peak_phase = "optimizer" if c["optimizer_step"] else "forward_backward"
        if stage in ("sft", "dpo"):
            # the held-out check after training samples eval.prompts, eval.batch_size at a time, with their KV cache;
            # DPO's scores with the reward model when the task has no ground truth: its adapter on the policy's base
            n = min(exp.eval.batch_size, exp.eval.prompts)
            check = generation_bytes(a, exp, n, exp.data.max_prompt_length + exp.eval.max_new_tokens)
            scored_by_rm = stage == "dpo" and exp.data.source != "synthetic"
            if scored_by_rm:
                check += _trainable(a, exp, head=False)[0]
            p.info[f"{stage} held-out check (sampling{', reward adapter' if scored_by_rm else ''})"] = check
            beyond = check - (c["activations"] + c["logits"] + c["optimizer_step"])
            if beyond > 0:  # the peak is the check's: what it needs beyond the training step's transient
                c["held_out_check"], p.peak_phase = beyond, "eval"
        _shard(p, a, exp)
        return p
    # online RL: policy (+ PPO's value) trained; ref, reward, value adapters co-resident on the one base. GRPO/RLOO
    # have no value model, a reference only when beta > 0 and a reward adapter only when reward.model > 0
    pp = getattr(exp, name)
    critic = pp.value_model if stage == "ppo" else None
    reference = pp.reference if stage == "ppo" or pp.beta else None
    uses_rm = stage == "ppo" or bool(exp.reward.model)
    T, P = pp.max_new_tokens, exp.data.max_prompt_length
    # the policy (and the SFT reference) carry the SFT adapter, with its saved lm_head; the reward and value roles
    # carry the reward model's, whose saved modules have no lm_head (a sequence classifier has none)
    rm_bytes, rm_params = _trainable(a, exp, head=False)
    n_sft, n_rm = 1 + (reference == "sft"), int(uses_rm) + (critic == "separate")
    dt = _act_bytes(a, exp)
    c["lora"] = adapter_bytes * n_sft + rm_bytes * n_rm + (2 * a.hidden * 4 if critic else 0)
    trained = 1 + (critic == "separate")
    train_bytes = adapter_bytes + rm_bytes * (trained - 1)
    train_params = adapter_params + rm_params * (trained - 1)
    c["grads"] = train_bytes
    c["optimizer"] = _optimizer(train_params, train_bytes, pp.optim)
    local_rollout = _local(pp.rollout_batch, exp)
    rows = min(pp.forward_batch, local_rollout) if pp.forward_batch else local_rollout
    micro = _local(pp.micro_batch, exp)
    seq = P + T
    # rollout (no grad): generation holds the KV cache; each scoring pass holds one layer's transient tensors, the
    # final hidden states (every layer's with value_model=shared: output_hidden_states) and float32 logits +
    # log-softmax + entropy terms. (Every layer's hidden states for a separate value model too over-predicted the 7B
    # Mistral rollout 2.8x on an H100: results/gpu/.)
    kv = generation_bytes(a, exp, rows, seq)
    kept = a.layers + 1 if critic == "shared" else 1
    scoring = rows * seq * (4 * a.hidden + 3 * a.intermediate + kept * a.hidden) * dt
    scoring += PPO_SCORING_LOGITS * rows * (T + 1) * a.vocab * 4  # logits, /temperature, log-softmax, exp, product
    rollout = max(kv, scoring)
    # update: one micro-batch's graph at a time (a separate value model's loss is backpropagated after the
    # policy's graph is freed: ppo.micro_step), float32 logits + log-softmax + grads of them
    tokens = micro * seq
    acts = activations(a, exp, tokens)
    update_logits = PPO_UPDATE_LOGITS * micro * (T + 1) * a.vocab * 4
    step = optimizer_step(a, exp, pp.optim, train_bytes, True)
    update = max(acts + update_logits, step)
    p.info[f"{name} rollout phase (KV cache or scoring pass)"] = rollout
    p.info[f"{name} update phase (activations + logits)"] = update
    if update >= rollout:
        c["activations"], c["logits"], p.peak_phase = acts, update_logits, "update"
        c["optimizer_step"] = update - acts - update_logits
    else:
        c["kv_cache" if kv >= scoring else "rollout_scoring"], p.peak_phase = rollout, "rollout"
    c["rollout_buffers"] = local_rollout * seq * 8 * 6
    _shard(p, a, exp)
    return p


def _cuda_overhead(p: Plan) -> None:
    """CUDA context and allocator slack (reserved beyond allocated), measured on an H100 (results/gpu/): the process
    holds 0.75 GB beyond what torch reserves, and torch reserves 5-16% beyond its peak allocation in SFT, RM and DPO,
    25-39% in PPO (generation and training passes of different shapes alternate and fragment the cache)."""
    slack = 0.30 if registry.get(p.stage).memplan in ("ppo", "grpo") else 0.10
    p.components["cuda_context_and_cache"] = 0.75 * GB + slack * sum(p.components.values())


def plans(exp: Experiment, stages=None) -> list[Plan]:
    out = [plan(exp, s) for s in (stages or registry.training())]
    if exp.device == "cuda":
        for p in out:
            _cuda_overhead(p)
    return out


def table(exp: Experiment, stages=None) -> str:
    """A per-stage, per-component table (GB) with the predicted peak and the budget."""
    ps = plans(exp, stages)
    names = list(dict.fromkeys(k for p in ps for k in p.components))
    unit, scale = ("GB", GB) if max(p.peak_gb for p in ps) >= 0.5 else ("MB", 1024**2)
    width = max(len(n) for n in names + ["predicted peak"])
    where = (f", per GPU of {ranks(exp)} ({exp.distributed.strategy})" if ranks(exp) > 1 else "")
    lines = [f"memory plan for {exp.name} ({exp.model.name}), {unit}{where}; budget {exp.memory.budget_gb} GB",
             f"{'component':<{width}}" + "".join(f"{p.stage:>18}" for p in ps)]
    for n in names:
        lines.append(f"{n:<{width}}" + "".join(f"{p.components.get(n, 0) / scale:>18.3f}" for p in ps))
    lines.append(f"{'predicted peak':<{width}}" + "".join(f"{p.peak_gb * GB / scale:>18.3f}" for p in ps))
    lines.append(f"{'peak phase':<{width}}" + "".join(f"{p.peak_phase:>18}" for p in ps))
    lines.append(f"{'fits budget':<{width}}" + "".join(f"{'yes' if p.fits else 'NO':>18}" for p in ps))
    for key in dict.fromkeys(k for p in ps for k in p.info):
        lines.append(f"for reference, {key}: " + ", ".join(f"{p.stage} {p.info[key] / scale:.3f}" for p in ps if key in p.info)
                     + f" {unit}")
    return "\n".join(lines)


def preflight(exp: Experiment, stage: str) -> Plan | None:
    """Refuse a stage predicted over budget before anything is loaded (memory.preflight=false launches anyway)."""
    try:
        p = plans(exp, [stage])[0]
    except UnknownArchitecture as e:
        log.warning("%s; launching without a memory prediction", e)
        return None
    if not p.fits and exp.memory.preflight:
        top = sorted(p.components.items(), key=lambda kv: -kv[1])[:3]
        parts = ", ".join(f"{k} {v / GB:.2f} GB" for k, v in top)
        raise MemoryPlanError(f"{stage}: predicted peak {p.peak_gb:.2f} GB > memory.budget_gb={exp.memory.budget_gb} "
                              f"(largest: {parts}). See `make memplan EXP={exp.source or '...'}`; lower the batch "
                              f"or sequence length, or set memory.preflight=false to launch anyway.")
    return p


