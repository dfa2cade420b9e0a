"""Tuned tiles of the FP8 linears (fp8_gemm.py, fp8_gemv.py): one JSON file per device, keyed by
kernel, weight shape (N, K) and row count, and the rule that looks them up.

    configs/fp8/fp8_linear,device=NVIDIA_H200.json
    {"kernels": {"block_gemm": {"24576,1536": {"2048": {"block_m": 128, ...}, "4096": {...}}},
                 "row_gemm": {...}, "gemv": {"4096,4096": {"1": {...}}}, "block_gemv": {...}},
     "meta": {...}}

A call takes its (N, K)'s entry for the largest row bucket <= M (else the smallest); a device with
no file of its own reads its family's (tuned_files.py); a shape with no entry, or a device with no
file (the CPU interpreter), runs the kernel's default
(`fp8_gemm.gemm_config`, `fp8_gemv.gemv_config`). An entry need not name every knob: the default
fills the rest. `benchmarks/fp8_linear.py --sweep --write-configs` writes the file (merging into
what is there), as benchmarks/tune_moe.py does for the MoE tiles (moe_config.py).

The files change how kernels are launched, never the traced graph, so they are read when a kernel
first runs at a shape (cached per process) and are not part of the compile cache key.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from atomc.kernels.triton import tuned_files

CONFIG_DIR = Path(__file__).resolve().parent / "configs" / "fp8"  # beside the MoE files, apart
# the knobs each kernel takes (fp8_gemm.fp8_gemm's config, fp8_gemv.fp8_gemv's keywords)
GEMM_KNOBS = frozenset({"block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m", "tma"})
GEMV_KNOBS = frozenset({"kernel", "block_n", "block_k", "split_k", "groups_per_step", "num_warps", "num_stages"})
KERNELS = {"block_gemm": GEMM_KNOBS, "row_gemm": GEMM_KNOBS, "gemv": GEMV_KNOBS, "block_gemv": GEMV_KNOBS}


PREFIX = "fp8_linear,"


def config_name(device_name: str) -> str:
    return f"{PREFIX}device={tuned_files.file_tag(device_name)}.json"


def shape_key(n: int, k: int) -> str:
    return f"{n},{k}"


@functools.cache
def load_table(device_name: str, directory: Path, family: str = "") -> dict:
    """{kernel: {(n, k): {m: config}}} from the device's (or its family's) file in `directory` ({}
    without one)."""
    path = tuned_files.find(directory, PREFIX, device_name, family)
    if path is None:
        return {}
    raw = json.loads(path.read_text())
    table: dict = {}
    for kernel, shapes in raw.get("kernels", {}).items():
        if kernel not in KERNELS:
            raise ValueError(f"{path}: unknown FP8 kernel {kernel!r} (known: {', '.join(KERNELS)})")
        for key, buckets in shapes.items():
            n, k = (int(v) for v in key.split(","))
            for m, cfg in buckets.items():
                unknown = set(cfg) - KERNELS[kernel]
                if unknown:
                    raise ValueError(f"{path}: {kernel} {key} M={m}: unknown knobs {sorted(unknown)}")
            table.setdefault(kernel, {})[(n, k)] = {int(m): dict(cfg) for m, cfg in buckets.items()}
    return table


@functools.cache  # per (kernel, shape, M): a dict lookup per call after the first
def tuned(
    kernel: str, n: int, k: int, m: int, device_name: str, directory: Path | None = None, family: str = ""
) -> dict | None:
    """The tuned config for this call, or None (run the default); `directory` defaults to
    CONFIG_DIR; `family` (tuned_files.py) lets a device without a file read its family's. Callers
    must not modify the result (it is cached)."""
    buckets = load_table(device_name, directory or CONFIG_DIR, family).get(kernel, {}).get((n, k))
    if not buckets:
        return None
    below = [b for b in buckets if b <= m]
    return buckets[max(below) if below else min(buckets)]


def merge_into_file(found: dict, device_name: str, meta: dict, directory: Path | None = None) -> Path:
    """Write {kernel: {(n, k): {m: config}}} into the device's file, keeping entries it does not name."""
    directory = directory or CONFIG_DIR
    path = directory / config_name(device_name)
    raw = json.loads(path.read_text()) if path.is_file() else {}
    kernels = raw.setdefault("kernels", {})
    for kernel, shapes in found.items():
        for (n, k), buckets in shapes.items():
            entry = kernels.setdefault(kernel, {}).setdefault(shape_key(n, k), {})
            entry.update({str(m): cfg for m, cfg in sorted(buckets.items())})
    raw["meta"] = meta
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(raw, indent=1, sort_keys=True) + "\n")
    load_table.cache_clear()
    tuned.cache_clear()
    return path
