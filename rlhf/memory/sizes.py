"""The bytes of each memory component (memplan.py adds them up per stage): weights, LoRA, gradients, optimizer
state and step, activations per token and layer, the LM head's logits tiles and the generation cache. The per-token
coefficients were derived by counting the tensors each layer saves and checked against the CPU tensor probe."""

from __future__ import annotations

from rlhf.memory.arch import Arch, data_shape
from rlhf.experiment.config import Experiment

GB = 1024**3
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# TRL 1.16's fused LM head (trl/kernels/chunked_logprob.py): TOKEN_CHUNK_SIZE positions x _CHUNKED_LOGPROB_CHUNK_SIZE
# (trl.trainer.utils) vocabulary entries per tile; its buffer is torch.empty at that width whatever the vocabulary
TILE_TOKENS, TILE_VOCAB = 4096, 32768
# our PPO (rlhf/rl/generation.py, rlhf/maths/losses.py) works on float32 logits of the response positions: copies of
# [rows, response + 1, vocab] held at once by a no-grad scoring pass and by an update's graph + backward
PPO_SCORING_LOGITS, PPO_UPDATE_LOGITS = 5, 5
GEN_SAMPLING_BYTES = 40  # per row and vocabulary entry: a generation step's float32 logits through the samplers
# float32 temporaries as wide as the vocabulary chunk that the torch fold of the head's backward (_backward_tile, CPU)
# holds at once: the scaled logits y, z = y / T, log_p, p, the gradient, the target mask (bool: a quarter), mask - p
# and its product with the incoming gradient. Counted on the tensor probe: 7.25 from a vocabulary of 40 to 128k
# (studies/memaccuracy.py --head)
CPU_TILE_TEMPS = 7.25


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
    PEFT copies each saved module separately; on a tied base the causal LM's embedding and head are one copy
    (models.lora_config: ensure_weight_tying), which the reward model's classifier, without a head, saves alone."""
    lora_params, _ = _lora_counts(a, exp)
    tables = [n for n in exp.lora.modules_to_save if n == "embed_tokens" or (n == "lm_head" and head)]
    saved = (1 if a.tied and head and tables else len(tables)) * a.vocab * a.hidden
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


def sampling_copy_bytes(a: Arch, exp: Experiment) -> float:
    """A copy of the decoder's linear layers in the compute dtype: the merged sampler's (rlhf/rl/sampler.py), and the
    training path's dequantized copy of a 4-bit base (models.dequantized)."""
    dtype = exp.quantization.compute_dtype if exp.quantization.load_in_4bit else exp.model.dtype
    return sum(i * o for i, o in a.linears().values()) * a.layers * BYTES[dtype]


def _targets(a: Arch, exp: Experiment) -> dict[str, tuple[int, int]]:
    targets = exp.lora.target_modules
    return a.linears() if targets == ["all-linear"] else {k: v for k, v in a.linears().items() if k in targets}


def _unpadded(exp: Experiment) -> bool:
    """Every training batch is unpadded: the synthetic task with fixed prompt and response lengths (memcheck)."""
    s = exp.data.synthetic
    return (exp.data.source == "synthetic" and s.prompt_letters_min == s.prompt_letters_max
            and s.response_len_min == s.response_len_max)


def padded_length(exp: Experiment) -> int:
    """The sequence length SFT, RM and DPO batches reach: TRL's collators pad each batch to its longest sequence,
    truncated at data.max_length. Where the data and the tokenizer can be read before the stage starts (the
    synthetic task, or local JSONL / hh-rlhf files; the tiny model's word-level tokenizer built as the SFT stage
    builds it, or a local model directory's, with data.chat_template), that is the data's longest tokenized
    prompt + response + EOS (arch.data_shape); otherwise (a hub dataset or tokenizer) data.max_length."""
    return min(exp.data.max_length, data_shape(exp)[1] or exp.data.max_length)


def _sdpa_kv_dim(a: Arch, exp: Experiment, padded: bool = True) -> int:
    """Width of the keys and values attention keeps for the backward pass. With fewer key/value heads than heads,
    transformers' SDPA path repeats them to every head (`repeat_kv`) whenever it needs an attention mask (padded
    batches; PPO's response masks); without one it passes enable_gqa. FlashAttention-2 reads the key/value heads as
    they are."""
    from rlhf.inputs.models import attn_implementation

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
    """TRL 1.16's fused LM head (trl/kernels/chunked_logprob.py, which SFTTrainer and DPOTrainer put on the model),
    at its backward's peak, for `tokens` scored positions: one [min(tokens, 4096), 32768] buffer in the compute dtype
    whatever the vocabulary (torch.empty at the chunk width, _CHUNKED_LOGPROB_CHUNK_SIZE, sliced to the vocabulary:
    the probe and CUDA's allocator count all of it; on CPU the pages a narrow vocabulary never touches are not
    resident, so RSS does not), the float32 gradient of the hidden states, and, where the head trains (lm_head in
    modules_to_save) in a dtype narrower than float32, a float32 accumulator of its gradient. Without Triton (CPU)
    each tile is folded by torch ops that hold CPU_TILE_TEMPS float32 copies of the tile at the vocabulary chunk's
    real width, min(vocabulary, 32768).
    Scored positions: without Triton every position of the padded batch, prompt and padding included
    (rows x (padded length - 1), `padded_length`); with Triton (CUDA) only the labelled ones (the completion
    tokens), which the plan does not know before the data is tokenized: planned as every position, an upper bound."""
    n = min(tokens, TILE_TOKENS)
    b = n * TILE_VOCAB * _act_bytes(a, exp) + tokens * a.hidden * 4
    if head_trains and _act_bytes(a, exp) < 4:
        b += a.vocab * a.hidden * 4
    if _torch_head(exp):
        b += CPU_TILE_TEMPS * n * min(a.vocab, TILE_VOCAB) * 4
    return b
