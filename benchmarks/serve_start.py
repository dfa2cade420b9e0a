"""Seconds from `atomc serve` to a 200 on /health: a cold start (empty compile cache) and warm starts
(the entry the cold start built), each server in its own process, with the start-up phase lines of
each server's log. Llama-3.1-8B shape, random bf16 weights (`--load-format dummy`).

    python benchmarks/serve_start.py --warm 2 --out serve_start.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from atomc.bench.sweep import free_port, server_command, stop_process_group, wait_until_healthy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import make_checkpoint  # noqa: E402


class LogStamper:
    """Stamps each new line of a server's log with the seconds since the server was started, by
    tailing the file on a thread: the server's own lines carry no clock, the engine's carry a wall
    clock, and only a common one shows the gaps between phases."""

    def __init__(self, path: Path, t0: float):
        self.path, self.t0, self.lines = path, t0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tail, daemon=True)
        self._thread.start()

    def _tail(self) -> None:
        pos, partial = 0, ""
        while not self._stop.is_set():
            try:
                with open(self.path, errors="replace") as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
            except OSError:
                chunk = ""
            now = time.perf_counter() - self.t0
            *done, partial = (partial + chunk).split("\n")
            self.lines += [(round(now, 2), ln.strip()) for ln in done]
            time.sleep(0.05)

    def stop(self) -> list[tuple[float, str]]:
        self._stop.set()
        self._thread.join()
        return self.lines


def start_once(model_dir: str, cache_dir: str, log_path: Path) -> dict:
    port = free_port()
    args = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "4096", "--cache-dir", cache_dir]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            server_command(model_dir, port, args), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        stamper = LogStamper(log_path, t0)
        try:
            wait_until_healthy(f"http://127.0.0.1:{port}", proc, 900, log_path)
            seconds = time.perf_counter() - t0
        finally:
            time.sleep(0.1)  # the last lines
            stamped = stamper.stop()
            stop_process_group(proc)
    phases = [f"{t:6.2f}s  {ln}" for t, ln in stamped if "start-up" in ln or "serving " in ln]
    return {"seconds_to_health": seconds, "phases": phases}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--root", default="/tmp/atomc-bench-models")
    ap.add_argument("--warm", type=int, default=2, help="warm starts after the cold one")
    ap.add_argument("--out", default="serve_start.json")
    ap.add_argument("--cache-dir", default=None, help="keep the compile cache here (default: a temporary folder)")
    args = ap.parse_args()
    model_dir = str(make_checkpoint(args.model, Path(args.root)))
    out = Path(args.out)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or tmp
        for i in range(1 + args.warm):
            kind = "cold" if i == 0 else "warm"
            res = {"kind": kind, **start_once(model_dir, cache_dir, out.parent / f"serve_start_{i}.log")}
            runs.append(res)
            print(f"{kind}: {res['seconds_to_health']:.1f} s to /health", flush=True)
            for line in res["phases"]:
                print("   ", line, flush=True)
    out.write_text(json.dumps({"model": args.model, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
