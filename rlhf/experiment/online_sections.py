"""The online RL stages' sections (rlhf/experiment/config.py builds and checks them; rlhf/rl/online.py runs them): what PPO, GRPO
and RLOO share (OnlineConfig) and what each adds or changes. Every field is typed and documented where it is declared,
as in rlhf/experiment/sections.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class OnlineConfig:
    """What every online RL stage sets (PPO, GRPO, RLOO; rlhf/rl/online.py): sampling, batch sizes, optimizer, the
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
    learning_rate: float = 1e-4
    """Adam learning rate of the trained adapter(s) (and PPO's value head), constant. Default `1e-4`, a LoRA
    adapter's rate (TRL 0.25.1's PPOConfig: TrainingArguments' 5e-5)."""
    optim: str = "adamw_torch"
    """adamw_torch (torch.optim.AdamW) | paged_adamw_8bit (bitsandbytes), each given the four settings below. Default
    `adamw_torch` (TRL's: adamw_torch_fused, the same update fused on a GPU, accepted and run as adamw_torch): one
    optimizer on every device."""
    weight_decay: float = 0.0
    """Decoupled weight decay of the trained adapter(s) and value head, for either `optim` (bitsandbytes' own
    default, 0.01, is never used)."""
    adam_beta1: float = 0.9
    """AdamW's beta1, for either `optim`."""
    adam_beta2: float = 0.999
    """AdamW's beta2, for either `optim`."""
    adam_epsilon: float = 1e-5
    """AdamW's eps, for either `optim` (never bitsandbytes' own default). PPO's `1e-5` (cleanrl's, what PPO has always
    used here; TRL 0.25.1's PPOConfig: TrainingArguments' 1e-8); GRPO and RLOO declare TRL's."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0: no clipping, as in TRL; the norm is logged either way)."""
    reference: str = "sft"
    """sft: reference = the frozen SFT adapter; base: the base with adapters disabled."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the reward of a response that hit max_new_tokens without EOS. Default `0.0`: off, what TRL
    0.25.1's PPOConfig.missing_eos_penalty=None means."""
    normalize_reward: bool = True
    """Standardize the reward model's scores with the mean/std the RM stage measured on its eval set (the scale the
    EOS penalty, the reward functions' weights and PPO's value head start are on)."""
    forward_batch: int = 0
    """Rows per no-grad pass of the rollout (generation, scoring, reference, values); 0 = the whole rollout_batch.
    Bounds the KV cache and the float32 logits of the rollout (see `make memplan`)."""
    temperature: float = 1.0
    """Rollout sampling temperature (the log-probs are computed at the same temperature). Default `1.0`, TRL 1.16's
    GRPOConfig and RLOOConfig's; for PPO too (TRL 0.25.1's PPOConfig: 0.7), so that the three stages sample alike and
    eval's held-out check (eval.temperature) grades the distribution they trained."""
    top_p: float = 1.0
    """Rollout nucleus sampling threshold."""
    kl_band: list[float] = field(default_factory=lambda: [0.0, 2.0])
    """Acceptable [low, high] of `kl/ref` (the exact KL(policy || reference) at `temperature`, summed over each
    response's tokens and averaged over responses, in nats) over the last 5 iterations; the summary's
    `kl_within_band` says whether the run stayed inside. The high end is also the guard's KL budget: once kl/ref
    averaged over `judge_every` iterations passes it the run has left its budget (flagged; overopt_stop stops it; the
    judge's keep rule keeps a policy measured within it, the SFT policy when none was). A sum over the response, so it
    grows with the response length: a band set for short responses is tight for long ones. Default `[0, 2]`; the tiny
    experiments ship `[2, 6]` (PPO) and `[0.5, 8]` (GRPO, RLOO), the 7B ones `[0, 6]` (not measured at 7B)."""
    log_samples_every: int = 10
    """Log a few sampled responses every N iterations."""
    save_steps: int = 10
    """Checkpoint the trained adapters, optimizer and RNG states every N iterations (0 = only at the end). Default
    `10` (TRL's save_steps: 500 optimizer steps; an iteration here is one or a few)."""
    judge_every: int = 5
    """Every N iterations from the first, and once after the last update, sample judge_prompts fixed training prompts
    with a fixed seed at eval's sampling settings (temperature, top_p, max_new_tokens: as the held-out check grades)
    and score the responses with the judge (data.judge_fraction) and the reward model: `overopt/judge` and
    `overopt/proxy`, and the judge's gain over the SFT policy's samples of the same prompts, paired per prompt, with
    its standard error (rlhf/rl/overopt.py). They draw overoptimization.png and decide the flag, the kept policy and the
    early stop. 0 = never; only when the reward model takes part in the reward."""
    judge_prompts: int = 128
    """Prompts of each judge measurement (the first of the training prompts; a multiple of the processes). Default
    `128`: the paired gain's standard error shrinks as 1/sqrt(n); studies/flag_calibration.py measures the flag's
    error rates at this n."""
    playoff_alpha: float = 0.05
    """The final playoff's level: at the end of a guarded run with keep=judge, the policy the guard chose and its
    challenger (the judge's best measured policy when the guard chose the last one, else the latest one within the
    KL budget) sample playoff_prompts fresh training prompts (beyond the judge's, at a seed no measurement used) and
    are compared once, paired per prompt, on the judge's scale; the challenger is kept when its gain over the
    guard's choice, less playoff_margin of that choice's gain, is significant at this one-sided level (Student's t),
    else the guard's choice stands
    (rlhf/maths/guard.py: playoff). One test of two policies on prompts that selected nothing: no maximum's bias,
    1.65 standard errors at 512 prompts instead of the fall test's 3.5-4.4. The same level confirms a fall before
    it counts (flags, stops the run, changes the kept policy), on as many fresh prompts again, after the playoff's
    (none left: a fall counts as seen). 0 = no playoff and no confirmation. Their time counts in
    throughput.judge_share."""
    playoff_margin: float = 0.2
    """How much better than the guard's choice the playoff's challenger must be, as a share of the guard's choice's
    measured gain over SFT (none when that gain is not positive): the challenger is kept when its paired gain exceeds
    playoff_margin x that gain significantly at playoff_alpha (rlhf/maths/guard.py: playoff). The judge is a proxy:
    with 512 prompts the playoff resolves differences of a few hundredths of a standard deviation, finer than the
    judge's agreement with the truth. On the tiny task's healthy runs the judge preferred an earlier policy by up to
    a fifth of the last one's gain where the truth preferred the last (significantly, in 2 of 24 runs at margin 0, in
    1 at 0.1); the declines it saw were larger. Default `0.2`: the challenger must be better by more than a fifth of
    the guard's choice's gain, or (a choice no better than SFT) better at all (docs/algorithms.md, "The playoff's
    margin"). 0: any significant gain."""
    fall_margin: float = 0.1
    """How big a fall must be before it counts, as a share of what the peak gained over SFT (by the statistic that
    fell; none when the peak gained nothing): on its confirmation's fresh prompts the drop less fall_margin x that
    gain must be significant at playoff_alpha (rlhf/maths/guard.py: confirm). The judge is a proxy, and fresh prompts
    confirm its own small declines as readily as real ones: on the tiny task two healthy runs in 44 stopped at a
    confirmed fall of a tenth of the peak's gain (the truth barely moved) and the declines lost a quarter to three
    quarters of it. Default `0.1` (docs/algorithms.md, "The fall's margin"). 0: any significant drop."""
    playoff_prompts: int = 0
    """Fresh training prompts of the playoff, taken after the judge's, and as many again for a fall's confirmation
    (0: four times judge_prompts, 512 by default; the playoff's 2 x 512 samples are a one-off cost against the
    61 x 128 of a 300-iteration PPO run's measurements, and each fall the judge's prompts see costs 512 more samples,
    the peak's 512 once; studies/fall_simulation.py reports what the saved policy's true gain came to); the playoff is
    skipped when fewer than 8 per process remain, the confirmation likewise."""
    overopt_z: float = 0.0
    """How many standard errors the judge must fall below its peak (paired per prompt) to count as a fall: the
    evidence behind the over-optimization flag and the early stop (rlhf/rl/overopt.py). Default `0`: set from
    overopt_alpha and the run's planned measurements (rlhf/maths/guard.py: fall_z; 3.50 standard errors for 13
    measurements, 3.78 for 21, 4.35 for 61, on 128 prompts); a positive value fixes it whatever the run's length."""
    overopt_alpha: float = 0.05
    """The false-fall budget of a whole run: the chance that a run whose judge holds a plateau is flagged for a fall
    at any of its measurements, at most, by a union bound over every pair of measurements the test can compare, while
    each statistic's expectation holds still, which the win rate's does against SFT's second draw (a seed no
    measurement uses; against SFT's first, same-seed measurement it drifts under correlated measurements):
    studies/fall_simulation.py measures each statistic within alpha / 2 at 13, 21 and 61 measurements, independent and
    AR(1) 0.9 (rlhf/maths/guard.py)."""
    overopt_stop: bool = True
    """Stop the run at the first significant fall of the judge (overopt_z) that fresh prompts confirm (with the
    playoff on: the peak's and the current policy sample fresh prompts of their own, after the playoff's, and are
    compared at playoff_alpha, the drop less fall_margin of the peak's gain; a fall they do not confirm is reported as
    `judge_unconfirmed` and the run goes on): later
    iterations would only train the policy further against the reward model's errors; the summary reports the
    iterations saved."""
    keep: str = "auto"
    """Which policy the run saves (and eval and export use): judge | last | auto (default `auto`: judge when the run
    has a judge, else last). judge: the last policy (the judge measures it after the last update) when the judge
    never fell significantly and the run stayed within its KL budget; otherwise the one-standard-error rule over the
    judge's measurements within the budget, the earliest measured policy whose paired gain over SFT is within one
    standard error of the best one (the SFT policy itself, the first measurement, when no gain stands out). The kept
    policy and the last one are then graded on the held-out prompts, which selected nothing."""
    sampler_is_correction: bool = False
    """TRL's vllm_importance_sampling_correction (GRPOConfig, RLOOConfig; PPO too here), for this harness's sampler
    (the merged copy, not vLLM): the policy terms of the loss are weighted by pi_old / pi_sampler of the sampled
    tokens, truncated or masked (rlhf/maths/losses.py: sampler_is_weight), to correct for the sampler's gap to the
    trained policy (the logged rollout/logprob_gap_*, rollout/sampler_ratio_std). Default `false` (TRL's true with
    vLLM): at the bf16 gap and four times it, on PPO, GRPO and RLOO over 3 seeds, the uncorrected runs learned as the
    clean ones did and the correction gained nothing (docs/algorithms.md, "The sampler and the policy's samples")."""
    sampler_is_mode: str = "sequence_mask"
    """TRL's vllm_importance_sampling_mode: token_truncate, token_mask, sequence_truncate or sequence_mask (TRL's
    default): per token or per response (the summed log-ratio), clamped into the bounds or zeroed outside them.
    loss_type rloo takes the sequence modes."""
    sampler_is_clip_max: float | None = 3.0
    """TRL's vllm_importance_sampling_clip_max (its deprecated vllm_importance_sampling_cap): the upper bound."""
    sampler_is_clip_min: float | None = None
    """TRL's vllm_importance_sampling_clip_min: the lower bound (null: none)."""


KL_STEP = 0.2
"""The adaptive KL controller's clip on its error kl / target_kl - 1: each iteration of n episodes moves beta by a
factor of at most 1 +- KL_STEP x n / kl_horizon (losses.KLController; kl_controller_error's reach)."""


@dataclass
class PPOConfig(OnlineConfig):
    """PPO: per-token KL-penalized rewards, GAE advantages from a value model, clipped policy and value losses. Fields
    by TRL 0.25.1's PPOConfig names (the last TRL with PPO; rlhf/experiment/trl_names.py lists the ones that do not apply)."""

    num_ppo_epochs: int = 4
    """Passes over each rollout batch (TRL's PPOConfig.num_ppo_epochs; formerly `epochs`)."""
    cliprange: float = 0.2
    """Policy ratio clip epsilon (TRL's PPOConfig.cliprange; formerly `clip_range`)."""
    response_length: int = 12
    """Longest response sampled in rollouts (TRL's PPOConfig.response_length; formerly `max_new_tokens`). Default
    `12` (TRL's: 53): the tiny task's responses are at most 8 letters; the hub experiments set their own."""
    kl_estimator: str = "k1"
    """TRL 0.25.1's PPOConfig.kl_estimator: the per-token KL penalty's estimator, k1 (log pi - log pi_ref, TRL's
    default) or k3 (pi_ref / pi - 1 - log(pi_ref / pi): never negative; rlhf/maths/losses.py: kl_penalized_rewards)."""
    whiten_rewards: bool = False
    """TRL 0.25.1's PPOConfig.whiten_rewards: the per-token rewards (KL penalty and score) whitened over the rollout
    batch, their mean kept, before GAE."""

    gamma: float = 1.0
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda."""
    cliprange_value: float = 0.2
    """Value clip: new values stay within this of the rollout values (TRL's PPOConfig.cliprange_value; formerly
    `clip_range_value`)."""
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

    # the names the shared loop (rlhf/rl/online.py, the memory planner) reads, whatever the stage's TRL name
    epochs = property(lambda self: self.num_ppo_epochs)
    clip_range = property(lambda self: self.cliprange)
    max_new_tokens = property(lambda self: self.response_length)
    length_key = "response_length"  # max_new_tokens' name in the section, for messages


def kl_controller_error(p: PPOConfig) -> tuple[str, tuple[str, ...]] | None:
    """What keeps PPO's adaptive KL controller, when on, from reaching its target within the run it is configured
    for (rlhf/experiment/config.py refuses it), or None: a positive target inside kl_band, and a horizon that lets beta move by a
    factor of 2 in steps x rollout_batch episodes (each iteration moves log beta by at most KL_STEP x rollout_batch /
    kl_horizon: losses.KLController), with the keys it is about, the one to change first."""
    if not p.adaptive_kl:
        return None
    if p.target_kl <= 0:
        return f"ppo.target_kl must be > 0 with ppo.adaptive_kl, got {p.target_kl}", ("ppo.target_kl",)
    if not p.kl_band[0] <= p.target_kl <= p.kl_band[1]:
        return (f"ppo.target_kl ({p.target_kl}) is outside ppo.kl_band {p.kl_band}: the controller would steer the "
                f"run out of the band it is checked against; set a band that contains it"), ("ppo.target_kl",
                                                                                           "ppo.kl_band")
    reach = p.steps * KL_STEP * p.rollout_batch / p.kl_horizon  # the most log beta can move over the run
    if reach < math.log(2):
        most = math.floor(p.steps * KL_STEP * p.rollout_batch / math.log(2))
        return (f"ppo.kl_horizon={p.kl_horizon}: over {p.steps} steps x {p.rollout_batch} episodes the controller "
                f"can move beta by a factor of {math.exp(reach):.2f} at most, too little to reach ppo.target_kl; set "
                f"ppo.kl_horizon <= {most}, or ppo.adaptive_kl=false (a fixed beta, ppo.kl_coef)"), (
                    "ppo.kl_horizon", "ppo.steps", "ppo.rollout_batch", "ppo.adaptive_kl")
    return None


@dataclass
class GRPOConfig(OnlineConfig):
    """Critic-free online RL (GRPO; RLOO reads the same fields from its own `rloo` section): each iteration samples
    `num_generations` responses per prompt from the policy adapter, scores them with the `reward` section, and turns
    each response's reward into an advantage against its own group (rlhf/maths/losses.py: group_advantages). With one
    epoch and one minibatch the policy is still the sampler at update time: the old log-probs' pass is skipped."""

    minibatch: int = 64
    """As ppo.minibatch; GRPO's default `64`: the whole rollout batch, one optimizer step per generation batch."""
    num_iterations: int = 1
    """TRL's num_iterations: passes over each rollout batch (formerly `epochs`); 1, TRL's default: the policy is
    still the sampler at update time."""
    epsilon: float = 0.2
    """TRL's epsilon: the policy ratio's clip, [1 - epsilon, 1 + epsilon] (formerly `clip_range`)."""
    max_completion_length: int = 12
    """TRL's max_completion_length: the longest response sampled in rollouts (formerly `max_new_tokens`). Default
    `12` (TRL's: 512): the tiny task's responses are at most 8 letters; the hub experiments set their own."""
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
    """How the per-token loss terms are aggregated, by TRL 1.16's names (rlhf/maths/losses.py: group_policy_loss):
    grpo: each response's token mean, averaged over responses (length-biased); dr_grpo: the sum over the tokens
    divided by responses x max_new_tokens (TRL's max_completion_length), a constant; dapo: the sum over the tokens
    divided by the tokens of the rollout batch per minibatch (TRL's global accumulated batch); bnpo: each
    micro-batch's token mean, averaged over the minibatch's micro-batches (depends on micro_batch, as in TRL);
    rloo: TRL's RLOOTrainer, one clipped ratio per response from its summed token log-ratios, averaged over
    responses. TRL's GRPOConfig defaults to dapo; grpo here keeps this harness's earlier (loss_norm=sequence)
    runs. Replaces loss_norm (sequence = grpo; token = dapo, the same with one minibatch per rollout batch)."""

    epsilon_high: float | None = None
    """TRL's epsilon_high (DAPO's clip-higher): the ratio's upper clip is 1 + epsilon_high (null: epsilon), its lower
    one stays 1 - epsilon; with loss_type cispo, the cap on the ratio that weighs each token (TRL: set it, e.g. 5)."""
    delta: float | None = None
    """TRL's delta (two-sided clipping): the unclipped ratio is capped at delta too, so that a response with a
    negative advantage and a large ratio costs at most delta x |A| (null: off; TRL advises above 1 + epsilon)."""
    importance_sampling_level: str = "token"
    """TRL's importance_sampling_level: token, one ratio per token (GRPO); sequence, one per response, the exp of the
    mean of its tokens' log-ratios, on each of its tokens (GSPO). loss_type rloo has its own per-response ratio."""
    sapo_temperature_pos: float = 1.0
    """TRL's sapo_temperature_pos: tau of loss_type sapo's soft clip sigmoid(tau (r - 1)) 4 / tau where A > 0."""
    sapo_temperature_neg: float = 1.05
    """TRL's sapo_temperature_neg: sapo's tau where A <= 0."""
    top_k: int = 0
    """TRL's top_k: sample from the k most likely tokens only (0: off), as transformers' generate does. The
    log-probs the loss uses are the unfiltered softmax(logits / temperature)'s, as TRL's (so are top_p's)."""
    min_p: float | None = None
    """TRL's min_p: drop the tokens below min_p times the most likely one's probability when sampling (null: off)."""
    repetition_penalty: float = 1.0
    """TRL's repetition_penalty: transformers' penalty on the logits of tokens already in the sequence when sampling
    (1: off)."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """TRL's multi_objective_aggregation: sum_then_normalize (default), the reward section's weighted sum of the reward
    model and the reward functions, then the group advantages; or normalize_then_sum (GDPO, GRPO only), each of them
    normalized within its group first ((r - mean) / (std + 1e-4), a function's None left out), then their weighted sum
    (the EOS penalty one more, weight 1), whitened over the rollout batch (losses.normalize_then_sum)."""
    normalize_advantages: bool = False
    """TRL's RLOOConfig.normalize_advantages: the advantages (after the baseline and scale_rewards) whitened over the
    rollout batch of every process, (A - mean) / (std + 1e-4)."""
    reward_clip_range: list[float] | None = None
    """TRL's RLOOConfig.reward_clip_range: [low, high] each response's reward is clamped to before the KL penalty and
    the advantages (null: not clipped)."""
    off_policy_mask_threshold: float | None = None
    """TRL's off_policy_mask_threshold (DeepSeek-V3.2's off-policy sequence mask): a response with a negative
    advantage whose mean per-token log pi_sampler - log pi is above it takes no part in the policy terms (null: off)."""
    mask_truncated_completions: bool = False
    """TRL's mask_truncated_completions: a response that hit max_completion_length without EOS takes no part in the
    loss (nor in the token counts that normalize it); its reward still counts in its group's advantages."""
    top_entropy_quantile: float = 1.0
    """TRL's top_entropy_quantile: the policy terms of the loss count only on the tokens whose entropy is in this top
    fraction of the micro-batch's (1: every token; 0.2: the top 20%, Wang et al. 2025); the KL term on every
    token. Computed over each process's micro-batch."""
    entropy_coef: float = 0.0
    """TRL's entropy_coef: minus entropy_coef times the token-mean entropy of each micro-batch (over the
    top_entropy_quantile tokens), averaged over the minibatch's micro-batches, is added to the loss (0: off)."""

    # the names the shared loop (rlhf/rl/online.py, the memory planner) reads, whatever the stage's TRL name
    epochs = property(lambda self: self.num_iterations)
    clip_range = property(lambda self: self.epsilon)
    max_new_tokens = property(lambda self: self.max_completion_length)
    length_key = "max_completion_length"  # max_new_tokens' name in the section, for messages


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


def judge_missing(exp, stage: str, section) -> list[str]:
    """What an online `section` lacks for the judge to measure its run, decided from the config before anything
    loads (rlhf/rl/overopt.Judge.on is the same decision on the loaded roles): measurements (judge_every > 0), a
    judge (the RM stage's: data.judge_fraction > 0, or the user's: reward.judge_functions or reward.judge_model) and
    a reward to guard (reward.model or reward.functions). Empty: the run is guarded."""
    r = exp.reward
    return [what for ok, what in ((section.judge_every > 0, f"{stage}.judge_every > 0"),
                                  (exp.data.judge_fraction > 0 or bool(r.judge_functions or r.judge_model),
                                   "data.judge_fraction > 0, reward.judge_functions or reward.judge_model"),
                                  (r.model > 0 or bool(r.functions),
                                   "a reward to guard (reward.model > 0 or reward.functions)"))
            if not ok]


def guarded(exp, section) -> bool:
    """Whether the judge will measure a run of this online `section` (judge_missing finds nothing), so that the roles
    and the memory plan know before anything loads."""
    return not judge_missing(exp, "", section)
