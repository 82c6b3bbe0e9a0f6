#!/usr/bin/env bash
# Builds the extension against torch's CUDA build, so the device path (stream-
# ordered NCCL receives, CUDA-event task times) compiles on every change even
# on a machine without a GPU. Nothing built here runs here: it is loaded once,
# to check that it links against that torch. Run by scripts/test.sh (CI).
#   CUDA_TORCH_VERSION=2.14.1  the CUDA build on this machine's disk
set -euo pipefail
cd "$(dirname "$0")/.."

CUDA_TORCH_VERSION="${CUDA_TORCH_VERSION:-2.14.1}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=.venv-cuda

if [ ! -x "$VENV/bin/python" ]; then
  echo "cuda_build: creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$CUDA_TORCH_VERSION' or torch.version.cuda is None)" 2>/dev/null; then
  echo "cuda_build: installing torch==$CUDA_TORCH_VERSION (CUDA build, from this machine's disk)"
  "$VENV/bin/python" -m pip install -q "torch==$CUDA_TORCH_VERSION" numpy ninja setuptools 2>&1 | grep -v "is ignored" || true
fi
"$VENV/bin/python" -c "import torch; print('cuda_build: torch', torch.__version__, 'CUDA', torch.version.cuda)"
# Out of tree: the CPU build in torchmpmd/ stays as it is.
# Unoptimised, without debug information: nothing built here runs, and the
# compile takes half the time.
TORCHMPMD_BUILD_FLAGS="-O0 -g0" MAX_JOBS="${MAX_JOBS:-2}" "$VENV/bin/python" setup.py -q build_ext \
  --build-lib build/cuda/lib --build-temp build/cuda/tmp >build/cuda.log 2>&1 || {
  grep -v "is ignored" build/cuda.log | tail -40
  echo "cuda_build: building against torch $CUDA_TORCH_VERSION failed" >&2
  exit 1
}
so=$(find build/cuda/lib -name '_C*.so' | head -1)
"$VENV/bin/python" - "$so" <<'PY'
import importlib.util, sys
import torch  # loads libtorch (and its CUDA libraries) first
spec = importlib.util.spec_from_file_location("torchmpmd._C", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print("cuda_build: loaded", sys.argv[1], "against torch", torch.__version__)
PY
