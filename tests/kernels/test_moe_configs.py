"""The tuned MoE tile files shipped in atomc/kernels/triton/configs/: each one parses, is named for
the shape it holds, and every bucket is a configuration the kernels take (a route that exists, every
tile key, powers of two where the kernels need them), so a bad file fails here and not on a GPU."""

import json

import pytest
import torch

from atomc.kernels.triton import moe_config

TILE_KEYS = {"block_m", "block_n", "block_k", "num_warps", "num_stages"}
FILES = sorted(moe_config.CONFIG_DIR.glob("*.json"))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def test_there_are_tuned_files():
    assert FILES, "benchmarks/tune_moe.py writes them; at least one H200 shape is shipped"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_tuned_file_is_a_valid_configuration(path):
    raw = json.loads(path.read_text())
    fields = dict(kv.split("=", 1) for kv in path.stem.split(","))
    dtype = getattr(torch, fields["dtype"])
    weights = fields.get("weights", "")  # a quantised experts' file names its format
    assert weights == ("" if raw["meta"].get("weights", "bf16") == "bf16" else raw["meta"]["weights"])
    shape = (int(fields["E"]), int(fields["H"]), int(fields["I"]), int(fields["topk"]), dtype)
    assert path.name == moe_config.config_name(*shape, raw["meta"]["device"], weights)
    buckets = moe_config.load_configs(moe_config.config_prefix(*shape, weights), raw["meta"]["device"])
    assert buckets and all(m >= 1 for m in buckets)
    for m, cfg in buckets.items():
        assert cfg.get("path", "gemv") in moe_config.PATHS
        assert moe_config.fits(cfg.get("path", "sorted"), m, int(fields["topk"])), (m, cfg)
        for part in ("gate_up", "down"):
            tile = cfg[part]
            assert TILE_KEYS <= set(tile), (m, part, tile)
            assert _pow2(tile["block_n"]) and _pow2(tile["block_k"]) and tile["num_warps"] in (1, 2, 4, 8, 16)
            assert set(tile) - TILE_KEYS <= {"fuse_combine", "packed_f16"}
        if cfg.get("path") == "sorted":
            assert cfg["gate_up"]["block_m"] == cfg["down"]["block_m"]  # one alignment for both GEMMs


def _gemv_file(directory, shape, weights) -> None:
    """A tuned file whose one-token bucket is the gemv route without the packed knob."""
    tile = dict(block_m=0, block_n=4, block_k=1024, num_warps=4, num_stages=4)
    name = moe_config.config_name(*shape, "none", weights)
    body = {"buckets": {"1": {"path": "gemv", "gate_up": tile, "down": tile}}, "meta": {"device": "none"}}
    (directory / name).write_text(json.dumps(body))


@pytest.mark.parametrize("weights", ["mxfp4", "fp8_channel", "fp8_block"])
def test_one_token_packed_loops_follow_the_format_switch_unless_a_tile_says(weights, monkeypatch, tmp_path, request):
    """PACKED_GEMV fills `packed_f16` into the one-token GEMV tiles, default or tuned, of its formats
    (on where a GPU timed the packed loop faster); a tile's own value wins; other formats and routes
    are left as they were."""
    request.addfinalizer(moe_config.pick_config.cache_clear)  # no cached switch for the tests after this one
    shape = (32, 2880, 2880, 4, torch.bfloat16)
    if weights != "mxfp4":  # FP8's one-token default is the small route: a tuned gemv bucket instead
        _gemv_file(tmp_path, shape, weights)
        _gemv_file(tmp_path, (*shape[:-1], torch.float32), weights)
    monkeypatch.setitem(moe_config.PACKED_GEMV, weights, False)
    moe_config.pick_config.cache_clear()
    off = moe_config.pick_config(1, *shape, "none", tmp_path, weight_format=weights)
    assert off["path"] == "gemv" and off["gate_up"]["packed_f16"] is False and off["down"]["packed_f16"] is False
    monkeypatch.setitem(moe_config.PACKED_GEMV, weights, True)
    moe_config.pick_config.cache_clear()  # the switch is read once per shape, as a process sets it before
    on = moe_config.pick_config(1, *shape, "none", tmp_path, weight_format=weights)
    assert on["gate_up"]["packed_f16"] is True and on["down"]["packed_f16"] is True
    tile = dict(block_m=0, block_n=4, block_k=1024, num_warps=4, num_stages=4)
    tuned = {"path": "gemv", "gate_up": dict(tile, packed_f16=False), "down": dict(tile)}
    assert moe_config.with_packed_default(tuned, weights)["gate_up"]["packed_f16"] is False  # the tile's own
    assert moe_config.with_packed_default(tuned, weights)["down"]["packed_f16"] is True
    assert "packed_f16" not in moe_config.pick_config(1, *shape, "none", tmp_path)["gate_up"]  # bf16 experts
    assert "packed_f16" not in moe_config.pick_config(64, *shape, "none", tmp_path, weight_format=weights)["gate_up"]
    fp32 = moe_config.pick_config(1, *shape[:-1], torch.float32, "none", tmp_path, weight_format=weights)
    assert fp32["gate_up"]["packed_f16"] is False  # an fp32 model keeps the fp32 loops


@pytest.mark.parametrize("weights", ["fp8_channel", "fp8_block"])
def test_fp8_experts_default_to_the_small_route_at_one_token(weights, tmp_path):
    """Untuned FP8 shapes take the small route's tensor-core tiles at one token (what every tuned FP8
    file picked), bf16 experts the GEMVs, MXFP4 its packed GEMVs."""
    shape = (64, 2048, 1408, 6, torch.bfloat16)
    cfg = moe_config.pick_config(1, *shape, "none", tmp_path, weight_format=weights)
    assert cfg["path"] == "small" and cfg["gate_up"] == moe_config.FP8_ONE_TOKEN["gate_up"]
    assert cfg["down"] == moe_config.FP8_ONE_TOKEN["down"]
    assert moe_config.pick_config(1, *shape, "none", tmp_path)["path"] == "gemv"
    assert moe_config.pick_config(1, *shape, "none", tmp_path, weight_format="mxfp4")["path"] == "gemv"
    assert moe_config.pick_config(2, *shape, "none", tmp_path, weight_format=weights)["gate_up"]["block_n"] == 16


def test_shared_experts_count_in_the_route_a_tuned_file_gives(tmp_path):
    """A tuned small-route bucket for 8 tokens x 8 routed experts (64 pairs) is the file's; with a
    shared expert inside the op each token runs 9 slots, 72 pairs, past the small route: the sorted
    default (DeepSeek-V3's block-FP8 layers at CONC 8 raised here on a GPU)."""
    shape = (256, 7168, 2048, 8, torch.bfloat16)
    tile = dict(block_m=0, block_n=32, block_k=128, num_warps=4, num_stages=3)
    name = moe_config.config_name(*shape, "none", "fp8_block")
    body = {"buckets": {"8": {"path": "small", "gate_up": tile, "down": tile}}, "meta": {"device": "none"}}
    (tmp_path / name).write_text(json.dumps(body))
    assert moe_config.pick_config(8, *shape, "none", tmp_path, weight_format="fp8_block")["path"] == "small"
    shared = moe_config.pick_config(8, *shape, "none", tmp_path, weight_format="fp8_block", num_shared=1)
    assert shared["path"] == "sorted"
    assert moe_config.fits(shared["path"], 8, 9)
    # 7 tokens x 9 slots = 63 pairs: the tuned tile still fits
    assert (
        moe_config.pick_config(7, *shape, "none", tmp_path, weight_format="fp8_block", num_shared=1)["path"] == "small"
    )


def test_deepseek_v2_lite_shipped_tiles_with_its_shared_experts():
    """The shipped V2-Lite file (64 experts, top-6) has a small-route bucket at 8 tokens; with its 2
    shared experts inside the op, 9 tokens run 72 slots, so the route must not be the small one
    (it raised there before the route counted the shared slots)."""
    shape = (64, 2048, 1408, 6, torch.bfloat16)
    assert moe_config.pick_config(9, *shape, "NVIDIA H200")["path"] == "small"  # 54 routed pairs
    for tokens in (9, 15):
        cfg = moe_config.pick_config(tokens, *shape, "NVIDIA H200", num_shared=2)
        assert moe_config.fits(cfg["path"], tokens, 8) and cfg["path"] == "sorted"
    assert moe_config.pick_config(8, *shape, "NVIDIA H200", num_shared=2)["path"] == "small"  # 64 slots fit
