"""Which tuned-tile file a device reads (atomc/kernels/triton/tuned_files.py): its own, else one
tuned on a device of its family, else none (the defaults)."""

from __future__ import annotations

import json

import torch

from atomc.kernels.triton import fp8_config, moe_config, tuned_files
from atomc.kernels.triton.tuned_files import TileDevice

H100 = TileDevice("NVIDIA H100 80GB HBM3", "sm_90/132")
QWEN3_MOE = dict(experts=128, hidden=2048, inter=768, top_k=8, dtype=torch.bfloat16)


def _write(path, family, payload):
    path.write_text(json.dumps({**payload, "meta": {"family": family} if family else {}}))
    return path


def test_own_file_first_then_the_family_then_none(tmp_path):
    pre = "shape,"
    other = _write(tmp_path / "shape,device=GPU_B.json", "sm_90/132", {})
    _write(tmp_path / "shape,device=GPU_C.json", "sm_80/108", {})
    _write(tmp_path / "shape2,device=GPU_D.json", "sm_90/132", {})  # another shape: never read
    assert tuned_files.find(tmp_path, pre, "GPU A", "sm_90/132") == other
    assert tuned_files.find(tmp_path, pre, "GPU A", "sm_89/128") is None
    assert tuned_files.find(tmp_path, pre, "GPU A", "") is None  # no family: only its own file
    own = _write(tmp_path / "shape,device=GPU_A.json", "", {})
    assert tuned_files.find(tmp_path, pre, "GPU A", "sm_90/132") == own
    (tmp_path / "shape,device=GPU_0.json").write_text("{not json")  # sorts first; unreadable: skipped
    assert tuned_files.find(tmp_path, pre, "GPU E", "sm_90/132") == other


def test_cpu_has_no_family():
    assert tuned_files.tile_device(torch.device("cpu")) == TileDevice("cpu", "")


def test_moe_tiles_of_a_sibling_device(tmp_path):
    tiles = dict(block_m=0, block_n=48, block_k=64, num_warps=4, num_stages=2)
    prefix = moe_config.config_prefix(**QWEN3_MOE)
    _write(tmp_path / f"{prefix}device=GPU_B.json", "sm_90/132",
           {"buckets": {"1": {"path": "small", "gate_up": tiles, "down": tiles}}})  # fmt: skip
    args = (1, *QWEN3_MOE.values(), "GPU A", tmp_path)
    assert moe_config.pick_config(*args)["path"] == "gemv"  # no family given: the default
    assert moe_config.pick_config(*args, family="sm_80/108")["path"] == "gemv"
    picked = moe_config.pick_config(*args, family="sm_90/132")
    assert picked["path"] == "small" and picked["gate_up"]["block_n"] == 48


def test_fp8_tiles_of_a_sibling_device(tmp_path):
    found = {"gemv": {(64, 128): {1: dict(kernel="reduce", block_n=2)}}}
    fp8_config.merge_into_file(found, "GPU B", {"family": "sm_90/132"}, tmp_path)
    try:
        assert fp8_config.tuned("gemv", 64, 128, 1, "GPU A", tmp_path, family="sm_90/132")["block_n"] == 2
        assert fp8_config.tuned("gemv", 64, 128, 1, "GPU A", tmp_path, family="sm_89/128") is None
        assert fp8_config.tuned("gemv", 64, 128, 1, "GPU A", tmp_path) is None
    finally:
        fp8_config.load_table.cache_clear(), fp8_config.tuned.cache_clear()


def test_shipped_files_name_their_family_and_serve_an_h100():
    files = sorted(moe_config.CONFIG_DIR.glob("*.json")) + sorted(fp8_config.CONFIG_DIR.glob("*.json"))
    assert files
    for path in files:
        meta = json.loads(path.read_text())["meta"]
        assert meta.get("family"), f"{path.name}: its meta names no family"
    # the H200's Qwen3-MoE file: an H100 (same family) takes its one-token tensor-core route
    picked = moe_config.pick_config(1, *QWEN3_MOE.values(), H100.name, family=H100.family)
    assert picked["path"] == "small"
    assert fp8_config.tuned("gemv", 4096, 14336, 1, H100.name, family=H100.family) is not None
