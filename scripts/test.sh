#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs every check: the torch-free
# C++ tests (ctest), the linters, the type checker and the Python test suite.
#
#   bash scripts/test.sh          # everything (what CI runs: .ci/run)
#   bash scripts/test.sh --fast   # the fast lane, under 3 minutes on 2 cores
#
# --fast runs ruff, mypy, clang-format, the C++ tests if build/cpp is already
# built, and the Python tests not marked slow or multiprocess (pytest -m "not
# slow and not multiprocess"); it skips the sanitizer and CUDA builds and the
# fuzzer, and uses the active virtual environment if there is one (else it
# sets up .venv as the full run does). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each phase's header says when it started (seconds since the run began),
# so that the time budget shows where it goes.
phase() { echo "== $1 (at ${SECONDS} s)"; }

fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi

if [ "$fast" = 1 ] && [ -n "${VIRTUAL_ENV:-}" ]; then
  echo "== fast lane, in $VIRTUAL_ENV"
else
  bash scripts/setup.sh
  . .venv/bin/activate
fi

if [ "$fast" = 0 ]; then
  phase "C++ core (CMake + GoogleTest, no torch)"
  cmake -S . -B build/cpp -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build/cpp
  ctest --test-dir build/cpp --output-on-failure --timeout 60

  phase "C++ core again under AddressSanitizer and UndefinedBehaviorSanitizer"
  cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTORCHMPMD_SANITIZE=ON >/dev/null
  cmake --build build/asan
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build/asan --output-on-failure --timeout 120

  # The CUDA build and the fuzzer run beside the linters and the Python
  # tests, at the lowest priority: they take the cycles the tests leave idle
  # (a rank waiting on a peer, a test on one core) and hardly delay them (a
  # nice 19 process gets about 1.5% of a contended core). Their output and
  # status come at the end.
  phase "in the background at nice 19: the CUDA build, then the fuzzer"
  mkdir -p build
  # Its own process group (setsid), so that a failure below stops all of it.
  setsid -w nice -n 19 bash -c 'set -e
    echo "== the extension against torch'"'"'s CUDA build (compiles and links; no GPU here)"
    bash scripts/cuda_build.sh
    echo "== fuzzing the schedule validator (libFuzzer, 20 s)"
    bash scripts/fuzz.sh' >build/background.log 2>&1 &
  background=$!
  trap 'kill -- -"$background" 2>/dev/null || true' EXIT
elif [ -f build/cpp/CTestTestfile.cmake ]; then
  phase "C++ core (the existing build/cpp, rebuilt if its sources changed)"
  cmake --build build/cpp
  ctest --test-dir build/cpp --output-on-failure --timeout 60
else
  echo "== C++ core: skipped (build/cpp not built yet; the full run builds it)"
fi

phase "lint and type check"
ruff check .
ruff format --check .
mypy  # strict, over torchmpmd/ and the native core's stub (pyproject.toml)
find csrc tests/cpp \( -name '*.cpp' -o -name '*.h' \) -print0 | xargs -0 clang-format --dry-run -Werror

phase "Python tests"
# Exit code 5 (nothing collected) fails like any other failure.
if [ "$fast" = 1 ]; then
  python -m pytest tests -m "not slow and not multiprocess" "$@"
else
  # The 25 slowest at the end of every full run, so that growth shows.
  python -m pytest tests --durations=25 "$@"
  phase "waiting for the background jobs (the CUDA build, the fuzzer)"
  status=0
  wait "$background" || status=$?
  trap - EXIT
  cat build/background.log
  if [ "$status" != 0 ]; then
    echo "== the CUDA build or the fuzzer failed (exit $status; above)" >&2
    exit "$status"
  fi
fi
phase "done"
