#!/usr/bin/env bash
# `make gpucheck` on a bare GPU host: Python 3.12 with torch (CUDA), transformers' dependencies, peft and accelerate,
# but no network and none of bitsandbytes, trl, datasets. Where pip works (here): `scripts/gpucheck.sh --download`
# (or `make gpucheck-wheels`) puts the locked wheels of what is missing into .whl/ (~57 MB). On the GPU host, from the
# repository root with .whl/ beside it: `scripts/gpucheck.sh [gpucheck arguments]` installs them into /tmp/site and
# runs `python3 -m rlhf.tools.gpucheck` (results/gpu/<date>-<device>.json and .md; ~8 min per 7B experiment on an H100).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(bitsandbytes trl datasets transformers peft dill multiprocess)
DIR=${GPUCHECK_WHEELS:-.whl}
if [[ "${1:-}" == "--download" ]]; then
  mkdir -p "$DIR"
  for name in "${WHEELS[@]}"; do
    pin=$(grep -i "^${name}==" requirements.lock)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d "$DIR" "$pin"
  done
  ls -l "$DIR"
  exit 0
fi
if ls "$DIR"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$DIR"/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
PYTHONUNBUFFERED=1 exec python3 -m rlhf.tools.gpucheck "$@"
