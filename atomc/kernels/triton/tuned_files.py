"""Which tuned-tile file a device reads: its own, else one tuned on a device of its family.

The fused MoE's and the FP8 linears' tiles (moe_config.py, fp8_config.py) are JSON files named by
the device they were tuned on (torch's name for it). A device with no file of its own takes a file
whose meta names the same family (compute capability and multiprocessor count) before the untuned
defaults: an H100 SXM and an H200 are both sm_90 with 132 SMs, so a tile that fills one's SMs in
whole waves fills the other's and fits the same shared memory; only the bandwidth differs, which
moves the best tile far less than the defaults are from it. Files are read when an op first runs,
never at trace time, so none of this enters the compile cache key.
"""

from __future__ import annotations

import functools
import glob
import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TileDevice:
    name: str  # torch.cuda.get_device_name(), or "cpu"
    family: str = ""  # "sm_90/132": capability and multiprocessor count; "" matches no other device


def tile_device(device: torch.device) -> TileDevice:
    if device.type != "cuda":
        return TileDevice("cpu")
    return _cuda_device(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_device(index: int) -> TileDevice:
    props = torch.cuda.get_device_properties(index)
    family = family_of(props.major, props.minor, props.multi_processor_count)
    return TileDevice(torch.cuda.get_device_name(index), family)


def family_of(major: int, minor: int, multiprocessors: int) -> str:
    return f"sm_{major}{minor}/{multiprocessors}"


def file_tag(device_name: str) -> str:
    """The device's name as it appears in a file name (letters, digits, '-', '.'; the rest '_')."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in device_name)


def find(directory: Path, prefix: str, device_name: str, family: str = "") -> Path | None:
    """`{prefix}device={device}.json` in `directory` when there is one, else the first (by name) of
    the prefix's files whose meta names `family`, else None."""
    own = directory / f"{prefix}device={file_tag(device_name)}.json"
    if own.is_file() or not family:
        return own if own.is_file() else None
    for path in sorted(directory.glob(f"{glob.escape(prefix)}device=*.json")):
        if _family(path) == family:
            return path
    return None


def _family(path: Path) -> str:
    try:
        return str(json.loads(path.read_text()).get("meta", {}).get("family", ""))
    except (OSError, ValueError):
        return ""
