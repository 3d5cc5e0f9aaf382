"""The online RL stages' sections (rlhf/config.py builds and checks them; rlhf/online.py runs them): what PPO, GRPO
and RLOO share (OnlineConfig) and what each adds or changes. Every field is typed and documented where it is declared,
as in rlhf/sections.py."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """AdamW's eps, for either `optim` (never bitsandbytes' own default). PPO's `1e-5` (cleanrl's, what PPO has always
    used here); GRPO and RLOO declare TRL's."""
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
    """Every N iterations from the first, and once after the last update, sample judge_prompts fixed training prompts
    with a fixed seed at eval's sampling settings (temperature, top_p, max_new_tokens: as the held-out check grades)
    and score the responses with the judge (data.judge_fraction) and the reward model: `overopt/judge` and
    `overopt/proxy`, and the judge's gain over the SFT policy's samples of the same prompts, paired per prompt, with
    its standard error (rlhf/overopt.py). They draw overoptimization.png and decide the flag, the kept policy and the
    early stop. 0 = never; only when the reward model takes part in the reward."""
    judge_prompts: int = 128
    """Prompts of each judge measurement (the first of the training prompts; a multiple of the processes). Default
    `128`: the paired gain's standard error shrinks as 1/sqrt(n); studies/flag_calibration.py measures the flag's
    error rates at this n."""
    overopt_z: float = 0.0
    """How many standard errors the judge must fall below its peak (paired per prompt) to count as a fall: the
    evidence behind the over-optimization flag and the early stop (rlhf/overopt.py). Default `0`: set from
    overopt_alpha and the run's planned measurements (rlhf/guard.py: fall_z; 3.50 standard errors for 13
    measurements, 3.78 for 21, 4.35 for 61, on 128 prompts); a positive value fixes it whatever the run's length."""
    overopt_alpha: float = 0.05
    """The false-fall budget of a whole run: the chance that a run whose judge holds a plateau is flagged for a fall
    at any of its measurements, at most (a union bound over every pair of measurements the test can compare;
    studies/fall_simulation.py measures the rates it gives)."""
    overopt_stop: bool = True
    """Stop the run at the first significant fall of the judge (overopt_z): later iterations would only train the
    policy further against the reward model's errors; the summary reports the iterations saved."""
    keep: str = "auto"
    """Which policy the run saves (and eval and export use): judge | last | auto (default `auto`: judge when the run
    has a judge, else last). judge: the last policy (the judge measures it after the last update) when the judge
    never fell significantly and the run stayed within its KL budget; otherwise the one-standard-error rule over the
    judge's measurements within the budget, the earliest measured policy whose paired gain over SFT is within one
    standard error of the best one (the SFT policy itself, the first measurement, when no gain stands out). The kept
    policy and the last one are then graded on the held-out prompts, which selected nothing."""


KL_STEP = 0.2
"""The adaptive KL controller's clip on its error kl / target_kl - 1: each iteration of n episodes moves beta by a
factor of at most 1 +- KL_STEP x n / kl_horizon (losses.KLController; config.check_kl_controller's reach)."""


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
    """Beta of the per-token KL penalty -beta * (logp_policy - logp_ref) (the initial one with adaptive_kl). Default
    `0.05`, TRL's PPOConfig.kl_coef: with the guard (keep, the early stop, kl_band's budget) it matched the best
    unguarded setting with a reward model of modest accuracy and never lost to SFT with a weak one, over three seeds
    on the ground-truth task (docs/algorithms.md)."""
    adaptive_kl: bool = False
    """Adapt beta toward `target_kl` (Ziegler et al. proportional controller); default `false`: a fixed beta, as TRL.
    The controller must be able to reach its target in the run: target_kl > 0, inside kl_band, and a kl_horizon
    short enough for beta to move by a factor of 2 over steps x rollout_batch episodes (checked when loading)."""
    target_kl: float = 1.0
    """Target sequence-level KL (nats per response) for the adaptive controller."""
    kl_horizon: int = 10000
    """Horizon (episodes) of the adaptive KL controller: beta moves by at most KL_STEP (20%) x episodes / horizon a
    step."""
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
    """As ppo.learning_rate; GRPO's and RLOO's default `1e-5`, ten times TRL 1.16's GRPOConfig and RLOOConfig default
    (1e-6), which is a rate for training the whole model: here a LoRA adapter trains, which needs a larger one."""
    adam_epsilon: float = 1e-8
    """As ppo.adam_epsilon; GRPO's and RLOO's default `1e-8` is TRL's (TrainingArguments.adam_epsilon, which
    GRPOConfig and RLOOConfig keep), so that a TRL user's GRPO settings mean the same here."""
    num_generations: int = 8
    """G: responses sampled per prompt; the group its advantages are relative to (>= 2). Default `8`, TRL 1.16's
    GRPOConfig's; RLOO's too (TRL's RLOOConfig: 2), so that GRPO and RLOO sample alike and compare at one budget."""
    judge_every: int = 15
    """As ppo.judge_every; GRPO's default `15`: without a critic an iteration is cheap, and a measurement (128
    prompts sampled and scored, about 1.15 of tiny.yaml's GRPO iterations) every 5 took 14% of the run's iteration
    time (throughput.judge_share) and every 10 10.5%; every 15, 8% (PPO's every 5: 4-8%)."""
    beta: float = 0.04
    """KL coefficient to the reference; 0 skips the reference pass entirely (and `kl/ref` is 0). GRPO's default
    `0.04` (TRL 1.16's GRPOConfig: 0.0, no KL term) keeps the KL to the SFT reference measured and penalized: the
    over-optimization guard's KL budget (kl_band) reads it."""
    kl_penalty: str = "loss"
    """loss: beta * KL is a per-token loss term, Schulman's k3 estimator (TRL's GRPOTrainer); reward: beta times the
    response's summed log-ratio log pi - log pi_ref (k1, at the sampling policy) is subtracted from its reward before
    the advantages (TRL's RLOOTrainer, Ahmadian et al. 2024). Either way `reward/mean` is the reward before it and
    `reward/kl_penalty` the mean subtracted (0 with kl_penalty=loss)."""
    use_bias_correction_kl: bool = True
    """TRL 1.16's GRPOConfig.use_bias_correction_kl (its default `true`): with kl_penalty=loss, each token's k3 term
    is multiplied by that token's importance ratio pi / pi_old (differentiable, 1 in value on-policy), which makes
    the KL term's gradient the unbiased gradient of the reverse KL to the reference (DeepSeek-V3.2) instead of k3's
    own, biased one. It changes the gradient even on-policy; false is the k3 term alone (GRPO's paper, TRL before
    1.x). Not used with kl_penalty=reward."""
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
    reward with its beta, no std scaling. Its learning rate and group size are GRPO's (see there why they are not
    TRL's)."""

    beta: float = 0.05
    """As grpo.beta; RLOO's default `0.05` is TRL 1.16's RLOOConfig.beta: the weight of the KL in the reward."""
    kl_penalty: str = "reward"
    """As grpo.kl_penalty; RLOO's default `reward` is TRL's: the KL in the reward."""
    scale_rewards: bool | str = "none"
    """As grpo.scale_rewards; RLOO's default `none` is TRL's (RLOOConfig.normalize_advantages=False)."""
    loss_type: str = "rloo"
    """As grpo.loss_type; RLOO's default `rloo` is TRL's RLOOTrainer loss."""
