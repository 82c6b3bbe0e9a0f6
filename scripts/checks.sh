#!/usr/bin/env bash
# The checks besides the Python tests, by name, in the order given:
#
#   lint       ruff, ruff format, mypy (strict), clang-format
#   cpp        the torch-free C++ core: CMake + GoogleTest (build/cpp)
#   cpp-built  the same where build/cpp is already configured (else skipped)
#   asan       the C++ core again under AddressSanitizer and UBSan
#   cuda       the extension against torch's CUDA build (scripts/cuda_build.sh)
#   fuzz       the schedule validator under libFuzzer, 20 s (scripts/fuzz.sh)
#
# scripts/test.sh runs them (CI: all of them, at nice 19 beside pytest).
# Expects the virtual environment active (ruff, mypy).
set -euo pipefail
cd "$(dirname "$0")/.."

phase() { echo "== $1 (at ${SECONDS} s of these checks)"; }

for check in "$@"; do
  case "$check" in
    lint)
      phase "lint and type check"
      ruff check .
      ruff format --check .
      mypy # strict, over torchmpmd/ and the native core's stub (pyproject.toml)
      find csrc tests/cpp \( -name '*.cpp' -o -name '*.h' \) -print0 |
        xargs -0 clang-format --dry-run -Werror
      ;;
    cpp)
      phase "C++ core (CMake + GoogleTest, no torch)"
      cmake -S . -B build/cpp -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
      cmake --build build/cpp
      ctest --test-dir build/cpp --output-on-failure --timeout 60
      ;;
    cpp-built)
      if [ -f build/cpp/CTestTestfile.cmake ]; then
        phase "C++ core (the existing build/cpp, rebuilt if its sources changed)"
        cmake --build build/cpp
        ctest --test-dir build/cpp --output-on-failure --timeout 60
      else
        echo "== C++ core: skipped (build/cpp not built yet; the full run builds it)"
      fi
      ;;
    asan)
      phase "C++ core again under AddressSanitizer and UndefinedBehaviorSanitizer"
      cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTORCHMPMD_SANITIZE=ON >/dev/null
      cmake --build build/asan
      ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
        ctest --test-dir build/asan --output-on-failure --timeout 120
      ;;
    cuda)
      phase "the extension against torch's CUDA build (compiles and links; no GPU here)"
      bash scripts/cuda_build.sh
      ;;
    fuzz)
      phase "fuzzing the schedule validator (libFuzzer, 20 s)"
      bash scripts/fuzz.sh
      ;;
    *)
      echo "scripts/checks.sh: no check named '$check' (lint, cpp, cpp-built, asan, cuda, fuzz)" >&2
      exit 2
      ;;
  esac
done
