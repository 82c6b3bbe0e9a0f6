#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: system packages, a virtual
# environment in .venv with torch from this machine's disk, the test tools,
# and torchmpmd itself built from source (editable).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

need_apt=()
for pkg in cmake g++ libgtest-dev libgmock-dev clang-format clang; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]} from Debian"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
# An exact version: pip takes the CPU build from this machine's disk. An open
# range would download a multi-GB CUDA build instead.
if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION"
  python -m pip install -q "torch==$TORCH_VERSION" 2>&1 | grep -v "is ignored" || true
fi
python -m pip install -q -r requirements-test.txt 2>&1 | grep -v "is ignored" || true
# Rebuild the extension only when its sources or build files changed.
stamp=.venv/.torchmpmd-build
digest=$(cat setup.py pyproject.toml $(find csrc -type f | sort) | sha1sum | cut -d' ' -f1)
# CI builds without debug information (a quarter less time); a local build
# keeps it, for gdb and perf.
if [ "${CI:-}" = "true" ]; then
  export TORCHMPMD_BUILD_FLAGS="${TORCHMPMD_BUILD_FLAGS:--g0}"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$digest" ] || ! python -c "import torchmpmd" 2>/dev/null; then
  echo "setup: building torchmpmd (log: .venv/build.log)"
  if ! MAX_JOBS="${MAX_JOBS:-2}" python -m pip install --no-build-isolation --no-deps -e . \
    >.venv/build.log 2>&1; then
    grep -v "is ignored" .venv/build.log | tail -40
    echo "setup: building torchmpmd failed" >&2
    exit 1
  fi
  echo "$digest" >"$stamp"
fi
python -c "import torchmpmd; print('setup: torchmpmd', torchmpmd.__version__, 'with torch', __import__('torch').__version__)"
