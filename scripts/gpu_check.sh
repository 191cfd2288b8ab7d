#!/usr/bin/env bash
# One GPU check, at most 6 minutes on one GPU (LIMIT_S below; docs/running.md's sentence is
# generated from it and from TESTS_S), with nothing but a preinstalled torch (2.11
# or newer), transformers, pandas, psutil, tiktoken and pytest -- no network; the pages stage
# also needs streamlit and plotly importable (docs/running.md says which wheels to carry).
# scripts/gpu_check.py runs the stages (`--list-stages`: the CUDA tests first, then peaks,
# sweeps, attribution, staircase, memory, planner, prediction, bench, peers, speculate, the
# dashboard's pages, the bandwidth floor), each isolated and bounded, and rewrites
# OUT/summary.json after each one. This wrapper tees everything printed into OUT/gpu_check.log
# and, when the check was killed (the time limit, a signal), closes summary.json -- the stage
# that was running failed, the rest skipped -- and prints the last line, which names the failed
# stages. Exit status: 0 no stage failed, 1 one did (or the check was killed), 2 bad input.
# Usage: scripts/gpu_check.sh [--out DIR] [--device cuda|cpu] [--tiny] [--skip-tests]
#                             [--stages a,b] [--list-stages] [--no-compile]
#   --out DIR   everything goes there (default gpu-check/<UTC time>)
# A dry run of the logic on a CPU: scripts/gpu_check.sh --device cpu --tiny --out /tmp/gc
# PY picks the interpreter (default .venv/bin/python when it exists, else python3).
set -uo pipefail
LIMIT_S=360  # the whole check, killed (`timeout`) past it
TESTS_S=120  # the CUDA tests' cap within it
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=gpu-check/$(date -u +%Y%m%dT%H%M%SZ)
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift ;;
    --out=*) OUT="${1#--out=}" ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
# The check plans for all but 15 s of the limit (the last stage's overrun, the interpreter's
# exit); timeout signals the whole process group: the pytest run and the measuring process too.
timeout --kill-after=5 "$LIMIT_S" "$PY" scripts/gpu_check.py --total-s $((LIMIT_S - 15)) \
  --tests-timeout-s "$TESTS_S" --out "$OUT" "${ARGS[@]}"
status=$?
case "$status" in
  0 | 1 | 2) ;;
  124 | 137) "$PY" scripts/device_check/runner.py --close "$OUT" \
      "killed at the $LIMIT_S s limit (timeout, exit $status)"; status=1 ;;
  *) "$PY" scripts/device_check/runner.py --close "$OUT" "the check ended with exit $status"
     status=1 ;;
esac
exit $status
