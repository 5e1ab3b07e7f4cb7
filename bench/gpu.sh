#!/usr/bin/env bash
# The GPU checks in one unattended call, under 8 minutes, on a machine with one NVIDIA GPU:
#
#   bench/gpu.sh                 # results in $OUT if set, else ./gpu-results
#
# On a bare lent machine (its own python3 with torch and transformers, no Malleus, no network)
# the wheels come with the tree: run `scripts/gpu-wheels.sh` here first, then `bash bench/gpu.sh`
# there with .gpu-wheels carried (docs/benchmarks.md "GPU" has the exact call).
#
# 0. machine.txt      nvidia-smi, the date, Python, torch and CUDA versions
# 1. install.txt      the wheels of .gpu-wheels (MALLEUS_GPU_WHEELS) into a temporary site
#                     folder with pip --no-index --no-deps, on PYTHONPATH from then on; only
#                     when the interpreter has no Malleus of its own (a .venv here has)
# 2. imports.txt      everything the stages import, each module's version and origin; a
#                     missing one stops the run here, named (bench/gpu_report.py env)
# 3. gpu-solo.json    tokens/s and MFU of a ~1.1B Llama in bf16, one rank on the whole GPU
# 4. gpu-plain.json   the same model in a plain transformers loop (bf16 autocast, fused AdamW)
# 5. cuda-tests.txt   the CUDA/NCCL tests (pytest -m cuda: bf16, fp32, float64 and activation
#                     checkpointing on the GPU against the CPU reference; skipped without CUDA)
# 6. gpu-share.json   four one-rank jobs sharing the GPU (NCCL allows no two ranks of one job
#                     on one GPU: bench/gpu.py says why), each one's tokens/s and their sum
# 7. gpu-compiled.json solo with `training.compile` (torch.compile of the layers' math), if
#                     time allows: only when its limit (120 s) still fits in the call's 480 s,
#                     and a C compiler is on PATH (inductor and Triton build with one)
# 8. summary.txt      one line per stage, PASS/FAIL, then the figures against the targets
#                     (MFU >= 40%, trainer/plain step time <= 1.10)
#
# Every stage has its own time limit (timeout: 30 + 30 + 45 + 90 + 75 + 90 + 115 s = 475 s in
# all, and the compiled stage only within the 480 s), so one hang cannot eat the others' time;
# after the imports every stage runs whatever the previous did; the exit code is 1 if any stage
# failed (a skipped one has not).
# MALLEUS_GPU_DRY_RUN=1 runs the same stages on CPU with a tiny model (tests/trainer/run), with
# 4x the time limits (a shared CPU imports torch slower than a GPU machine runs a step);
# MALLEUS_GPU_TIME_SCALE multiplies the limits (default 1, 4 in a dry run);
# MALLEUS_GPU_SHARE_RANKS sets how many jobs share the GPU (default 4);
# MALLEUS_GPU_STAGES runs only the stages named (e.g. "solo plain"; install and imports run
# whenever they are needed). PYTHON picks the interpreter (default: .venv/bin/python if present,
# else python3, else python).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; elif command -v python3 >/dev/null; then PY=python3; else PY=python; fi
fi
WHEELS="${MALLEUS_GPU_WHEELS:-.gpu-wheels}"
STAGES=" ${MALLEUS_GPU_STAGES:-machine solo plain cuda-tests share compiled} "
DRY=()
SCALE=1
if [[ "${MALLEUS_GPU_DRY_RUN:-0}" == "1" ]]; then DRY=(--dry-run --peak-tflops 1) SCALE=4; fi
SCALE="${MALLEUS_GPU_TIME_SCALE:-$SCALE}"
BUDGET=$((480 * SCALE)) # the whole call's seconds
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
failed=0

stage() { # stage NAME SECONDS LOG COMMAND...: run with a time limit, record PASS/FAIL
  local name=$1 limit=$(($2 * SCALE)) log=$3
  shift 3
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >"$OUT/$log" 2>&1
  local rc=$?
  local verdict=PASS
  if [[ $rc -ne 0 ]]; then verdict="FAIL (exit $rc$([[ $rc -eq 124 ]] && echo ', timed out'))"; failed=1; fi
  echo "$name: $verdict in $((SECONDS - t0)) s, log $log" | tee -a "$SUMMARY"
  return $rc
}
wanted() { [[ "$STAGES" == *" $1 "* ]]; }
give_up() { # the stages cannot run without what failed: say so and stop
  echo "stopped: $1 (see $OUT/$2)" | tee -a "$SUMMARY"
  tail -n 20 "$OUT/$2" >&2
  exit 1
}

if wanted machine; then
  stage machine 30 machine.txt bash -c "nvidia-smi || true; date -u; $PY -c 'import sys; print(\"python\", sys.version)'; $PY -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available())'"
fi

# The interpreter's own Malleus (a .venv's editable install), or the carried wheels.
if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("malleus.trainer") is None)' 2>/dev/null; then
  SITE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/malleus-gpu.XXXXXX")
  trap 'rm -rf "$SITE_DIR"' EXIT
  stage install 30 install.txt "$PY" bench/gpu_report.py install "$WHEELS" "$SITE_DIR/site" ||
    give_up "the wheels did not install ($PY has no Malleus; $WHEELS: scripts/gpu-wheels.sh)" install.txt
  export PYTHONPATH="$SITE_DIR/site${PYTHONPATH:+:$PYTHONPATH}"
fi
stage imports 45 imports.txt "$PY" bench/gpu_report.py env || give_up "a module is missing" imports.txt
grep -h '^WARNING' "$OUT/imports.txt" | tee -a "$SUMMARY"

if wanted solo; then stage solo 90 solo.txt "$PY" bench/gpu.py solo --out "$OUT" "${DRY[@]}"; fi
if wanted plain; then stage plain 75 plain.txt "$PY" bench/gpu.py plain --out "$OUT" "${DRY[@]}"; fi
if wanted cuda-tests; then
  stage cuda-tests 90 cuda-tests.txt "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/trainer/model/test_precision_cuda.py tests/trainer/parallel/test_timing.py
fi
if wanted share; then
  stage share 115 share.txt "$PY" bench/gpu.py share --ranks "${MALLEUS_GPU_SHARE_RANKS:-4}" --out "$OUT" "${DRY[@]}"
fi
if wanted compiled; then
  if ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
    echo "compiled: skipped, no C compiler on PATH (torch.compile builds its kernels with one)" | tee -a "$SUMMARY"
  elif ((SECONDS + 120 * SCALE > BUDGET)); then
    echo "compiled: skipped, $((BUDGET - SECONDS)) s left of the call's $BUDGET s" | tee -a "$SUMMARY"
  else
    stage compiled 120 compiled.txt "$PY" bench/gpu.py compiled --out "$OUT" "${DRY[@]}"
  fi
fi

"$PY" bench/gpu_report.py summary "$OUT" | tee -a "$SUMMARY"
exit $failed
