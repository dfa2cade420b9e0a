"""`atomc_triton::all_reduce_add_rms_norm`: the tensor-parallel all-reduce, residual add and RMSNorm
(atomc/ops/all_reduce_norm.py) on CUDA and ROCm. Two paths, chosen per call:

- **Collective, then the add + norm kernel** (the default; on ROCm always): torch.distributed's
  all-reduce (NCCL on CUDA, RCCL on ROCm), then the Triton add + RMSNorm kernel (rmsnorm.py). These
  are the two kernels the unfused graph runs: this path saves nothing, it keeps the fused op as fast
  as the pair it replaced.
- **One shot over symmetric memory** (CUDA only, opt-in: `parallel.one_shot_all_reduce`,
  `--one-shot-all-reduce`, set once per process by the model runner through `configure`). Every rank
  maps every other rank's buffer of a workspace (`torch.distributed._symmetric_memory`). A rank
  copies its partial sum into its own buffer; a barrier; then one program per row reads the row
  from every rank's buffer, sums in fp32 in rank order (every rank gets the same bits, which tensor
  parallelism needs: the ranks must not drift apart), rounds the sum to the dtype as an all-reduce
  would, adds the residual and normalises, so the reduced sum is never written nor read back and no
  NCCL kernel runs; a second barrier keeps a rank from overwriting its buffer while a peer still
  reads it (two barriers a call, so it is correct in any order of calls, CUDA graphs included).
  Calls it cannot take fall back to the first path: another device, more than MAX_WORLD ranks, a
  partial sum larger than the workspace, or the first call during CUDA-graph capture (the
  workspace's allocation is a collective and cannot be captured). Every rank makes the same choice,
  since it depends only on what every rank has alike (shapes, the call sequence, the config).

**The one-shot path has never run on GPUs**: it was written without a multi-GPU machine. Tested:
its kernel under TRITON_INTERPRET=1 on CPU tensors standing in for the ranks' buffers, against the
reference (tests/kernels/test_triton_all_reduce_norm.py). Not tested: the workspace, the barriers'
memory ordering, capture in CUDA graphs, and whether it is faster than NCCL at any size (the
workspace size, ONE_SHOT_MAX_BYTES, is a guess, not a measurement). Hence opt-in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from atomc.kernels.binding import bind_as_atomc
from atomc.kernels.triton import rmsnorm  # a module: the registry's test finds each op's body by its name
from atomc.ops import collective

MAX_WORLD = 8  # the kernel takes one pointer per rank
_one_shot_enabled = False


def configure(one_shot: bool) -> None:
    """The engine's `parallel.one_shot_all_reduce` (set once per process by the model runner)."""
    global _one_shot_enabled
    _one_shot_enabled = bool(one_shot)
# a rank's partial sum, at most: a decode batch of 256 tokens at hidden 8192 in bf16. One shot reads
# every peer's whole buffer, so past some size NCCL's ring wins; where is unmeasured
ONE_SHOT_MAX_BYTES = 4 << 20


@triton.jit
def _one_shot_kernel(
    p0, p1, p2, p3, p4, p5, p6, p7,  # the ranks' partial sums, rank order; the first WORLD are read
    res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_p, stride_r, stride_o, stride_ro,
    n_cols, eps,
    WORLD: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    at = row * stride_p + cols
    acc = tl.load(p0 + at, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 1:
        acc += tl.load(p1 + at, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 2:
        acc += tl.load(p2 + at, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 3:
        acc += tl.load(p3 + at, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 4:
        acc += tl.load(p4 + at, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 5:
        acc += tl.load(p5 + at, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 6:
        acc += tl.load(p6 + at, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 7:
        acc += tl.load(p7 + at, mask=mask, other=0.0).to(tl.float32)
    dtype = res_out_ptr.dtype.element_ty
    reduced = acc.to(dtype)  # the all-reduce's result, in the model's dtype
    r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
    x = (reduced.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the residual rounds to dtype (rmsnorm.py)
    tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * rstd).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def one_shot_rows(
    parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum(parts) + residual), sum(parts) + residual) for 2-D [rows, N] tensors, `parts`
    the ranks' partial sums in rank order (peer buffers on a GPU; any tensors under the interpreter)."""
    if not 1 <= len(parts) <= MAX_WORLD:
        raise ValueError(f"{len(parts)} partial sums: the kernel reads 1 to {MAX_WORLD}")
    rows, n = residual.shape
    stride = parts[0].stride(0)
    if any(p.shape != residual.shape or p.stride() != (stride, 1) for p in parts):
        raise ValueError("the partial sums must be row-major [rows, N] like the residual, with one stride")
    out = torch.empty_like(residual)
    summed = torch.empty_like(residual)
    if rows == 0:
        return out, summed
    ptrs = [*parts, *[parts[0]] * (MAX_WORLD - len(parts))]  # unread: any valid pointer
    block_n = triton.next_power_of_2(n)
    _one_shot_kernel[(rows,)](
        *ptrs, residual, weight, out, summed,
        stride, residual.stride(0), out.stride(0), summed.stride(0),
        n, eps,
        WORLD=len(parts), BLOCK_N=block_n, num_warps=min(16, max(1, block_n // 512)),
    )  # fmt: skip
    return out, summed


class _Workspace:
    """One symmetric-memory buffer per group and device, mapped on every rank; its views by dtype."""

    def __init__(self, group_name: str, device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem

        group = collective.group(group_name) or dist.group.WORLD
        self.buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)  # a collective: every rank is here too
        self.rank, self.world = self.handle.rank, self.handle.world_size
        self._flat: dict[torch.dtype, list[torch.Tensor]] = {}

    def views(self, rows: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Each rank's buffer as [rows, N] of `dtype`, rank order."""
        if dtype not in self._flat:
            size = ONE_SHOT_MAX_BYTES // torch.empty((), dtype=dtype).element_size()
            self._flat[dtype] = [self.handle.get_buffer(r, (size,), dtype) for r in range(self.world)]
        return [f[: rows * n].view(rows, n) for f in self._flat[dtype]]


_WORKSPACES: dict[tuple[str, torch.device], _Workspace] = {}


def _workspace(x: torch.Tensor, group_name: str) -> _Workspace | None:
    """The workspace for this call, or None when the one-shot path cannot take it."""
    if not (_one_shot_enabled and x.is_cuda and torch.version.hip is None):
        return None
    if x.numel() * x.element_size() > ONE_SHOT_MAX_BYTES:
        return None
    key = (group_name, x.device)
    ws = _WORKSPACES.get(key)
    if ws is None:
        if torch.cuda.is_current_stream_capturing():
            return None  # allocating is a collective: not inside a capture
        if dist.get_world_size(collective.group(group_name)) > MAX_WORLD:
            return None
        ws = _WORKSPACES[key] = _Workspace(group_name, x.device)
    return ws


def _one_shot(ws: _Workspace, x, residual, weight, eps):
    n = x.shape[-1]
    rows = x.numel() // n
    parts = ws.views(rows, n, x.dtype)
    parts[ws.rank].copy_(x.reshape(rows, n))
    ws.handle.barrier()  # every rank's partial sum is in its buffer
    normed, summed = one_shot_rows(parts, residual.reshape(rows, n).contiguous(), weight, eps)
    ws.handle.barrier()  # every rank has read every buffer: the next call may overwrite its own
    return normed.view(x.shape), summed.view(x.shape)


@bind_as_atomc("atomc_triton", "all_reduce_add_rms_norm")
def all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    ws = _workspace(x, group_name)
    if ws is not None:
        return _one_shot(ws, x, residual, weight, eps)
    reduced = collective.all_reduce(x, group_name)  # a fresh buffer: the norm may write over it
    return rmsnorm.fused_add_rms_norm(reduced, residual.contiguous(), weight, eps, out=reduced)
