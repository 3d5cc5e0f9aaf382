#!/usr/bin/env bash
# The one install path. `make install` (and so CI's `make test`) and the Docker image both run this script; every
# version comes from requirements.lock (pip -c), the torch pin included.
#
#   scripts/install.sh VENV [deps|all]
#     deps  VENV with pip, setuptools, torch and the direct dependencies of pyproject.toml: needs no source code, so the image
#           installs it in a layer of its own before copying the code
#     all   deps, then the project itself, editable (the default)
#
# PYTHON: the interpreter that creates VENV (default python3). FLASH_ATTN=1 adds FlashAttention, built against the
# installed torch; only the CUDA image asks for it.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${1:?usage: scripts/install.sh VENV [deps|all]}
step=${2:-all}
case $step in deps | all) ;; *) echo "install.sh: unknown step '$step' (deps or all)" >&2; exit 2 ;; esac

torch_version=$(sed -n 's/^torch==//p' requirements.lock)
if [ -z "$torch_version" ]; then echo "install.sh: requirements.lock pins no torch" >&2; exit 1; fi

[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
# pip and setuptools as pinned, not as this Python's ensurepip left them
"$venv/bin/pip" install -q -c requirements.lock --upgrade pip setuptools
# torch first, by exact version: a CPU host takes its local CPU wheel, a CUDA host the default (CUDA) build
"$venv/bin/pip" install -q -c requirements.lock "torch==$torch_version"

deps=$(mktemp)
trap 'rm -f "$deps"' EXIT
"$venv/bin/python" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")' >"$deps"
"$venv/bin/pip" install -q -c requirements.lock -r "$deps"

if [ "${FLASH_ATTN:-0}" = 1 ]; then
  # its setup.py imports torch, so no build isolation: the build tools come pinned from the lock too
  "$venv/bin/pip" install -q -c requirements.lock ninja wheel einops
  "$venv/bin/pip" install -q -c requirements.lock --no-build-isolation flash-attn
fi

if [ "$step" = all ]; then
  "$venv/bin/pip" install -q -c requirements.lock -e .
fi
