#!/usr/bin/env bash
# `kiln profile` on the H200, everything in one command (at most 405 s of parts; each part has its own cap):
#   the ceilings, the Qwen2.5-1.5B-shape decode step at batch 1 and 64 with CUDA graphs on and off, the
#   roofline of every kernel, and the profile GPU tests. Results land under OUT_DIR (tar it):
#   ceilings.json, decode/ (JSON, CSV, PNGs and the Chrome trace of each step), roofline/ (JSON, PNG),
#   a log per part and status.txt (exit status and seconds of each part).
# Usage (from the repo root): bash bench/profile_suite.sh OUT_DIR
set -u
OUT=${1:?usage: bench/profile_suite.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# the ceilings cache goes with the results (and every part below reads the one measurement)
export XDG_CACHE_HOME="$OUT/cache"
PY=${PYTHON:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  echo "commit ${KILN_COMMIT:-unknown}"
  date -u
} > "$OUT/env.txt" 2>&1

part() {  # part NAME SECONDS command...
  local name=$1 limit=$2
  shift 2
  local start
  start=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start )) s" | tee -a "$OUT/status.txt"
  tail -n 40 "$OUT/$name.log"
}

part ceilings 45 $PY -m kiln.cli profile ceilings --out "$OUT/ceilings.json"
# the four decode configurations in one process: the model is built and the kernels compiled once
part decode 200 $PY -m kiln.cli profile decode --shape qwen2.5-1.5b --batch 1,64 --graphs on,off \
  --context 1024 --out "$OUT/decode"
part roofline 110 $PY -m kiln.cli profile roofline --out "$OUT/roofline"
part gpu_tests 50 $PY -m pytest -q -p no:cacheprovider -m gpu tests/profile
echo "total $SECONDS s" | tee -a "$OUT/status.txt"
