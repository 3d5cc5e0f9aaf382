"""The sections of an experiment (rlhf/config.py builds and checks them): one dataclass per YAML section, every
field typed and documented where it is declared. Stages read their own section: `exp.sft`, `exp.ppo`, `exp.grpo`..."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    the prompt (+1) against letters that were not (-1), divided by max(len, min_len). See rlhf/data.py."""

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
    optimization shows as the two disagreeing; docs/algorithms.md). A seeded subset; 0 = no judge."""
    ppo_prompts: int = 2000
    """Training prompts for PPO (from data.prompts_path, else the pool). 0 = all."""
    eval_examples: int = 200
    """Held-out examples for every stage's eval (and prompts for `make eval`). Disjoint from training data. With
    data.eval_path: the first N of that file (0 = all)."""
    max_length: int = 64
    """Longest prompt + response in tokens; longer examples are truncated (prompt kept from the right)."""
    max_prompt_length: int = 32
    """Longest prompt in tokens (left-truncated); used by PPO, DPO and eval."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """Settings of the synthetic task (source=synthetic only)."""


@dataclass
class TrainConfig:
    """Optimization settings shared by the SFT, RM and DPO stages (each stage has its own copy)."""

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
    """Gradient clipping norm."""
    logging_steps: int = 10
    """Log training metrics every N optimizer steps."""
    eval_steps: int = 0
    """Evaluate every N steps (0 = only at the end)."""
    save_steps: int = 0
    """Checkpoint every N steps (0 = only the final adapter); rerunning a killed run resumes from the newest one."""


@dataclass
class SFTConfig(TrainConfig):
    packing: bool = False
    """Pack several examples per row (padding-free). Only with flash_attention_2 or a trainer that supports it."""


@dataclass
class RMConfig(TrainConfig):
    margin: bool = False
    """Use the data's `margin` column in the Bradley-Terry loss: -log sigmoid(r_c - r_r - margin)."""
    center_rewards_coefficient: float = 0.0
    """Weight of an auxiliary (r_c + r_r)^2 term that keeps rewards centred on 0 (0 = off)."""
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
    """Weights of the losses in a `loss_type` list (same length); None = 1 each."""
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
class OnlineConfig:
    """What every online RL stage sets (PPO, GRPO, RLOO; rlhf/online.py): sampling, batch sizes, optimizer, the
    reference and the checkpoints. Defaults here are PPO's; GRPOConfig and RLOOConfig declare the few they change."""

    steps: int = 40
    """Iterations; each samples one rollout batch, then runs `epochs` passes of updates over it."""
    rollout_batch: int = 64
    """Responses (episodes) sampled per iteration, over all processes: each of N ranks samples rollout_batch / N
    of them (GRPO/RLOO: prompts x num_generations)."""
    minibatch: int = 16
    """Responses per optimizer step within the epochs (rollout_batch must be a multiple); global, like
    rollout_batch."""
    micro_batch: int = 16
    """Responses per forward/backward (global: micro_batch / N per rank); gradients accumulate over
    minibatch / micro_batch passes. The loss is normalized by the whole minibatch's tokens (or responses), so the
    update does not depend on how a minibatch is split into micro-batches or ranks."""
    epochs: int = 4
    """Passes over each rollout batch (TRL's num_iterations)."""
    learning_rate: float = 1e-4
    """Adam learning rate of the trained adapter(s) (and PPO's value head), constant."""
    optim: str = "adamw_torch"
    """adamw_torch (torch.optim.AdamW) | paged_adamw_8bit (bitsandbytes), each given the four settings below."""
    weight_decay: float = 0.0
    """Decoupled weight decay of the trained adapter(s) and value head, for either `optim` (bitsandbytes' own
    default, 0.01, is never used)."""
    adam_beta1: float = 0.9
    """AdamW's beta1, for either `optim`."""
    adam_beta2: float = 0.999
    """AdamW's beta2, for either `optim`."""
    adam_epsilon: float = 1e-5
    """AdamW's eps, for either `optim` (1e-5: what the online stages have always used; bitsandbytes' default 1e-8
    is never used)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    clip_range: float = 0.2
    """Policy ratio clip epsilon."""
    reference: str = "sft"
    """sft: reference = the frozen SFT adapter; base: the base with adapters disabled."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the reward of a response that hit max_new_tokens without EOS (0 = off)."""
    normalize_reward: bool = True
    """Standardize the reward model's scores with the mean/std the RM stage measured on its eval set (the scale the
    EOS penalty, the reward functions' weights and PPO's value head start are on)."""
    forward_batch: int = 0
    """Rows per no-grad pass of the rollout (generation, scoring, reference, values); 0 = the whole rollout_batch.
    Bounds the KV cache and the float32 logits of the rollout (see `make memplan`)."""
    max_new_tokens: int = 12
    """Longest response sampled in rollouts."""
    temperature: float = 1.0
    """Rollout sampling temperature (the log-probs are computed at the same temperature)."""
    top_p: float = 1.0
    """Rollout nucleus sampling threshold."""
    kl_band: list[float] = field(default_factory=lambda: [0.0, 2.0])
    """Acceptable [low, high] of `kl/ref` (the exact KL(policy || reference) at `temperature`, summed over each
    response's tokens and averaged over responses, in nats) over the last 5 iterations; the summary's
    `kl_within_band` says whether the run stayed inside."""
    log_samples_every: int = 10
    """Log a few sampled responses every N iterations."""
    save_steps: int = 10
    """Checkpoint the trained adapters, optimizer and RNG states every N iterations (0 = only at the end)."""
    judge_every: int = 5
    """Every N iterations from the first, sample judge_prompts fixed training prompts with a fixed seed and score
    the responses with the judge (data.judge_fraction) and the reward model: `overopt/judge` and `overopt/proxy`,
    the curves of the run's overoptimization.png and its over-optimization flag (rlhf/overopt.py). 0 = never; only
    when the reward model takes part in the reward."""
    judge_prompts: int = 64
    """Prompts of each judge measurement (the first of the training prompts; a multiple of the processes)."""
    overopt_confirm: float = 0.25
    """The share of the reward model's gain since the first judge measurement that the judge must confirm (each gain
    in its own held-out standard deviations); below it the run is flagged as over-optimized (rlhf/overopt.py). Sound
    tiny runs confirmed 0.35 and 0.79 of it; docs/algorithms.md."""
    keep: str = "last"
    """Which policy the run saves (and eval and export use): last | judge_best: of the judge_every measurements
    whose gain the judge confirms (overopt_confirm), the policy it scored highest; the SFT policy (the first
    measurement) when it confirms none."""


@dataclass
class PPOConfig(OnlineConfig):
    """PPO: per-token KL-penalized rewards, GAE advantages from a value model, clipped policy and value losses."""

    gamma: float = 1.0
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda."""
    clip_range_value: float = 0.2
    """Value clip: new values stay within this of the rollout values."""
    vf_coef: float = 0.1
    """Weight of the value loss."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus (0 = off)."""
    target_kl_stop: float = 0.0
    """Stop the PPO epochs of an iteration early once approx_kl (old vs new policy) exceeds this (0 = never)."""
    whiten_advantages: bool = True
    """Normalize advantages to zero mean, unit variance over the rollout batch."""
    kl_coef: float = 0.05
    """Initial beta of the per-token KL penalty -beta * (logp_policy - logp_ref)."""
    adaptive_kl: bool = True
    """Adapt beta toward `target_kl` (Ziegler et al. proportional controller); False = fixed beta."""
    target_kl: float = 1.0
    """Target sequence-level KL (nats per response) for the adaptive controller."""
    kl_horizon: int = 10000
    """Horizon (episodes) of the adaptive KL controller: beta moves by at most 20% * episodes / horizon a step."""
    value_model: str = "separate"
    """separate: value head on its own LoRA adapter (more stable); shared: value head on the policy's trunk."""
    greedy: bool = False
    """Greedy rollouts (no sampling): reproducible whatever the batch split, e.g. to compare 1 and N processes."""


@dataclass
class GRPOConfig(OnlineConfig):
    """Critic-free online RL (GRPO; RLOO reads the same fields from its own `rloo` section): each iteration samples
    `num_generations` responses per prompt from the policy adapter, scores them with the `reward` section, and turns
    each response's reward into an advantage against its own group (rlhf/losses.py: group_advantages). With one
    epoch and one minibatch the policy is still the sampler at update time: the old log-probs' pass is skipped."""

    minibatch: int = 64
    """As ppo.minibatch; GRPO's default `64`: the whole rollout batch, one optimizer step per generation batch."""
    epochs: int = 1
    """As ppo.epochs; GRPO's default `1`: the policy is still the sampler at update time (TRL's num_iterations=1)."""
    learning_rate: float = 1e-5
    """As ppo.learning_rate; GRPO's default `1e-5`: TRL's usual rate for GRPO and RLOO."""
    num_generations: int = 8
    """G: responses sampled per prompt; the group its advantages are relative to (>= 2)."""
    beta: float = 0.04
    """KL coefficient to the reference; 0 skips the reference pass entirely (and `kl/ref` is 0)."""
    kl_penalty: str = "loss"
    """loss: beta * KL is a per-token loss term, Schulman's k3 estimator (TRL's GRPOTrainer); reward: beta times the
    response's summed log-ratio log pi - log pi_ref (k1, at the sampling policy) is subtracted from its reward before
    the advantages (TRL's RLOOTrainer, Ahmadian et al. 2024). Either way `reward/mean` is the reward before it and
    `reward/kl_penalty` the mean subtracted (0 with kl_penalty=loss)."""
    scale_rewards: bool | str = "group"
    """TRL 1.16's GRPOConfig.scale_rewards: group: divide each group's centred rewards by the group's std (GRPO);
    batch: by the std of the whole rollout batch's rewards; none: centred only (Dr. GRPO's advantages). true and
    false are read as group and none, as TRL reads them."""
    loss_type: str = "grpo"
    """How the per-token loss terms are aggregated, by TRL 1.16's names (rlhf/losses.py: group_policy_loss):
    grpo: each response's token mean, averaged over responses (length-biased); dr_grpo: the sum over the tokens
    divided by responses x max_new_tokens (TRL's max_completion_length), a constant; dapo: the sum over the tokens
    divided by the tokens of the rollout batch per minibatch (TRL's global accumulated batch); bnpo: each
    micro-batch's token mean, averaged over the minibatch's micro-batches (depends on micro_batch, as in TRL);
    rloo: TRL's RLOOTrainer, one clipped ratio per response from its summed token log-ratios, averaged over
    responses. TRL's GRPOConfig defaults to dapo; grpo here keeps this harness's earlier (loss_norm=sequence)
    runs. Replaces loss_norm (sequence = grpo; token = dapo, the same with one minibatch per rollout batch)."""


@dataclass
class RLOOConfig(GRPOConfig):
    """RLOO: the same loop as GRPO with the leave-one-out baseline (the mean reward of the group's other responses),
    and TRL 1.16's RLOOTrainer defaults where they decide the algorithm: the sequence-ratio loss, the KL in the
    reward, no std scaling."""

    kl_penalty: str = "reward"
    """As grpo.kl_penalty; RLOO's default `reward` is TRL's: the KL in the reward."""
    scale_rewards: bool | str = "none"
    """As grpo.scale_rewards; RLOO's default `none` is TRL's (RLOOConfig.normalize_advantages=False)."""
    loss_type: str = "rloo"
    """As grpo.loss_type; RLOO's default `rloo` is TRL's RLOOTrainer loss."""


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
    say); see rlhf/rewards.py. When set, eval's win rates use them; otherwise the task's own ground truth (the
    synthetic task's is `rlhf.data:letters_reward`), else the reward model."""
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
