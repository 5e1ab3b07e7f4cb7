#!/usr/bin/env bash
# The GPU checks in one unattended call, under 8 minutes, on a machine with one NVIDIA GPU:
#
#   bench/gpu.sh                 # results in $OUT if set, else ./gpu-results
#
# 1. machine.txt      nvidia-smi, torch and CUDA versions
# 2. cuda-tests.txt   the CUDA/NCCL tests (pytest -m cuda: bf16, fp32, float64 and activation
#                     checkpointing on the GPU against the CPU reference; skipped without CUDA)
# 3. gpu-solo.json    tokens/s and MFU of a ~1.1B Llama in bf16, one rank on the whole GPU
# 4. gpu-share.json   four one-rank jobs sharing the GPU (NCCL allows no two ranks of one job
#                     on one GPU: bench/gpu.py says why), each one's tokens/s and their sum
# 5. summary.txt      one line per stage, PASS/FAIL, and the figures
#
# Every stage has its own time limit (timeout; 30 + 150 + 120 + 150 s = 7.5 min in all), so one
# hang cannot eat the others' time, and
# every stage runs whatever the previous did; the exit code is 1 if any stage failed.
# MALLEUS_GPU_DRY_RUN=1 runs the same stages on CPU with a tiny model (tests/trainer);
# MALLEUS_GPU_SHARE_RANKS sets how many jobs share the GPU (default 4).
# PYTHON picks the interpreter (default: .venv/bin/python if present, else python3).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
DRY=()
if [[ "${MALLEUS_GPU_DRY_RUN:-0}" == "1" ]]; then DRY=(--dry-run --peak-tflops 1); fi
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
failed=0

stage() { # stage NAME SECONDS LOG COMMAND...: run with a time limit, record PASS/FAIL
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$log" 2>&1
  local rc=$?
  local verdict=PASS
  if [[ $rc -ne 0 ]]; then verdict="FAIL (exit $rc$([[ $rc -eq 124 ]] && echo ', timed out'))"; failed=1; fi
  echo "$name: $verdict in $((SECONDS - t0)) s, log $log" | tee -a "$SUMMARY"
}

stage machine 30 machine.txt bash -c "nvidia-smi || true; $PY -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available())'"
stage cuda-tests 150 cuda-tests.txt "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/trainer/model/test_precision_cuda.py
stage solo 120 solo.txt "$PY" bench/gpu.py solo --out "$OUT" "${DRY[@]}"
stage share 150 share.txt "$PY" bench/gpu.py share --ranks "${MALLEUS_GPU_SHARE_RANKS:-4}" --out "$OUT" "${DRY[@]}"

for f in solo share; do
  [[ -f "$OUT/$f.txt" ]] && tail -n 1 "$OUT/$f.txt" | tee -a "$SUMMARY"
done
exit $failed
