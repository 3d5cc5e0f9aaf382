"""TRL's names in the online sections (rlhf/experiment/online_sections.py; rlhf/experiment/config.py applies them when loading): which of
TRL's fields the sections refuse and why (TRL_REFUSED), the harness's former names of fields now named as TRL names
them (DEPRECATED_PPO, DEPRECATED_GROUP), the group sections' choices and the checks TRL's options need; the same for
the TrainConfig sections (sft, rm, dpo, kto: TRAIN_REFUSED, SFT_REFUSED, RM_REFUSED, PREFERENCE_REFUSED, KTO_REFUSED,
dpo_option_error)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_VLLM = ("this harness samples through its own merged sampler (quantization.dequantized_copy), not vLLM",
         "remove the key")
_HUB = ("run records go to results_dir and the tracking section; nothing is pushed to the hub", "remove the key")
_DS = ("DeepSpeed-only; this harness shards with distributed.strategy", "remove the key")
_LOGGED = ("sampled responses are logged every log_samples_every iterations to the run record",
           "set log_samples_every")
_SAMPLER = ("this harness samples with its own sampler (rlhf/rl/sampler.py)", "remove the key")
_MODEL = ("the model section loads the base (model.name, model.dtype, model.attn_implementation)",
          "set the model section")
_TRAINER = ("this harness has its own loop; nothing is read from transformers' Trainer", "remove the key")
_SAMPLER_IS = ("the sampler is this harness's merged copy, not vLLM: its correction is named for it",
               "set sampler_is_correction, sampler_is_mode, sampler_is_clip_max, sampler_is_clip_min")

TRL_REFUSED: dict[str, tuple[str, str]] = {
    # TRL 1.16's GRPOConfig / RLOOConfig (their own fields)
    "model_init_kwargs": _MODEL,
    "trust_remote_code": ("the harness loads only models transformers implements", "remove the key"),
    "router_aux_loss_coef": ("mixture-of-experts routers only; the harness trains LoRA on dense decoders",
                             "remove the key"),
    "disable_dropout": ("the only dropout trained here is LoRA's", "set lora.dropout=0"),
    "cast_lm_head_to_fp32": ("the log-probs are computed in float32 from the head's logits already",
                             "remove the key"),
    "num_generations_eval": ("eval samples one response per held-out prompt (the eval section)",
                             "set eval.prompts / eval.max_new_tokens"),
    "ds3_gather_for_generation": _DS,
    "shuffle_dataset": ("the prompts are drawn in a seeded order (the top-level seed)", "set seed"),
    "pad_to_multiple_of": ("responses are padded to the batch's longest", "remove the key"),
    "generation_batch_size": ("one generation batch is the section's rollout_batch", "set <stage>.rollout_batch"),
    "steps_per_generation": ("optimizer steps per generation batch are rollout_batch / minibatch",
                             "set <stage>.minibatch"),
    "generation_kwargs": ("sampling is set by the section's named fields",
                          "set <stage>.temperature, <stage>.top_p (or remove the key)"),
    "chat_template_kwargs": ("conversational prompts are rendered with data.chat_template", "set data.chat_template"),
    "cache_implementation": _SAMPLER,
    "use_transformers_continuous_batching": _SAMPLER,
    "transformers_continuous_batching_config": _SAMPLER,
    "use_transformers_paged": _SAMPLER,
    "use_vllm": _VLLM, "vllm_mode": _VLLM, "vllm_model_impl": _VLLM, "vllm_enable_sleep_mode": _VLLM,
    "vllm_structured_outputs_regex": _VLLM, "vllm_server_base_url": _VLLM, "vllm_server_host": _VLLM,
    "vllm_server_port": _VLLM, "vllm_server_timeout": _VLLM, "vllm_group_port": _VLLM,
    "vllm_gpu_memory_utilization": _VLLM, "vllm_max_model_length": _VLLM, "vllm_tensor_parallel_size": _VLLM,
    "vllm_importance_sampling_correction": _SAMPLER_IS, "vllm_importance_sampling_mode": _SAMPLER_IS,
    "vllm_importance_sampling_clip_max": _SAMPLER_IS, "vllm_importance_sampling_clip_min": _SAMPLER_IS,
    "vllm_importance_sampling_cap": _SAMPLER_IS,
    "vespo_k_pos": ("loss_type vespo is not implemented here", "remove the key"),
    "vespo_lambda_pos": ("loss_type vespo is not implemented here", "remove the key"),
    "vespo_k_neg": ("loss_type vespo is not implemented here", "remove the key"),
    "vespo_lambda_neg": ("loss_type vespo is not implemented here", "remove the key"),
    "reward_weights": ("the reward section weighs each reward by name, for every online stage: reward.model (the reward "
                       "model's weight) and reward.functions {import path: weight}", "set the weights there"),
    "sync_ref_model": ("the reference is the frozen SFT adapter or the base (reference); TR-DPO's syncing of it is "
                       "not implemented", "remove the key"),
    "ref_model_mixup_alpha": ("goes with sync_ref_model, which is not implemented", "remove the key"),
    "ref_model_sync_steps": ("goes with sync_ref_model, which is not implemented", "remove the key"),
    "use_adaptive_entropy": ("the adaptive entropy controller is not implemented", "remove the key"),
    "entropy_coef_min": ("goes with use_adaptive_entropy, which is not implemented", "remove the key"),
    "entropy_coef_max": ("goes with use_adaptive_entropy, which is not implemented", "remove the key"),
    "entropy_coef_delta": ("goes with use_adaptive_entropy, which is not implemented", "remove the key"),
    "entropy_target": ("goes with use_adaptive_entropy, which is not implemented", "remove the key"),
    "max_tool_calling_iterations": ("the harness samples plain responses; no tool calls", "remove the key"),
    "log_completions": _LOGGED, "num_completions_to_print": _LOGGED, "log_unique_prompts": _LOGGED,
    "log_multimodal": ("the harness trains text models", "remove the key"),
    "log_completions_hub_repo": _HUB,
    # TRL 0.25.1's PPOConfig (and OnPolicyConfig, its base) own fields
    "exp_name": ("the experiment's name is the top-level name", "set name"),
    "reward_model_path": ("the reward model is the rm stage's adapter on the same base", "run make rm"),
    "sft_model_path": ("the policy starts from the sft stage's adapter", "run make sft"),
    "model_adapter_name": ("the adapters' names are the harness's (rlhf/rl/roles.py)", "remove the key"),
    "ref_adapter_name": ("the reference is chosen by the section's reference (sft | base)", "set <stage>.reference"),
    "num_mini_batches": ("minibatches are set by their size in responses",
                         "set <stage>.minibatch = <stage>.rollout_batch / num_mini_batches"),
    "total_episodes": ("a run's episodes are steps x rollout_batch", "set <stage>.steps"),
    "local_rollout_forward_batch_size": ("the rollout's no-grad passes take forward_batch rows at a time",
                                         "set <stage>.forward_batch"),
    "num_sample_generations": _LOGGED,
    "stop_token": ("responses always end at the tokenizer's EOS here", "remove the key"),
    "stop_token_id": ("responses always end at the tokenizer's EOS here", "remove the key"),
    "dataset_num_proc": ("the prompts are tokenized in one process", "remove the key"),
    "world_size": ("set by the launch", "set distributed.num_processes"),
    "num_total_batches": ("computed: steps", "set <stage>.steps"),
    "micro_batch_size": ("the harness's own name", "set <stage>.micro_batch (responses per forward/backward, global)"),
    "local_batch_size": ("computed from the global sizes", "set <stage>.rollout_batch"),
    "batch_size": ("the harness's own name", "set <stage>.rollout_batch (responses per iteration, global)"),
    "local_mini_batch_size": ("computed from the global sizes", "set <stage>.minibatch"),
    "mini_batch_size": ("the harness's own name", "set <stage>.minibatch (responses per optimizer step, global)"),
    # transformers' TrainingArguments, the fields a TRL user commonly sets (the rest fail as unknown keys)
    "per_device_train_batch_size": ("batch sizes are global here", "set <stage>.micro_batch (responses per "
                                    "forward/backward, over all processes)"),
    "gradient_accumulation_steps": ("accumulation follows from the global sizes", "set <stage>.minibatch "
                                    "(= <stage>.micro_batch x accumulation steps)"),
    "num_train_epochs": ("a run is a number of iterations, one rollout batch each", "set <stage>.steps"),
    "max_steps": ("a run is a number of iterations, one rollout batch each", "set <stage>.steps"),
    "seed": ("one seed for the whole experiment", "set the top-level seed"),
    "bf16": ("the compute dtype is the model's", "set model.dtype / quantization.compute_dtype"),
    "fp16": ("the compute dtype is the model's", "set model.dtype / quantization.compute_dtype"),
    "gradient_checkpointing": ("set for the model once", "set model.gradient_checkpointing"),
    "logging_steps": ("every iteration is logged", "remove the key"),
    "output_dir": ("runs are recorded under results_dir/<name>/<stage>/", "set the top-level results_dir"),
    "run_name": ("runs are named by the experiment and a run id", "set the top-level name"),
    "report_to": ("the tracking section chooses the backend", "set tracking.backend"),
    "lr_scheduler_type": ("the learning rate is constant here", "remove the key"),
    "warmup_steps": ("the learning rate is constant here (no warmup)", "remove the key"),
    "save_strategy": ("checkpoints are every save_steps iterations", "set save_steps"),
    "save_total_limit": ("a run keeps its latest checkpoint", "remove the key"),
    "eval_strategy": ("the judge measures every judge_every iterations; eval runs after the stage",
                      "set judge_every"),
    "eval_steps": ("the judge measures every judge_every iterations", "set judge_every"),
    "per_device_eval_batch_size": ("eval has its own section", "set eval.batch_size"),
    "push_to_hub": _HUB, "hub_model_id": _HUB, "hub_token": _HUB, "hub_strategy": _HUB, "hub_private_repo": _HUB,
    "deepspeed": _DS,
    "fsdp": ("sharding is the distributed section's", "set distributed.strategy"),
    "torch_compile": ("the sampler compiles its own decode step", "remove the key"),
    "remove_unused_columns": _TRAINER, "dataloader_num_workers": _TRAINER,
    "lr_scheduler_kwargs": ("the learning rate is constant here", "remove the key"),
}
"""TRL's fields (GRPOConfig, RLOOConfig, TRL 0.25.1's PPOConfig, and the TrainingArguments a TRL user commonly sets)
that the online sections refuse: {name: (why it does not apply here, what to do instead)}. A config that sets one
fails in one line naming it (rlhf/experiment/config.py); every other TRL field is the section's own, by TRL's name
(tests/test_trl_fields.py reads TRL's dataclasses and fails on a field in neither)."""

_OURS = ("the field is named otherwise here", "set <stage>.{}")
TRAIN_REFUSED: dict[str, tuple[str, str]] = {
    # transformers' TrainingArguments a TRL user sets on SFTConfig, RewardConfig, DPOConfig, KTOConfig (the sft, rm,
    # dpo and kto sections; learning_rate, max_steps, optim, weight_decay, adam_*, max_grad_norm, logging_steps,
    # eval_steps and save_steps are their own fields)
    "per_device_train_batch_size": ("batch sizes are over all processes here: each of N ranks takes batch_size / N",
                                    "set <stage>.batch_size = per-device batch x processes"),
    "per_device_eval_batch_size": ("the trainer evaluates <stage>.batch_size rows at a time; the held-out checks "
                                   "take eval.batch_size", "set <stage>.batch_size or eval.batch_size"),
    "gradient_accumulation_steps": (_OURS[0], _OURS[1].format("grad_accum")),
    "num_train_epochs": (_OURS[0], _OURS[1].format("epochs")),
    "lr_scheduler_type": (_OURS[0], _OURS[1].format("lr_scheduler")),
    "lr_scheduler_kwargs": ("the schedule is named by <stage>.lr_scheduler alone", "remove the key"),
    "use_liger_kernel": ("Liger's kernels are not wired here", "remove the key"),
    "warmup_steps": ("warm-up is a share of the steps here", "set <stage>.warmup_ratio"),
    "seed": TRL_REFUSED["seed"], "bf16": TRL_REFUSED["bf16"], "fp16": TRL_REFUSED["fp16"],
    "gradient_checkpointing": TRL_REFUSED["gradient_checkpointing"], "output_dir": TRL_REFUSED["output_dir"],
    "run_name": TRL_REFUSED["run_name"], "report_to": TRL_REFUSED["report_to"],
    "save_strategy": ("checkpoints are every <stage>.save_steps steps (0: the final adapter only)",
                      "set <stage>.save_steps"),
    "eval_strategy": ("the trainer evaluates every <stage>.eval_steps steps (0: at the end only)",
                      "set <stage>.eval_steps"),
    "push_to_hub": _HUB, "hub_model_id": _HUB, "hub_token": _HUB, "hub_strategy": _HUB, "hub_private_repo": _HUB,
    "deepspeed": _DS, "fsdp": TRL_REFUSED["fsdp"],
    "torch_compile": ("TRL's trainers run uncompiled here", "remove the key"),
    "remove_unused_columns": ("set for TRL's trainers by the harness (rlhf/recipes/trainers.py)", "remove the key"),
    "dataloader_num_workers": ("set for TRL's trainers by the harness (rlhf/recipes/trainers.py)", "remove the key"),
}
"""The TrainingArguments a TRL user commonly sets that the TrainConfig sections (sft, rm, dpo, kto) refuse, `<stage>`
standing for the section: {name: (why it does not apply here, what to do instead)}, as TRL_REFUSED for the online
sections (rlhf/experiment/config.py: REFUSED)."""

_LENGTH = ("sequence lengths are the data section's, one for every stage (TRL 1.16 keeps a longer sequence's start and "
           "leaves out a row whose prompt alone fills it)", "set data.max_length (prompt + completion) and "
           "data.max_prompt_length")
_PREFERENCE_SHARED: dict[str, tuple[str, str]] = {
    **TRAIN_REFUSED,
    # fields TRL 1.16's DPOConfig and KTOConfig both have (their loss fields are the sections' own)
    "max_length": _LENGTH,
    "pad_to_multiple_of": ("sequences are padded to the batch's longest (TRL's default off Neuron)", "remove the key"),
    "dataset_num_proc": TRL_REFUSED["dataset_num_proc"],
    "model_init_kwargs": TRL_REFUSED["model_init_kwargs"], "trust_remote_code": TRL_REFUSED["trust_remote_code"],
    "router_aux_loss_coef": TRL_REFUSED["router_aux_loss_coef"],
    "disable_dropout": ("TRL's default (true) holds: dropout is off in the policy and the reference, LoRA's too",
                        "remove the key"),
    "activation_offloading": ("memplan plans the activations on the device; offloading them is not wired",
                              "set model.gradient_checkpointing to save activation memory"),
    "sync_ref_model": TRL_REFUSED["sync_ref_model"], "ref_model_mixup_alpha": TRL_REFUSED["ref_model_mixup_alpha"],
    "ref_model_sync_steps": TRL_REFUSED["ref_model_sync_steps"],
    # TRL 0.x's DPOConfig and KTOConfig (gone in 1.x; a config written for them fails here in one line, not as an
    # unknown key)
    "max_prompt_length": _LENGTH, "max_completion_length": _LENGTH,
}
PREFERENCE_REFUSED: dict[str, tuple[str, str]] = {
    **_PREFERENCE_SHARED,
    # DPOConfig's alone
    "truncation_mode": _LENGTH,
    "padding_free": ("TRL 1.16's DPOTrainer has it disabled (it warns and pads)", "remove the key"),
    "pad_token": ("deprecated in TRL 1.16; the harness sets the tokenizer's pad token", "remove the key"),
    "precompute_ref_batch_size": ("the reference's precompute pass takes <stage>.batch_size rows, as memplan plans",
                                  "set <stage>.batch_size"),
    # TRL 0.x's DPOConfig
    "rpo_alpha": ("TRL 1.x mixes losses by list", "set dpo.loss_type [sigmoid, sft] and dpo.loss_weights "
                  "[1.0, rpo_alpha]"),
}
"""TRL's DPOConfig fields (and TRAIN_REFUSED's TrainingArguments) that the dpo section refuses; every other field of
TRL 1.16's DPOConfig is the section's own (tests/test_trl_fields.py)."""
_KTO_REFERENCE = ("not wired for KTO here: its reference runs in every step (dpo has it)", "remove the key")
KTO_REFUSED: dict[str, tuple[str, str]] = {
    **_PREFERENCE_SHARED,
    # KTOConfig's alone, and a TrainingArguments field TRL's KTOTrainer reads
    "precompute_ref_log_probs": _KTO_REFERENCE, "precompute_ref_batch_size": _KTO_REFERENCE,
    "train_sampling_strategy": ("TRL's sequential order holds (the kto loss's KL term pairs each row with its batch "
                                "neighbours)", "remove the key"),
}
"""TRL's KTOConfig fields (and TRAIN_REFUSED's TrainingArguments) that the kto section refuses; every other field of
TRL 1.16's KTOConfig is the section's own (tests/test_trl_fields.py)."""
_TRAIN_LENGTH = ("sequence lengths are the data section's, one for every stage", "set data.max_length")
_EOS = ("every stage ends a response with the tokenizer's EOS (the sampler stops at it, the reward model scores it): "
        "another end token here would train a stop that no later stage uses", "remove the key")
_TEMPLATE = ("the chat template is data.chat_template (a Jinja string or file), set on the tokenizer and saved with "
             "every adapter, so every stage renders alike", "set data.chat_template")
_COMMON_SFT_RM: dict[str, tuple[str, str]] = {
    **TRAIN_REFUSED,
    # fields TRL 1.16's SFTConfig and RewardConfig both have
    "max_length": (_TRAIN_LENGTH[0] + " (TRL 1.16's SFTTrainer keeps a longer sequence's start; its RewardTrainer "
                   "leaves out a pair longer than it)", _TRAIN_LENGTH[1]),
    "model_init_kwargs": TRL_REFUSED["model_init_kwargs"], "trust_remote_code": TRL_REFUSED["trust_remote_code"],
    "chat_template_path": _TEMPLATE, "eos_token": _EOS,
    "dataset_num_proc": ("the data are tokenized in one process", "remove the key"),
    "pad_to_multiple_of": PREFERENCE_REFUSED["pad_to_multiple_of"], "pad_token": PREFERENCE_REFUSED["pad_token"],
    "activation_offloading": PREFERENCE_REFUSED["activation_offloading"],
}
SFT_REFUSED: dict[str, tuple[str, str]] = {
    **_COMMON_SFT_RM,
    # TRL 1.16's SFTConfig (packing, packing_strategy, padding_free, eval_packing, shuffle_dataset,
    # completion_only_loss and loss_type are the section's own)
    "truncation_mode": (_TRAIN_LENGTH[0] + " (TRL 1.16 keeps a longer sequence's start, its only mode)",
                        _TRAIN_LENGTH[1]),
    "router_aux_loss_coef": TRL_REFUSED["router_aux_loss_coef"],
    "dataset_text_field": ("SFT trains on prompt-completion rows (a language-modeling 'text' row is one with an empty "
                           "prompt); data.columns renames a file's columns", "set data.sft_path in one of the formats "
                           "of docs/data.md, and data.columns {your_column: text} (or prompt / completion)"),
    "dataset_kwargs": ("the harness hands TRL prompt-completion rows for it to tokenize (skip_prepare_dataset would "
                       "train on untokenized text)", "remove the key"),
    "assistant_only_loss": ("conversational rows reach TRL rendered by the chat template as prompt and completion "
                            "text, and the loss is on the completion: the final assistant turn and its end-of-turn "
                            "token (sft.completion_only_loss, TRL's default)", "remove the key"),
}
"""TRL 1.16's SFTConfig fields (and TRAIN_REFUSED's TrainingArguments) that the sft section refuses; every other field
of SFTConfig is the section's own (tests/test_trl_fields.py)."""
RM_REFUSED: dict[str, tuple[str, str]] = {
    **_COMMON_SFT_RM,
    # TRL 1.16's RewardConfig (center_rewards_coefficient is the section's own)
    "disable_dropout": ("TRL's default (true) holds: dropout is off in the reward model, LoRA's too",
                        "remove the key"),
}
"""TRL 1.16's RewardConfig fields (and TRAIN_REFUSED's TrainingArguments) that the rm section refuses; every other
field of RewardConfig is the section's own (tests/test_trl_fields.py)."""
SFT_LOSS_TYPES = {"nll", "dft", "chunked_nll"}
"""TRL 1.16's SFTConfig loss types (sft.loss_type; chunked_nll is TRL's deprecated name of nll, which it warns
about)."""
SFT_PACKING_STRATEGIES = {"bfd", "bfd_split", "wrapped", "bfd-requeue"}
"""TRL 1.16's SFTConfig packing strategies (sft.packing_strategy; bfd-requeue is TRL's deprecated name of bfd_split,
which it warns about)."""

FORMER_TRL = {"max_prompt_length", "max_completion_length", "rpo_alpha"}
"""The refused names that TRL 1.16's DPOConfig and KTOConfig no longer have (a TRL 0.x config's; rpo_alpha was
DPOConfig's alone)."""

DEPRECATED_PPO = {"epochs": "num_ppo_epochs", "clip_range": "cliprange", "clip_range_value": "cliprange_value",
                  "max_new_tokens": "response_length"}
"""The ppo section's former names of fields now named as TRL 0.25.1's PPOConfig names them: {old: the field}."""
DEPRECATED_GROUP = {"epochs": "num_iterations", "clip_range": "epsilon", "max_new_tokens": "max_completion_length"}
"""The grpo and rloo sections' former names of fields now named as TRL 1.16's GRPOConfig names them."""

DPO_LOSS_TYPES = {"sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"}
"""TRL 1.16's DPOConfig loss types (dpo.loss_type, one or a list; TRL checks them only once training has started)."""

DPO_F_DIVERGENCES = {"reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"}
"""TRL 1.16's DPOConfig.f_divergence_type values (dpo.f_divergence_type)."""
F_DIVERGENCE_LOSS_TYPES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
"""The loss types TRL 1.16's DPOTrainer takes with an f_divergence_type other than reverse_kl (it raises otherwise)."""
SMOOTHED = {"robust": "0.1 (the Robust DPO paper's)", "exo_pair": "1e-3 (the EXO paper's)"}
"""The DPO loss types that need label_smoothing above 0 (TRL 1.16's robust loss at 0 is sigmoid's, exo_pair's takes the
log of it), with the value their paper suggests."""
LABEL_SMOOTHING_READERS = ("robust", "exo_pair", "aot", "aot_unpaired")
"""The DPO loss types whose TRL 1.16 loss reads label_smoothing (sigmoid's does not: TRL 0.x's conservative DPO is
robust or aot here)."""


def dpo_option_error(o, name: str = "dpo") -> tuple[str | tuple[str, ...], str] | None:
    """(the dotted key, or the keys it is about together; a one-line reason) for what a dpo section `o` sets of
    TRL's loss options that no loss can run with, or None. The values are checked as TRL 1.16's DPOTrainer does when
    it is built (its ValueError or NotImplementedError), or as its DPOConfig documents them; what TRL runs but that
    changes nothing is dpo_option_notes'."""
    lt = o.loss_type if isinstance(o.loss_type, list) else [o.loss_type]
    if not lt:
        return f"{name}.loss_type", f"{name}.loss_type is an empty list; name one TRL loss type (sigmoid) or several"
    if o.loss_weights is not None and len(o.loss_weights) != len(lt):
        return ((f"{name}.loss_weights", f"{name}.loss_type"), f"{name}.loss_weights ({o.loss_weights}) must "
                f"have one weight per {name}.loss_type ({o.loss_type}); set {name}.loss_weights=null to weigh each "
                f"type 1, or one weight per type")
    ls = o.label_smoothing
    if "robust" in lt and not 0 <= ls < 0.5:  # TRL 1.16 refuses it there (its robust loss divides by 1 - 2 ls)
        return (f"{name}.label_smoothing", f"{name}.label_smoothing must be in [0, 0.5) for loss_type robust (the "
                f"probability that a preference label is flipped), got {ls}")
    if "exo_pair" in lt and ls == 0:
        return (f"{name}.loss_type", f"{name}.loss_type exo_pair needs {name}.label_smoothing above 0 (TRL 1.16 "
                f"refuses it at 0 when training starts); set it, e.g. to {SMOOTHED['exo_pair']}")
    if o.ld_alpha is not None and not 0 <= o.ld_alpha <= 1:
        return f"{name}.ld_alpha", f"{name}.ld_alpha must be in [0, 1] (or null: no LD-DPO weighting), got {o.ld_alpha}"
    if o.f_divergence_type != "reverse_kl" and not set(lt) <= F_DIVERGENCE_LOSS_TYPES:
        return (f"{name}.f_divergence_type", f"{name}.f_divergence_type={o.f_divergence_type} takes only loss types "
                f"{', '.join(sorted(F_DIVERGENCE_LOSS_TYPES))} (TRL 1.16 refuses "
                f"{', '.join(sorted(set(lt) - F_DIVERGENCE_LOSS_TYPES))}); use reverse_kl or those")
    if o.use_weighting and set(lt) & {"aot", "aot_unpaired"}:
        return (f"{name}.use_weighting", f"{name}.use_weighting (WPO) does not go with loss types aot, aot_unpaired, "
                f"which sort the pairs (TRL 1.16 raises NotImplementedError); use another loss type or remove the key")
    return None


def dpo_option_notes(o, name: str = "dpo") -> list[str]:
    """What a dpo section `o` sets that TRL 1.16 runs but that changes nothing (no loss it names reads the option,
    or reads it at a value where it is another loss): the config runs as written, as it does under TRL, and these
    say so (the DPO stage's warnings, said as it starts: preference.Method.notes)."""
    lt = o.loss_type if isinstance(o.loss_type, list) else [o.loss_type]
    notes = []
    twice = sorted({t for t in lt if lt.count(t) > 1})
    if twice:
        notes.append(f"{name}.loss_type names {twice[0]!r} twice: TRL adds its loss twice, as one with the summed "
                     f"{name}.loss_weights weight would")
    if o.loss_weights is not None and (any(w < 0 for w in o.loss_weights) or not any(o.loss_weights)):
        notes.append(f"{name}.loss_weights {o.loss_weights}: a negative weight maximizes its loss, all 0 trains "
                     f"nothing")
    if "robust" in lt and o.label_smoothing == 0:
        notes.append(f"{name}.loss_type robust at {name}.label_smoothing 0 is TRL's sigmoid loss; set "
                     f"{name}.label_smoothing (e.g. {SMOOTHED['robust']}) for the robust loss")
    if o.label_smoothing and not set(lt) & set(LABEL_SMOOTHING_READERS):
        notes.append(f"{name}.label_smoothing={o.label_smoothing} is read only by loss types "
                     f"{', '.join(LABEL_SMOOTHING_READERS)} (TRL 1.16's sigmoid ignores it: no conservative DPO): it "
                     f"changes nothing here")
    if o.discopop_tau != 0.05 and "discopop" not in lt:
        notes.append(f"{name}.discopop_tau is read only by loss_type discopop: it changes nothing here")
    if o.f_alpha_divergence_coef != 0.5 and o.f_divergence_type != "alpha_divergence":
        notes.append(f"{name}.f_alpha_divergence_coef is read only with {name}.f_divergence_type "
                     f"alpha_divergence: it changes nothing here")
    return notes


GROUP_CHOICES = {
    "kl_penalty": {"loss", "reward"},
    # rlhf/maths/losses.py's LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS, SCALE_REWARDS, SAMPLER_IS_MODES (no torch here)
    "loss_type": {"grpo", "bnpo", "dr_grpo", "dapo", "rloo", "cispo", "sapo"},
    "importance_sampling_level": {"token", "sequence"},
    "multi_objective_aggregation": {"sum_then_normalize", "normalize_then_sum"},
    "sampler_is_mode": {"token_truncate", "token_mask", "sequence_truncate", "sequence_mask"},
    "scale_rewards": {"group", "batch", "none", True, False},
}
"""The values each grpo / rloo field takes (rlhf/experiment/config.py's CHOICES)."""


def undeprecated(data: dict, deprecated: dict[str, str], origin: str, error: type[Exception],
                 prefix: str = "") -> dict:
    """`data` (a section's keys under `prefix`, or a whole experiment's) with the `deprecated` dotted keys ({old: new})
    under their new names, each with a one-line warning; both names of one field set at once raise `error`."""
    out = {}
    for key, value in data.items():
        where = f"{prefix}{key}"
        if isinstance(value, dict) and not prefix and any(k.startswith(f"{key}.") for k in deprecated):
            value = undeprecated(value, deprecated, origin, error, f"{key}.")
        if where in deprecated:
            new = deprecated[where]
            log.warning("%s: '%s' is deprecated: it is '%s' now (TRL's name)", origin, where, new)
            key = new.rsplit(".", 1)[1]
            if key in data:
                raise error(f"{origin}: '{where}' and '{new}' both set; keep '{new}' (TRL's name)")
        out[key] = value
    return out


def group_option_error(g, name: str) -> str | None:
    """What a grpo / rloo section `g` (named `name`) sets of TRL's options that cannot hold together, or None."""
    if g.importance_sampling_level == "sequence" and g.loss_type == "rloo":
        return (f"{name}.importance_sampling_level=sequence does not apply to loss_type rloo, whose ratio is per "
                f"response already; use loss_type grpo (GSPO) or level token")
    if g.sampler_is_correction and g.loss_type == "rloo" and not g.sampler_is_mode.startswith("sequence"):
        return (f"{name}.sampler_is_mode={g.sampler_is_mode} is per token; loss_type rloo weighs each response: use "
                f"sequence_truncate or sequence_mask")
    if g.multi_objective_aggregation == "normalize_then_sum" and (name == "rloo" or g.kl_penalty == "reward"):
        return (f"{name}.multi_objective_aggregation=normalize_then_sum is GRPO's (TRL's RLOOConfig has none) and takes "
                f"the KL as a loss term ({name}.kl_penalty: loss), not in each reward; use sum_then_normalize")
    if g.reward_clip_range is not None and (len(g.reward_clip_range) != 2
                                            or g.reward_clip_range[0] > g.reward_clip_range[1]):
        return f"{name}.reward_clip_range must be [low, high] with low <= high, got {g.reward_clip_range}"
    if g.loss_type == "rloo" and (g.top_entropy_quantile < 1 or g.off_policy_mask_threshold is not None):
        return (f"{name}.top_entropy_quantile and {name}.off_policy_mask_threshold choose tokens or responses of the "
                f"per-token losses; loss_type rloo's is per response: use loss_type grpo (or dapo...) or unset them")
    if not 0 < g.top_entropy_quantile <= 1:
        return f"{name}.top_entropy_quantile must be in (0, 1], got {g.top_entropy_quantile}"
    return None
