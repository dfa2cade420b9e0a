"""The ceilings the benchmarks report against (benchmarks/ceilings.py): pure arithmetic, no GPU."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ceilings  # noqa: E402

BW, FLOPS = 4.3e12, 790e12  # the rates docs/performance.md's targets were set with


def test_llama_serving_ceiling_matches_the_targets_figure():
    # the targets' 8,290 tok/s also counts logits for every prompt token (+0.5 GFLOP a token);
    # engines compute them for the last token only, so the ceiling here is about 1% higher
    got = ceilings.serving_ceiling("llama-3.1-8b", 64, 1024, 1024, BW, FLOPS)
    assert got == pytest.approx(8290, rel=0.015)
    assert got > 8290


def test_prefill_lowers_the_decode_only_bound():
    for name in ("llama-3.1-8b", "qwen3-8b"):
        bound = ceilings.decode_only_bound(name, 64, 1024, 1024, BW)
        ceiling = ceilings.serving_ceiling(name, 64, 1024, 1024, BW, FLOPS)
        assert 0.8 * bound < ceiling < bound
        # infinitely fast prefill leaves the decode-only bound
        assert ceilings.serving_ceiling(name, 64, 1024, 1024, BW, 1e30) == pytest.approx(bound)


def test_llama_decode_step_at_conc_64():
    # 15.0 GB of weights + 64 sequences x 1,536 tokens x 131,072 B of KV, at 4.3 TB/s
    assert ceilings.kv_bytes_per_token("llama-3.1-8b") == 131072
    assert ceilings.decode_step_s("llama-3.1-8b", 64, 1024, 1024, BW) == pytest.approx(6.49e-3, rel=0.01)
