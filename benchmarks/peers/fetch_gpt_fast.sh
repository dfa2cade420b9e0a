#!/usr/bin/env bash
# Puts the pieces of gpt-fast's Mixtral example that benchmarks/peers/gpt_fast_mixtral.py runs into
# .peers/gpt-fast/ (an ignored folder: carry it to the device with the working tree):
#   mixtral-moe/model.py     its Transformer (MOEFeedForward: gathered per-token expert weights)
#   mixtral-moe/generate.py  prefill / decode_one_token / generate and its Inductor settings
#   mixtral-moe/tp.py        imported by generate.py (tensor parallelism; unused at one GPU)
#   LICENSE, and COMMIT (the commit they came from)
# and, into .peers/gpt-fast/llama/, the pieces of its Llama that benchmarks/peers/gpt_fast_llama.py runs:
#   model.py, generate.py, quantize.py (WeightOnlyInt8QuantHandler: its int8 weight-only mode),
#   tokenizer.py (imported by generate.py and quantize.py), tp.py, LICENSE, COMMIT
#
#   bash benchmarks/peers/fetch_gpt_fast.sh GIT_DIR [REV]  # a clone or bare git dir of pytorch-labs/gpt-fast
#   bash benchmarks/peers/fetch_gpt_fast.sh                # clones it from GitHub first
set -euo pipefail
SRC=${1:-}
REV=${2:-HEAD}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEST="$ROOT/.peers/gpt-fast"
if [ -z "$SRC" ]; then
  TMP=$(mktemp -d)
  trap 'rm -rf "$TMP"' EXIT
  git clone --bare --quiet https://github.com/pytorch-labs/gpt-fast "$TMP/gpt-fast.git"
  SRC="$TMP/gpt-fast.git"
fi
mkdir -p "$DEST"
for f in mixtral-moe/model.py mixtral-moe/generate.py mixtral-moe/tp.py LICENSE; do
  git -C "$SRC" show "$REV:$f" >"$DEST/$(basename "$f")"
done
git -C "$SRC" rev-parse "$REV" >"$DEST/COMMIT"
mkdir -p "$DEST/llama"
for f in model.py generate.py quantize.py tokenizer.py tp.py LICENSE; do
  git -C "$SRC" show "$REV:$f" >"$DEST/llama/$f"
done
cp "$DEST/COMMIT" "$DEST/llama/COMMIT"
echo "gpt-fast $(cat "$DEST/COMMIT") -> $DEST (Mixtral) and $DEST/llama (Llama)"
