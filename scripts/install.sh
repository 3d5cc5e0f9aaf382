#!/usr/bin/env bash
# The one install path. `make install` (and so CI's `make test`) and the Docker image both run this script; every
# version comes from a lock `make lock` writes: requirements.lock (pip -c, the torch pin included), or, for the image,
# LOCK=requirements-gpu.lock, whose hashes put pip in hash-checking mode: it installs that lock whole (the image's
# packages: the dependencies and the sweep extra, the CUDA wheels included) and refuses a file whose hash it lacks.
#
#   scripts/install.sh VENV [deps|all]
#     deps  VENV with pip, setuptools, torch and the direct dependencies of pyproject.toml (with those of EXTRAS): needs
#           no source code, so the image installs it in a layer of its own before copying the code
#     all   deps, then the project itself, editable, with EXTRAS (the default)
#
# EXTRAS: the optional dependency groups of pyproject.toml, comma separated (default dev,sweep: tests, tools and
# sweeps, as `make install` and CI want them; the image sets sweep). Importing rlhf needs none of them.
# PYTHON: the interpreter that creates VENV (default python3). FLASH_ATTN=1 adds FlashAttention, built against the
# installed torch, it and its build tools hash-checked from requirements-flash.lock; only the CUDA image asks for it.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${1:?usage: scripts/install.sh VENV [deps|all]}
step=${2:-all}
extras=${EXTRAS-dev,sweep}
lock=${LOCK:-requirements.lock}
case $step in deps | all) ;; *) echo "install.sh: unknown step '$step' (deps or all)" >&2; exit 2 ;; esac

torch_version=$(sed -n 's/^torch==\([^ ;\\]*\).*/\1/p' "$lock")
if [ -z "$torch_version" ]; then echo "install.sh: $lock pins no torch" >&2; exit 1; fi

[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
if grep -q -- '--hash=' "$lock"; then
  # hash-checking mode: the lock is the whole set (so no resolution, --no-deps), pip and setuptools included
  "$venv/bin/pip" install -q --require-hashes --no-deps -r "$lock"
  project=(--no-deps --no-build-isolation)  # the project alone: its dependencies are the lock's, installed above
else
  # pip and setuptools as pinned, not as this Python's ensurepip left them
  "$venv/bin/pip" install -q -c "$lock" --upgrade pip setuptools
  # torch first, by exact version: a CPU host takes its local CPU wheel, a CUDA host the default (CUDA) build
  "$venv/bin/pip" install -q -c "$lock" "torch==$torch_version"

  deps=$(mktemp)
  trap 'rm -f "$deps"' EXIT
  "$venv/bin/python" - "$extras" >"$deps" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = [name for name in sys.argv[1].split(",") if name]
print(*project["dependencies"], *(dep for name in extras for dep in project["optional-dependencies"][name]), sep="\n")
EOF
  "$venv/bin/pip" install -q -c "$lock" -r "$deps"
  project=(-c "$lock")
fi

if [ "${FLASH_ATTN:-0}" = 1 ]; then
  # its setup.py imports torch, so no build isolation: the build tools first; every file is checked against the hashes
  # of requirements-flash.lock (pip honours a constraint's hashes), then FlashAttention compiles with the image's nvcc
  "$venv/bin/pip" install -q --require-hashes --no-deps -c requirements-flash.lock ninja wheel einops
  "$venv/bin/pip" install -q --require-hashes --no-deps -c requirements-flash.lock --no-build-isolation flash-attn
fi

if [ "$step" = all ]; then
  "$venv/bin/pip" install -q "${project[@]}" -e ".${extras:+[$extras]}"
fi
