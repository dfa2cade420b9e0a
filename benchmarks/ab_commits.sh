#!/usr/bin/env bash
# A/B in one device call: batch-1 decode and 1024/1024 CONC 64 serving (Llama-3.1-8B shape, random
# bf16 weights) for two source trees, run alternately on the same GPU, so a change to a hot path is
# measured against the commit before it under the same conditions.
#
#   git archive PREV | tar -x -C .prev      # the tree to compare against (an ignored folder)
#   bash benchmarks/ab_commits.sh .prev . OUT_DIR
set -euo pipefail
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd); OUT=$3
mkdir -p "$OUT"
run() {  # tree label
  local tree=$1 label=$2
  (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" python3 benchmarks/decode_bs1.py --engines atomc \
      --out "$OUT/decode_bs1_$label.json" | tail -3) || echo "decode_bs1 $label failed"
  (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" python3 benchmarks/serving.py --conc 64 --skip-hf \
      --out "$OUT/serving_conc64_$label.json" | tail -3) || echo "serving $label failed"
}
run "$A" a
run "$B" b
