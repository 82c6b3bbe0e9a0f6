#!/usr/bin/env bash
# Every GPU check, in one go, for a machine with one GPU (the device tool's
# H200: torch, nvcc, cmake and ninja, no network). Builds the extension from
# source against that machine's torch, then runs
#   1. scripts/gpu/check_cuda.py: every schedule kind on CUDA tensors (ranks
#      as threads of one process: one GPU cannot hold two NCCL ranks),
#      gradients against the unpipelined model, task times from CUDA events,
#      a failure on one rank stopping every rank at once;
#   2. benchmarks/gpu_step.py: one process holding every stage of a bf16 GPT
#      against a plain gradient-accumulation loop, microbatch sizes 1-8.
# Logs and JSON go to $OUT (default: out/). Finishes in under 8 minutes: the
# build (about 1-2 minutes on 16 cores) and the two checks' time limits
# (150 + 210 s) stay under the device tool's 10 minutes per command.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python || command -v python3)}"
# The extension is built in place, not installed: import it from here.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - <<'PY' | tee "$OUT/device.txt"
import setuptools  # noqa: F401  (setup.py builds with it)
import torch
assert torch.cuda.is_available(), "gpu_check: no GPU visible to torch"
print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))
PY

echo "== build (log: $OUT/build.log)"
start=$(date +%s)
if ! MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
echo "built in $(($(date +%s) - start)) s"

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
status=0
echo "== correctness on CUDA"
timeout 150 "$PY" scripts/gpu/check_cuda.py 2>&1 | tee "$OUT/check_cuda.log" || status=1
echo "== one process, every stage, bf16 GPT: step / plain gradient accumulation"
timeout 210 "$PY" benchmarks/gpu_step.py --warmup 2 --steps 6 --json "$OUT/gpu_step.json" 2>&1 \
  | grep -v "Warning" | tee "$OUT/gpu_step.log" || status=1
exit $status
