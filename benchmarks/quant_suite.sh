#!/usr/bin/env bash
# The quantisation suite (issue 16) sized for ONE device call of 600 s (about 50 s of it the
# machine's start): the FP8 / MXFP4 code's GPU tests, then its benchmarks, each step time-boxed so a
# hang or a crash costs only its own box, each writing under OUT, and a summary at the end
# (benchmarks/quant_summary.py):
#
#   bash benchmarks/quant_suite.sh OUT [--tiny]
#
#   step                                                        estimate  box   writes (under OUT)
#   1 GPU tests: pytest -m gpu of the five FP8 / MXFP4 / FP8-KV  ~170 s   190   gpu_tests.log, gpu_tests.xml
#     files (106 tests, the FP8-KV engine tests last: ~90 s of it,
#     so a cut costs those first)
#   2 benchmarks/fp8_linear.py: FP8 GEMV / GEMM / _scaled_mm     ~90 s    110   fp8_linear.json, .log
#     against bf16 at Llama-3.1-8B shapes (M 1 first, then
#     DeepSeek-V3 block shapes at M 2048 / 4096, then M 8..4096;
#     ~185 timings of ~0.2 s at --rep-ms 10, ~25 Triton compiles)
#   3 benchmarks/decode_bs1.py: Llama-3.1-8B batch-1 decode,      ~130 s   170   decode_bs1_llama31_8b.json, .<engine>.log
#     atomc bf16 (~60 s: cold compile, 3 x 512 tokens; stopped
#     where it would leave atomc fp8 less than 65 s) then atomc
#     --quantization fp8 (~60 s), rooflines from one copy measure
#   4 benchmarks/moe_kernel.py --weights mxfp4 --shapes gpt_oss   ~45 s    60    moe_kernel_mxfp4_gpt_oss.json, .log
#   5 gpt-fast int8 Llama (decode_bs1.py --engines gpt-fast-int8) ~110 s   rest  decode_bs1_llama31_8b_gpt_fast_int8.json, .log
#     only with .peers/gpt-fast/llama/ (benchmarks/peers/fetch_gpt_fast.sh; carry .peers/) and
#     only if >= 100 s of the budget are left (its compile with coordinate-descent tuning ~80 s)
#   steps 1-4: ~435 s estimated, boxes summing to 530 within SUITE_BUDGET (default 520 s from the
#   start; a step's box shrinks so that the steps after it keep their minimum); 5 only in what is
#   left of the budget, so the whole stays within it (+ ~50 s machine start: < 600 s).
#
# Step 1 is stopped with SIGINT, so pytest still writes its junit XML and its -rf summary; the
# benchmarks write their JSON as they go, so a stopped step keeps what it finished. --tiny runs the
# same steps on the CPU (the GPU tests then skip; the benchmarks' --tiny modes: Triton interpreter,
# toy shapes), with every box TINY_SCALE (default 4) times longer, to check the script before
# GPU time. PYTHON (default python3), MODELS_DIR (config-only checkpoints, default
# /tmp/atomc-bench-models) and SUITE_BUDGET can be set.
set -uo pipefail
OUT=${1:?usage: quant_suite.sh OUT [--tiny]}
TINY=()
for arg in "${@:2}"; do
  case $arg in
    --tiny) TINY=(--tiny) ;;
    *) echo "unknown argument $arg" >&2; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT:${PYTHONPATH:-}"  # this tree's atomc, whatever is installed
PY=${PYTHON:-python3}
MODELS_DIR=${MODELS_DIR:-/tmp/atomc-bench-models}
SCALE=1
[ ${#TINY[@]} -gt 0 ] && SCALE=${TINY_SCALE:-4}
BUDGET=$(( ${SUITE_BUDGET:-520} * SCALE ))
mkdir -p "$OUT"
status=0
start=$SECONDS

# box CAP RESERVE: CAP * SCALE seconds, less where the budget left would not keep RESERVE * SCALE
# for the steps after this one (20 s at least)
box() {
  local cap=$(( $1 * SCALE )) keep=$(( $2 * SCALE )) left
  left=$(( BUDGET - (SECONDS - start) - keep ))
  [ "$left" -lt "$cap" ] && cap=$left
  [ "$cap" -lt 20 ] && cap=20
  echo "$cap"
}
stamp() { echo "== $1 (at $(( SECONDS - start )) s, box $2 s)"; }

# 1. the GPU tests
TESTS=(tests/kernels/test_triton_fp8_gpu.py tests/quant/test_fp8_ops.py tests/quant/test_fp8_models.py
       tests/kernels/test_triton_moe_quant_gpu.py tests/kernels/test_triton_fp8_kv_cache_gpu.py)
for f in "${TESTS[@]}"; do [ -f "$f" ] || { echo "missing test file $f" >&2; status=1; }; done
T=$(box 190 250)
stamp "1 GPU tests" "$T"
timeout -s INT -k 20 "$T" "$PY" -m pytest -m gpu -q -rf -p no:cacheprovider --durations=15 \
  --junitxml="$OUT/gpu_tests.xml" "${TESTS[@]}" >"$OUT/gpu_tests.log" 2>&1 || status=1
tail -25 "$OUT/gpu_tests.log"

# 2. FP8 linears against bf16
T=$(box 110 190)
stamp "2 fp8_linear" "$T"
timeout -k 10 "$T" "$PY" benchmarks/fp8_linear.py "${TINY[@]}" --rep-ms 10 --out "$OUT/fp8_linear.json" \
  >"$OUT/fp8_linear.log" 2>&1 || status=1
grep -E "FAILED|wrote|Error" "$OUT/fp8_linear.log" | tail -12

# 3. batch-1 decode, bf16 and online FP8, one bandwidth measure
T=$(box 170 40)
stamp "3 decode_bs1 atomc bf16, atomc fp8" "$T"
timeout -k 15 "$T" "$PY" benchmarks/decode_bs1.py --model llama-3.1-8b --root "$MODELS_DIR" "${TINY[@]}" \
  --engines atomc,atomc-fp8 --budget $(( T - 10 )) --reserve $(( 65 * SCALE )) \
  --out "$OUT/decode_bs1_llama31_8b.json" >"$OUT/decode_bs1_llama31_8b.log" 2>&1 || status=1
tail -5 "$OUT/decode_bs1_llama31_8b.log"

# 4. the MXFP4 fused MoE kernels at GPT-OSS-20B widths
T=$(box 60 0)
stamp "4 moe_kernel mxfp4 gpt_oss" "$T"
timeout -k 10 "$T" "$PY" benchmarks/moe_kernel.py --weights mxfp4 --shapes gpt_oss "${TINY[@]}" \
  --out "$OUT/moe_kernel_mxfp4_gpt_oss.json" >"$OUT/moe_kernel_mxfp4_gpt_oss.log" 2>&1 || status=1
tail -8 "$OUT/moe_kernel_mxfp4_gpt_oss.log"

# 5. the peer, with what is left
left=$(( BUDGET - (SECONDS - start) ))
if [ ! -f .peers/gpt-fast/llama/generate.py ]; then
  echo "== 5 gpt-fast int8: skipped, .peers/gpt-fast/llama/ is missing (run benchmarks/peers/fetch_gpt_fast.sh and carry .peers/)"
elif [ "$left" -lt $(( 100 * SCALE )) ]; then
  echo "== 5 gpt-fast int8: skipped, only $left s of the budget left"
else
  stamp "5 gpt-fast int8" "$left"
  bw=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['bandwidth_TBps'] * 1e12)" \
    "$OUT/decode_bs1_llama31_8b.json" 2>/dev/null)
  timeout -k 15 "$left" "$PY" benchmarks/decode_bs1.py --model llama-3.1-8b --root "$MODELS_DIR" "${TINY[@]}" \
    --engines gpt-fast-int8 --budget $(( left - 10 )) ${bw:+--bandwidth "$bw"} \
    --out "$OUT/decode_bs1_llama31_8b_gpt_fast_int8.json" >"$OUT/decode_bs1_llama31_8b_gpt_fast_int8.log" 2>&1 \
    || status=1
  tail -3 "$OUT/decode_bs1_llama31_8b_gpt_fast_int8.log"
fi

echo
echo "== summary ($OUT, $(( SECONDS - start )) s)"
"$PY" benchmarks/quant_summary.py "$OUT" | tee "$OUT/summary.md"
exit $status
