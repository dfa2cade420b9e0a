"""The PDL rules of atomc/kernels/triton/pdl.py, checked on every PDL-aware kernel through the Triton
interpreter with PDL forced on: each program waits once and releases once, stores nothing before its
wait, and before it loads only the model weights the case names. The interpreter runs programs one
by one, so each memory access is attributed to its program."""

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import; test_pdl_gpu.py covers CUDA

triton = pytest.importorskip("triton")
from mla_latent_cases import layer_inputs  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton_kernel_cases import cos_sin_cache, make_batch, make_moe  # noqa: E402

from atomc.kernels.triton import (  # noqa: E402
    fp8_quant,
    fused_add_rms_norm,
    mla_attention,
    mla_latent_norm_rope,
    paged_attention,
    pdl,
    rms_norm,
    rope_and_write_kv,
    silu_and_mul,
    write_latent_cache,
)
from atomc.kernels.triton.argmax import argmax_rows  # noqa: E402
from atomc.kernels.triton.fp8_epilogue import scale_epilogue  # noqa: E402
from atomc.kernels.triton.fp8_gemv import fp8_gemv  # noqa: E402
from atomc.kernels.triton.gemv import gemv  # noqa: E402
from atomc.kernels.triton.moe import fused_experts  # noqa: E402
from atomc.kernels.triton.moe_quant import fused_experts_quant  # noqa: E402
from atomc.kernels.triton.moe_routing import grouped_topk, softmax_topk  # noqa: E402
from atomc.ops import fp8 as ref  # noqa: E402
from atomc.ops.moe import select_experts  # noqa: E402
from models.quant.mxfp4 import quantize_mxfp4  # noqa: E402


class Trace:
    """Per program (grid index): the ordered events wait / release / load(addresses) / store."""

    def __init__(self, monkeypatch):
        self.programs: dict[tuple, list] = {}
        b = interpreter.interpreter_builder
        cls = type(b)
        # the kernels read `pdl.launch` and the jit helpers `pdl.gdc_*` when they run
        monkeypatch.setattr(pdl, "launch", lambda t: {"PDL": True})
        monkeypatch.setattr(pdl, "gdc_wait", lambda: self._add("wait"))
        monkeypatch.setattr(pdl, "gdc_launch_dependents", lambda: self._add("release"))
        set_idx, load, store = cls.set_grid_idx, cls.create_masked_load, cls.create_masked_store
        atomic_rmw, atomic_cas = cls.create_atomic_rmw, cls.create_atomic_cas

        def set_grid_idx(builder, x, y, z):
            set_idx(builder, x, y, z)
            self.programs.setdefault((self.launches, x, y, z), [])

        def masked_load(builder, ptrs, mask, *a):
            self._add(("load", ptrs.data[mask.data].astype("uint64").tolist()))
            return load(builder, ptrs, mask, *a)

        def masked_store(builder, ptrs, value, mask, *a):
            self._add("store")
            return store(builder, ptrs, value, mask, *a)

        def rmw(builder, *a):
            self._add("store")
            return atomic_rmw(builder, *a)

        def cas(builder, *a):
            self._add("store")
            return atomic_cas(builder, *a)

        self.launches = 0
        set_dim = cls.set_grid_dim

        def set_grid_dim(builder, *a):
            self.launches += 1
            return set_dim(builder, *a)

        for name, fn in [("set_grid_idx", set_grid_idx), ("create_masked_load", masked_load),
                         ("create_masked_store", masked_store), ("create_atomic_rmw", rmw),
                         ("create_atomic_cas", cas), ("set_grid_dim", set_grid_dim)]:  # fmt: skip
            monkeypatch.setattr(cls, name, fn)
        self._builder = b

    def _add(self, event):
        self.programs[(self.launches, *self._builder.grid_idx)].append(event)

    def check(self, weights: list[torch.Tensor]) -> int:
        """Assert the rules for every program of each launch in which a program waited (a PDL-aware
        kernel; the MoE sort's torch ops are not); returns how many such launches ran."""
        spans = [(w.untyped_storage().data_ptr(), w.untyped_storage().data_ptr() + w.untyped_storage().nbytes())
                 for w in weights]  # fmt: skip
        pdl_launches = {p[0] for p, events in self.programs.items() if "wait" in events}
        for prog, events in self.programs.items():
            if prog[0] not in pdl_launches:
                continue
            kinds = [e if isinstance(e, str) else e[0] for e in events]
            assert kinds.count("wait") == 1 and kinds.count("release") == 1, (prog, kinds)
            w = kinds.index("wait")
            assert kinds.index("release") > w, (prog, "released before its wait")
            before = events[:w]
            assert "store" not in before, (prog, "stored before its wait")
            for e in before:
                for a in e[1]:
                    assert any(lo <= a < hi for lo, hi in spans), (prog, "loaded a non-weight before its wait")
        return len(pdl_launches)

    def clear(self):
        self.programs.clear()


@pytest.fixture
def trace(monkeypatch):
    return Trace(monkeypatch)


def test_rms_norm(trace):
    x, w = torch.randn(3, 80), torch.randn(80)
    y = rms_norm(x, w, 1e-6)
    assert trace.check([w]) == 1 and len(trace.programs) == 3
    torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)


def test_fused_add_rms_norm(trace):
    x, r, w = torch.randn(2, 64), torch.randn(2, 64), torch.randn(64)
    fused_add_rms_norm(x, r, w, 1e-6)
    assert trace.check([w]) == 1 and len(trace.programs) == 2


def test_reduce_gemv_loads_its_first_weight_tile_early(trace):
    x, w = torch.randn(1, 100), torch.randn(37, 100)  # K over several 32-wide tiles, a masked tail
    b = torch.randn(37)
    y = gemv(x, w, b, kernel="reduce", block_n=4, block_k=32)
    assert trace.check([w]) == 1 and len(trace.programs) == triton.cdiv(37, 4)
    for events in trace.programs.values():
        assert events[0][0] == "load", "the first weight tile streams in before the wait"
    torch.testing.assert_close(y, x @ w.t() + b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["reduce", "reduce_f16"])
def test_fp8_reduce_gemv(trace, kernel):
    fp8 = torch.float8_e4m3fn
    xq = (torch.randn(1, 96) * 8).to(fp8)
    w = (torch.randn(20, 96) * 8).to(fp8)
    xs, ws = torch.rand(1, 1), torch.rand(20)
    fp8_gemv(xq, xs, w, ws, None, torch.float32, kernel=kernel, block_n=4, block_k=32)
    assert trace.check([w, ws]) == 1
    for events in trace.programs.values():
        assert events[0][0] == "load", "the first weight tile streams in before the wait"


@pytest.mark.parametrize("block", [None, (16, 32)])
@pytest.mark.parametrize("split_k", [1, 2])
def test_fp8_dot_gemv_loads_its_first_weight_tile_early(trace, block, split_k):
    fp8 = torch.float8_e4m3fn
    k = 96 if block is None else 128  # per-row: a masked tail (96 = 32 + 64); block: 4 groups of 32
    xq = (torch.randn(1, k) * 8).to(fp8)
    w = (torch.randn(40, k) * 8).to(fp8)
    xs = torch.rand(1, 1) if block is None else torch.rand(1, k // 32)
    ws = torch.rand(40) if block is None else torch.rand(3, k // 32)  # 40 rows: 3 blocks of 16
    y = fp8_gemv(xq, xs, w, ws, None, torch.float32, block=block, kernel="dot", block_n=16, block_k=64,
                 split_k=split_k)  # fmt: skip
    assert trace.check([w, ws]) == 1 and len(trace.programs) == 3 * split_k
    for events in [e for e in trace.programs.values() if "wait" in e]:
        assert events[0][0] == "load", "the first weight tile streams in before the wait"
    want = (
        ref.fp8_gemm_reference(xq, xs, w, ws, None, torch.float32)
        if block is None
        else ref.fp8_block_gemm_reference(xq, xs, w, ws, *block, None, torch.float32)
    )
    torch.testing.assert_close(y, want, atol=1e-3, rtol=1e-3)


def test_fp8_scale_epilogue(trace):
    acc, xs, ws, bias = torch.randn(19, 200), torch.rand(19, 1), torch.rand(200), torch.randn(200)
    y = scale_epilogue(acc, xs, ws, bias, torch.float32)  # the weight's scales and bias before the wait
    assert trace.check([ws, bias]) == 1 and len(trace.programs) == 2 * 2
    torch.testing.assert_close(y, acc * xs * ws + bias)


def test_rope_and_write_kv(trace):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, h, 32, generator=g) for h in (4, 2, 2))
    kc, vc = torch.zeros(3, 16, 2, 32), torch.zeros(3, 16, 2, 32)
    qw, kw = torch.rand(32) + 0.5, torch.rand(32) + 0.5
    cs = cos_sin_cache(64, 32, "cpu")
    rope_and_write_kv(torch.tensor([0, 5, 9, 2]), q, k, v, cs, kc, vc, torch.tensor([3, -1, 20, 7]),
                      qk_norm=(qw, 1e-6, kw, 1e-6))  # fmt: skip
    assert trace.check([cs, qw, kw]) == 1


@pytest.mark.parametrize("segments,merge_in_kernel,launches", [(1, None, 1), (3, False, 2), (3, True, 1)])
def test_paged_attention(trace, segments, merge_in_kernel, launches):
    # a split adds its reduce kernel, unless the attention kernel merges (MERGE_LAST)
    q, k_cache, v_cache, meta = make_batch([1, 1, 3], [9, 70, 40], 4, 2, 32, torch.float32, "cpu")
    out = torch.empty_like(q)
    paged_attention(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.2,
                    meta.max_query_len, meta.max_seq_len, meta.num_seqs, num_segments=segments,
                    merge_in_kernel=merge_in_kernel)  # fmt: skip
    assert trace.check([]) == launches


def test_silu_and_mul(trace):
    silu_and_mul(torch.randn(2, 80))
    assert trace.check([]) == 1 and len(trace.programs) == 2


def test_softmax_topk(trace):
    softmax_topk(torch.randn(3, 24), 4)
    assert trace.check([]) == 1 and len(trace.programs) == 3


def test_grouped_topk(trace):
    grouped_topk(torch.randn(3, 32), 4, "sigmoid", True, 0.1 * torch.randn(32), 4, 2, 2.5)
    assert trace.check([]) == 1 and len(trace.programs) == 3


TILE = dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
MOE_CONFIGS = {
    "gemv": {"path": "gemv", "gate_up": dict(TILE, block_n=4, block_k=16), "down": dict(TILE, block_n=2, block_k=32)},
    "gemv-combine-kernel": {"path": "gemv", "gate_up": dict(TILE, block_n=4, block_k=16),
                            "down": dict(TILE, block_n=2, block_k=32, fuse_combine=False)},
    "small": {"path": "small", "gate_up": dict(TILE), "down": dict(TILE)},
    "sorted": {"path": "sorted", "gate_up": dict(TILE), "down": dict(TILE)},
}  # fmt: skip


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_fused_experts(trace, name):
    t = 1 if name.startswith("gemv") else 5
    x, logits, w13, w2, _, _ = make_moe(t, 6, 48, 40, 2, torch.float32, "cpu")
    weights, ids = select_experts(logits, 2)
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32)  # experts on another rank exit early
    trace.clear()
    fused_experts(x, weights, ids, w13[:4], w2[:4], expert_map=expert_map, config=MOE_CONFIGS[name])
    # gate-up, down (+ the combine; + the sorted route's one-launch alignment, moe_align.py)
    assert trace.check([w13, w2]) == {"gemv": 2, "sorted": 4}.get(name, 3)


def test_fp8_activation_quants(trace):
    x, r, w = torch.randn(2, 128), torch.randn(2, 128), torch.rand(128) + 0.5
    fp8_quant.rms_norm_quant(x, r, w, 1e-6, None, 128)  # RMSNorm (+ residual) -> per-token FP8
    assert trace.check([w]) == 1
    trace.clear()
    fp8_quant.quant_dynamic(x, 32)  # per-group
    fp8_quant.silu_and_mul_quant(torch.randn(3, 2 * 64), None, 64)  # one program a row
    assert trace.check([]) == 2
    trace.clear()
    wide = fp8_quant.SPLIT_CHUNK + 96  # a row over two chunks: the split path's two kernels
    fp8_quant.silu_and_mul_quant(torch.randn(1, 2 * wide), None, wide)
    assert trace.check([]) == 2


def test_argmax(trace):
    argmax_rows(torch.randn(3, 5000))
    assert trace.check([]) == 2


@pytest.mark.parametrize("segments", [1, 2])
def test_mla_attention(trace, segments):
    q, cache, _, meta = make_batch([1, 1, 4], [9, 30, 12], 4, 1, 48, torch.float32, "cpu", page=8)
    out = torch.empty(*q.shape[:2], 40)
    mla_attention(q[..., :40], q[..., 40:], cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                  0.2, meta.max_query_len, meta.max_seq_len, meta.num_seqs,
                  num_segments=segments, tile_n=16)  # fmt: skip
    assert trace.check([]) == segments  # the split adds its merge


def test_latent_norm_rope_and_cache_write(trace):
    args = layer_inputs(3, 4, 32, 8, torch.float32, "cpu", False)
    mla_latent_norm_rope(*args)
    assert trace.check([args[4]]) == 1
    trace.clear()
    write_latent_cache(torch.randn(3, 40), torch.randn(3, 8), torch.zeros(4, 8, 1, 48), torch.tensor([5, -1, 20]))
    assert trace.check([]) == 1


def _fp8_rows(w):
    s = w.abs().amax(-1).clamp(min=1e-8) / 448
    return (w / s[..., None]).to(torch.float8_e4m3fn), s


QTILE = dict(block_m=16, block_n=16, block_k=64, num_warps=4, num_stages=2)
QUANT_CONFIGS = {
    "gemv": {"path": "gemv", "gate_up": dict(QTILE, block_n=4), "down": dict(QTILE, block_n=2, block_k=32)},
    "small": {"path": "small", "gate_up": dict(QTILE), "down": dict(QTILE)},
}


@pytest.mark.parametrize("fmt", ["fp8_channel", "mxfp4"])
@pytest.mark.parametrize("route", list(QUANT_CONFIGS))
def test_quantised_experts(trace, fmt, route):
    t = 1 if route == "gemv" else 3
    x, logits, w13, w2, _, _ = make_moe(t, 4, 96, 64, 2, torch.float32, "cpu")
    weights, ids = select_experts(logits, 2)
    quant = quantize_mxfp4 if fmt == "mxfp4" else _fp8_rows
    (q13, s13), (q2, s2) = quant(w13), quant(w2)
    trace.clear()
    fused_experts_quant(x, weights, ids, q13, s13, q2, s2, weight_format=fmt, config=QUANT_CONFIGS[route])
    assert trace.check([q13, s13, q2, s2]) == (2 if route == "gemv" else 3)


def test_launch_is_off_without_a_hopper_gpu():
    assert pdl.launch(torch.zeros(1)) == {"PDL": False}
    pdl.configure(False)
    try:
        assert not pdl.enabled()
    finally:
        pdl.configure(True)
