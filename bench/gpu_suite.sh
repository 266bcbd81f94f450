#!/usr/bin/env bash
# One batched GPU session: kiln's GPU tests, every benchmark, and the main job on CUDA.
# Usage (on the H200, from the repo root): bash bench/gpu_suite.sh OUT_DIR [parts...]
# parts: tests norms gemm_ce attention matmul_decode host_overhead run infer compile, and the measurements
# the open issues wait for: serve overlap quant quantsweep fp8curve fp8check fp8speed fp8rowwise speedrun cuda
# moe imbalance decode decodestep quantprofile moesmall (default: tests norms gemm_ce attention run). Each part has its own time
# cap so one slow part cannot eat the others'; results are JSON/logs in OUT_DIR.
# At most 7 files land in OUT_DIR (the device tool brings back 8).
set -u
OUT=${1:?usage: gpu_suite.sh OUT_DIR [parts...]}
shift
PARTS=${*:-tests norms gemm_ce attention run}
mkdir -p "$OUT"
# kiln is imported from this tree (the GPU machine has no install of it); the scripts add no paths themselves
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# Wheels the GPU image lacks travel in .whl/ (Liger Kernel; FastAPI, uvicorn, pydantic for `serve`; see
# PLATFORM.md): installed out of the tree when present.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
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
    # (each file has its own time cap, KILN_TEST_TIMEOUT, 240 s: test_attention alone takes ~150 s;
    # KILN_TEST_JOBS files at a time, 4)
    tests) grep -l "mark.gpu" -r tests --include="test_*.py" | sort | xargs -P "${KILN_TEST_JOBS:-4}" -I{} \
             sh -c 'timeout "${KILN_TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider {} > "$0/gpu_tests.$(basename {} .py).log" 2>&1; echo "{}: exit $?"' "$OUT" \
             > "$OUT/gpu_tests.log" 2>&1
           for f in "$OUT"/gpu_tests.test_*.log; do echo "== $f"; cat "$f"; done >> "$OUT/gpu_tests.log"
           rm -f "$OUT"/gpu_tests.test_*.log ;;
    norms) timeout 170 python3 bench/norms.py --budget 150 --out "$OUT/norms.json" >> "$OUT/bench.log" 2>&1 ;;
    gemm_ce) timeout 150 python3 bench/gemm_ce.py --out "$OUT/gemm_ce.json" >> "$OUT/bench.log" 2>&1 ;;
    matmul_decode) timeout 90 python3 bench/matmul_decode.py --out "$OUT/matmul_decode.json" >> "$OUT/bench.log" 2>&1 ;;
    host_overhead) timeout 90 python3 bench/host_overhead.py --out "$OUT/host_overhead.json" >> "$OUT/bench.log" 2>&1 ;;
    attention) timeout 130 python3 bench/attention.py --out "$OUT/attention.json" >> "$OUT/bench.log" 2>&1 ;;
    compile) timeout 400 python3 bench/compile.py --preset gpu --out "$OUT/compile.json" >> "$OUT/bench.log" 2>&1 ;;
    infer) timeout 590 python3 bench/infer.py --out "$OUT/infer.json" >> "$OUT/bench.log" 2>&1 ;;
    run) timeout 75 python3 -m kiln.cli run --no-progress --out /tmp/kiln-gpu-run --data.max_bytes=12000000 \
           --tokenizer.train_bytes=3000000 --train.steps=150 --train.eval_interval=50 --train.ckpt_interval=150 \
           > "$OUT/run_gpu.log" 2>&1 ;;
    # issue 16: HTTP at saturation from one and from four client processes against the offline engine (~2 min)
    serve) timeout 200 python3 bench/serve.py --phases saturation,saturation_clients --out "$OUT/serve.json" \
             >> "$OUT/bench.log" 2>&1 ;;
    # issue 15: async scheduling off / on, its agreement over the prefix cache, and its fp32 GPU test
    overlap) timeout 150 python3 bench/infer_overlap.py --batches 1,64,128 --timed-steps 48 \
               --out "$OUT/infer_overlap.json" >> "$OUT/bench.log" 2>&1
             timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/infer/test_engine_gpu.py \
               >> "$OUT/bench.log" 2>&1 ;;
    # issue 18: the engine's quantized decode with the swept tables, prefill, the logit error (~1 min)
    quant) timeout 150 python3 bench/quant.py --skip decode --out "$OUT/quant.json" >> "$OUT/bench.log" 2>&1 ;;
    # issue 23: FP8 training's GEMMs and gradients against float64 and bf16, eager and compiled (<= 150 s)
    fp8check) timeout 150 python3 bench/fp8_check.py --out "$OUT" --budget 95 >> "$OUT/bench.log" 2>&1 ;;
    # issue 23: the FP8 casts' bytes per form, then FP8 training's speed against kiln's own bf16 (<= 330 s)
    fp8speed) timeout 60 python3 bench/experiments/fp8_cast_probe.py --out "$OUT/fp8_cast_probe.json" \
                >> "$OUT/bench.log" 2>&1
              timeout 270 python3 bench/train.py --shapes 350m,1b --contenders kiln-compiled,kiln-compiled-fp8 \
                --out "$OUT/train-fp8-speed.json" >> "$OUT/bench.log" 2>&1 ;;
    # issue 23: bf16 against FP8 loss curves over 1000 steps through torch.compile (<= 330 s; the rowwise
    # run needs ~100 s more than that budget)
    fp8curve) timeout 330 python3 bench/train.py --case fp8-curve --compile --steps 1000 --budget 250 \
                --out "$OUT/train-fp8-curve.json" >> "$OUT/bench.log" 2>&1 ;;
    # issue 23: the row-wise recipe's casts from transposed views: the FP8 GPU tests, then its speed at 1.1B
    # beside bf16 and tensorwise (<= 470 s)
    fp8rowwise) timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_fp8_cast.py \
                  tests/kernels/test_fp8_train_gpu.py tests/model/test_fp8_training.py >> "$OUT/bench.log" 2>&1
                timeout 270 python3 bench/train.py --shapes 1b \
                  --contenders kiln-compiled,kiln-compiled-fp8,kiln-compiled-fp8-rowwise \
                  --out "$OUT/train-fp8-rowwise.json" >> "$OUT/bench.log" 2>&1 ;;
    # issue 18: the decode config sweep (the fma form's new loop, its multi-row tiles), then the engine's
    # quantized decode with the tables in the tree (<= 300 s)
    quantsweep) timeout 150 python3 bench/quant.py --case decode-sweep --budget 105 --out "$OUT/quant_sweep.json" \
                  >> "$OUT/bench.log" 2>&1
                timeout 150 python3 bench/quant.py --skip decode,prefill,logits --out "$OUT/quant-engine.json" \
                  >> "$OUT/bench.log" 2>&1 ;;
    # issue 23: the speed run, kiln's recipe against the compiled HF baseline to the target bpb (<= 595 s)
    speedrun) timeout 595 python3 bench/speedrun.py --out "$OUT/speedrun.json" >> "$OUT/bench.log" 2>&1 ;;
    # issue 21: the CUDA kernels' GPU tests (wgmma and the TMA-fed mma.sync included), then the ladder
    cuda) timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/cuda >> "$OUT/bench.log" 2>&1
          timeout 200 python3 bench/cuda_ladder.py --out "$OUT/cuda_ladder.json" >> "$OUT/bench.log" 2>&1 ;;
    # issue 19: the decode kernels' GPU tests, then decode batch 1-64, prefill against torch._grouped_mm and
    # the tile sweeps (<= 400 s; ~130 s without the sweeps at c598f16)
    moe) timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_moe_decode.py \
           >> "$OUT/bench.log" 2>&1
         timeout 280 python3 bench/moe.py --case quick --budget 240 --out "$OUT/moe_quick.json" \
           >> "$OUT/bench.log" 2>&1 ;;
    # issue 19: tokens and GPU time per expert (Zipf vs balanced), each expert's work alone against the
    # grouped layer's one launch per GEMM, every shape at 4k tokens: moe_imbalance.json and .png (~60-90 s)
    imbalance) timeout 150 python3 bench/moe_imbalance.py --out "$OUT/moe_imbalance.json" >> "$OUT/bench.log" 2>&1 ;;
    # issues 15 and 19: the decode forms built without a GPU, each against the form in use, side by side.
    # decode: kernel level (decode attention's one-launch form and split configs; add + RMSNorm split over
    # the decode matmuls) and the GPU tests of every new form (<= 530 s; attention alone took ~130 s at c598f16)
    decode) timeout 200 python3 bench/attention.py --no-flex --out "$OUT/attention.json" >> "$OUT/bench.log" 2>&1
            timeout 90 python3 bench/matmul_decode.py --case norm_fused --out "$OUT/matmul_decode-norm_fused.json" \
              >> "$OUT/bench.log" 2>&1
            timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
              tests/kernels/test_norm_fused_decode.py tests/kernels/test_moe_decode.py tests/kernels/test_moe_gemm.py \
              tests/model/test_norm_split.py >> "$OUT/bench.log" 2>&1 ;;
    # decodestep: whole decode steps (async scheduling, CUDA graphs; batch 1 and 16, where the split norm
    # applies: at most 16 rows) in today's forms, with decode attention
    # in one launch (KILN_DECODE_FORM=one_pass), and with the add + RMSNorm split (KILN_DECODE_NORM=split):
    # one process each, one after the other (tables in bench.log), one file {"base", "one_pass",
    # "norm_split"} (<= 420 s)
    decodestep)
            rm -f /tmp/infer_overlap-step_*.json
            for form in base one_pass norm_split; do
              echo "== infer_overlap $form" >> "$OUT/bench.log"
              env $( [ $form = one_pass ] && echo KILN_DECODE_FORM=one_pass ) \
                $( [ $form = norm_split ] && echo KILN_DECODE_NORM=split ) \
                timeout 140 python3 bench/infer_overlap.py --batches 1,16 --timed-steps 48 \
                --out "/tmp/infer_overlap-step_$form.json" >> "$OUT/bench.log" 2>&1
            done
            python3 -c 'import json, os, sys; json.dump({f: json.load(open(f"/tmp/infer_overlap-step_{f}.json"))
              for f in ("base", "one_pass", "norm_split") if os.path.exists(f"/tmp/infer_overlap-step_{f}.json")},
              open(sys.argv[1], "w"), indent=1)' "$OUT/infer_overlap-decode_forms.json" >> "$OUT/bench.log" 2>&1 ;;
    # issue 18: the batch-1 step of bf16, int8 and int4-g128 models (round to nearest, head quantized) kernel by
    # kernel, at the engine benchmark's context (kiln profile decode --quant; ~30 s each): profile/ in OUT
    quantprofile)
            for s in bf16 int8 int4-g128; do
              q=$( [ $s = bf16 ] || echo "--quant $s" )
              timeout 120 python3 -m kiln.cli profile decode --shape qwen2.5-1.5b $q --batch 1 --context 256 \
                --out "/tmp/quantprofile/$s" >> "$OUT/bench.log" 2>&1
            done
            cat /tmp/quantprofile/*/decode_summary.md > "$OUT/quantprofile_summary.md" 2>/dev/null ;;
    # issue 19: MoE decode at 1-4 tokens over cold weight copies, with the 16-row up kernel's 3-programs-an-SM
    # tiles beside the default (docs/perf/moe.md, "Waves of the 16-row up kernel"), then at 1 and 3 tokens
    # L2-warm as the runs before 2026-12-04 timed it (<= 400 s)
    moesmall) timeout 250 python3 bench/experiments/moe_decode_batch.py --tokens 1,2,3,4 --no-profile \
                --out "$OUT/moe_decode_small.json" >> "$OUT/bench.log" 2>&1
              timeout 150 python3 bench/experiments/moe_decode_batch.py --tokens 1,3 --no-profile --warm \
                --out "$OUT/moe_decode_small_warm.json" >> "$OUT/bench.log" 2>&1 ;;
    *) echo "unknown part $part" ;;
  esac
  echo "$part: exit $? in $(( $(date +%s) - start ))s" | tee -a "$OUT/env.txt"
done
grep -E "^(tests/.*: exit|[0-9]+ (passed|failed)|.* in [0-9.]+s)" "$OUT/gpu_tests.log" 2>/dev/null | grep -v "exit 0$"
