"""The Triton FP8 kernels (GEMV, GEMM, fused quants) against the atomc ops' references, on CPU
through the Triton interpreter. The interpreter handles float8e4nv loads, stores, casts and tl.dot
(checked first in `test_interpreter_handles_e4m3`), so the kernels run on real e4m3 tensors here.

Tolerances: the GEMMs multiply the same e4m3 values as the reference and accumulate in fp32, in
another order: fp32 round-off only (rel 1e-5). The quant kernels compute the value the unfused ops
compute, then the same division and rounding: the e4m3 bytes may differ only where the two fp32
values straddle a rounding boundary (a different summation order in the norm), so at most a few
values may differ, by one e4m3 step; scales to fp32 round-off.
"""

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import; test_triton_fp8_gpu.py covers CUDA

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import atomc.ops  # noqa: E402, F401
from atomc.kernels import registry  # noqa: E402
from atomc.kernels.triton import fp8 as backend  # noqa: E402
from atomc.kernels.triton import fp8_quant  # noqa: E402
from atomc.kernels.triton.fp8_gemm import fp8_gemm  # noqa: E402
from atomc.kernels.triton.fp8_gemv import fp8_gemv  # noqa: E402
from atomc.ops import fp8 as ref  # noqa: E402

FP8 = torch.float8_e4m3fn
ops = torch.ops.atomc


def _fp8(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 64).clamp(-448, 448).to(FP8)


def _rand(shape, seed=0, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def close(got, want, rel=1e-5):
    err = (got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)
    assert err < rel, f"relative error {err:.3g}"


def fp8_close(q_got, q_want, max_flips=4):
    """e4m3 tensors equal but for a few values one step apart (rounding-boundary flips)."""
    assert q_got.dtype == FP8 and q_got.shape == q_want.shape
    a, b = q_got.float(), q_want.float()
    diff = (a - b).abs()
    flips = int((diff > 0).sum())
    assert flips <= max_flips, f"{flips} e4m3 values differ"
    # one e4m3 step at the value's magnitude: 2^-3 relative (normal values)
    assert (diff <= 0.125 * torch.maximum(a.abs(), b.abs()) + 2**-9).all()


@triton.jit
def _e4m3_probe(x_ptr, w_ptr, y_ptr, q_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tile = offs[:, None] * N + offs[None, :]
    x = tl.load(x_ptr + tile)
    acc = tl.dot(x, tl.trans(tl.load(w_ptr + tile)))
    tl.store(y_ptr + tile, acc)
    tl.store(q_ptr + tile, (x.to(tl.float32) * 1.37).to(q_ptr.dtype.element_ty))


def test_interpreter_handles_e4m3():
    x, w = _fp8((16, 16)), _fp8((16, 16), 1)
    y, q = torch.empty(16, 16), torch.empty(16, 16, dtype=FP8)
    _e4m3_probe[(1,)](x, w, y, q, N=16)
    assert torch.equal(y, x.float() @ w.float().t())  # small integers times powers of two: exact
    assert torch.equal(q.view(torch.uint8), (x.float() * 1.37).to(FP8).view(torch.uint8))


# ---- GEMV (one row) ----


# the dot kernel (tensor cores, 16-row tiles) and its split-K, the reduce kernel, and the default
# for these small N (gemv_config: the packed-f16 loop, 4 rows x 2,048)
GEMV_KNOBS = {
    "dot": dict(kernel="dot", block_n=16, block_k=64),
    "dot split": dict(kernel="dot", block_n=16, block_k=32, split_k=3),
    "reduce": dict(kernel="reduce", block_n=4, block_k=64),
    "reduce_f16": dict(kernel="reduce_f16", block_n=4, block_k=64),
    "default": dict(),
}
# The packed-f16 loop's products are exact; its per-column partial sums (K / block_k products, at
# most 4 here) round to f16 (2^-11 relative a step) before the fp32 sum: a few 1e-4 at most
F16_SUMS_REL = 2e-3


@pytest.mark.parametrize("n,k", [(48, 256), (37, 200), (64, 96)])
@pytest.mark.parametrize("scales", ["tensor", "channel"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("knobs", list(GEMV_KNOBS))
def test_gemv_per_tensor_and_channel(n, k, scales, out_dtype, knobs):
    xq, w = _fp8((1, k)), _fp8((n, k), 1)
    xs = torch.rand(1, 1) / 100
    ws = torch.rand(n) / 100 if scales == "channel" else torch.rand(1) / 100
    bias = _rand(n, 2)
    got = fp8_gemv(xq, xs, w, ws, bias, out_dtype, **GEMV_KNOBS[knobs])
    rel = F16_SUMS_REL if knobs == "reduce_f16" else 1e-5 if out_dtype == torch.float32 else 1e-3
    close(got, ref.fp8_gemm_reference(xq, xs, w, ws, bias, torch.float32), rel)
    assert got.shape == (1, n) and got.dtype == out_dtype


@pytest.mark.parametrize("k,block_k", [(64, 64), (448, 64), (1000, 32)])
def test_gemv_f16_sums_stay_finite_at_the_largest_e4m3_values(k, block_k):
    """Every x and weight at 448, all of one sign: the worst case for the f16 partial sums (1, 7 and
    32 products a column). The x shift keeps them finite, and the sums here are exact."""
    xq = torch.full((1, k), 448.0).to(FP8)
    w = torch.full((8, k), -448.0).to(FP8)
    xs, ws = torch.ones(1, 1), torch.ones(8)
    got = fp8_gemv(xq, xs, w, ws, None, torch.float32, kernel="reduce_f16", block_n=4, block_k=block_k)
    assert torch.equal(got, torch.full((1, 8), -448.0 * 448.0 * k))


def test_gemv_f16_sums_refuse_block_scales():
    xq, w = _fp8((1, 128)), _fp8((16, 128), 1)
    with pytest.raises(ValueError, match="packed-f16"):
        fp8_gemv(xq, torch.ones(1, 2), w, torch.ones(1, 2), None, torch.float32, block=(16, 64), kernel="reduce_f16")


BLOCK_GEMV_KNOBS = {
    "dot": dict(),  # the default: one group a step
    "dot half groups": dict(block_k=32),  # two steps a group share its scale
    "dot split": dict(split_k=2, block_n=32),  # block_n drops to 16 where bn = 16
    "reduce": dict(kernel="reduce", block_n=8),
}


@pytest.mark.parametrize("n,bn", [(200, 128), (64, 16), (48, 32)])
@pytest.mark.parametrize("knobs", list(BLOCK_GEMV_KNOBS))
def test_gemv_block_scales(n, bn, knobs):
    k, bk = 384, 64  # 6 groups
    xq, w = _fp8((1, k)), _fp8((n, k), 1)
    xs = torch.rand(1, k // bk) / 100
    ws = torch.rand(-(-n // bn), k // bk) / 100
    want = ref.fp8_block_gemm_reference(xq, xs, w, ws, bn, bk, None, torch.float32)
    got = fp8_gemv(xq, xs, w, ws, None, torch.float32, block=(bn, bk), **BLOCK_GEMV_KNOBS[knobs])
    close(got, want)
    if knobs == "reduce":  # a step of 4 of the 6 groups: a ragged last step
        close(fp8_gemv(xq, xs, w, ws, None, torch.float32, block=(bn, bk), kernel="reduce", groups_per_step=4), want)


def test_block_gemv_with_blocks_under_16_rows_runs_the_reduce_kernel():
    """bn = 8: a 16-row dot program would span two weight blocks; the CUDA-core kernel takes it."""
    k, bk, n, bn = 128, 64, 24, 8
    xq, w = _fp8((1, k)), _fp8((n, k), 1)
    xs, ws = torch.rand(1, k // bk) / 100, torch.rand(n // bn, k // bk) / 100
    got = fp8_gemv(xq, xs, w, ws, None, torch.float32, block=(bn, bk))
    close(got, ref.fp8_block_gemm_reference(xq, xs, w, ws, bn, bk, None, torch.float32))


def test_gemv_rejects_bad_knobs():
    xq, w, s = _fp8((1, 64)), _fp8((32, 64), 1), torch.ones(1)
    with pytest.raises(ValueError, match="block_n >= 16"):
        fp8_gemv(xq, s, w, s, None, torch.float32, kernel="dot", block_n=8)
    with pytest.raises(ValueError, match="unknown kernel"):
        fp8_gemv(xq, s, w, s, None, torch.float32, kernel="cublas")


# ---- GEMM ----

GEMM_CONFIG = dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("scales", ["tensor", "rows"])
@pytest.mark.parametrize("tma", [False, True])
def test_gemm_row_scales(m, scales, tma):
    n, k = 72, 80  # neither a multiple of the tiles: masked (or, TMA, zero-filled) edges
    xq, w = _fp8((m, k)), _fp8((n, k), 1)
    xs, ws = (torch.rand(m, 1) / 100, torch.rand(n) / 100) if scales == "rows" else (torch.rand(1), torch.rand(1))
    bias = _rand(n, 3)
    got = fp8_gemm(xq, xs, w, ws, bias, torch.float32, config={**GEMM_CONFIG, "tma": tma})
    close(got, ref.fp8_gemm_reference(xq, xs, w, ws, bias, torch.float32))


@pytest.mark.parametrize("m", [1, 7, 40])
@pytest.mark.parametrize("n,bn", [(200, 128), (96, 32)])
@pytest.mark.parametrize("tma", [False, True])
def test_block_gemm(m, n, bn, tma):
    k, bk = 192, 64
    xq, w = _fp8((m, k)), _fp8((n, k), 1)
    xs, ws = torch.rand(m, k // bk) / 100, torch.rand(-(-n // bn), k // bk) / 100
    cfg = {**GEMM_CONFIG, "tma": tma}
    got = fp8_gemm(xq, xs, w, ws, None, torch.float16, block=(bn, bk), config=cfg)
    close(got, ref.fp8_block_gemm_reference(xq, xs, w, ws, bn, bk, None, torch.float32), 1e-3)
    # a K step smaller than the group: two dots a group, each scaled by the group's scales
    got = fp8_gemm(xq, xs, w, ws, None, torch.float32, block=(bn, bk), config={**cfg, "block_k": 32})
    close(got, ref.fp8_block_gemm_reference(xq, xs, w, ws, bn, bk, None, torch.float32))


def test_block_gemm_gathers_weight_scales_when_a_tile_spans_blocks():
    """bn = 16 under a 32-row tile: the per-row scale gather (SCALAR_BS off), rows of two blocks."""
    m, n, k, bn, bk = 9, 80, 128, 16, 64
    xq, w = _fp8((m, k)), _fp8((n, k), 1)
    xs, ws = torch.rand(m, k // bk) / 100, torch.rand(n // bn, k // bk) / 100
    for tma in (False, True):
        got = fp8_gemm(xq, xs, w, ws, None, torch.float32, block=(bn, bk), config={**GEMM_CONFIG, "tma": tma})
        close(got, ref.fp8_block_gemm_reference(xq, xs, w, ws, bn, bk, None, torch.float32))


def test_gemm_tma_falls_back_to_pointer_loads_when_unaligned():
    """A row stride of 24 bytes cannot be a tensor descriptor: the pointer loads run instead."""
    from atomc.kernels.triton.fp8_gemm import _tma_ok

    xq, w = _fp8((5, 24)), _fp8((32, 24), 1)
    assert not _tma_ok(xq, w)
    xs, ws = torch.rand(5, 1) / 100, torch.rand(32) / 100
    got = fp8_gemm(xq, xs, w, ws, None, torch.float32, config={**GEMM_CONFIG, "block_k": 16, "tma": True})
    close(got, ref.fp8_gemm_reference(xq, xs, w, ws, None, torch.float32))


def test_block_gemm_3d_input():
    xq, w = _fp8((2, 3, 128)), _fp8((64, 128), 1)
    xs, ws = torch.rand(2, 3, 2) / 100, torch.rand(1, 2) / 100
    got = fp8_gemm(xq, xs, w, ws, None, torch.float32, block=(64, 64), config=GEMM_CONFIG)
    assert got.shape == (2, 3, 64)
    close(got, ref.fp8_block_gemm_reference(xq, xs, w, ws, 64, 64, None, torch.float32))


# ---- the tile table (fp8_config.py): the kernels run what it holds for their (N, K) ----


@pytest.fixture
def cpu_table(tmp_path, monkeypatch):
    from atomc.kernels.triton import fp8_config

    monkeypatch.setattr(fp8_config, "CONFIG_DIR", tmp_path)
    fp8_config.load_table.cache_clear(), fp8_config.tuned.cache_clear()

    def write(found):
        fp8_config.merge_into_file(found, "cpu", {"device": "cpu"})

    yield write
    fp8_config.load_table.cache_clear(), fp8_config.tuned.cache_clear()


def test_gemm_and_gemv_take_the_tuned_entry_for_their_shape(cpu_table):
    m, n, k = 40, 96, 128
    xq, w = _fp8((m, k)), _fp8((n, k), 1)
    xs, ws = torch.rand(m, 2) / 100, torch.rand(1, 2) / 100
    want = ref.fp8_block_gemm_reference(xq, xs, w, ws, 128, 64, None, torch.float32)
    # an entry the kernel refuses shows it was read; the default tiles would run
    cpu_table({"block_gemm": {(n, k): {32: dict(block_k=48)}}})
    with pytest.raises(ValueError, match="K step 48"):
        fp8_gemm(xq, xs, w, ws, None, torch.float32, block=(128, 64))
    w2 = _fp8((n + 16, k), 2)  # another shape: no entry, the default tiles
    close(fp8_gemm(xq, xs, w2, ws, None, torch.float32, block=(128, 64)),
          ref.fp8_block_gemm_reference(xq, xs, w2, ws, 128, 64, None, torch.float32))  # fmt: skip
    cpu_table({"block_gemm": {(n, k): {32: dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)}}})
    close(fp8_gemm(xq, xs, w, ws, None, torch.float32, block=(128, 64)), want)
    x1, s1 = xq[:1], torch.rand(1, 1) / 100
    cpu_table({"gemv": {(n, k): {1: dict(kernel="cublas")}}})
    with pytest.raises(ValueError, match="unknown kernel 'cublas'"):
        fp8_gemv(x1, s1, w, ws[:, 0], None, torch.float32)
    cpu_table({"gemv": {(n, k): {1: dict(kernel="reduce", block_n=8, block_k=32)}}})
    ws1 = ws[:1, 0]
    close(fp8_gemv(x1, s1, w, ws1, None, torch.float32), ref.fp8_gemm_reference(x1, s1, w, ws1, None, torch.float32))


# ---- quant kernels ----

QUANT_DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("k,group", [(256, 256), (200, 200), (256, 64), (384, 128), (256, 0)])
def test_dynamic_quant(dtype, k, group):
    x = _rand((5, k), 0, 3).to(dtype)
    x[1] = 0  # zeros quantise to zeros with the floor scale, not NaN
    q, s = fp8_quant.quant_dynamic(x, group)
    q_ref, s_ref = ref.fp8_quant_dynamic_reference(x, group)
    assert s.shape == s_ref.shape
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    fp8_close(q, q_ref, 0)  # the same division of the same values: identical bytes


def test_static_quant_tiles_a_long_row():
    x = _rand((3, 2500), 1, 10)  # 3 column tiles of 1024, the last one ragged; saturates above 448 * s
    s = torch.tensor([0.02])
    fp8_close(fp8_quant.quant_static(x, s), ref.to_fp8(x, s), 0)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("group", [96, 32, None])  # per token (I = 96), per group of 32, static
def test_silu_and_mul_quant(dtype, group):
    x = _rand((6, 192), 2, 2).to(dtype)
    from atomc.ops.fp8_fused import silu_and_mul_reference

    y = silu_and_mul_reference(x)
    if group is None:
        scale = torch.tensor([0.005])
        q, _ = fp8_quant.silu_and_mul_quant(x, scale, None)
        fp8_close(q, ref.to_fp8(y, scale))
    else:
        q, s = fp8_quant.silu_and_mul_quant(x, None, group)
        q_ref, s_ref = ref.fp8_quant_dynamic_reference(y, group)
        torch.testing.assert_close(s, s_ref, rtol=2e-3 if dtype == torch.float16 else 1e-6, atol=0)
        fp8_close(q, q_ref, max_flips=6)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_silu_and_mul_quant_split_over_chunks_writes_the_one_program_bytes(monkeypatch, dtype, rows):
    """A few rows of per-token SiLU·mul quant run as chunks over two launches (the row's amax
    between them); the scale and bytes equal the one-program kernel's (nine rows take it)."""
    monkeypatch.setattr(fp8_quant, "SPLIT_CHUNK", 64)  # 200 columns: 4 chunks, the last ragged
    x = _rand((rows + 9, 400), 4, 2).to(dtype)
    q, s = fp8_quant.silu_and_mul_quant(x[:rows], None, 200)
    q_one, s_one = fp8_quant.silu_and_mul_quant(x, None, 200)  # 9 + rows > SPLIT_MAX_ROWS: one program a row
    assert s.shape == (rows, 1)
    torch.testing.assert_close(s, s_one[:rows], rtol=0, atol=0)
    fp8_close(q, q_one[:rows], 0)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("group", [160, 32, None])
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm_quant(dtype, group, add):
    from atomc.ops.norm import rms_norm_reference

    x, r = _rand((7, 160), 3).to(dtype), _rand((7, 160), 4).to(dtype)
    w = (1 + 0.5 * _rand(160, 5)).to(dtype)
    scale = torch.tensor([0.01]) if group is None else None
    q, s, summed = fp8_quant.rms_norm_quant(x, r if add else None, w, 1e-6, scale, group)
    base = x + r if add else x
    normed = rms_norm_reference(base, w, 1e-6)
    if add:
        torch.testing.assert_close(summed, base, rtol=0, atol=0)
    else:
        assert summed is None
    if group is None:
        assert s is None
        fp8_close(q, ref.to_fp8(normed, scale), max_flips=8)
    else:
        q_ref, s_ref = ref.fp8_quant_dynamic_reference(normed, group)
        torch.testing.assert_close(s, s_ref, rtol=2e-3 if dtype == torch.float16 else 1e-5, atol=0)
        fp8_close(q, q_ref, max_flips=8)


def test_quant_kernels_decline_what_they_cannot_tile():
    x = _rand((2, 96), 0)
    assert fp8_quant.silu_and_mul_quant(torch.cat([x, x], -1), None, 24) is None  # 24: not a power of two
    assert fp8_quant.rms_norm_quant(x, None, torch.ones(96, dtype=torch.float16), 1e-6, None, 96) is None
    q, s = fp8_quant.quant_dynamic(x, 24)  # the op body falls back to the reference
    q_ref, s_ref = ref.fp8_quant_dynamic_reference(x, 24)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


# ---- the backend ops: the choice rule, and every op against its atomc op ----


def test_choice_rule():
    w = _fp8((64, 128))
    assert backend.pick_gemm(_fp8((1, 128)), w, block=False) == "gemv"
    assert backend.pick_gemm(_fp8((3, 128)), w, block=True) == "triton"
    assert backend.pick_gemm(_fp8((3, 128)), w, block=False) == "triton"  # _scaled_mm is CUDA only
    assert backend.pick_gemm(_fp8((1, 128)), w.t().contiguous().t(), block=False) == "reference"


def test_backend_ops_match_the_atomc_ops():
    tri = torch.ops.atomc_triton
    registry.ensure_registered("cuda")
    x = _rand((3, 128), 0, 2)
    w, ws_row, ws_blk = _fp8((64, 128), 1), torch.rand(64) / 100, torch.rand(1, 2) / 100
    for group in (0, 128, 64):
        q, s = tri.fp8_quant_dynamic(x, group)
        q_ref, s_ref = ops.fp8_quant_dynamic(x, group)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert torch.equal(
        tri.fp8_quant_static(x, torch.tensor([0.01])).float(), ops.fp8_quant_static(x, torch.tensor([0.01])).float()
    )
    for rows in (1, 3):
        xq, xs = ops.fp8_quant_dynamic(x[:rows], 128)
        close(
            tri.fp8_gemm(xq, xs, w, ws_row, None, torch.float32), ops.fp8_gemm(xq, xs, w, ws_row, None, torch.float32)
        )
        xq, xs = ops.fp8_quant_dynamic(x[:rows], 64)
        close(
            tri.fp8_block_gemm(xq, xs, w, ws_blk, 64, 64, None, torch.float32),
            ops.fp8_block_gemm(xq, xs, w, ws_blk, 64, 64, None, torch.float32),
        )
    nw, r = 1 + 0.1 * _rand(128, 7), _rand((3, 128), 8)
    cases = [
        ("rms_norm_fp8_quant_dynamic", (x, nw, 1e-6, 128)),
        ("rms_norm_fp8_quant_static", (x, nw, 1e-6, torch.tensor([0.01]))),
        ("fused_add_rms_norm_fp8_quant_dynamic", (x, r, nw, 1e-6, 64)),
        ("fused_add_rms_norm_fp8_quant_static", (x, r, nw, 1e-6, torch.tensor([0.01]))),
        ("silu_and_mul_fp8_quant_dynamic", (x, 64)),
        ("silu_and_mul_fp8_quant_static", (x, torch.tensor([0.01]))),
    ]
    for name, args in cases:
        got, want = getattr(tri, name)(*args), getattr(ops, name)(*args)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        assert len(got) == len(want)
        for g, w_ in zip(got, want, strict=True):
            if g.dtype == FP8:
                fp8_close(g, w_)
            else:
                torch.testing.assert_close(g, w_, rtol=1e-5, atol=0)


@triton.jit
def _grid_probe(x_ptr, q_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    q = fp8_quant._round_to_e4m3_grid(tl.load(x_ptr + offs))
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty))


def test_interpreter_rounding_helper_is_torchs_cast():
    """ROUND_IN_FP32 (interpreter only) against torch's cast: every e4m3 value, the midpoints between
    neighbours (ties to even), values just off them, and subnormals."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), torch.linspace(-448, 448, 4096)])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    q = torch.empty(n, dtype=FP8)
    _grid_probe[(1,)](x, q, N=n)
    assert torch.equal(q.view(torch.uint8), x.to(FP8).view(torch.uint8))


# ---- cuBLAS's block GEMM (scaled_mm_block): the rule, the fallback, what it hands torch._scaled_mm ----


class _CudaRows:
    """What pick_gemm reads of a CUDA activation of `shape` (with kernels_run_on patched to True)."""

    is_cuda = True

    def __init__(self, *shape):
        self.shape = shape

    def numel(self):
        return int(torch.tensor(self.shape).prod())


def test_choice_rule_for_block_scales(monkeypatch):
    w = _fp8((256, 512))
    lo = backend.CUBLAS_BLOCK_MIN_ROWS
    assert lo > 1
    assert backend.pick_gemm(_fp8((lo, 512)), w, block=True) == "triton"  # the interpreter: never cuBLAS
    monkeypatch.setattr(backend, "kernels_run_on", lambda t: True)  # an sm_89+ CUDA device
    assert backend.pick_gemm(_CudaRows(1, 512), w, block=True) == "gemv"
    assert backend.pick_gemm(_CudaRows(2, 512), w, block=True) == "triton"
    assert backend.pick_gemm(_CudaRows(lo - 1, 512), w, block=True) == "triton"
    assert backend.pick_gemm(_CudaRows(lo, 512), w, block=True) == "scaled_mm_block"
    assert backend.pick_gemm(_CudaRows(2, lo, 512), w, block=True) == "scaled_mm_block"  # rows over all leading dims
    assert backend.pick_gemm(_CudaRows(4096, 512), w, block=True) == "scaled_mm_block"
    one = torch.ones(1)
    assert backend.pick_gemm(_CudaRows(lo, 512), w, block=False, x_scale=one, weight_scale=one) == "scaled_mm"
    assert backend.pick_gemm(_CudaRows(lo, 512), w.t().contiguous().t(), block=True) == "reference"
    monkeypatch.setattr(backend, "kernels_run_on", lambda t: False)  # before sm_89, or ROCm without AITER
    assert backend.pick_gemm(_CudaRows(lo, 512), w, block=True) == "reference"


def test_block_gemm_runs_triton_where_cublas_declines(monkeypatch):
    tri = torch.ops.atomc_triton
    registry.ensure_registered("cuda")
    x, w, ws = _rand((5, 512), 0, 2), _fp8((160, 512), 1), torch.rand(2, 4) / 100
    xq, xs = ops.fp8_quant_dynamic(x, 128)
    want = ops.fp8_block_gemm(xq, xs, w, ws, 128, 128, None, torch.float32)
    calls = []
    monkeypatch.setattr(backend, "pick_gemm", lambda xq, w, block, **scales: "scaled_mm_block" if block else "triton")
    monkeypatch.setattr(backend, "scaled_mm_block", lambda *a: calls.append(a) or None)
    close(tri.fp8_block_gemm(xq, xs, w, ws, 128, 128, None, torch.float32), want)  # the Triton GEMM
    assert len(calls) == 1 and calls[0][4:] == (128, 128, None, torch.float32)
    ran = torch.full((5, 160), 3.0)
    monkeypatch.setattr(backend, "scaled_mm_block", lambda *a: ran)  # where it runs, its output is the op's
    assert torch.equal(tri.fp8_block_gemm(xq, xs, w, ws, 128, 128, None, torch.float32), ran)


def _cublas_block_checks(a, b, scale_a, scale_b, out_dtype):
    """The CUDA _scaled_mm's checks for DeepSeek's recipe and what cuBLAS reads, in Python
    (aten/src/ATen/native/cuda/ScaledBlas.cpp: get_joint_scaling, is_blockwise_1x128_scaling and
    is_blockwise_128x128_scaling, the latter on (mat2.t(), scale_b.t()); pytorch PR 166752 for the
    128x128 scales' leading dimension, which cuBLAS reads rounded up to 4 blocks). The meta function
    run beside this checks shapes only, not the scales' strides."""
    m, k = a.shape
    n = b.shape[1]
    kb, nb = -(-k // 128), -(-n // 128)
    assert a.dtype == b.dtype == FP8 and scale_a.dtype == scale_b.dtype == torch.float32
    assert a.stride(1) == 1 and a.stride(0) >= k, "mat1 row-major"
    assert b.stride(0) == 1 and b.stride(1) >= k, "mat2 column-major"
    assert k % 16 == 0 and n % 16 == 0
    # 1x128 on mat1: [M, K/128], M-major (stride 1 along M, M along the groups)
    assert scale_a.shape == (m, kb) and scale_a.stride(0) == 1 and (kb == 1 or scale_a.stride(1) == m)
    # 128x128 on mat2: scale_b.t() [N/128, K/128] row-major, rows K/128 apart; cuBLAS reads them
    # round_up(K/128, 4) apart, some torch versions check K/128: the same only where 4 divides K/128
    sbt = scale_b.t()
    assert sbt.shape == (nb, kb) and sbt.stride(1) == 1
    assert nb == 1 or (sbt.stride(0) == kb and kb % 4 == 0)
    # what atomc adds: M a multiple of 4 (scale_a's leading dimension 16 bytes), never M == 1 (where
    # scale_a would also read as 128x128 and the (128x128, 1x128) pair is tried first)
    assert m % 4 == 0
    assert out_dtype in (torch.bfloat16, torch.float16, torch.float32)


def _emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """What cuBLAS computes from these operands and scales (read as the checks above lay them out)."""
    k, n = b.shape
    sa = scale_a.repeat_interleave(128, 1)[:, :k]
    sb = scale_b.repeat_interleave(128, 0)[:k].repeat_interleave(128, 1)[:, :n]
    return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """torch._scaled_mm replaced by a recorder that runs torch's meta function on meta tensors of the
    same shapes and strides, the checks above, then the emulation; the device check passes on CPU."""
    calls = []

    def fake(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        assert bias is None and scale_result is None and not use_fast_accum

        def meta(t):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

        out = torch.ops.aten._scaled_mm.default(meta(a), meta(b), meta(scale_a), meta(scale_b), None, None, out_dtype)
        assert out.shape == (a.shape[0], b.shape[1]) and out.dtype == out_dtype
        _cublas_block_checks(a, b, scale_a, scale_b, out_dtype)
        calls.append(
            {name: (t.shape, t.stride()) for name, t in dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b).items()}
        )
        return _emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake)
    monkeypatch.setattr(backend, "_cublas_block_device_ok", lambda xq, out_dtype: True)
    return calls


@pytest.mark.parametrize("lead", [(1,), (3,), (4,), (130,), (2, 3)])
@pytest.mark.parametrize(("n", "k"), [(576, 1024), (256, 512)])  # 576: 4.5 weight blocks
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_block_hands_cublas_its_layouts(scaled_mm_calls, lead, n, k, out_dtype):
    x = _rand((*lead, k), 0, 2)
    xq, xs = ops.fp8_quant_dynamic(x, 128)
    w, ws = _fp8((n, k), 1), torch.rand(-(-n // 128), k // 128) / 100
    bias = _rand(n, 2).to(out_dtype)
    got = backend.scaled_mm_block(xq, xs, w, ws, 128, 128, bias, out_dtype)
    assert got.shape == (*lead, n) and got.dtype == out_dtype
    want = ref.fp8_block_gemm_reference(xq, xs, w, ws, 128, 128, bias, torch.float32)
    close(got, want, rel=1e-5 if out_dtype == torch.float32 else 1e-2)
    (call,) = scaled_mm_calls
    rows = int(torch.tensor(lead).prod())
    m4 = -(-rows // 4) * 4
    assert call["a"] == ((m4, k), (k, 1))
    assert call["b"] == ((k, n), (1, k))  # the weight itself, transposed: no copy
    assert call["scale_a"] == ((m4, k // 128), (1, m4))
    assert call["scale_b"] == ((k // 128, -(-n // 128)), (1, k // 128))


def test_scaled_mm_block_declines_what_cublas_cannot_run(scaled_mm_calls, monkeypatch):
    k, n = 1024, 256
    xq, xs = ops.fp8_quant_dynamic(_rand((8, k), 0), 128)
    w, ws = _fp8((n, k), 1), torch.rand(2, 8) / 100
    bf16 = torch.bfloat16
    assert backend.scaled_mm_block(xq, xs, w, ws, 128, 128, None, bf16) is not None
    assert backend.scaled_mm_block(xq, xs, w, ws, 128, 64, None, bf16) is None  # 1x128 / 128x128 only
    assert backend.scaled_mm_block(xq, xs, w, ws, 64, 128, None, bf16) is None
    assert backend.scaled_mm_block(xq, xs, w, ws, 128, 128, None, torch.float8_e4m3fn) is None  # no FP8 out
    assert backend.scaled_mm_block(xq, xs, w.t().contiguous().t(), ws, 128, 128, None, bf16) is None
    assert backend.scaled_mm_block(xq, xs, w, ws[:1], 128, 128, None, bf16) is None  # scales not per block
    assert backend.scaled_mm_block(xq, xs[:, :4], w, ws, 128, 128, None, bf16) is None
    xq5, xs5 = ops.fp8_quant_dynamic(_rand((8, 640), 0), 128)  # K/128 = 5: not a multiple of 4
    assert backend.scaled_mm_block(xq5, xs5, _fp8((n, 640)), torch.rand(2, 5), 128, 128, None, bf16) is None
    assert backend.scaled_mm_block(xq, xs, _fp8((200, k)), torch.rand(2, 8), 128, 128, None, bf16) is None  # N % 16
    assert len(scaled_mm_calls) == 1
    monkeypatch.undo()  # the real device check: CPU tensors are no CUDA device
    assert backend.scaled_mm_block(xq, xs, w, ws, 128, 128, None, bf16) is None


def test_blockwise_probe_tells_a_misread_layout():
    """compat's one-time check (run on CUDA) against three stand-ins for torch._scaled_mm on CPU: the
    layout atomc hands it read as cuBLAS reads it, one that reads the weight scales transposed, and
    one that raises (an older torch)."""
    from atomc import compat

    def emulated(xq, xs, w, ws, out_dtype):
        return _emulated_scaled_mm(xq, w.t(), xs, ws.t(), out_dtype)

    def misread(xq, xs, w, ws, out_dtype):
        return _emulated_scaled_mm(xq, w.t(), xs, ws.t().reshape(ws.shape).t(), out_dtype)

    def raises(*a):
        raise RuntimeError("Invalid scaling configuration")

    cpu = torch.device("cpu")
    assert compat._try_blockwise(cpu, torch.bfloat16, emulated) == ""
    assert compat._try_blockwise(cpu, torch.bfloat16, misread).startswith("wrong result")
    assert "Invalid scaling configuration" in compat._try_blockwise(cpu, torch.bfloat16, raises)


# ---- scaled_mm_unit: tensorwise _scaled_mm with unit scales into fp32, then the Triton scale epilogue ----


@pytest.mark.parametrize("m", [1, 5, 19])  # 19: a partial 16-row tile after a whole one
@pytest.mark.parametrize("n", [64, 200])  # 200: a partial 128-column tile
@pytest.mark.parametrize("scales", ["row x col", "tensor x col", "row x tensor", "tensor x tensor"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])  # the interpreter mishandles bf16
@pytest.mark.parametrize("has_bias", [False, True])
def test_scale_epilogue_matches_torch(m, n, scales, out_dtype, has_bias):
    from atomc.kernels.triton.fp8_epilogue import scale_epilogue

    acc = _rand((m, n), 0, 300.0)
    x_part, w_part = scales.split(" x ")
    xs = torch.rand(m, 1, generator=torch.Generator().manual_seed(1)) / 50 if x_part == "row" else torch.tensor([0.013])
    ws = torch.rand(n, generator=torch.Generator().manual_seed(2)) / 50 if w_part == "col" else torch.tensor([0.021])
    bias = _rand(n, 3).to(out_dtype) if has_bias else None
    got = scale_epilogue(acc, xs, ws, bias, out_dtype)
    want = acc * xs.reshape(-1, 1) * ws.reshape(1, -1)
    if bias is not None:
        want = want + bias.float()
    assert got.shape == (m, n) and got.dtype == out_dtype
    # the same fp32 products in the same order, one rounding: equal
    torch.testing.assert_close(got, want.to(out_dtype), rtol=0, atol=0)


def test_scale_epilogue_reads_strided_scales_and_rejects_wrong_sizes():
    from atomc.kernels.triton.fp8_epilogue import scale_epilogue

    acc = _rand((6, 48), 0, 300.0)
    xs = torch.rand(6, 2)[:, :1]  # [M, 1] with row stride 2
    ws = torch.rand(48, 2)[:, 1]  # [N], stride 2
    got = scale_epilogue(acc, xs, ws, None, torch.float32)
    torch.testing.assert_close(got, acc * xs * ws, rtol=0, atol=0)
    with pytest.raises(ValueError, match="scale epilogue"):
        scale_epilogue(acc, torch.rand(5, 1), ws, None, torch.float32)
    with pytest.raises(ValueError, match="scale epilogue"):
        scale_epilogue(acc, xs, torch.rand(47), None, torch.float32)


def test_choice_rule_for_row_scales(monkeypatch):
    w = _fp8((256, 512))
    hi = backend.UNIT_SCALE_MAX_ROWS
    assert hi >= 2
    row = lambda rows: torch.rand(rows, 1)  # noqa: E731  # per-token activation scales
    one, col = torch.ones(1), torch.rand(256)
    # the interpreter: never _scaled_mm
    assert backend.pick_gemm(_fp8((3, 512)), w, block=False, x_scale=row(3), weight_scale=col) == "triton"
    monkeypatch.setattr(backend, "kernels_run_on", lambda t: True)  # an sm_89+ CUDA device

    def route(*shape, xs, ws):
        return backend.pick_gemm(_CudaRows(*shape, 512), w, block=False, x_scale=xs, weight_scale=ws)

    assert route(1, xs=row(1), ws=col) == "gemv"
    for rows in (2, 16, hi):
        assert route(rows, xs=row(rows), ws=col) == "scaled_mm_unit"  # per-token x per-channel
        assert route(rows, xs=one, ws=col) == "scaled_mm_unit"  # per-tensor x per-channel
        assert route(rows, xs=row(rows), ws=one) == "scaled_mm_unit"  # per-token x per-tensor
        assert route(rows, xs=one, ws=one) == "scaled_mm"  # per-tensor on both: tensorwise as is
    assert route(2, hi // 2, xs=row(hi), ws=col) == "scaled_mm_unit"  # rows over all leading dims
    assert route(hi + 1, xs=row(hi + 1), ws=col) == "scaled_mm"  # rowwise above the threshold
    assert route(2, hi, xs=row(2 * hi), ws=col) == "scaled_mm"
    assert route(4096, xs=one, ws=col) == "scaled_mm"
    assert route(hi, xs=None, ws=None) == "scaled_mm_unit"  # scales left out: read as row scales
    assert backend.pick_gemm(_CudaRows(2, 512), w, block=True) == "triton"  # block scales: not this route
    monkeypatch.setattr(backend, "TRITON_GEMM_MAX_ROWS", 16)  # the Triton GEMM's rows come first
    assert route(16, xs=row(16), ws=col) == "triton"
    assert route(17, xs=row(17), ws=col) == "scaled_mm_unit"


@pytest.fixture
def unit_scaled_mm_calls(monkeypatch):
    """torch._scaled_mm replaced by a recorder of what scaled_mm_unit hands it (tensorwise: 0-d fp32
    scales, an fp32 output), returning the exact fp32 product; the device check passes on CPU."""
    calls = []

    def fake(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        assert bias is None and scale_result is None and not use_fast_accum
        calls.append(dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype))
        return (a.float() @ b.float()) * scale_a * scale_b

    monkeypatch.setattr(torch, "_scaled_mm", fake)
    monkeypatch.setattr(backend, "_scaled_mm_device_ok", lambda xq: True)
    return calls


@pytest.mark.parametrize("lead", [(2,), (19,), (2, 3)])
@pytest.mark.parametrize("scales", ["row x col", "tensor x col", "row x tensor"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("has_bias", [False, True])
def test_scaled_mm_unit_hands_cublas_unit_scales(unit_scaled_mm_calls, lead, scales, out_dtype, has_bias):
    n, k = 208, 256
    x = _rand((*lead, k), 0, 2)
    xq, xs = ops.fp8_quant_dynamic(x, 0 if scales.startswith("tensor") else k)
    w = _fp8((n, k), 1)
    ws = torch.rand(n) / 100 if scales.endswith("col") else torch.tensor([0.007])
    bias = _rand(n, 2).to(out_dtype) if has_bias else None
    got = backend.scaled_mm_unit(xq, xs, w, ws, bias, out_dtype)
    assert got.shape == (*lead, n) and got.dtype == out_dtype
    want = ref.fp8_gemm_reference(xq, xs, w, ws, bias, torch.float32)
    close(got, want, rel=1e-5 if out_dtype == torch.float32 else 1e-3)
    (call,) = unit_scaled_mm_calls
    rows = int(torch.tensor(lead).prod())
    assert call["a"].shape == (rows, k) and call["a"].dtype == FP8
    assert call["b"].shape == (k, n) and call["b"].stride() == (1, k) and call["b"].data_ptr() == w.data_ptr()
    assert call["out_dtype"] == torch.float32  # the raw product: the epilogue rounds once
    for s in (call["scale_a"], call["scale_b"]):
        assert s.shape == () and s.dtype == torch.float32 and s.item() == 1.0


def test_scaled_mm_unit_keeps_one_unit_scale_per_device(unit_scaled_mm_calls, monkeypatch):
    monkeypatch.setattr(backend, "_UNIT_SCALES", {})
    xq, xs = ops.fp8_quant_dynamic(_rand((4, 128), 0), 128)
    w, ws = _fp8((64, 128), 1), torch.rand(64) / 100
    backend.scaled_mm_unit(xq, xs, w, ws, None, torch.float32)
    backend.scaled_mm_unit(xq, xs, w, ws, None, torch.float32)
    first, second = unit_scaled_mm_calls
    assert first["scale_a"] is first["scale_b"] is second["scale_a"]  # made once, kept
    assert list(backend._UNIT_SCALES) == [torch.device("cpu")]


def test_scaled_mm_unit_declines_what_scaled_mm_cannot_run(unit_scaled_mm_calls, monkeypatch):
    xq, xs = ops.fp8_quant_dynamic(_rand((4, 256), 0), 256)
    assert backend.scaled_mm_unit(xq, xs, _fp8((200, 256)), torch.rand(200), None, torch.float32) is None  # N % 16
    xq2, xs2 = ops.fp8_quant_dynamic(_rand((4, 200), 0), 200)
    assert backend.scaled_mm_unit(xq2, xs2, _fp8((64, 200)), torch.rand(64), None, torch.float32) is None  # K % 16
    assert not unit_scaled_mm_calls
    monkeypatch.undo()  # the real device check: CPU tensors are no CUDA device
    assert backend.scaled_mm_unit(xq, xs, _fp8((64, 256)), torch.rand(64), None, torch.float32) is None


def test_fp8_gemm_takes_the_unit_route_and_falls_back_to_triton(unit_scaled_mm_calls, monkeypatch):
    tri = torch.ops.atomc_triton
    registry.ensure_registered("cuda")
    x, w, ws = _rand((5, 256), 0, 2), _fp8((160, 256), 1), torch.rand(160) / 100
    xq, xs = ops.fp8_quant_dynamic(x, 256)
    bias = _rand(160, 3)
    want = ops.fp8_gemm(xq, xs, w, ws, bias, torch.float32)
    seen = []

    def pick(xq, w, block, x_scale=None, weight_scale=None):
        seen.append((x_scale, weight_scale))
        return "scaled_mm_unit"

    monkeypatch.setattr(backend, "pick_gemm", pick)
    close(tri.fp8_gemm(xq, xs, w, ws, bias, torch.float32), want)  # through _scaled_mm + the epilogue
    assert len(unit_scaled_mm_calls) == 1 and seen[0][0] is xs and seen[0][1] is ws  # the rule saw the scales
    monkeypatch.setattr(backend, "scaled_mm_unit", lambda *a: None)  # where it declines: the Triton GEMM
    close(tri.fp8_gemm(xq, xs, w, ws, bias, torch.float32), want)
    assert len(unit_scaled_mm_calls) == 1


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("scales", ["row", "tensor"])
def test_fp8_linear_dynamic_one_row_skips_the_quant(silu, scales, monkeypatch):
    """One row: the activation times the e4m3 weights (W8A16), no quant kernel; the result is the
    dequantised product to fp32 round-off, and differs from the W8A8 reference only by the
    activation's e4m3 rounding. More rows: the quant kernel and fp8_gemm, as the reference."""
    tri = torch.ops.atomc_triton
    registry.ensure_registered("cuda")
    monkeypatch.setattr(backend, "ONE_ROW_W8A16", True)
    k, n = 256, 48
    x = _rand((1, 2 * k if silu else k), 3, 2)
    w = _fp8((n, k), 4)
    ws = torch.rand(n) / 100 if scales == "row" else torch.tensor([0.013])
    bias = _rand(n, 5)
    quants = []
    for name in ("fp8_quant_dynamic", "_silu"):
        real = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, real=real: quants.append(a) or real(*a))
    got = tri.fp8_linear_dynamic(x, k, w, ws, bias, torch.float32, silu)
    assert quants == []  # the one-row path quantises nothing
    a = torch.nn.functional.silu(x[:, :k]) * x[:, k:] if silu else x
    w16 = w.float() * ws.reshape(-1, 1)
    close(got, a @ w16.t() + bias)
    w8a8 = ops.fp8_linear_dynamic(x, k, w, ws, bias, torch.float32, silu)
    assert not torch.equal(got, w8a8)
    close(got, w8a8, rel=0.08)  # e4m3's rounding of the activation: 2^-4 a value at most
    monkeypatch.setattr(backend, "ONE_ROW_W8A16", False)
    close(tri.fp8_linear_dynamic(x, k, w, ws, bias, torch.float32, silu), w8a8)
    assert len(quants) == 1

    xs = _rand((3, x.shape[1]), 6, 2)  # several rows: quant + GEMM, the reference's numbers
    close(tri.fp8_linear_dynamic(xs, k, w, ws, bias, torch.float32, silu),
          ops.fp8_linear_dynamic(xs, k, w, ws, bias, torch.float32, silu))  # fmt: skip
