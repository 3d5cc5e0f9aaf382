#!/usr/bin/env bash
# The GPU loan's command (docs/performance.md, "The GPU loan: one call"), on a bare GPU host: Python 3.12 with torch
# (CUDA), transformers' dependencies, peft and accelerate, but no network and none of bitsandbytes, trl, datasets.
# Where pip works (here): `scripts/gpucheck.sh --download` (or `make gpucheck-wheels`) puts the locked wheels of what
# is missing into .whl/ (~56 MiB: scripts/gpucheck-wheels.txt); the device call must name `.whl` in its `carry` (an
# ignored folder travels only when named). On the GPU host, from the repository root: `scripts/gpucheck.sh --loan
# --out "$OUT" --budget-s 480` installs them into /tmp/site (GPUCHECK_SITE), sets the hub and trackers offline and
# runs `python3 -m rlhf.tools.gpucheck` with the arguments given, which checks in one line that the libraries import
# and the driver suits torch before it builds anything.
set -euo pipefail
cd "$(dirname "$0")/.."
export GPUCHECK_T0=${GPUCHECK_T0:-$(date +%s)}  # the budget counts from here: the install is part of it
WHEELS=(bitsandbytes trl datasets transformers peft dill multiprocess)
DIR=${GPUCHECK_WHEELS:-.whl}
SITE=${GPUCHECK_SITE:-/tmp/site}
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
if ! ls "$DIR"/*.whl >/dev/null 2>&1; then
  echo "error: no wheels in $DIR/: run \`make gpucheck-wheels\` where pip works and name .whl in the device call's carry (docs/performance.md)" >&2
  exit 2
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 WANDB_MODE=disabled
export RLHF_DISABLE_TRACKING=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$DIR"/*.whl
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m rlhf.tools.gpucheck "$@"
