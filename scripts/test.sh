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
# sets up .venv as the full run does). Extra arguments go to both pytest
# passes (below).
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

if [ "$fast" = 1 ]; then
  bash scripts/checks.sh cpp-built lint
else
  bash scripts/checks.sh cpp asan lint
fi

# The full run's CUDA build and fuzzer run beside the second pass of
# Python tests (below) at the lowest priority, in the cycles its ranks leave
# idle (a rank waiting on a peer); their output and status come after
# pytest. Not lint and the C++ builds too: with them beside it as well,
# pytest took 1532 s (its 4-rank tests 1.3-2.2x as long), against 1289 s
# with these two and 1318 s with nothing beside it. Not beside the first
# pass, whose two workers keep both cores busy.
background=""
start_background() {
  [ "$fast" = 1 ] && return 0
  phase "in the background at nice 19: the CUDA build, then the fuzzer"
  mkdir -p build
  # Its own process group (setsid), so that a failure below stops all of it.
  setsid -w nice -n 19 bash scripts/checks.sh cuda fuzz >build/background.log 2>&1 &
  background=$!
  trap 'kill -- -"$background" 2>/dev/null || true; cat build/background.log' EXIT
}

# Two passes (marker expressions: $1 the first's, $2 the second's). The
# tests of one process run on two pytest-xdist workers (a
# file per worker at a time, so a module's fixtures are made once): most of
# their time is one Python thread tracing or stepping, so two share the two
# cores (299 s against 514 s one after another). The multiprocess tests
# (their ranks already take every core; a dozen bound a failure's time) and
# those marked `alone` (they time the machine and compare) run after, one at
# a time. Exit code 5 (nothing collected) fails unless the other pass ran.
pytest_passes() {
  local first=0 second=0
  phase "Python tests of one process, on two workers: -m \"$1\""
  python -m pytest tests -n 2 --dist loadfile -m "$1" "${@:3}" || first=$?
  start_background
  phase "Python tests one at a time: -m \"$2\""
  python -m pytest tests -m "$2" "${@:3}" || second=$?
  if [ "$first" = 5 ] && [ "$second" = 0 ]; then first=0; fi
  if [ "$second" = 5 ] && [ "$first" = 0 ]; then second=0; fi
  [ "$first" = 0 ] || return "$first"
  return "$second"
}
if [ "$fast" = 1 ]; then
  pytest_passes "not slow and not multiprocess and not alone" \
    "alone and not slow and not multiprocess" "$@"
else
  # The 25 slowest of each pass at the end of every full run, so that
  # growth shows.
  pytest_passes "not multiprocess and not alone" "multiprocess or alone" --durations=25 "$@"
  phase "waiting for the checks in the background"
  status=0
  wait "$background" || status=$?
  trap - EXIT
  cat build/background.log
  if [ "$status" != 0 ]; then
    echo "== a check in the background failed (exit $status; above)" >&2
    exit "$status"
  fi
fi
phase "done"
