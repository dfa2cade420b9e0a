"""FP8 GEMM on tensor cores: C[M, N] = A_e4m3[M, K] . B_e4m3[N, K]^T, fp32 accumulation.

Two ways of scaling, the two FP8 GEMM ops:
- block (DeepSeek-V3 style, atomc::fp8_block_gemm): A has one scale per row per group of bk values
  ([M, K/bk], the activation quantised per token group at run time), B one per bn x bk block
  ([ceil(N/bn), K/bk]). A K step (BLOCK_K) lies inside one group (BLOCK_K divides bk), so each
  step's dot is scaled by a_s[m, g] * b_s[n // bn, g] before it is added to the accumulator, which is
  the dequantise-then-multiply of the reference up to fp32 summation order;
- row (atomc::fp8_gemm): A's scale is [1] or per row, B's [1] or per output row; the raw dot is
  accumulated and scaled once in the epilogue (what _scaled_mm's tensorwise / rowwise modes do).
  It covers what _scaled_mm cannot (an fp32 output with row scales, dimensions not multiples of 16)
  and is the Triton side of the _scaled_mm comparison in benchmarks/fp8_linear.py.

What a Hopper FP8 GEMM needs, and how this one meets it: e4m3 tiles straight into `tl.dot` with an
fp32 accumulator (no upcast); both operands K-contiguous (the weight is [N, K] row-major, the layout
FP8 wgmma wants for B); BLOCK_K 128, the scale group, so a step is one group; grouped program order
(GROUP_M rows of tiles at a time) so neighbouring programs share B tiles in L2. The block path's
per-step cost is what the first H200 run found 3x slower than the row path on the same tiles
(15-22% of the FP8 peak against 56-62%), and what changed for it:
- the step's scales are loaded one step ahead (loop-carried): Triton pipelines only the loads that
  feed a dot, so a scale load used right after its own dot stalled every K step on its latency;
- when BLOCK_N divides the weight block's rows (128 | 128) the weight scale is one scalar a step,
  not a gathered [BLOCK_N] vector, and the scales meet the partial product as one [BLOCK_M] vector:
  acc += dot * (a_s * b_s)[:, None], one multiply-add per accumulator element;
- no load masks: rows past M or N read a valid row (offs % M) and are dropped at the store, and K
  (a whole number of groups) needs no mask (EVEN_K), so the loop is loads, a dot and the FMA.

Accumulation: on sm_90 Triton lets FP8 wgmma accumulate in the tensor core's reduced-precision
accumulator across the whole K loop unless told otherwise (its `max_num_imprecise_acc` default),
which the interpreter does not model. The row path passes `max_num_imprecise_acc=BLOCK_K`, so each
step's partial sum is added to the fp32 accumulator (one add per element a step); the block path
does that by construction (a fresh dot a step, scaled into acc).

Operand loads are pointer loads (cp.async, pipelined num_stages deep) or, with the `tma` knob, tensor
descriptors (Hopper's bulk copies: no address arithmetic in the loop, zeros past the edges); the
sweep decides which, the default is pointer loads until it has.

Tiles: `gemm_config(M)` is the default by row count; a tuned entry for the weight's (N, K) on this
device (fp8_config.py, written by `benchmarks/fp8_linear.py --sweep --write-configs`) overrides it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from atomc.kernels.triton import fp8_config, tuned_files
from atomc.kernels.triton.specialize import token_counts


@triton.jit(do_not_specialize_on_alignment=token_counts("M"))
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr,
    M, N, K, stride_am, stride_bn, stride_cm, stride_asm, stride_bsn, SCALE_ROWS,
    BLOCK_SCALES: tl.constexpr, A_ROWS: tl.constexpr, B_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, SCALAR_BS: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # rows past the edge read a valid row and are dropped at the store: the loads need no mask
    rows_a = offs_m % M
    rows_b = offs_n % N
    if not TMA:
        a_ptrs = a_ptr + rows_a.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + rows_b.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BLOCK_SCALES:
        last_group = K // GROUP_K - 1
        as_ptrs = as_ptr + rows_a * stride_asm
        if SCALAR_BS:  # the tile's rows lie in one weight block: one scale a group
            bs_ptrs = bs_ptr + ((pid_n * BLOCK_N) // SCALE_ROWS) * stride_bsn
        else:
            bs_ptrs = bs_ptr + (rows_b // SCALE_ROWS) * stride_bsn
        a_s = tl.load(as_ptrs)  # group 0's scales; each step loads the next step's
        b_s = tl.load(bs_ptrs)
    for k0 in range(0, K, BLOCK_K):
        if TMA:  # a_ptr, b_ptr are tensor descriptors: one bulk copy a tile, zeros past the edges
            a = a_ptr.load([pid_m * BLOCK_M, k0])
            b = b_ptr.load([pid_n * BLOCK_N, k0])
        elif EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
        if BLOCK_SCALES:
            # issued before this step's dot, used after the next one: the latency hides behind a dot
            g_next = tl.minimum((k0 + BLOCK_K) // GROUP_K, last_group)
            a_s_next = tl.load(as_ptrs + g_next)
            b_s_next = tl.load(bs_ptrs + g_next)
            if SCALAR_BS:
                acc += tl.dot(a, tl.trans(b)) * (a_s * b_s)[:, None]
            else:
                acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
            a_s = a_s_next
            b_s = b_s_next
        else:
            # promote the fp8 products to fp32 once a step: Triton's sm_90 default never does
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
        if not TMA:
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    if not BLOCK_SCALES:
        if A_ROWS:
            acc = acc * tl.load(as_ptr + rows_a)[:, None]
        else:
            acc = acc * tl.load(as_ptr)
        if B_ROWS:
            acc = acc * tl.load(bs_ptr + rows_b)[None, :]
        else:
            acc = acc * tl.load(bs_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_b).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemm_config(m: int) -> dict:
    """Default tiles by row count (no tuned entry for the shape): 128x128x128 over 8 warps, 3 stages
    at prefill sizes, the Hopper FP8 starting point (and the row GEMM's 56-62% of the peak on the
    first H200 run); smaller M tiles below, so few rows still spread over the SMs."""
    if m <= 16:
        return dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if m <= 512:
        return dict(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4)
    return dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)


def _tma_ok(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """A bulk copy needs 16-byte aligned bases and row strides (e4m3: K a multiple of 16)."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) == 1 for t in (a, weight))


def pick_config(m: int, n: int, k: int, block: bool, device: torch.device) -> dict:
    """gemm_config(m) with the tuned entry for (N, K) on this device laid over it."""
    dev = tuned_files.tile_device(device)
    found = fp8_config.tuned("block_gemm" if block else "row_gemm", n, k, m, dev.name, family=dev.family)
    return {**gemm_config(m), **found} if found else gemm_config(m)


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    block: tuple[int, int] | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """atomc::fp8_gemm (block None) or atomc::fp8_block_gemm (block = (bn, bk)) for xq [..., K]
    and a row-major weight [N, K]; `config` (any of block_m/n/k, num_warps, num_stages, group_m)
    overrides the picked tiles; `tma` (bool) loads the operand tiles through tensor descriptors."""
    n, k = weight.shape
    a = xq.reshape(-1, k)
    a = a if a.stride(-1) == 1 else a.contiguous()
    m = a.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out.view(*xq.shape[:-1], n)
    cfg = pick_config(m, n, k, block is not None, xq.device)
    if config:
        cfg = {**cfg, **config}
    block_k = cfg["block_k"]
    scalar_bs = False
    if block is not None:
        bn, bk = block
        block_k = min(block_k, bk)
        if bk % block_k or k % bk:
            raise ValueError(
                f"fp8 block GEMM: the K step {block_k} must divide the block's {bk} columns, and they K = {k}"
            )
        a_s = x_scale.float().reshape(m, k // bk).contiguous()
        b_s = weight_scale.float().contiguous()
        strides = (a_s.stride(0), b_s.stride(0), bn)
        a_rows = b_rows = False
        scalar_bs = bn % cfg["block_n"] == 0
    else:
        bk = block_k
        a_s, b_s = x_scale.float().reshape(-1), weight_scale.float().reshape(-1)
        strides = (0, 0, 1)
        a_rows, b_rows = a_s.numel() > 1, b_s.numel() > 1
    grid = (triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"]),)
    tma = bool(cfg.get("tma")) and _tma_ok(a, weight)
    a_arg, b_arg = a, weight
    if tma:
        a_arg = TensorDescriptor.from_tensor(a, [cfg["block_m"], block_k])
        b_arg = TensorDescriptor.from_tensor(weight, [cfg["block_n"], block_k])
    _fp8_gemm_kernel[grid](
        a_arg, a_s, b_arg, b_s, bias if bias is not None else out, out,
        m, n, k, a.stride(0), weight.stride(0), out.stride(0), *strides,
        BLOCK_SCALES=block is not None, A_ROWS=a_rows, B_ROWS=b_rows, HAS_BIAS=bias is not None,
        GROUP_K=bk, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=block_k,
        GROUP_M=cfg.get("group_m", 8), EVEN_K=k % block_k == 0, SCALAR_BS=scalar_bs, TMA=tma,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out.view(*xq.shape[:-1], n)
