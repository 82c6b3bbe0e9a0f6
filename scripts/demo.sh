#!/usr/bin/env bash
# The main job: installs what is needed, then traces the bundled GPT and
# prints its stage plan.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
. .venv/bin/activate
python examples/inspect_plan.py "$@"
