#!/bin/sh
# The CUDA image's entry (the Dockerfile's ENTRYPOINT): the host's NVIDIA driver first, then make with the arguments
# given (`docker run IMAGE ppo EXP=...` runs `make ppo EXP=...`). A driver too old for the CUDA of the image's torch
# stops here with one line naming both versions and the fix (rlhf/infra/toolchain.py), not at torch's first CUDA call.
set -e
"${VENV:-/opt/venv}/bin/python" -m rlhf.infra.toolchain
exec make "$@"
