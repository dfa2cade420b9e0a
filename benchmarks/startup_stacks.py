"""Where a slow engine start-up goes: builds `LLM` with INFO logs on and dumps every thread's Python
stack every `--interval` seconds (faulthandler) until it is up, then times a short generation. For
a start-up that runs past its benchmark's box, this says which phase it was in.

    python benchmarks/startup_stacks.py --quantization fp8 --out-dir OUT [--interval 20]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import make_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--root", default="/tmp/atomc-bench-models")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--interval", type=float, default=20.0)
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s",
        handlers=[logging.FileHandler(out / "startup.log"), logging.StreamHandler()],
    )  # fmt: skip
    stacks = open(out / "stacks.txt", "w")  # noqa: SIM115 (faulthandler writes to it until exit)
    faulthandler.dump_traceback_later(args.interval, repeat=True, file=stacks)
    from atomc import LLM, SamplingParams

    model_dir = str(make_checkpoint(args.model, Path(args.root)))
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir, dtype="bfloat16", device="cuda", load_format="dummy", max_model_len=1024,
        max_num_seqs=8, enforce_eager=args.enforce_eager, quantization=args.quantization,
    )  # fmt: skip
    startup = time.perf_counter() - t0
    faulthandler.cancel_dump_traceback_later()
    t1 = time.perf_counter()
    llm.generate(
        {"prompt_token_ids": list(range(100, 228))}, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    )
    result = {"startup_s": round(startup, 1), "generate_64_s": round(time.perf_counter() - t1, 2)}
    (out / "result.json").write_text(json.dumps(result))
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
