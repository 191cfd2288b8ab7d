#!/usr/bin/env bash
# One GPU check, at most 8 minutes on one GPU:
#   1. the CUDA-gated tests (pytest -m cuda), capped at 120 s;
#   2. scripts/gpu_check.py: peaks, a 16-context sweep of every mode in fp32 and bf16,
#      step attribution and the matmul staircase, each saved to results/ (300 s budget);
#   3. each cached mode's step time against the bandwidth floor, printed at the end.
# Usage: scripts/gpu_check.sh [--device cuda|cpu] [--tiny] [--out DIR] [--skip-tests] [...]
# A dry run of the logic on a CPU: scripts/gpu_check.sh --device cpu --tiny --out /tmp/gc
# PY picks the interpreter (default .venv/bin/python, else python3); it needs a CUDA torch.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
RUN_TESTS=1
ARGS=()
for a in "$@"; do
  if [ "$a" = "--skip-tests" ]; then RUN_TESTS=0; else ARGS+=("$a"); fi
done
export PYTHONUNBUFFERED=1
start=$(date +%s)
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available())"
status=0
if [ "$RUN_TESTS" = 1 ]; then
  echo "== pytest -m cuda (compile tests included)"
  KV_LAB_COMPILE_TESTS=1 timeout 120 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests \
    || { echo "CUDA tests: exit $? (5 = none collected/all skipped, 124 = timed out)"; status=1; }
fi
echo "== measurements"
timeout 330 "$PY" scripts/gpu_check.py --budget-s 300 "${ARGS[@]}" || status=$?
echo "gpu_check finished in $(( $(date +%s) - start )) s with status $status"
exit $status
