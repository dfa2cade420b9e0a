#!/usr/bin/env bash
# The MoE performance suite (issue 14's Performance section) for one model, its peers in the same
# call, results under OUT and a summary table at the end (benchmarks/moe_summary.py):
#
#   bash benchmarks/moe_suite.sh MODEL OUT [PART] [--tiny]
#
#   MODEL  mixtral-8x7b | qwen3-30b-a3b | gpt-oss-20b | deepseek-v2-lite
#   PART   decode: batch-1 decode, 128 in / 512 out, atomc then its peer (gpt-fast for Mixtral, which
#                  needs .peers/gpt-fast/ from benchmarks/peers/fetch_gpt_fast.sh; transformers with a
#                  static cache for the others), each in its own process (decode_bs1_moe.py)
#          serving: 1024/1024 against the MoE serving ceiling (serving.py): Qwen3-30B-A3B at
#                  CONC 1,8,32,64,128 (one wave per cell, 2 requests at CONC 1, CONC warm-ups of 16
#                  tokens; no peer unless HF_SERVING=1), GPT-OSS-20B at CONC 64 next to transformers
#                  generate_batch (64 prompts, 128 new tokens), DeepSeek-V2-Lite at CONC 1,8,32,64 (as
#                  Qwen3: no peer unless HF_SERVING=1; its ceiling counts the latent cache's bytes);
#                  Mixtral has no serving target
#          all (default): decode, then serving where the model has it
#   --tiny the same scripts on the CPU with 2-layer toy models (a smoke test before GPU time)
#
# Each PART of each model is sized for one 10-minute device call: a part is stopped after
# PART_TIMEOUT s (default 590; the JSON keeps what finished: serving writes atomc's cells before the
# peer runs); a decode part runs in DECODE_BUDGET s (default 570), atomc first, and an engine's
# process is stopped where it would eat the 150 s kept for each engine after it. PYTHON (default python3) and MODELS_DIR (where the
# config-only checkpoints go, default /tmp/atomc-bench-models) can be set.
set -uo pipefail
MODEL=${1:?usage: moe_suite.sh MODEL OUT [decode|serving|all] [--tiny]}
OUT=${2:?usage: moe_suite.sh MODEL OUT [decode|serving|all] [--tiny]}
PART=all
TINY=()
for arg in "${@:3}"; do
  case $arg in
    --tiny) TINY=(--tiny) ;;
    decode | serving | all) PART=$arg ;;
    *) echo "unknown argument $arg" >&2; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT:${PYTHONPATH:-}"  # this tree's atomc, whatever is installed
PY=${PYTHON:-python3}
MODELS_DIR=${MODELS_DIR:-/tmp/atomc-bench-models}
mkdir -p "$OUT"
status=0

case $MODEL in
  mixtral-8x7b) SERVING=() ;;
  qwen3-30b-a3b) SERVING=(--conc 1,8,32,64,128) ; [ "${HF_SERVING:-0}" = 1 ] || SERVING+=(--skip-hf) ;;
  gpt-oss-20b) SERVING=(--conc 64 --hf-conc 64) ;;
  deepseek-v2-lite) SERVING=(--conc 1,8,32,64) ; [ "${HF_SERVING:-0}" = 1 ] || SERVING+=(--skip-hf) ;;
  *) echo "unknown model $MODEL (mixtral-8x7b, qwen3-30b-a3b, gpt-oss-20b, deepseek-v2-lite)" >&2; exit 2 ;;
esac
if [ "$MODEL" = mixtral-8x7b ] && [ "$PART" != serving ] && [ ! -f .peers/gpt-fast/generate.py ]; then
  echo "gpt-fast peer missing: run benchmarks/peers/fetch_gpt_fast.sh (and carry .peers/ to the device)" >&2
  exit 2
fi

if [ "$PART" = decode ] || [ "$PART" = all ]; then
  echo "== $MODEL batch-1 decode"
  timeout "${PART_TIMEOUT:-590}" "$PY" benchmarks/decode_bs1_moe.py --model "$MODEL" --root "$MODELS_DIR" "${TINY[@]}" \
    --budget "${DECODE_BUDGET:-570}" --out "$OUT/decode_bs1_$MODEL.json" | tail -4 || status=1
fi
if { [ "$PART" = serving ] || [ "$PART" = all ]; } && [ ${#SERVING[@]} -gt 0 ]; then
  echo "== $MODEL serving"
  # its folder also gets the server's log
  timeout "${PART_TIMEOUT:-590}" "$PY" benchmarks/serving.py --model "$MODEL" --root "$MODELS_DIR" "${TINY[@]}" "${SERVING[@]}" \
    --out "$OUT/serving_$MODEL/serving_$MODEL.json" 2>&1 | tail -12 || status=1
fi

echo
echo "== summary ($OUT)"
"$PY" benchmarks/moe_summary.py "$OUT"
exit $status
