#!/usr/bin/env bash
# One batched GPU session: kiln's GPU tests, every benchmark, and the main job on CUDA.
# Usage (on the H200, from the repo root): bash bench/gpu_suite.sh OUT_DIR [parts...]
# parts: tests norms gemm_ce attention matmul_decode host_overhead run infer compile (default: tests norms
# gemm_ce attention run). Each part has its own time cap so one
# slow part cannot eat the others'; results are JSON/logs in OUT_DIR.
# At most 7 files land in OUT_DIR (the device tool brings back 8).
set -u
OUT=${1:?usage: gpu_suite.sh OUT_DIR [parts...]}
shift
PARTS=${*:-tests norms gemm_ce attention run}
mkdir -p "$OUT"
# kiln is imported from this tree (the GPU machine has no install of it); the scripts add no paths themselves
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# Liger Kernel travels as a pure-Python wheel (see PLATFORM.md); install it out of the tree if present.
if ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/liger_kernel-*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  echo "commit ${KILN_COMMIT:-unknown}"
  date -u
} > "$OUT/env.txt" 2>&1

for part in $PARTS; do
  start=$(date +%s)
  case $part in
    # one process per test file, 4 at a time: a kernel fault poisons its CUDA context, and must not
    # fail the files that happen to share a worker with it
    # (each file has its own time cap: test_attention alone takes ~150 s)
    tests) grep -l "mark.gpu" -r tests --include="test_*.py" | sort | xargs -P 4 -I{} \
             sh -c 'timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider {} > "$0/gpu_tests.$(basename {} .py).log" 2>&1; echo "{}: exit $?"' "$OUT" \
             > "$OUT/gpu_tests.log" 2>&1
           for f in "$OUT"/gpu_tests.test_*.log; do echo "== $f"; cat "$f"; done >> "$OUT/gpu_tests.log"
           rm -f "$OUT"/gpu_tests.test_*.log ;;
    norms) timeout 170 python3 bench/norms.py --budget 150 --out "$OUT/norms.json" >> "$OUT/bench.log" 2>&1 ;;
    gemm_ce) timeout 150 python3 bench/gemm_ce.py --out "$OUT/gemm_ce.json" >> "$OUT/bench.log" 2>&1 ;;
    matmul_decode) timeout 90 python3 bench/matmul_decode.py --out "$OUT/matmul_decode.json" >> "$OUT/bench.log" 2>&1 ;;
    host_overhead) timeout 90 python3 bench/host_overhead.py --out "$OUT/host_overhead.json" >> "$OUT/bench.log" 2>&1 ;;
    attention) timeout 130 python3 bench/attention.py --out "$OUT/attention.json" >> "$OUT/bench.log" 2>&1 ;;
    compile) timeout 400 python3 bench/compile.py --preset gpu --out "$OUT/compile.json" >> "$OUT/bench.log" 2>&1 ;;
    infer) timeout 540 python3 bench/infer.py --out "$OUT/infer.json" >> "$OUT/bench.log" 2>&1 ;;
    run) timeout 75 python3 -m kiln.cli run --no-progress --out /tmp/kiln-gpu-run --data.max_bytes=12000000 \
           --tokenizer.train_bytes=3000000 --train.steps=150 --train.eval_interval=50 --train.ckpt_interval=150 \
           > "$OUT/run_gpu.log" 2>&1 ;;
    *) echo "unknown part $part" ;;
  esac
  echo "$part: exit $? in $(( $(date +%s) - start ))s" | tee -a "$OUT/env.txt"
done
grep -E "^(tests/.*: exit|[0-9]+ (passed|failed)|.* in [0-9.]+s)" "$OUT/gpu_tests.log" 2>/dev/null | grep -v "exit 0$"
