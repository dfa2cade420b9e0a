"""Where one warm engine start spends its time, function by function: the in-process profile behind
docs/performance.md section 5 (serve_start.py gives the phases; this gives what is inside them).

Builds the engine once in a child process (a cold compile if the cache has no entry yet), then
again in a fresh child under cProfile and `-X importtime`, and prints: the runner's phase times,
the functions with the most cumulative time, and the slowest top-level imports. Llama-3.1-8B
shape, random weights, the engine as `atomc serve` builds it (decode-only tokenizer).

    python benchmarks/warm_profile.py --cache-dir /tmp/cc                        # on the GPU box
    python benchmarks/warm_profile.py --device cpu --tiny --dtype float32 --cache-dir /tmp/cc
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child(args) -> None:
    import cProfile
    import pstats
    import time

    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    from atomc.config import EngineConfig
    from atomc.engine.llm_engine import LLMEngine

    t_imports = time.perf_counter() - t0
    cfg = EngineConfig(device=args.device)
    cfg.model.model, cfg.model.dtype, cfg.model.load_format = args.model, args.dtype, "dummy"
    cfg.model.max_model_len, cfg.compile.cache_dir = 4096, args.cache_dir
    engine = LLMEngine(cfg, decode_only_tokenizer=True)
    total = time.perf_counter() - t0
    if prof:
        prof.disable()
    runner = engine.runner
    out = {
        "hit": runner.compile_info.get("hit"),
        "engine_imports_s": t_imports,
        "engine_s": total,
        "runner": runner.timings,
        "compile": runner.compile_info.get("timings", {}),
    }
    if prof:
        stats = pstats.Stats(prof)
        rows = []
        for (file, line, fn), (_, ncalls, _tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
            rows.append((ct, ncalls, f"{file}:{line}({fn})"))
        rows.sort(reverse=True)
        out["top_cumulative"] = [
            {"cum_s": round(ct, 3), "calls": n, "where": w} for ct, n, w in rows[: args.top] if "<frozen" not in w
        ]
    print("RESULT " + json.dumps(out), flush=True)


def slowest_imports(stderr: str, n: int) -> list[dict]:
    """Top-level imports (`-X importtime` lines at the least indentation under a root) by their
    cumulative microseconds."""
    rows = []
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m and len(m.group(3)) <= 3:  # the module a phase imported, and its direct imports
            rows.append({"module": m.group(4), "cum_s": int(m.group(2)) / 1e6, "depth": len(m.group(3)) // 2})
    rows.sort(key=lambda r: -r["cum_s"])
    return rows[:n]


def run(args, profile: bool) -> tuple[dict, str]:
    cmd = [sys.executable] + (["-X", "importtime"] if profile else []) + [__file__, "--child"]
    cmd += ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--cache-dir", args.cache_dir]
    cmd += ["--top", str(args.top)] + (["--profile"] if profile else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"the child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT ")), proc.stderr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--root", default="/tmp/atomc-bench-models")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default="warm_profile.json")
    args = ap.parse_args()
    if args.child:
        return child(args)
    from checkpoints import make_checkpoint

    args.model = str(make_checkpoint(args.model, Path(args.root), tiny=args.tiny))
    first, _ = run(args, profile=False)  # fills the cache if it is empty
    plain, _ = run(args, profile=False)  # a warm start without the profiler's overhead
    profiled, stderr = run(args, profile=True)
    result = {"first": first, "warm": plain, "profiled": profiled, "imports": slowest_imports(stderr, args.top)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"warm start (no profiler): engine {plain['engine_s']:.1f} s, imports {plain['engine_imports_s']:.1f} s")
    for k, v in plain["runner"].items():
        print(f"    {k:<24} {v:6.2f} s")
    print("slowest imports (cumulative, -X importtime):")
    for r in result["imports"][:15]:
        print(f"    {r['cum_s']:6.2f} s  {'  ' * r['depth']}{r['module']}")
    print("most cumulative time under cProfile:")
    for r in profiled.get("top_cumulative", [])[:25]:
        print(f"    {r['cum_s']:7.3f} s  {r['calls']:>6}  {r['where']}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
