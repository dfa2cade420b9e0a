"""The FP8 linears' tile table (atomc/kernels/triton/fp8_config.py): the lookup by (kernel, N, K,
M bucket), the merge the benchmark's sweep writes, the errors a bad file gives, and every file
shipped under configs/fp8/ being one the kernels take (so a bad file fails here, not on a GPU)."""

import json

import pytest

from atomc.kernels.triton import fp8_config

FILES = sorted(fp8_config.CONFIG_DIR.glob("*.json"))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.fixture
def table_dir(tmp_path):
    fp8_config.load_table.cache_clear()
    fp8_config.tuned.cache_clear()
    yield tmp_path
    fp8_config.load_table.cache_clear()
    fp8_config.tuned.cache_clear()


def test_lookup_takes_the_largest_bucket_at_or_below_m(table_dir):
    big = dict(block_m=128, block_n=256, num_stages=4)
    small = dict(block_m=64)
    found = {"block_gemm": {(24576, 1536): {2048: big, 512: small}}}
    path = fp8_config.merge_into_file(found, "NVIDIA H200", {"note": "test"}, table_dir)
    assert path.name == "fp8_linear,device=NVIDIA_H200.json"
    look = lambda m: fp8_config.tuned("block_gemm", 24576, 1536, m, "NVIDIA H200", table_dir)  # noqa: E731
    assert look(4096) == big and look(2048) == big and look(2047) == small
    assert look(16) == small  # below every bucket: the smallest
    assert fp8_config.tuned("block_gemm", 24576, 7168, 2048, "NVIDIA H200", table_dir) is None  # another shape
    assert fp8_config.tuned("row_gemm", 24576, 1536, 2048, "NVIDIA H200", table_dir) is None  # another kernel
    assert fp8_config.tuned("block_gemm", 24576, 1536, 2048, "cpu", table_dir) is None  # no file


def test_merge_keeps_what_it_does_not_name(table_dir):
    fp8_config.merge_into_file({"gemv": {(4096, 4096): {1: dict(block_n=16)}}}, "X", {}, table_dir)
    fp8_config.merge_into_file({"gemv": {(6144, 4096): {1: dict(block_n=32)}}}, "X", {"run": 2}, table_dir)
    raw = json.loads((table_dir / fp8_config.config_name("X")).read_text())
    assert raw["kernels"]["gemv"] == {"4096,4096": {"1": {"block_n": 16}}, "6144,4096": {"1": {"block_n": 32}}}
    assert raw["meta"] == {"run": 2}
    assert fp8_config.tuned("gemv", 4096, 4096, 1, "X", table_dir) == {"block_n": 16}  # the caches were reset


def test_bad_files_name_what_is_wrong(table_dir):
    path = table_dir / fp8_config.config_name("X")
    path.write_text(json.dumps({"kernels": {"fp4_gemm": {}}}))
    with pytest.raises(ValueError, match="unknown FP8 kernel 'fp4_gemm'"):
        fp8_config.tuned("gemv", 1, 1, 1, "X", table_dir)
    fp8_config.load_table.cache_clear()
    path.write_text(json.dumps({"kernels": {"gemv": {"64,64": {"1": {"block_m": 16}}}}}))
    with pytest.raises(ValueError, match=r"unknown knobs \['block_m'\]"):
        fp8_config.tuned("gemv", 64, 64, 1, "X", table_dir)


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_shipped_file_is_a_valid_table(path):
    raw = json.loads(path.read_text())
    assert path.name == fp8_config.config_name(raw["meta"]["device"])
    table = fp8_config.load_table(raw["meta"]["device"], fp8_config.CONFIG_DIR)
    for kernel, shapes in table.items():
        for (n, k), buckets in shapes.items():
            assert n > 0 and k > 0 and buckets
            for cfg in buckets.values():
                for knob in ("block_m", "block_n", "block_k", "groups_per_step", "split_k"):
                    assert knob not in cfg or _pow2(cfg[knob]) or knob == "split_k", (kernel, n, k, cfg)
                assert cfg.get("num_warps", 4) in (1, 2, 4, 8, 16)
                assert cfg.get("kernel", "dot") in ("dot", "reduce", "reduce_f16")


def test_gemv_defaults_take_the_packed_f16_loop_at_every_row_count():
    from atomc.kernels.triton import fp8_gemv

    o, qkv, gate_up = (fp8_gemv.gemv_config(n, 4096, False) for n in (4096, 6144, 28672))
    assert (o["kernel"], o["block_n"], o["block_k"]) == ("reduce_f16", 4, 2048)  # the H100 sweep's winners
    assert (qkv["kernel"], qkv["block_n"], qkv["block_k"]) == ("reduce_f16", 2, 2048)
    assert (gate_up["kernel"], gate_up["block_n"], gate_up["block_k"]) == ("reduce_f16", 2, 2048)
    assert fp8_gemv.gemv_config(2048, 4096, True) == fp8_gemv.dot_config(True)  # block scales: the dot


def test_a_tuned_gemv_entry_fills_in_from_its_own_kernels_defaults(table_dir, monkeypatch):
    import torch

    from atomc.kernels.triton import fp8_gemv

    monkeypatch.setattr(fp8_config, "CONFIG_DIR", table_dir)
    found = {"gemv": {(2048, 4096): {1: dict(kernel="dot", block_n=32)}, (2048, 2048): {1: dict(block_k=512)}}}
    fp8_config.merge_into_file(found, "cpu", {}, table_dir)
    cpu = torch.device("cpu")
    assert fp8_gemv.pick_config(2048, 4096, False, cpu) == {**fp8_gemv.dot_config(False), "block_n": 32}
    assert fp8_gemv.pick_config(2048, 2048, False, cpu) == {**fp8_gemv.gemv_config(2048, 2048, False), "block_k": 512}
    assert fp8_gemv.pick_config(1024, 2048, False, cpu) == fp8_gemv.gemv_config(1024, 2048, False)  # no entry
