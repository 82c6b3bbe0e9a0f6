#!/usr/bin/env bash
# Builds the schedule validator's libFuzzer target with clang and fuzzes it
# for 20 s (or $FUZZ_SECONDS). Run by scripts/test.sh (CI).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DTORCHMPMD_FUZZ=ON \
  -DTORCHMPMD_BUILD_TESTS=OFF >/dev/null
cmake --build build/fuzz
mkdir -p build/fuzz/corpus
build/fuzz/fuzz_lower -max_total_time="${FUZZ_SECONDS:-20}" -print_final_stats=1 build/fuzz/corpus \
  2>&1 | tail -3
