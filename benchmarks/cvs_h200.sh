#!/usr/bin/env bash
# The H200 reference run of `atomc bench sweep` (issue 18), in one command that fits one device call:
#
#     benchmarks/cvs_h200.sh OUT_DIR            # the H200 run (profile perf)
#     benchmarks/cvs_h200.sh OUT_DIR --tiny     # the same suite on a CPU at toy size (profile tiny)
#
# Config: benchmarks/cvs/h200_atom_llama-3.1-8b_bf16_single.json (schema_version 2) and its threshold
# file beside it. The script writes the checkpoint the config's model.id names (config.json and a
# synthetic tokenizer, benchmarks/checkpoints.py; the weights are random, --load-format dummy), then
# runs the suite, which starts `atomc serve` on it itself (driver atom), runs FUNC-1/2, polls the
# platform (NVML through nvidia-ml-py, the kernel log through dmesg; each SKIPs with its reason where
# it cannot read), runs the 16 cells, gates them and writes OUT_DIR/report.json, run_deck.html and
# run_deck.json. Nothing here needs the network or a browser. Exit code: the suite's (0 pass, 1 a
# gate or block failed, 2 config error), 124 when the suite ran past SUITE_TIMEOUT_S (the deck is
# then rendered from the cells measured so far).
#
# Time budget (one device call of 600 s, ~50 s of it start overhead: this command gets ~520 s).
# Per-cell estimate, from H200 figures for this model (random bf16 weights; benchmarks/serving.py):
# decode step TPOT(B) ~ 5.0 + 0.075*B ms (4.96 ms measured at B=1, 9.0 at 64, 14.4 at 128), prefill
# ~34k tokens/s (30 ms per 1024-token prompt), so one wave of B requests takes
# B*ISL/34k + OSL*TPOT(B) seconds; warm-ups are 8 requests of 16 output tokens at the cell's CONC.
#
#   cell (ISL/OSL CONC: prompts)  waves x wave = cell    cell (ISL/OSL CONC: prompts)  waves x wave = cell
#   1024/1024    1:   2           2 x  5.2 s = 10.5 s    128/2048     1:   2           2 x 10.4 s = 20.8 s
#   1024/1024    2:   4           2 x  5.3 s = 10.7 s    128/2048     2:   2           1 x 10.6 s = 10.6 s
#   1024/1024    4:   8           2 x  5.5 s = 11.1 s    128/2048     4:   4           1 x 10.9 s = 10.9 s
#   1024/1024    8:  16           2 x  6.0 s = 12.0 s    128/2048     8:   8           1 x 11.5 s = 11.5 s
#   1024/1024   16:  16           1 x  6.8 s =  6.8 s    128/2048    16:  16           1 x 12.8 s = 12.8 s
#   1024/1024   32:  32           1 x  8.5 s =  8.5 s    128/2048    32:  32           1 x 15.3 s = 15.3 s
#   1024/1024   64:  64           1 x 12.0 s = 12.0 s    128/2048    64:  64           1 x 20.3 s = 20.3 s
#   1024/1024  128: 128           1 x 18.8 s = 18.8 s    128/2048   128: 128           1 x 30.4 s = 30.4 s
#   shape total                               90.4 s                                          132.6 s
#
#   sweep 223 s + warm-ups ~5 s + functional checks ~3 s            ~ 231 s
#   server start (cold compile, measured 40-70 s; capped at 240 s)  ~  70 s
#   checkpoint ~3 s, imports, server stop (drain), deck             ~  20 s
#   total                                                           ~ 320 s  (200 s of margin)
#
# Guards so a hang cannot eat the call: the server must answer /health within 240 s and each cell's
# client within 120 s (params in the config), and the suite as a whole is stopped at
# SUITE_TIMEOUT_S (default 470 s; SIGTERM stops the server's process group), after which the deck is
# rendered from report.json (rewritten after every cell).
#
# Environment: PYTHON (default python), SUITE_TIMEOUT_S.
set -uo pipefail

usage() { echo "usage: $0 OUT_DIR [--tiny]" >&2; exit 2; }
[[ $# -ge 1 && $1 != -* ]] || usage
OUT=$1
shift
PROFILE=perf
for arg in "$@"; do
  case $arg in
    --tiny) PROFILE=tiny ;;
    *) usage ;;
  esac
done

PY=${PYTHON:-python}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONFIG=benchmarks/cvs/h200_atom_llama-3.1-8b_bf16_single.json  # relative: the script runs from the repo root
if [[ $PROFILE == tiny ]]; then
  TIMEOUT_S=${SUITE_TIMEOUT_S:-1800}  # a shared CPU compiles slowly
else
  TIMEOUT_S=${SUITE_TIMEOUT_S:-470}
fi
# the model folder is local and the prompts are token ids: nothing may reach for the Hub
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$REPO" || exit 2
t0=$(date +%s)
echo "cvs_h200: profile $PROFILE, config $CONFIG, output $OUT, suite timeout ${TIMEOUT_S}s"

# 1. the checkpoint the profile's model.id names; prints its vocabulary size (prompts draw ids below it)
VOCAB=$("$PY" - "$CONFIG" "$PROFILE" <<'EOF'
import json, sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
from checkpoints import make_checkpoint
from atomc.bench.config import load_sweep_config

cfg = load_sweep_config(sys.argv[1], sys.argv[2])
model = Path(cfg.model_id)
name, tiny = model.name.removesuffix("-tiny"), model.name.endswith("-tiny")
made = make_checkpoint(name, model.parent, tiny=tiny)
assert made == model, f"checkpoint written to {made}, config names {model}"
print(json.loads((made / "config.json").read_text())["vocab_size"])
EOF
) || { echo "cvs_h200: could not write the checkpoint" >&2; exit 2; }
echo "cvs_h200: checkpoint ready (vocab $VOCAB) after $(( $(date +%s) - t0 ))s"

# 2. what the platform blocks will be able to read (they SKIP, never crash, where they cannot)
if "$PY" -c "import pynvml" 2>/dev/null; then
  echo "cvs_h200: nvidia-ml-py found: platform.gpu_metrics_poll reads NVML"
else
  echo "cvs_h200: WARN: nvidia-ml-py (pynvml) not importable: platform.gpu_metrics_poll will SKIP" >&2
fi
if dmesg >/dev/null 2>&1; then
  echo "cvs_h200: dmesg readable: platform.dmesg_scan scans the kernel log"
else
  echo "cvs_h200: WARN: dmesg not readable here (a container?): platform.dmesg_scan will SKIP" >&2
fi

# 3. the suite: it starts atomc serve, runs every block and cell, gates them, writes the deck
# (suite.log keeps every line; the terminal skips the per-request httpx lines, and the long gate
# table is summed up at the end, so the tail of the output shows the run)
timeout -k 30 "$TIMEOUT_S" "$PY" -m atomc.cli bench sweep --config "$CONFIG" --config-profile "$PROFILE" \
  --output-dir "$OUT" --vocab-size "$VOCAB" --disable-tqdm 2>&1 | tee "$OUT/suite.log" \
  | grep --line-buffered -v "INFO httpx: HTTP Request"
rc=${PIPESTATUS[0]}

# 4. a suite stopped by the timeout wrote no deck: render it from the cells measured so far
if [[ ! -f $OUT/run_deck.html && -f $OUT/report.json ]]; then
  echo "cvs_h200: suite ended with $rc before writing the deck; rendering it from report.json" >&2
  if ! "$PY" -m atomc.cli bench deck "$OUT/report.json" --output-dir "$OUT" && [[ $rc == 0 ]]; then rc=1; fi
fi
# 5. a short summary of report.json: every cell, every block, the gate counts and any failed gate
if [[ -f $OUT/report.json ]]; then
  "$PY" - "$OUT/report.json" <<'EOF'
import json, sys

r = json.load(open(sys.argv[1]))


def f(v, d=1):
    return "n/a" if not isinstance(v, int | float) else f"{v:.{d}f}"


print(f"\n== {r.get('model_id')} ({r.get('gpu_arch')}, profile {r.get('profile')}) {r.get('started_at')} .. {r.get('finished_at')}")
print(f"{'cell':<34}{'ok/n':>9}{'dur s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}")
for key, c in (r.get("cells") or {}).items():
    ok = f"{c.get('completed')}/{c.get('num_prompts')}"
    print(
        f"{key:<34}{ok:>9}{f(c.get('duration')):>8}{f(c.get('output_throughput')):>11}"
        f"{f(c.get('median_ttft_ms')):>10}{f(c.get('p99_ttft_ms')):>10}{f(c.get('median_tpot_ms'), 2):>10}"
    )
for b in r.get("blocks") or []:
    print(f"block {b.get('block'):<28} {b.get('verdict'):<6} {str(b.get('reason'))[:100]}")
print("gates:", r.get("summary"), "exit code:", r.get("exit_code"))
for g in r.get("gates") or []:
    if g.get("status") == "FAIL":
        print(f"FAIL {g['cell']} {g['metric']}: {g['reason']}")
EOF
fi
echo "cvs_h200: done in $(( $(date +%s) - t0 ))s, exit $rc; files in $OUT:"
ls -l "$OUT"
exit "$rc"
