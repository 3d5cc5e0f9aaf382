# rlhf-harness. `make help` lists the targets. The first use creates .venv and installs the pinned toolchain.
EXP ?= experiments/tiny.yaml
ARGS ?=
STAGE ?= sft
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION := $(shell sed -n 's/^torch==//p' requirements.lock)
RLHF := $(PY) -m rlhf

.DEFAULT_GOAL := help
.PHONY: help install sft rm dpo ppo eval pipeline export test clean

help:  ## list the targets
	@echo "usage: make <target> [EXP=experiments/x.yaml] [ARGS='key=value ...']"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | awk -F'\t' '{printf "  %-10s %s\n", $$1, $$2}'

# The one install path, shared with the Docker image: venv, torch==$(TORCH_VERSION) first, then
# `pip install -c requirements.lock -e .`
$(VENV)/.installed: pyproject.toml requirements.lock scripts/install.sh
	scripts/install.sh $(VENV)
	touch $@

install: $(VENV)/.installed  ## create .venv with the pinned versions (requirements.lock)

sft: install  ## supervised fine-tuning on the chosen responses
	$(RLHF) sft --exp $(EXP) $(ARGS)

rm: sft  ## reward model (runs SFT first)
	$(RLHF) rm --exp $(EXP) $(ARGS)

dpo: sft  ## DPO from the SFT adapter (runs SFT first)
	$(RLHF) dpo --exp $(EXP) $(ARGS)

ppo: rm  ## PPO with the reward model (runs SFT and RM first)
	$(RLHF) ppo --exp $(EXP) $(ARGS)

eval: install  ## compare every finished policy (SFT, DPO, PPO) on held-out prompts
	$(RLHF) eval --exp $(EXP) $(ARGS)

pipeline: install  ## everything on one SFT run: SFT, RM, DPO, PPO, then eval
	$(RLHF) sft --exp $(EXP) $(ARGS)
	$(RLHF) rm --exp $(EXP) $(ARGS)
	$(RLHF) dpo --exp $(EXP) $(ARGS)
	$(RLHF) ppo --exp $(EXP) $(ARGS)
	$(RLHF) eval --exp $(EXP) $(ARGS)

export: install  ## export STAGE's adapter; MERGE=1 merges it into the base as safetensors
	$(RLHF) export --exp $(EXP) --from-stage $(STAGE) $(if $(MERGE),--merge) $(ARGS)

test: install  ## the test suite (CPU; GPU tests skip without a GPU)
	$(PY) -m pytest -q -m "not bench" tests

clean:  ## remove .venv and run records of the tiny experiment
	rm -rf $(VENV) results/tiny
