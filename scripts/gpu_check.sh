#!/usr/bin/env bash
# One GPU check, at most 6 minutes on one GPU (the two `timeout`s below; the README's sentence
# is generated from them), with nothing but a preinstalled torch (2.11 or
# newer), transformers, pandas, psutil, tiktoken and pytest -- no network, no dashboard packages:
#   1. the CUDA-gated tests (pytest -m cuda; test files that need streamlit/plotly are not
#      collected where those are missing), capped at 120 s;
#   2. scripts/gpu_check.py: peaks, a 16-context sweep of every mode in fp32 and bf16 and of
#      the Llama family's modes on SmolLM2-135M's shapes (its real weights where the package is
#      installed, else random ones: the run says which), step
#      attribution, the matmul staircase and memory, each saved as a run file (200 s budget);
#      the predicted step and the peers (CTranslate2, ONNX Runtime, transformers, where their
#      packages are present; skipped ones are named with why);
#   3. each cached mode's step time against the bandwidth floor, printed at the end.
# Usage: scripts/gpu_check.sh [--out DIR] [--device cuda|cpu] [--tiny] [--skip-tests] [...]
#   --out DIR   every run file and the logs (gpu_check.log, pytest.log) go there (default results)
# A dry run of the logic on a CPU: scripts/gpu_check.sh --device cpu --tiny --out /tmp/gc
# PY picks the interpreter (default .venv/bin/python when it exists, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
RUN_TESTS=1
OUT=results
DEVICE=cuda
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) RUN_TESTS=0 ;;
    --out) OUT="$2"; shift ;;
    --out=*) OUT="${1#--out=}" ;;
    --device) DEVICE="$2"; ARGS+=("$1" "$2"); shift ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
start=$(date +%s)
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available())"
status=0
if [ "$RUN_TESTS" = 1 ]; then
  echo "== pytest -m cuda (compile tests included)"
  KV_LAB_COMPILE_TESTS=1 timeout 120 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests \
    2>&1 | tee "$OUT/pytest.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 5 ] && [ "$DEVICE" = cpu ]; then
    echo "CUDA tests: none selected on a CPU (collection itself worked)"
  elif [ "$rc" != 0 ]; then
    echo "CUDA tests: exit $rc (5 = none collected/all skipped, 124 = timed out)"; status=1
  fi
fi
echo "== measurements"
timeout 240 "$PY" scripts/gpu_check.py --budget-s 200 --out "$OUT" "${ARGS[@]}" || status=$?
echo "gpu_check finished in $(( $(date +%s) - start )) s with status $status"
exit $status
