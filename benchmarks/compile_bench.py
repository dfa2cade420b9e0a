"""Cold compile vs warm start of an 8B-shaped Llama (Llama-3.1-8B config, random bf16 weights).

Each measurement runs in its own subprocess, so no in-process Dynamo/Inductor cache helps:
  cold        empty atomc cache (Inductor builds in a fresh cache inside the new entry)
  warm        the cache the cold run filled: load the artifact, no trace, no Inductor
(The kernels a load needs are part of the signed entry, so there is no "warm without Inductor's
cache" case any more: removing them breaks the entry's signature and forces a rebuild.)
Prints one JSON object. Goal: warm load <= 0.25x cold compile.

    python benchmarks/compile_bench.py --work-dir /tmp/atomc_bench        # on the GPU box
    python benchmarks/compile_bench.py --device cpu --layers 2 --hidden 256  # smoke test
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def write_checkpoint(out: Path, device: str, layers: int | None, hidden: int | None, weights: bool = True) -> Path:
    """config.json + random bf16 safetensors shards, generated on `device` (fast on a GPU).
    Without `weights` only config.json is written and the children load random weights in memory."""
    import torch
    from checkpoints import CONFIGS
    from safetensors.torch import save_file

    from models.arch import ModelArch
    from models.loader.safetensors import build_on_meta, checkpoint_shapes

    cfg = dict(CONFIGS["llama-3.1-8b"])
    if layers:
        cfg["num_hidden_layers"] = layers
    if hidden:  # smoke-test shapes: keep head_dim, scale the rest
        cfg.update(
            hidden_size=hidden,
            intermediate_size=hidden * 3,
            num_attention_heads=hidden // 128 or 1,
            num_key_value_heads=1,
            vocab_size=4096,
        )
    tag = f"L{cfg['num_hidden_layers']}_H{cfg['hidden_size']}"
    ckpt = out / f"llama31_8b_shape_{tag}"
    if (ckpt / "model.safetensors.index.json").is_file():
        return ckpt
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))
    if not weights:
        return ckpt
    # the checkpoint's own names and shapes (q/k/v and gate/up apart), not the merged parameters
    shapes = checkpoint_shapes(build_on_meta(ModelArch.from_dict(cfg), torch.bfloat16))
    gen = torch.Generator(device=device).manual_seed(0)
    weight_map, shard, shard_bytes, idx = {}, {}, 0, 0

    def flush():
        nonlocal shard, shard_bytes, idx
        if shard:
            name = f"model-{idx:05d}.safetensors"
            save_file(shard, str(ckpt / name))
            weight_map.update(dict.fromkeys(shard, name))
            shard, shard_bytes, idx = {}, 0, idx + 1

    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
        shard[name] = (t + 1.0 if name.endswith("norm.weight") else t).cpu()
        shard_bytes += shard[name].numel() * 2
        if shard_bytes > 4 << 30:
            flush()
    flush()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return ckpt


def child(args) -> None:
    """One measured start: weights, then load_or_compile, then forwards at a few batch sizes."""
    t_start = time.perf_counter()
    import torch

    from atomc import compat
    from atomc.config import EngineConfig
    from atomc.graphs.build import load_or_compile
    from models.loader import load_model

    t_import = time.perf_counter() - t_start
    dtype = getattr(torch, args.dtype)
    cfg = EngineConfig(device=args.device)
    cfg.compile.cache_dir = args.cache_dir
    cfg.scheduler.max_num_batched_tokens = args.max_num_batched_tokens
    t0 = time.perf_counter()
    has_weights = (Path(args.model) / "model.safetensors.index.json").is_file()
    model = load_model(Path(args.model), dtype, args.device, "safetensors" if has_weights else "dummy")
    t_weights = time.perf_counter() - t0
    before = compat.compile_counters()
    t0 = time.perf_counter()
    forward, info = load_or_compile(model, Path(args.model), cfg, args.device, dtype)
    t_compile = time.perf_counter() - t0
    after_load = compat.compile_counters()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for n in (1, 7, 256, 1024):
            forward(torch.zeros(n, dtype=torch.long, device=args.device), torch.arange(n, device=args.device))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    print(
        json.dumps(
            {
                "hit": info["hit"],
                "key": info["key"],
                "import_s": t_import,
                "load_weights_s": t_weights,
                "compile_or_load_s": t_compile,
                "first_forwards_s": time.perf_counter() - t0,
                "phases": info["timings"],
                "process_s": time.perf_counter() - t_start,
                "counters_during_load": {k: after_load[k] - before[k] for k in before},
            }
        )
    )


def run_child(args, model: Path, cache_dir: Path) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--model",
        str(model),
        "--cache-dir",
        str(cache_dir),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"child failed ({proc.returncode})")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default="/tmp/atomc_compile_bench")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (default 32)")
    p.add_argument("--hidden", type=int, default=None, help="smoke tests only: shrink the model")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--dummy-weights", action="store_true", help="write no weights; children load random ones")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    work = Path(args.work_dir)
    t0 = time.perf_counter()
    model = write_checkpoint(work, args.device, args.layers, args.hidden, weights=not args.dummy_weights)
    ckpt_s = time.perf_counter() - t0
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    cold = run_child(args, model, cache)
    warm = run_child(args, model, cache)
    entry = cache / cold["key"]
    manifest = json.loads((entry / "manifest.json").read_text())
    print(
        json.dumps(
            {
                "model": model.name,
                "device": args.device,
                "dtype": args.dtype,
                "checkpoint_s": ckpt_s,
                "cold": cold,
                "warm": warm,
                "artifact_bytes": manifest.get("artifact_bytes"),
                "partitions": len(manifest.get("partitions", [])),
                "warm_over_cold": warm["compile_or_load_s"] / cold["compile_or_load_s"],
                "warm_over_cold_process": warm["process_s"] / cold["process_s"],
                "goal_met": warm["compile_or_load_s"] <= 0.25 * cold["compile_or_load_s"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
