# rlhf-harness. `make help` lists the targets. The first use creates .venv and installs the pinned toolchain.
EXP ?= experiments/tiny.yaml
ARGS ?=
STAGE ?= sft
RUNS ?=
RESULTS ?= results
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION := $(shell sed -n 's/^torch==//p' requirements.lock)
RLHF := $(PY) -m rlhf

.DEFAULT_GOAL := help
.PHONY: help install sft rm dpo ppo eval pipeline export compare test clean

help:  ## list the targets
	@echo "usage: make <target> [EXP=experiments/x.yaml] [ARGS='key=value ...']"
	@echo "  a killed stage resumes from its last checkpoint when rerun; rm/dpo/ppo reuse an unchanged upstream run"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | awk -F'\t' '{printf "  %-10s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml requirements.lock
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first, by exact version: a CPU host takes its local CPU wheel, a CUDA host the default build
	$(VENV)/bin/pip install -q torch==$(TORCH_VERSION)
	$(VENV)/bin/pip install -q -c requirements.lock -e .
	touch $@

install: $(VENV)/.installed  ## create .venv with the pinned versions (requirements.lock)

sft: install  ## supervised fine-tuning on the chosen responses (always trains; resumes a killed run)
	$(RLHF) sft --exp $(EXP) $(ARGS)

rm: install  ## reward model (reuses the SFT run if its config and data are unchanged, else trains SFT first)
	$(RLHF) sft --exp $(EXP) --reuse $(ARGS)
	$(RLHF) rm --exp $(EXP) $(ARGS)

dpo: install  ## DPO from the SFT adapter (reuses an unchanged SFT run)
	$(RLHF) sft --exp $(EXP) --reuse $(ARGS)
	$(RLHF) dpo --exp $(EXP) $(ARGS)

ppo: install  ## PPO with the reward model (reuses unchanged SFT and RM runs)
	$(RLHF) sft --exp $(EXP) --reuse $(ARGS)
	$(RLHF) rm --exp $(EXP) --reuse $(ARGS)
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

compare: install  ## RUNS="tiny/dpo/*" (dirs or globs, relative to results/): table + curves in results/compare/
	$(RLHF) compare --results $(RESULTS) $(RUNS)

test: install  ## the test suite (CPU; GPU tests skip without a GPU)
	$(PY) -m pytest -q -m "not bench" tests

clean:  ## remove .venv and run records of the tiny experiment
	rm -rf $(VENV) results/tiny
