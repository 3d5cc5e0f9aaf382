# The CUDA image for GPU hosts: the toolchain CI tests, pinned. `make docker-build`, then
# `make docker-run TARGET=ppo EXP=experiments/llama2-7b-hh-4090.yaml` (README, "Docker (GPU hosts)").
# `make test` checks this file (hadolint and rlhf/tools/dockercheck.py: `make docker-check`; tests/test_docker.py).

# Pinned by digest (the multi-arch index of the tag): a rebuilt tag cannot change the image under us. The devel
# flavour, for nvcc when FLASH_ATTN=1 builds FlashAttention.
FROM nvidia/cuda:12.4.1-devel-ubuntu22.04@sha256:da6791294b0b04d7e65d87b7451d6f2390b4d36225ab0701ee7dfec5769829f5

# The Python minor version CI runs (tests/test_docker.py compares it with the interpreter running the tests).
ARG PYTHON_VERSION=3.11
# 1 builds FlashAttention into the image, at the version pinned in requirements.lock.
ARG FLASH_ATTN=0
# The optional dependencies installed with the project (scripts/install.sh): sweeps, not the test tools.
ARG EXTRAS=sweep
# The user the stages run as; `make docker-build` passes the host's, so files in the mounted results/ are yours.
ARG USER_UID=1000
ARG USER_GID=1000
ARG DEBIAN_FRONTEND=noninteractive

RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates git make \
        python${PYTHON_VERSION} python${PYTHON_VERSION}-dev python${PYTHON_VERSION}-venv \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --gid ${USER_GID} rlhf \
    && useradd --create-home --uid ${USER_UID} --gid ${USER_GID} --shell /bin/bash rlhf \
    && mkdir -p /opt/venv /app/results /cache/huggingface \
    && chown -R rlhf:rlhf /opt/venv /app /cache

# No WANDB_MODE here: rlhf/tracking.py logs offline unless WANDB_API_KEY is passed at run time (`docker run -e
# WANDB_API_KEY`); a WANDB_MODE set in the image would keep it offline even then. No credentials in the image.
ENV VENV=/opt/venv \
    PYTHON=python${PYTHON_VERSION} \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    HF_HUB_DISABLE_TELEMETRY=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

USER rlhf
WORKDIR /app

# Dependency layers first: only what the install reads, so a code change rebuilds from the code layer on.
COPY --chown=rlhf:rlhf pyproject.toml requirements.lock ./
COPY --chown=rlhf:rlhf scripts/install.sh scripts/
RUN scripts/install.sh "$VENV" deps

# The code, then the install CI runs (`make test` runs `make install`): only the project itself is left to add.
COPY --chown=rlhf:rlhf . .
RUN make install

VOLUME ["/cache/huggingface", "/app/results"]
ENTRYPOINT ["make"]
CMD ["help"]
