#!/usr/bin/env bash
# The main job: installs what is needed, then trains the bundled GPT
# pipelined over 2 processes (Gloo on CPU, NCCL if GPUs are present) with
# torchrun. Extra arguments go to examples/train_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
. .venv/bin/activate
NPROC="${NPROC:-2}"
exec torchrun --standalone --nproc_per_node="$NPROC" examples/train_gpt.py "$@"
