# The CUDA image for GPU hosts: the toolchain CI tests, pinned. `make docker-build`, then
# `make docker-run TARGET=ppo EXP=experiments/llama2-7b-hh-4090.yaml` (README, "Docker (GPU hosts)").
# `make test` checks this file (hadolint and rlhf/tools/dockercheck.py: `make docker-check`; tests/test_docker.py).

# Pinned by digest: a rebuilt tag cannot change the image under us. Its CUDA is the one the locked torch wheel was
# built for (requirements-gpu.lock: torch's `cuda-toolkit` pin; `make docker-check` compares them). The devel
# flavour, for the nvcc FLASH_ATTN=1 builds FlashAttention with.
FROM nvidia/cuda:13.0.0-devel-ubuntu22.04@sha256:1470d2d7904fac4e5cb3bdfd4993305c46d3ee76deb0213eaaf248e5cf9c7400

# The Python minor version CI runs (tests/test_docker.py compares it with the interpreter running the tests).
ARG PYTHON_VERSION=3.11
# 1 builds FlashAttention into the image, at the version pinned in requirements-flash.lock (hash-checked).
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

# No WANDB_MODE here: rlhf/runs/tracking.py logs offline unless WANDB_API_KEY is passed at run time (`docker run -e
# WANDB_API_KEY`); a WANDB_MODE set in the image would keep it offline even then. No credentials in the image.
# LOCK: scripts/install.sh installs the hashed GPU lock whole, in pip's hash-checking mode. NVIDIA_DISABLE_REQUIRE:
# the entry checks the host's driver itself (scripts/entrypoint.sh), naming the fix, instead of the container
# runtime refusing to start the container.
ENV VENV=/opt/venv \
    LOCK=requirements-gpu.lock \
    NVIDIA_DISABLE_REQUIRE=1 \
    PYTHON=python${PYTHON_VERSION} \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    HF_HUB_DISABLE_TELEMETRY=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

USER rlhf
WORKDIR /app

# Dependency layers first: only what the install reads, so a code change rebuilds from the code layer on.
COPY --chown=rlhf:rlhf pyproject.toml requirements-gpu.lock requirements-flash.lock ./
COPY --chown=rlhf:rlhf scripts/install.sh scripts/
RUN scripts/install.sh "$VENV" deps

# The code, then the install CI runs (`make test` runs `make install`): only the project itself is left to add.
COPY --chown=rlhf:rlhf . .
RUN make install

VOLUME ["/cache/huggingface", "/app/results"]
# the host's driver against the image's CUDA first (one line and exit 2 when too old), then `make ARGS...`
ENTRYPOINT ["/app/scripts/entrypoint.sh"]
CMD ["help"]
