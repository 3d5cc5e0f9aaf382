# The stage targets, written from the stage registry (rlhf/experiment/stages.py) by `python -m rlhf.experiment.stages > stages.mk`:
# do not edit; tests/test_stages.py fails when this file is not what the registry writes.
STAGES := sft rm dpo kto ppo grpo rloo eval export
.PHONY: $(STAGES) pipeline

sft: install  ## supervised fine-tuning on the chosen responses (always trains; resumes a killed run)
	$(RLHF) sft --exp $(EXP) $(ARGS)

rm: install  ## reward model (reuses the SFT run if its config and data are unchanged, else trains SFT first)
	$(RLHF) sft --exp $(EXP) --reuse $(ARGS)
	$(RLHF) rm --exp $(EXP) $(ARGS)

dpo: install  ## DPO from the SFT adapter (reuses an unchanged SFT run)
	$(RLHF) sft --exp $(EXP) --reuse $(ARGS)
	$(RLHF) dpo --exp $(EXP) $(ARGS)

kto: install  ## KTO from the SFT adapter on unpaired feedback (kto.path, else the pairs unpaired; reuses SFT)
	$(RLHF) sft --exp $(EXP) --reuse $(ARGS)
	$(RLHF) kto --exp $(EXP) $(ARGS)

ppo: install  ## PPO with the reward model (reuses unchanged SFT and RM runs)
	$(RLHF) sft --exp $(EXP) --reuse $(ARGS)
	$(RLHF) rm --exp $(EXP) --reuse $(ARGS)
	$(RLHF) ppo --exp $(EXP) $(ARGS)

grpo: install  ## GRPO: G responses per prompt, group-relative advantages, no critic (reuses SFT; RM if reward.model>0)
	$(RLHF) sft --exp $(EXP) --reuse $(ARGS)
	$(RLHF) rm --exp $(EXP) --reuse --for grpo $(ARGS)
	$(RLHF) grpo --exp $(EXP) $(ARGS)

rloo: install  ## RLOO: GRPO's loop with the leave-one-out baseline (reuses SFT; RM if reward.model>0)
	$(RLHF) sft --exp $(EXP) --reuse $(ARGS)
	$(RLHF) rm --exp $(EXP) --reuse --for rloo $(ARGS)
	$(RLHF) rloo --exp $(EXP) $(ARGS)

eval: install  ## compare every finished policy with SFT on the same held-out prompts, by every grader
	$(RLHF1) eval --exp $(EXP) $(ARGS)

pipeline: install  ## every training stage on one SFT run (sft, rm, dpo, kto, ppo, grpo, rloo), then eval
	$(RLHF) sft --exp $(EXP) $(ARGS)
	$(RLHF) rm --exp $(EXP) $(ARGS)
	$(RLHF) dpo --exp $(EXP) $(ARGS)
	$(RLHF) kto --exp $(EXP) $(ARGS)
	$(RLHF) ppo --exp $(EXP) $(ARGS)
	$(RLHF) grpo --exp $(EXP) $(ARGS)
	$(RLHF) rloo --exp $(EXP) $(ARGS)
	$(RLHF1) eval --exp $(EXP) $(ARGS)

export: install  ## export STAGE's adapter; MERGE=1 merges it into the base as safetensors
	$(RLHF1) export --exp $(EXP) --from-stage $(STAGE) $(if $(MERGE),--merge) $(ARGS)
