#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs every check: the torch-free
# C++ tests (ctest), the linters, the type checker and the Python test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate

echo "== C++ core (CMake + GoogleTest, no torch)"
cmake -S . -B build/cpp -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/cpp
ctest --test-dir build/cpp --output-on-failure --timeout 60

echo "== C++ core again under AddressSanitizer and UndefinedBehaviorSanitizer"
cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTORCHMPMD_SANITIZE=ON >/dev/null
cmake --build build/asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build/asan --output-on-failure --timeout 120

echo "== the extension against torch's CUDA build (compiles and links; no GPU here)"
bash scripts/cuda_build.sh

echo "== fuzzing the schedule validator (libFuzzer, 20 s)"
cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DTORCHMPMD_FUZZ=ON \
  -DTORCHMPMD_BUILD_TESTS=OFF >/dev/null
cmake --build build/fuzz
mkdir -p build/fuzz/corpus
build/fuzz/fuzz_lower -max_total_time=20 -print_final_stats=1 build/fuzz/corpus 2>&1 | tail -3

echo "== lint and type check"
ruff check .
ruff format --check .
mypy  # strict, over torchmpmd/ and the native core's stub (pyproject.toml)
find csrc tests/cpp \( -name '*.cpp' -o -name '*.h' \) -print0 | xargs -0 clang-format --dry-run -Werror

echo "== Python tests"
# Exit code 5 (nothing collected) fails like any other failure.
python -m pytest tests "$@"
