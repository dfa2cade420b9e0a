#!/usr/bin/env bash
# Issue 16's serving targets in one device call: Llama-3.1-8B, ISL/OSL 1024/1024, one `atomc serve`
# after another (benchmarks/serving.py, random weights), each in its own time box:
#
#   bash benchmarks/fp8_serving.sh OUT [--tiny]
#
#   variant   server flags                                   cells       target it feeds
#   bf16      (none)                                         CONC 64,128 the baseline of both ratios
#   fp8       --quantization fp8                             CONC 64,128 FP8 / bf16 at CONC 64 >= 1.4x
#   fp8kv     --quantization fp8 --kv-cache-dtype fp8        CONC 64,128 fp8kv / fp8 at CONC 128 >= 1.15x;
#                                                                        fp8kv / bf16 at CONC 64 (the 1.4x
#                                                                        target with the KV cache in FP8 too)
#
# The FP8-KV ratio is taken against the FP8-weight server, so it measures the KV cache's bytes alone.
# Each variant writes OUT/<variant>/serving.json and server.log; the summary (quant_summary.py
# serving section) prints the ratios at the end. CONC (BF16_CONC for the bf16 server alone: 64 when
# only the CONC-64 ratio is wanted), VARIANTS (the servers to run, default "bf16 fp8 fp8kv": e.g.
# "fp8 fp8kv" for the FP8 KV ratio alone), WARMUPS (unmeasured requests a cell, default
# 16), BOX (seconds a variant, default 170) and PYTHON can be set; --tiny runs the same on the CPU
# (toy model, interpreter-free torch reference) to check the script before GPU time.
set -uo pipefail
OUT=${1:?usage: fp8_serving.sh OUT [--tiny]}
TINY=()
for arg in "${@:2}"; do
  case $arg in
    --tiny) TINY=(--tiny) ;;
    *) echo "unknown argument $arg" >&2; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT:${PYTHONPATH:-}"
PY=${PYTHON:-python3}
CONC=${CONC:-64,128}
WARMUPS=${WARMUPS:-16}
BOX=${BOX:-170}
mkdir -p "$OUT"
status=0

run_variant() {  # NAME CONC FLAGS...
  local name=$1 conc=$2
  shift 2
  mkdir -p "$OUT/$name"
  echo "== $name: CONC $conc, serve flags: $*" | tee -a "$OUT/fp8_serving.log"
  timeout -s INT "$BOX" "$PY" benchmarks/serving.py "${TINY[@]}" --skip-hf --conc "$conc" --warmups "$WARMUPS" \
    --server-args "$*" --out "$OUT/$name/serving.json" 2>&1 | tee -a "$OUT/fp8_serving.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "== $name exited $rc" | tee -a "$OUT/fp8_serving.log"; status=1; }
}

for variant in ${VARIANTS:-bf16 fp8 fp8kv}; do
  case $variant in
    bf16) run_variant bf16 "${BF16_CONC:-$CONC}" ;;
    fp8) run_variant fp8 "$CONC" --quantization fp8 ;;
    fp8kv) run_variant fp8kv "$CONC" --quantization fp8 --kv-cache-dtype fp8 ;;
    *) echo "unknown variant $variant (bf16, fp8, fp8kv)" >&2; exit 2 ;;
  esac
done
"$PY" benchmarks/quant_summary.py "$OUT" --serving | tee "$OUT/summary.md"
exit $status
