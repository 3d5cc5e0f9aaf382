# rlhf-harness. `make help` lists the targets. The first use creates .venv and installs the pinned toolchain.
EXP ?= experiments/tiny.yaml
ARGS ?=
STAGE ?= sft
RUNS ?=
RESULTS ?= results
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION := $(shell sed -n 's/^torch==//p' requirements.lock)
# Data parallel: NPROC>1 launches NPROC ranks with `accelerate launch` and configs/accelerate/$(ACCEL).yaml (ddp |
# fsdp-qlora | zero2 | zero3). Without CUDA the ranks run on CPU over gloo, launched by torchrun (accelerate's own
# multi-CPU mode needs mpirun). Batch sizes in the experiment stay global. rlhf/launch.py runs the launcher:
# the config checked once before any rank starts, each line said once, no launcher traceback.
NPROC ?= 1
ifneq ($(shell [ "$(NPROC)" -ge 1 ] 2>/dev/null && echo ok),ok)
$(error NPROC=$(NPROC): give the number of processes, 1 or more)
endif
ACCEL ?= ddp
PORT ?= 29500
HAS_CUDA = $(shell $(PY) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
ifeq ($(shell [ $(NPROC) -gt 1 ] && echo multi),multi)
RLHF = $(PY) -m rlhf.launch $(if $(filter 1,$(HAS_CUDA)),accelerate --num_processes $(NPROC) \
	--config_file configs/accelerate/$(ACCEL).yaml --main_process_port $(PORT),torchrun \
	--nproc_per_node $(NPROC) --master_port $(PORT)) -m rlhf
else
RLHF := $(PY) -m rlhf
endif
RLHF1 := $(PY) -m rlhf
# Docker (GPU hosts): the image, the stage docker-run runs, where the Hugging Face cache lives on the host
IMAGE ?= rlhf-harness:cuda
TARGET ?= ppo
DOCKERFILE ?= Dockerfile
FLASH_ATTN ?= 0
HF_CACHE ?= $(HOME)/.cache/huggingface
# make lock: the folder the locks are written to (and docker-check reads them from; default: here); TORCH_INDEX: an index of torch's CUDA builds
# for the GPU lock (docs/docker.md, "Older drivers"); uv resolves for the image's Python on Linux x86_64
LOCK_DIR ?=
LOCKS = $(if $(LOCK_DIR),$(LOCK_DIR)/)
TORCH_INDEX ?=
LOCK_PYTHON := $(shell sed -n 's/^ARG PYTHON_VERSION=//p' Dockerfile)
UV_COMPILE = $(VENV)/bin/uv pip compile --quiet --python-version $(LOCK_PYTHON) \
	--python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" $(ARGS)
TORCH_FROM = $(if $(TORCH_INDEX),--index $(TORCH_INDEX) --index-strategy unsafe-best-match --upgrade-package torch)
# Sweeps: the sweep file, worker processes on this host, and an Optuna storage URL (default: the file's, else SQLite
# under results/sweeps/); several hosts share one study by running `make sweep` with the same PostgreSQL URL. ARGS
# sets the sweep file's keys (n_trials=2), not the experiment's (those go in the file's overrides:)
SWEEP ?= sweeps/dpo-beta-lr.yaml
WORKERS ?= 1
STORAGE ?=
COUNT ?=
# make flag-calibration: runs per scenario, and the online stage's iterations (0: tiny.yaml's; 300: the 7B
# experiments' run lengths, 60 PPO measurements and 20 GRPO/RLOO ones)
SEEDS ?= 10
STEPS ?= 0
# the host's user owns what the container writes to results/ (root builds get uid 1000)
DOCKER_UID := $(or $(filter-out 0,$(shell id -u)),1000)
DOCKER_GID := $(or $(filter-out 0,$(shell id -g)),1000)
# GPUs, shared memory, the mounts, and credentials passed by name from your environment (never their values here)
DOCKER_RUN := docker run --rm --gpus all --shm-size 8g -e WANDB_API_KEY -e HF_TOKEN \
	-v $(HF_CACHE):/cache/huggingface -v $(CURDIR)/results:/app/results -v $(CURDIR)/experiments:/app/experiments:ro

# make test: xdist workers, one torch thread each (tests/conftest.py); each test module runs whole on one worker, so a
# trained fixture is built once, longest module first (conftest's order, kept by --no-loadscope-reorder)
TEST_WORKERS ?= 2
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.DEFAULT_GOAL := help
.PHONY: lock bench decodebench flag-calibration gpucheck gpucheck-wheels memplan memcheck memcheck-update help install compare test test-fast clean distclean docker-build docker-run docker-shell docker-check

help:  ## list the targets
	@echo "usage: make <target> [EXP=experiments/x.yaml] [ARGS='key=value ...'] [NPROC=n ACCEL=ddp|fsdp-qlora|zero2|zero3]"
	@echo "  a killed stage resumes from its last checkpoint when rerun; a stage reuses its unchanged upstream runs"
	@grep -hE '^[a-z-]+:.*## ' $(STAGES_MK) $(filter-out $(STAGES_MK),$(MAKEFILE_LIST)) | sed 's/:.*## /\t/' | \
		awk -F'\t' '{printf "  %-12s %s\n", $$1, $$2}'

# The one install path, shared with the Docker image: venv, torch==$(TORCH_VERSION) first, then
# `pip install -c requirements.lock -e .[dev,sweep]` (the image: EXTRAS=sweep)
$(VENV)/.installed: pyproject.toml requirements.lock scripts/install.sh
	scripts/install.sh $(VENV)
	touch $@

install: $(VENV)/.installed  ## create .venv with the pinned versions (requirements.lock)

# a target per stage and `make pipeline`, written from the stage registry (rlhf/experiment/stages.py: `python -m rlhf.experiment.stages >
# stages.mk`); `make help` lists them first
STAGES_MK := stages.mk
include $(STAGES_MK)

memplan: install  ## predicted peak memory per stage and component, before anything is loaded (EXP=...)
	$(RLHF1) memplan --exp $(EXP) $(ARGS)

memcheck: install  ## CI memory gate: measured stage peaks vs configs/memcheck-baseline.json, 7B plans vs budgets
	$(RLHF1) memcheck $(ARGS)

memcheck-update: install  ## re-measure and rewrite configs/memcheck-baseline.json (review the diff)
	$(RLHF1) memcheck --update $(ARGS)

compare: install  ## RUNS="tiny/dpo/*" (dirs or globs, relative to results/) [ARGS="--steps 1:15"]: table + curves
	$(RLHF1) compare --results $(RESULTS) $(RUNS) $(ARGS)

gpucheck: install  ## the GPU experiments at their 7B shapes on one CUDA device: measured vs planned -> results/gpu/
	$(RLHF1).tools.gpucheck $(ARGS)

decodebench: install  ## one decode step through each sampling path at the 7B shapes on one CUDA device -> results/gpu/
	$(RLHF1).tools.decodebench $(ARGS)

gpucheck-wheels:  ## the wheels a bare GPU host lacks (bitsandbytes, trl, ...) into .whl/, for scripts/gpucheck.sh
	scripts/gpucheck.sh --download

test: install  ## the whole test suite on TEST_WORKERS=2 processes (CPU; GPU tests skip without a GPU); what CI runs
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not bench" tests

test-fast: install  ## the inner loop: unit, config, data and loss tests, nothing trained (under 3 minutes)
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not bench and not slow" tests

bench: install  ## benchmarks (not test): stages vs plain TRL, PPO vs TRL 0.25.1, GRPO/RLOO vs TRL 1.16 [ARGS='-k grpo']
	$(PY) -m pytest -q -p no:cacheprovider -m bench bench --benchmark-columns=min,mean,rounds --benchmark-sort=name $(ARGS)

flag-calibration: install  ## the over-optimization guard's false-flag and detection rates: SEEDS runs of healthy and losing tiny runs of STEPS iterations
	OMP_NUM_THREADS=1 $(PY) studies/flag_calibration.py --seeds $(SEEDS) --steps $(STEPS) $(ARGS)

clean:  ## remove the tiny experiment's run records (results/tiny, or RESULTS=dir); keeps .venv
	rm -rf $(RESULTS)/tiny

distclean: clean  ## clean, and remove .venv (the next target installs it again)
	rm -rf $(VENV)

.PHONY: sweep sweep-report wandb-sweep
# STORAGE reaches rlhf.sweeps through its environment (RLHF_SWEEP_STORAGE), never in a recipe make echoes or a
# command line: a database password stays out of the console and the process list
ifneq ($(STORAGE),)
sweep sweep-report: export RLHF_SWEEP_STORAGE = $(STORAGE)
endif
sweep: install  ## Optuna sweep (resumable): make sweep SWEEP=sweeps/x.yaml [WORKERS=n] [STORAGE=url] [ARGS='n_trials=2']
	$(PY) -m rlhf.sweeps run $(SWEEP) $(ARGS) --workers $(WORKERS)

sweep-report: install  ## best trial, all trials, importances, plots: make sweep-report SWEEP=sweeps/x.yaml [ARGS=...]
	$(PY) -m rlhf.sweeps report $(SWEEP) $(ARGS)

wandb-sweep: install  ## the sweep file as a W&B sweep (offline without an account): make wandb-sweep SWEEP=... [COUNT=n]
	$(PY) -m rlhf.sweeps wandb $(SWEEP) $(ARGS) $(if $(COUNT),--count $(COUNT))

docker-check: install  ## hadolint and the project's checks of the Dockerfile and its locks (part of make test)
	$(PY) -m rlhf.tools.dockercheck $(DOCKERFILE) --locks $(or $(LOCK_DIR),.)

# The CPU lock (make install's constraints: every extra), then the image's (its packages, hashed, agreeing with the
# CPU lock), then FlashAttention's (FLASH_ATTN=1 only); uv keeps every version the lock it rewrites pins unless ARGS
# say otherwise (--upgrade, --upgrade-package NAME). uv writes a lock even when nothing in it changed: one that did
# not change keeps its time, so the next make does not reinstall .venv for it ($(call keep_time,LOCK,COMMAND), also
# when COMMAND fails)
keep_time = w=$$(mktemp) && { [ ! -f $(1) ] || cp -p $(1) $$w; } && { $(2); rc=$$?; ! cmp -s $(1) $$w || \
	touch -r $$w $(1); rm -f $$w; exit $$rc; }
lock: install  ## re-resolve the CPU, GPU and FlashAttention locks with uv (versions kept) [ARGS=--upgrade]
	$(call keep_time,$(LOCKS)requirements.lock,printf 'pip\nsetuptools\n' | $(UV_COMPILE) pyproject.toml - \
		--extra dev --extra sweep $(TORCH_FROM) -o $(LOCKS)requirements.lock)
	$(call keep_time,$(LOCKS)requirements-gpu.lock,printf 'pip\nsetuptools\n' | $(UV_COMPILE) pyproject.toml - \
		--extra sweep --generate-hashes $(TORCH_FROM) -c $(LOCKS)requirements.lock -o $(LOCKS)requirements-gpu.lock)
	$(call keep_time,$(LOCKS)requirements-flash.lock,printf 'flash-attn\neinops\nninja\nwheel\n' | \
		$(UV_COMPILE) - --no-deps --generate-hashes -c $(LOCKS)requirements-gpu.lock -o $(LOCKS)requirements-flash.lock)

docker-build:  ## build the CUDA image (IMAGE=rlhf-harness:cuda); FLASH_ATTN=1 adds FlashAttention
	docker build --build-arg FLASH_ATTN=$(FLASH_ATTN) --build-arg USER_UID=$(DOCKER_UID) \
		--build-arg USER_GID=$(DOCKER_GID) -t $(IMAGE) .

docker-run:  ## run TARGET (default ppo) in the image on all GPUs: make docker-run TARGET=ppo EXP=...
	mkdir -p results $(HF_CACHE)
	$(DOCKER_RUN) $(IMAGE) $(TARGET) EXP=$(EXP) $(if $(ARGS),"ARGS=$(ARGS)")

docker-shell:  ## a shell in the image, with the GPUs, mounts and credentials of docker-run
	mkdir -p results $(HF_CACHE)
	$(DOCKER_RUN) -it --entrypoint bash $(IMAGE)
