"""Seconds from `atomc serve` to a 200 on /health: a cold start (empty compile cache) and warm starts
(the entry the cold start built), each server in its own process, with the start-up phase lines of
each server's log and a breakdown of them into phases (`phase_breakdown`). Llama-3.1-8B shape,
random bf16 weights (`--load-format dummy`).

    python benchmarks/serve_start.py --warm 2 --out serve_start.json [--bytecode-cache /tmp/pyc]
    python benchmarks/serve_start.py --device cpu --tiny --dtype float32   # the same path on a CPU

Each run prints its phases in start-up order; `at` is the common clock (seconds since the launch)
when the phase's line arrived, so gaps between phases show too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


# (phase, pattern of its start-up line with the seconds as groups): the phases a warm start is made
# of, in start-up order; a phase whose line is absent (CUDA graphs on a CPU) is left out
PHASES = [
    ("listening", r"start-up: listening on"),
    ("http side imports (server)", r"HTTP side imported in (?P<s>[\d.]+)s"),
    ("engine spawn", r"engine process spawned in (?P<s>[\d.]+)s"),
    ("engine imports", r"engine imports (?P<s>[\d.]+)s"),
    ("model folder", r"model folder (?P<s>[\d.]+)s"),
    ("tokenizer (engine)", r"model folder [\d.]+s, tokenizer (?P<s>[\d.]+)s"),
    ("imports: backend ops, compiler", r"imports (?P<s>[\d.]+)s \(backend ops, compiler\)"),
    ("CUDA context (thread)", r"CUDA context (?P<s>[\d.]+)s on a thread"),
    ("CUDA context waited", r"on a thread, overlapped with the imports; (?P<s>[\d.]+)s waited"),
    ("weights", r"weights (?P<s>[\d.]+)s"),
    ("model", r"model \([\w ]+\) (?P<s>[\d.]+)s"),
    ("cache key and checks", r"cache key and checks (?P<s>[\d.]+)s"),
    ("artifact load", r"cache key and checks [\d.]+s, load (?P<s>[\d.]+)s"),
    ("KV sizing", r"KV sizing (?P<s>[\d.]+)s"),
    ("CUDA graphs", r"CUDA graphs captured in (?P<s>[\d.]+)s"),
    ("engine ready", r"engine ready in (?P<s>[\d.]+)s"),
    ("server-side tokenizer", r"server-side tokenizer (?P<s>[\d.]+)s"),
    ("serving", r"serving .* loaded in (?P<s>[\d.]+)s"),
]
# phases that run beside the engine's chain (their time is not on the path to /health) or that
# are parts of another phase (the wait for the CUDA context inside weights, key and load inside model)
OVERLAPPED = {"http side imports (server)", "CUDA context (thread)", "server-side tokenizer"}
PARTS = {"cache key and checks", "artifact load", "CUDA context waited"}


def phase_breakdown(stamped: list[tuple[float, str]]) -> list[dict]:
    """[{phase, seconds, at}] from a server's stamped log lines, in PHASES order. `seconds` is the
    phase's own figure from its line (None for a marker such as listening), `at` the common clock."""
    out = []
    for name, pattern in PHASES:
        for at, line in stamped:
            m = re.search(pattern, line)
            if m and ("start-up" in line or "serving " in line):
                seconds = float(m.group("s")) if "s" in m.groupdict() else None
                out.append({"phase": name, "seconds": seconds, "at": at})
                break
    return out


def format_breakdown(phases: list[dict]) -> list[str]:
    rows = []
    for p in phases:
        secs = "" if p["seconds"] is None else f"{p['seconds']:5.1f} s"
        note = " (overlapped)" if p["phase"] in OVERLAPPED else " (part of the above)" if p["phase"] in PARTS else ""
        rows.append(f"at {p['at']:6.2f}s  {p['phase']:<32} {secs}{note}")
    return rows


def start_once(model_dir: str, cache_dir: str, log_path: Path, device: str = "auto", dtype: str = "bfloat16") -> dict:
    port = free_port()
    args = ["--load-format", "dummy", "--dtype", dtype, "--max-model-len", "4096", "--cache-dir", cache_dir]
    args += ["--device", device, "--engine-process", "on"]  # the engine in its own process, as on a GPU
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
    return {"seconds_to_health": seconds, "phases": phases, "breakdown": phase_breakdown(stamped)}


def fill_bytecode_cache(path: str) -> None:
    """Point this process's children at a bytecode cache in `path` and fill it with what a server
    imports, so the timed starts read compiled bytecode as they would from a pip install."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = path
    code = (
        "import atomc.serve.server, atomc.engine.llm_engine, transformers, torch;"
        "from atomc.compat import import_compiler; import_compiler(torch.cuda.is_available())"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--root", default="/tmp/atomc-bench-models")
    ap.add_argument("--warm", type=int, default=2, help="warm starts after the cold one")
    ap.add_argument("--out", default="serve_start.json")
    ap.add_argument("--cache-dir", default=None, help="keep the compile cache here (default: a temporary folder)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16", help="float32 on a CPU")
    ap.add_argument("--tiny", action="store_true", help="the model's config at toy size (a CPU run of the same path)")
    ap.add_argument(
        "--bytecode-cache",
        default=None,
        metavar="DIR",
        help="run the servers with Python's bytecode cache in DIR, filled by one importing process first "
        "(as a pip install compiles it): for a Python environment that has none and writes none "
        "(PYTHONDONTWRITEBYTECODE), where every start compiles torch's sources again",
    )
    args = ap.parse_args()
    if args.bytecode_cache:
        fill_bytecode_cache(args.bytecode_cache)
    model_dir = str(make_checkpoint(args.model, Path(args.root), tiny=args.tiny))
    out = Path(args.out)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or tmp
        for i in range(1 + args.warm):
            kind = "cold" if i == 0 else "warm"
            log_path = out.parent / f"serve_start_{i}.log"
            res = {"kind": kind, **start_once(model_dir, cache_dir, log_path, args.device, args.dtype)}
            runs.append(res)
            print(f"{kind}: {res['seconds_to_health']:.1f} s to /health", flush=True)
            for line in format_breakdown(res["breakdown"]):
                print("   ", line, flush=True)
    meta = {"bytecode_cache": args.bytecode_cache, "writes_bytecode": not os.environ.get("PYTHONDONTWRITEBYTECODE")}
    out.write_text(json.dumps({"model": args.model, **meta, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
