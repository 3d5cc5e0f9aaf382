"""The sections of an experiment (rlhf/experiment/config.py builds and checks them): one dataclass per YAML section, every
field typed and documented where it is declared. Stages read their own section: `exp.sft`, `exp.ppo`, `exp.grpo`..."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

ADDED = {"added": True}
"""The metadata of a field added after runs were recorded: at its default it is left out of a run's fingerprint
(added_at_default), so the runs recorded before it existed keep theirs and are reused and resumed."""


def added_at_default(section) -> set[str]:
    """The names of a section's fields added later (ADDED) that hold their default."""
    return {f.name for f in fields(section) if f.metadata.get("added") and getattr(section, f.name) == f.default}


@dataclass
class ModelConfig:
    name: str = "tiny"
    """Hub id or local directory of the base model, or "tiny": a small Llama built from the fields below."""
    revision: str | None = None
    """Hub revision (commit, tag) to pin; None = the hub's default branch."""
    attn_implementation: str = "auto"
    """auto | flash_attention_2 | sdpa | eager. auto picks the best installed: flash_attention_2 > sdpa > eager."""
    dtype: str = "float32"
    """Dtype of the unquantized weights and of compute: float32 | bfloat16 | float16 (bf16 is slow on CPU)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30% more compute."""
    # Architecture of the "tiny" model (ignored for hub models).
    hidden_size: int = 64
    """tiny: width of the residual stream."""
    num_layers: int = 2
    """tiny: number of decoder layers."""
    num_heads: int = 4
    """tiny: attention heads."""
    num_kv_heads: int = 0
    """tiny: key/value heads; fewer than num_heads (and dividing it) is grouped-query attention, as in Llama-3,
    Mistral, Qwen2.5 and Gemma-2. 0 = num_heads."""
    tie_embeddings: bool = False
    """tiny: the output head shares the input embedding's weight (Qwen2.5's small sizes, Gemma)."""
    vocab_size: int = 0
    """tiny: rows of the embedding and head, padded above the tokenizer's size (the extra ids are never produced
    by it), to give the model a large vocabulary (Llama-3's 128,256) at a small cost. 0 = the tokenizer's size."""
    intermediate_size: int = 128
    """tiny: width of the SwiGLU MLP."""
    max_position_embeddings: int = 128
    """tiny: longest sequence the rotary embedding is set up for."""


@dataclass
class QuantizationConfig:
    load_in_4bit: bool = False
    """Store the base's linear layers in 4 bit with bitsandbytes (QLoRA). Embeddings, norms and head stay unquantized."""
    quant_type: str = "nf4"
    """4-bit data type: nf4 | fp4."""
    double_quant: bool = True
    """Quantize the quantization constants too (saves ~0.4 bit/parameter)."""
    compute_dtype: str = "bfloat16"
    """Dtype the 4-bit weights are dequantized to for matmuls: bfloat16 | float16 | float32."""
    quant_storage: str = "uint8"
    """Dtype the packed 4-bit weights are stored in: uint8 | bfloat16 | float16 | float32. FSDP needs every
    parameter in one dtype to flatten them: use bfloat16 (with model.dtype bfloat16) under distributed.strategy=fsdp."""
    dequantized_copy: str = "auto"
    """The online stages (PPO, GRPO, RLOO) on a 4-bit base compute through a copy of its linear layers dequantized
    once to the compute dtype (bf16 on a GPU: the size of the unquantized layers), instead of dequantizing every
    4-bit weight at every call (once per generated token): `run` the whole base for the whole run (rollouts and
    updates), `sampling` the whole base while sampling only (freed before the update), `never` through the 4-bit
    layers, `auto` run when `make memplan` says it has room within memory.budget_gb, else a sampling copy of as many
    decoder layers as have room. The plan shows the choice and the copy's bytes (docs/memory.md)."""


@dataclass
class LoraConfig:
    r: int = 16
    """LoRA rank."""
    alpha: int = 32
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.05
    """Dropout on the LoRA input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names that get adapters; ["all-linear"] = every linear layer but the output head."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full and saved with the adapter (e.g. embed_tokens, lm_head for a tiny model built from
    scratch, whose random embeddings a low-rank update cannot fix)."""


@dataclass
class SyntheticConfig:
    """The offline task: the prompt lists a few letters; the ground-truth reward counts response letters that were in
    the prompt (+1) against letters that were not (-1), divided by max(len, min_len). See rlhf/inputs/data.py."""

    alphabet: int = 16
    """Number of distinct letters (a, b, c, ...)."""
    prompt_letters_min: int = 2
    """Fewest letters in a prompt."""
    prompt_letters_max: int = 4
    """Most letters in a prompt."""
    response_len_min: int = 4
    """Shortest response in the data; shorter responses are scored as if this long."""
    response_len_max: int = 8
    """Longest response in the data."""
    conversational: bool = False
    """Emit the pairs in TRL's conversational format ({role, content} messages), rendered with data.chat_template;
    the letters, responses and ground truth are the same."""


@dataclass
class DataConfig:
    source: str = "synthetic"
    """synthetic | hh-rlhf | jsonl | hub. jsonl and hub read the preference pairs from data.path (the same loader:
    a local .jsonl/.jsonl.gz file, a local dataset directory or a hub dataset id via datasets.load_dataset)."""
    path: str | None = None
    """hh-rlhf: hub id (Anthropic/hh-rlhf) or local .jsonl/.jsonl.gz file(s), comma separated. jsonl/hub: the
    preference file or dataset: {prompt, chosen, rejected} or {chosen, rejected} (implicit prompt), standard or
    conversational."""
    split: str = "train"
    """Split of a hub dataset (or local dataset directory) read for data.path, data.sft_path and data.prompts_path."""
    columns: dict = field(default_factory=dict)
    """Column mapping applied to every record before its format is detected, {name in the data: TRL name}, e.g.
    {question: prompt, response_j: chosen, response_k: rejected}."""
    sft_path: str | None = None
    """SFT file or dataset (any source): prompt-completion, language modeling {text} / {messages},
    {instruction, input, output}, or preference (its chosen side). Default: the chosen side of the preference pool."""
    eval_path: str | None = None
    """Held-out preference file or dataset, used by every stage's eval and `make eval`. Default: a seeded split of
    data.eval_examples pairs from the pool."""
    eval_split: str = "test"
    """Split of a hub dataset (or local dataset directory) read for data.eval_path."""
    prompts_path: str | None = None
    """Prompt-only file or dataset for PPO (and the online RL stages): {prompt} or any record with a prompt, or
    {messages} ending with a user turn. Default: the prompts of the preference pool."""
    chat_template: str | None = None
    """Jinja chat template (or the path of a file holding one) for conversational records; set it for a base model
    that has none (it is saved with the tokenizer). Plain-text records never get a template."""
    sft_examples: int = 2000
    """Training examples for SFT (from data.sft_path, else the chosen responses of the pool). 0 = all."""
    pref_pairs: int = 2000
    """Training preference pairs for the reward model and DPO. 0 = all."""
    judge_fraction: float = 0.2
    """Share of those pairs held out of the reward model's and DPO's training to train the judge: a second reward
    adapter that no stage optimizes against, which grades every policy stage beside the reward model (over-
    optimization shows as the two disagreeing; docs/algorithms.md). A seeded subset; 0 = no judge. DPO and KTO say so
    when no reward model run exists yet: a DPO-only experiment sets 0 to train on them."""
    ppo_prompts: int = 2000
    """Training prompts for PPO (from data.prompts_path, else the pool). 0 = all."""
    eval_examples: int = 200
    """Held-out examples for every stage's eval (and prompts for `make eval`). Disjoint from training data. With
    data.eval_path: the first N of that file (0 = all)."""
    max_length: int = 64
    """Longest prompt + response in tokens in training: TRL's trainers keep a longer sequence's start; SFT's, DPO's
    and KTO's leave out the rows whose prompt alone fills it, the RM's the pairs longer than it, each with a warning
    and a count, and SFT, DPO and KTO count the rows they keep whose end (the response's EOS) is cut (docs/data.md)."""
    max_prompt_length: int = 32
    """Longest prompt in tokens when sampling (online stages, held-out checks, eval): longer ones are cut from the
    left; every stage that samples warns with their count before it starts (generation.cut_prompts), kept in the
    summary's `warnings`."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """Settings of the synthetic task (source=synthetic only)."""


@dataclass
class TrainConfig:
    """Optimization settings shared by the SFT, RM, DPO and KTO stages (each stage has its own copy). TRL's
    TrainingArguments names for them fail in one line naming the field here (rlhf/experiment/trl_names.py:
    TRAIN_REFUSED: per_device_train_batch_size is batch_size / processes, num_train_epochs epochs...)."""

    learning_rate: float = 2e-4
    """Peak learning rate."""
    epochs: float = 1.0
    """Passes over the training data."""
    max_steps: int = -1
    """Stop after this many optimizer steps (-1 = run all epochs)."""
    batch_size: int = 16
    """Examples per forward/backward over all processes: each of N data-parallel ranks takes batch_size / N (which
    must divide evenly). One process: the micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (effective batch = batch_size * grad_accum, whatever the process count)."""
    optim: str = "adamw_torch"
    """Optimizer, by its transformers name: adamw_torch | paged_adamw_8bit | adamw_8bit | ..., given the weight
    decay, betas and eps below whichever it is (transformers' TrainingArguments passes them to each)."""
    lr_scheduler: str = "cosine"
    """Learning-rate schedule (transformers name): cosine | linear | constant_with_warmup | ..."""
    warmup_ratio: float = 0.03
    """Fraction of steps for linear warm-up."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW's), for every `optim`."""
    adam_beta1: float = 0.9
    """AdamW's beta1 (transformers' TrainingArguments.adam_beta1 and its default), for every `optim`."""
    adam_beta2: float = 0.999
    """AdamW's beta2 (TrainingArguments.adam_beta2 and its default), for every `optim`."""
    adam_epsilon: float = 1e-8
    """AdamW's eps (TrainingArguments.adam_epsilon and its default), for every `optim`."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0: no clipping, transformers' meaning)."""
    logging_steps: int = 10
    """Log training metrics every N optimizer steps."""
    eval_steps: int = 0
    """Evaluate every N steps (0 = only at the end)."""
    save_steps: int = 0
    """Checkpoint every N steps (0 = only the final adapter); rerunning a killed run resumes from the newest one."""


@dataclass
class SFTConfig(TrainConfig):
    """SFT (TRL's SFTTrainer). packing, packing_strategy, padding_free, eval_packing, shuffle_dataset,
    completion_only_loss and loss_type are TRL 1.16's SFTConfig's names and defaults, passed to it as set
    (rlhf/recipes/sft.py: TRL_FIELDS); its other fields are refused in one line (trl_names.SFT_REFUSED)."""

    packing: bool = False
    """TRL's packing: several examples per row of data.max_length tokens (strategy `packing_strategy`). Only with
    flash_attention_2 or a trainer that supports it (docs/performance.md)."""
    packing_strategy: str = field(default="bfd", metadata=ADDED)
    """TRL's packing_strategy: bfd (best-fit decreasing, padding-free; a longer example is cut) | bfd_split (the
    overflow becomes another example) | wrapped (one stream cut every data.max_length tokens, across examples)."""
    padding_free: bool = field(default=False, metadata=ADDED)
    """TRL's padding_free: each batch flattened into one sequence, no padding (FlashAttention 2/3, as packing; bfd
    packing turns it on whatever this says)."""
    eval_packing: bool | None = field(default=None, metadata=ADDED)
    """TRL's eval_packing: pack the held-out set (null: as `packing`); the eval loss is over the same tokens either way
    except with wrapped packing."""
    shuffle_dataset: bool = field(default=False, metadata=ADDED)
    """TRL's shuffle_dataset: shuffle the training rows with the top-level seed (before packing, where it decides the
    rows that share a pack: wrapped packing especially); the trainer draws its batches in a seeded order either way."""
    completion_only_loss: bool | None = field(default=None, metadata=ADDED)
    """TRL's completion_only_loss: null (TRL's default) and true train on the completion only (the rows are always
    prompt-completion here: the final assistant turn of a conversation, a language-modeling row's whole text as its
    prompt is empty); false trains on the prompt's tokens too."""
    loss_type: str = field(default="nll", metadata=ADDED)
    """TRL's loss_type: nll (the negative log-likelihood) | dft (Dynamic Fine-Tuning: each token's NLL weighted by
    its probability, detached). With dft the eval loss is DFT's, so no perplexity is reported."""


@dataclass
class RMConfig(TrainConfig):
    margin: bool = False
    """Use the data's `margin` column in the Bradley-Terry loss: -log sigmoid(r_c - r_r - margin)."""
    center_rewards_coefficient: float | None = 0.0
    """TRL's center_rewards_coefficient: weight of an auxiliary (r_c + r_r)^2 term that keeps rewards centred on 0
    (0 or null = off, null being TRL's default; Eisenstein et al. 2023 suggest 0.01). RewardConfig's other fields are
    refused in one line (trl_names.RM_REFUSED)."""
    ensemble: int = 1
    """Reward adapters trained on the one base (member 0 on every training pair; member k on a bootstrap resample
    of them, with seed + k). The online stages score with mean - reward.ensemble_lambda x std over the members
    (Coste et al. 2023). 1 = one reward model."""


@dataclass
class DPOConfig(TrainConfig):
    learning_rate: float = 5e-5
    """As sft.learning_rate; DPO's default `5e-5`: its loss moves the policy further per step than SFT's."""
    beta: float = 0.1
    """Strength of the implicit KL constraint to the reference."""
    loss_type: str | list[str] = "sigmoid"
    """DPO loss variant as named by TRL (sigmoid = the original DPO loss), or TRL's list of them, combined with
    `loss_weights`: e.g. [sigmoid, sft] with [1.0, 1.0] adds the NLL of the chosen responses (RPO-style)."""
    loss_weights: list[float] | None = None
    """Weights of the losses in a `loss_type` list (same length, each 0 or above); None = 1 each."""
    label_smoothing: float = field(default=0.0, metadata=ADDED)
    """TRL's label_smoothing, in [0, 0.5): the probability that a preference label is flipped, read by loss types
    robust (Robust DPO; the paper suggests 0.1), exo_pair (EXO's epsilon; 1e-3), aot and aot_unpaired. exo_pair needs
    it above 0 (TRL refuses 0); robust at 0 is sigmoid, and set with no loss type that reads it it changes nothing:
    both run, as under TRL, with a warning (trl_names.dpo_option_notes)."""
    use_weighting: bool = field(default=False, metadata=ADDED)
    """TRL's use_weighting: weigh each pair's loss by the policy's length-normalized probabilities of its two
    responses (WPO). Not with aot / aot_unpaired."""
    ld_alpha: float | None = field(default=None, metadata=ADDED)
    """TRL's ld_alpha (LD-DPO), in [0, 1]: the weight of the log-probabilities of the tokens past the shorter
    response's length, in both responses (1: no weighting, 0: those tokens masked); None = no weighting."""
    discopop_tau: float = field(default=0.05, metadata=ADDED)
    """TRL's discopop_tau: the temperature of loss_type discopop's log-ratio modulation (the DiscoPOP paper's 0.05);
    above 0, read by discopop only."""
    f_divergence_type: str = field(default="reverse_kl", metadata=ADDED)
    """TRL's f_divergence_type (f-DPO): reverse_kl (DPO's) | forward_kl | js_divergence | alpha_divergence; other than
    reverse_kl only with loss types sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, discopop, sft."""
    f_alpha_divergence_coef: float = field(default=0.5, metadata=ADDED)
    """TRL's f_alpha_divergence_coef: alpha of f_divergence_type alpha_divergence (read by it only)."""
    reference: str = "sft"
    """sft: the reference is the frozen SFT adapter; base: the base with adapters disabled."""
    max_kl_ref: float = 8.0
    """Flag the run (summary `flags`, and a warning) when the held-out check's `eval_kl_ref` passes this: the mean
    over held-out prompts of the exact sequence KL(policy || dpo.reference) at temperature 1 (DPO's), in nats per
    response (0 = off). Replaces max_kl_to_sft (a sampled estimate at eval.temperature, always against SFT)."""
    min_terminated: float = 0.5
    """Flag the run when fewer than this fraction of its held-out responses end with EOS (0 = off)."""
    precompute_ref_log_probs: bool = False
    """TRL's option: compute the reference's log-probabilities of the training pairs once, before training, instead
    of in every step (it saves the reference's forward from the second epoch on; docs/performance.md). Off by
    default, as in TRL; not with data parallelism."""


@dataclass
class KTOConfig(TrainConfig):
    """KTO (TRL's KTOTrainer): each completion is desirable or not, with no pair to compare it with. beta,
    desirable_weight, undesirable_weight and loss_type are TRL 1.16's KTOConfig's names and defaults, its every loss
    field (tests/test_config.py reads them from the installed trl; tests/test_trl_fields.py its other fields, each
    the section's own or refused: rlhf/experiment/trl_names.py KTO_REFUSED)."""

    learning_rate: float = 5e-5
    """As dpo.learning_rate; KTO's default `5e-5`, as DPO's (TRL's KTOConfig: 1e-6, for a whole model; a LoRA
    adapter moves less per step)."""
    beta: float = 0.1
    """Strength of the implicit KL constraint to the reference (TRL's beta)."""
    desirable_weight: float = 1.0
    """Weight of the desirable completions' losses. With unequal counts, TRL (after the KTO paper) advises keeping
    desirable_weight x desirable / (undesirable_weight x undesirable) within [1, 4/3]: raise the rarer side's weight."""
    undesirable_weight: float = 1.0
    """Weight of the undesirable completions' losses (see desirable_weight)."""
    loss_type: str = "kto"
    """TRL's names: kto (the KTO paper's loss, its reference point the KL estimated from each batch's completions
    under the batch's other prompts: the batch must give each process at least 2 rows) | apo_zero_unpaired (APO-zero,
    unpaired: no KL term)."""
    reference: str = "sft"
    """sft: the reference is the frozen SFT adapter; base: the base with adapters disabled (as dpo.reference)."""
    max_kl_ref: float = 8.0
    """Flag the run when the held-out check's `eval_kl_ref` passes this (as dpo.max_kl_ref; 0 = off)."""
    min_terminated: float = 0.5
    """Flag the run when fewer than this fraction of its held-out responses end with EOS (0 = off)."""
    path: str | None = None
    """TRL's unpaired preference data, {prompt, completion, label} (label true: a desirable completion, false: an
    undesirable one; standard or conversational), read as data.path is (a .jsonl/.jsonl.gz file, a dataset directory
    or a hub id; data.columns and data.split apply). None: the preference pool's training pairs (less the judge's),
    unpaired: chosen desirable, rejected not. Planned by memplan at the pool's longest row."""


@dataclass
class RewardConfig:
    """What scores responses in PPO, GRPO and RLOO (the weighted sum of every component; each is logged) and what
    `make eval` and the held-out checks compute win rates with."""

    model: float = 1.0
    """Weight of the trained reward model (its RM adapter on the shared base), on the stage's scale when
    <stage>.normalize_reward; 0 = no reward model (GRPO/RLOO then need no RM stage; PPO still does: its value model
    starts from it)."""
    functions: dict[str, float] = field(default_factory=dict)
    """Python reward functions, `package.module:function: weight`, called as TRL 1.16's GRPOTrainer calls them:
    f(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **columns) -> a number, bool or
    None (does not apply) per completion, where columns are the prompt rows' other fields as lists (an answer key,
    say); see rlhf/rl/rewards.py. When set, eval's win rates use them; otherwise the task's own ground truth (the
    synthetic task's is `rlhf.inputs.data:letters_reward`), else the reward model."""
    judge_functions: dict[str, float] = field(default_factory=dict)
    """A judge of your own: reward functions (as `functions`, `package.module:function: weight`) that grade the
    policy instead of the RM stage's judge adapter, along training (the over-optimization guard: rlhf/rl/overopt.py) and
    in the held-out checks and `make eval` (`judge`). No stage optimizes them, so they must not appear in
    `functions`: a verifier, a rubric, or a call to a larger reward model. Empty: the judge adapter (data.judge_fraction)."""
    judge_model: str = ""
    """A reward model of your own as the judge, instead of the judge adapter: a hub id or a directory holding a
    one-label sequence classifier (TRL's RewardTrainer's output: another base, a larger RM), with its tokenizer; it
    scores with weight 1 beside any judge_functions (rewards.ModelJudge). Loaded once, quantized as model is;
    memplan counts its weights."""
    grader_functions: dict[str, float] = field(default_factory=dict)
    """An independent grader: reward functions (as `functions`, `package.module:function: weight`) that grade the saved
    policy and the last one against SFT in the held-out checks (`eval_win_rates.grader`, labelled independent: they
    neither trained nor selected the policy), nothing else. They must appear in neither `functions` nor
    `judge_functions`."""
    grader_model: str = ""
    """An independent grader model: a hub id or a directory holding a one-label sequence classifier (a public reward
    model of another base, say) with its own tokenizer, the text decoded and tokenized again as TRL does for a reward
    model with its own processing class (rlhf/rl/rewards.py: ModelJudge); it grades as grader_functions do (weight 1
    beside them), and its accuracy on the held-out preference pairs is reported beside its win rate
    (`pair_accuracy`), so its own reliability shows. Loaded once, quantized as model is; memplan counts its weights."""
    ensemble_lambda: float = 1.0
    """With rm.ensemble = K > 1 reward adapters, the reward model's score is mean - ensemble_lambda x std over the K
    members' scores (each on its own held-out scale when <stage>.normalize_reward; std over the K, not K - 1):
    uncertainty-weighted optimization (Coste et al. 2023). 0 = the ensemble's mean."""


@dataclass
class EvalConfig:
    prompts: int = 200
    """Held-out prompts generated from by every policy."""
    max_new_tokens: int = 12
    """Longest generated response."""
    temperature: float = 0.7
    """Sampling temperature (the same for every policy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    samples_in_table: int = 20
    """Prompts shown in the side-by-side sample table."""
    batch_size: int = 64
    """Prompts sampled (and scored) at once by the held-out checks and `make eval`: bounds their KV cache, which
    `make memplan` counts (64 rows of Llama-2-7B at 512 tokens hold 17 GB; PPO's check uses ppo.forward_batch)."""


@dataclass
class MemoryConfig:
    budget_gb: float = 24.0
    """Peak device memory a stage may use; a stage over it fails, naming the phase."""
    enforce: bool = True
    """Fail a stage whose measured peak passes the budget (False = only warn)."""
    cap_to_budget: bool = False
    """CUDA: cap this process's allocator at budget_gb (emulates a 24 GB card on a bigger one)."""
    track_tensors: bool = False
    """CPU: measure the peak of live tensor bytes (a dispatch mode sees every tensor; 7-25% slower, `make bench`).
    False = the process's peak RSS only. The memory gate (experiments/memcheck.yaml) turns it on."""
    preflight: bool = True
    """Refuse to launch a stage whose predicted peak (rlhf/memory/memplan.py) passes budget_gb. False = launch anyway."""


@dataclass
class DistributedConfig:
    """How the experiment is meant to scale out. The launcher (`make <stage> NPROC=n`, `accelerate launch`, `torchrun`)
    decides the process count at run time; these fields are what `make memplan` plans per GPU for."""

    num_processes: int = 1
    """Data-parallel ranks (GPUs) the memory plan is per GPU for."""
    strategy: str = "ddp"
    """ddp: every rank holds everything | fsdp (like zero3): weights, grads, optimizer state sharded over ranks |
    zero2: grads and optimizer state sharded. Pick the matching configs/accelerate/<strategy>.yaml."""


@dataclass
class TrackingConfig:
    backend: str = "none"
    """none | wandb. W&B runs offline unless WANDB_API_KEY is set (sync later with `wandb sync`)."""
    project: str = "rlhf-harness"
    """W&B project."""
