"""Tile configurations of the fused MoE: tuned JSON files per shape and device, and a default.

A file under `configs/` is named by (experts, hidden, intermediate, top_k, dtype, [weight format,]
device) and maps M buckets (token counts) to a configuration; a call takes the bucket nearest its
token count (the largest bucket <= M, else the smallest). A configuration:

    {"path": "gemv" | "small" | "sorted",   # optional; else gemv for one token (MXFP4: up to
                                            # GEMV_MAX_TOKENS; FP8: small), then by SMALL_PATH_MAX_PAIRS
     "gate_up": {"block_m", "block_n", "block_k", "num_warps", "num_stages"},
     "down": {...the same keys..., "fuse_combine": bool}}   # gemv only: combine in the down GEMV
                                                           # (default true)

The gemv and small routes ignore block_m (gemv has one row, small sizes it from the pair count).
`benchmarks/tune_moe.py` writes the files. A device with no file of its own reads one tuned on a
device of its family (tuned_files.py), else the default.

The files change only how the kernels are launched, never the traced graph, so they are read when
the op runs (cached per process) and are not part of the compile cache key: no module imports
them, and the key hashes only the Python files a build imports (atomc/graphs/sources.py).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from atomc.kernels.triton import tuned_files

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# the few-token path (no sort) for up to this many (token, expert) pairs; above it, the sorted
# grouped GEMM. Its tile is [next_pow2(pairs), block_n] so it must stay a small GEMV-like tile.
SMALL_PATH_MAX_PAIRS = 64
PATHS = ("gemv", "small", "sorted")
# The gemv route's most tokens by expert format (else one), and the default's: MXFP4's GEMVs take a
# pair a program, so a few tokens are a few one-token passes whose repeated experts mostly come
# from L2, where the small route's tensor-core tiles decode every weight once a pair too, and waste
# 15 of 16 rows. The packed GEMVs against the small route on GPT-OSS-20B's experts (H100,
# moe_kernel.py): 72.4 us against 284.7 at 2 tokens, 121.5 / 464.2 at 4, 222.3 / 756.8 at 8,
# 428.8 / 987.8 at 16.
GEMV_MAX_TOKENS = {"mxfp4": 16}


# FP8 experts at one token: the small route's tensor-core tiles beat the GEMVs in every tuned file,
# with these same tiles: Qwen3-30B-A3B per-row FP8 (H200) and DeepSeek-V3 block FP8 (H100, tune_moe.py:
# 138.6 us against the GEMVs' 145.4 at their best tiles and 220.9 at the defaults). The tensor core
# widens e4m3 itself, where a GEMV pays conversions on the CUDA cores.
FP8_ONE_TOKEN = {
    "path": "small",
    "gate_up": dict(block_m=0, block_n=32, block_k=128, num_warps=4, num_stages=3),
    "down": dict(block_m=0, block_n=64, block_k=256, num_warps=8, num_stages=3),
}


def gemv_max_tokens(weight_format: str = "") -> int:
    return GEMV_MAX_TOKENS.get(weight_format, 1)


def config_prefix(
    experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, weight_format: str = ""
) -> str:
    """A shape's file names up to the device; `weight_format` ("mxfp4"; "" for weights in the
    activation dtype) names quantised experts' own files."""
    weights = f",weights={weight_format}" if weight_format else ""
    return f"E={experts},H={hidden},I={inter},topk={top_k},dtype={str(dtype).removeprefix('torch.')}{weights},"


def config_name(
    experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, device_name: str, weight_format: str = ""
) -> str:
    prefix = config_prefix(experts, hidden, inter, top_k, dtype, weight_format)
    return f"{prefix}device={tuned_files.file_tag(device_name)}.json"


@functools.cache
def load_configs(
    prefix: str, device_name: str, family: str = "", directory: Path = CONFIG_DIR
) -> dict[int, dict] | None:
    """The buckets of the device's file for this shape, or of its family's (tuned_files.find)."""
    path = tuned_files.find(directory, prefix, device_name, family)
    if path is None:
        return None
    raw = json.loads(path.read_text())
    return {int(m): cfg for m, cfg in raw["buckets"].items()}


def default_config(tokens: int, top_k: int, experts: int, inter: int = 0, weight_format: str = "") -> dict:
    """Untuned shapes: the one-row GEMV for one token (two weight rows per program, as the dense
    `gemv` reduce kernel's H200 sweep found best), small tensor-core tiles for few pairs, and tiles
    growing with the expected rows per expert (tokens * top_k / experts) for many. MXFP4's GEMV
    takes four rows of 1024 values a step, a [4, 32, 16]-byte tile (16 bytes a thread at 4 warps:
    its rows are a quarter of bf16's bytes, so a program takes more of them); its tensor-core
    tiles are the bf16 ones (each block_k a multiple of the 32-value scale group), and its GEMVs
    take up to GEMV_MAX_TOKENS tokens (a pair a program). FP8 experts take the small route at one
    token too (FP8_ONE_TOKEN)."""
    if weight_format == "mxfp4" and tokens <= gemv_max_tokens(weight_format):
        tile = dict(block_m=0, block_n=4, block_k=1024, num_warps=4, num_stages=4)
        return {"path": "gemv", "gate_up": tile, "down": dict(tile)}
    if weight_format in ("fp8_channel", "fp8_block") and tokens == 1 and top_k <= SMALL_PATH_MAX_PAIRS:
        return {"path": "small", "gate_up": dict(FP8_ONE_TOKEN["gate_up"]), "down": dict(FP8_ONE_TOKEN["down"])}
    if tokens == 1:
        down_k = 2048 if inter >= 2048 else max(16, 1 << max(0, inter - 1).bit_length())
        return {"path": "gemv", "gate_up": dict(block_m=0, block_n=2, block_k=1024, num_warps=4, num_stages=4),
                "down": dict(block_m=0, block_n=2, block_k=down_k, num_warps=8, num_stages=4)}  # fmt: skip
    pairs = tokens * top_k
    if pairs <= SMALL_PATH_MAX_PAIRS:
        # 16 rows per program: even Qwen3-MoE's 768-row experts give 8 * 48 programs at one token
        tile = dict(block_m=0, block_n=16, block_k=128, num_warps=4, num_stages=4)
        return {"path": "small", "gate_up": tile, "down": dict(tile)}
    per_expert = pairs / experts
    if per_expert <= 32:
        tile = dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    elif per_expert <= 128:
        tile = dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
    else:
        tile = dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    return {"path": "sorted", "gate_up": tile, "down": dict(tile)}


def fits(path: str, tokens: int, top_k: int, weight_format: str = "") -> bool:
    """Whether a route can take this many tokens (of experts in `weight_format`)."""
    if path == "gemv":
        return 1 <= tokens <= gemv_max_tokens(weight_format)
    return path == "sorted" or tokens * top_k <= SMALL_PATH_MAX_PAIRS


# The gemv route on the packed-f16 loops (mxfp4_packed.py; moe_gemv.py for per-row FP8) by expert
# format, where a tile does not say; on where a GPU timed the packed loop faster than the fp32 one
# (docs/kernels.md, "Fused MoE"). MXFP4: GPT-OSS-20B's experts at one token 42.9 us against 69.7
# (H200, moe_kernel.py); ROCm runs the fp32 step whatever this says (PTX FMAs). Per-row FP8: off,
# Qwen3-30B-A3B's experts 38.2 us against the fp32 loop's 33.8 (H100; the small route's 25.5).
# Block FP8 (scales folded into x, moe_gemv.py): off until timed on a GPU.
PACKED_GEMV = {"mxfp4": True, "fp8_channel": False, "fp8_block": False}


def with_packed_default(cfg: dict, weight_format: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """`cfg` with PACKED_GEMV's choice in both GEMV tiles that do not name `packed_f16`. fp32
    activations keep the fp32 loops (f16 sums would cost an fp32 model its precision); a tile that
    names the knob is obeyed at any dtype."""
    if cfg["path"] != "gemv" or weight_format not in PACKED_GEMV:
        return cfg
    on = PACKED_GEMV[weight_format] and dtype in (torch.bfloat16, torch.float16)
    return {**cfg, "gate_up": {"packed_f16": on, **cfg["gate_up"]}, "down": {"packed_f16": on, **cfg["down"]}}


@functools.cache  # per (shape, token count): a dict lookup per call after the first
def pick_config(
    tokens: int, experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, device_name: str,
    directory: Path = CONFIG_DIR, weight_format: str = "", family: str = "", num_shared: int = 0,
) -> dict:  # fmt: skip
    """The tuned configuration for this shape and token count when a file has one (the device's, or
    its `family`'s), else the default; "path" always filled in. Callers must not modify the result
    (it is cached). `experts` and `top_k` are the routed ones (the tuned files' names); with
    `num_shared` shared experts inside the op each token runs top_k + num_shared slots, and the
    route must fit those (e.g. DeepSeek-V3 at 8 tokens: a tuned small-route tile for 8 x 8 pairs,
    but 8 x 9 are run, past SMALL_PATH_MAX_PAIRS: the default's sorted route)."""
    prefix = config_prefix(experts, hidden, inter, top_k, dtype, weight_format)
    tuned = load_configs(prefix, device_name, family, directory)
    slots = top_k + num_shared
    default = default_config(tokens, slots, experts + num_shared, inter, weight_format)
    default = with_packed_default(default, weight_format, dtype)
    if not tuned:
        return default
    below = [m for m in tuned if m <= tokens]
    cfg = {"path": default["path"], **tuned[max(below) if below else min(tuned)]}
    if not fits(cfg["path"], tokens, slots, weight_format):
        return default  # e.g. a one-token gemv entry or a small-route tile too short for these pairs
    return with_packed_default(cfg, weight_format, dtype)
