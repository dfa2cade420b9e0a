"""Linear layers that know their tensor-parallel shard and load their own weights.

Each layer holds a linear method (models/quant/: how weights are stored and the GEMM is run) and a
ParallelInfo (rank, size). Every parameter it owns carries `weight_loader(param, tensor, shard_id=None)`,
which writes this rank's part of a checkpoint tensor into the right place:

- ReplicatedLinear: the whole tensor;
- ColumnParallelLinear: output features split across ranks (rank r holds rows r*n/size ...);
- RowParallelLinear: input features split; its outputs are partial sums that need an all-reduce;
- MergedColumnParallelLinear: several column linears on one input, stacked (gate and up:
  shard ids 0, 1), so one GEMM serves them all; a section may be replicated instead of split
  (DeepSeek's q and kv_a projections: qkv_a_proj);
- QKVParallelLinear: q, k, v stacked (shard ids "q", "k", "v") with GQA head counts; when there
  are fewer KV heads than ranks, each KV head is replicated on size/num_kv_heads ranks.

A checkpoint that stores the sections separately (q_proj, k_proj, v_proj) loads each with its shard
id (the family's packed_modules_mapping says which); one that stores them fused (qkv_proj) loads with
shard_id=None and the layer cuts the sections itself. Sharding is a pure function of (rank, size).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from models.layers.parallel import SINGLE, ParallelInfo, all_reduce
from models.quant.base import LinearMethod, set_weight_attrs
from models.quant.unquantized import UnquantizedLinearMethod


class LinearBase(nn.Module):
    """A linear whose output is `len(shard_ids)` logical sections stacked along the output features.

    Subclasses fix, per section: its full size (`output_sizes`), this rank's size
    (`local_output_sizes`) and which slice of the full section this rank holds (`shard_ranks`);
    and whether the input features are split (`input_size_per_partition` < `input_size`).

    Two flags a model may set for the loader's quantisation (models/loader/quantize.py): `router`
    (a MoE router: never quantised, as checkpoints store it dense) and `dense_weight` (the model
    reads `weight` as a dense tensor besides or instead of calling the layer: FP8 checkpoints'
    weights are dequantised at load, online FP8 leaves it dense).
    """

    router = False
    dense_weight = False

    def __init__(
        self,
        input_size: int,
        input_size_per_partition: int,
        output_sizes: Sequence[int],
        local_output_sizes: Sequence[int],
        shard_ranks: Sequence[int],
        shard_ids: Sequence,
        bias: bool,
        parallel: ParallelInfo,
        linear_method: LinearMethod | None,
    ):
        super().__init__()
        self.parallel = parallel
        self.input_size, self.input_size_per_partition = input_size, input_size_per_partition
        self.output_sizes, self.local_output_sizes = list(output_sizes), list(local_output_sizes)
        self.shard_ranks, self.shard_ids = list(shard_ranks), tuple(shard_ids)
        self.params_dtype = dtype = torch.get_default_dtype()
        self.set_linear_method(linear_method or UnquantizedLinearMethod())
        if bias:
            b = nn.Parameter(torch.empty(sum(self.local_output_sizes), dtype=dtype), requires_grad=False)
            set_weight_attrs(b, {"output_dim": 0, "weight_loader": self.weight_loader})
            self.register_parameter("bias", b)
        else:
            self.register_parameter("bias", None)

    def set_linear_method(self, method: LinearMethod) -> None:
        """Use `method`: drop the parameters the previous method made and let `method` make its own
        (the loader picks a quantised method per layer after the model is built, on meta)."""
        for name in getattr(self, "_method_params", ()):
            del self._parameters[name]
        before = set(self._parameters)
        self.linear_method = method
        method.create_weights(
            self, self.input_size_per_partition, self.local_output_sizes, self.params_dtype, self.weight_loader
        )
        self._method_params = [n for n in self._parameters if n not in before]

    @property
    def input_sharded(self) -> bool:
        return self.input_size_per_partition != self.input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        out_dim = getattr(param, "output_dim", None)
        fused = shard_id is None and len(self.shard_ids) > 1
        if getattr(param, "per_shard", False):  # one entry per section (e.g. a per-tensor scale each)
            if fused:
                return _copy(param.data, loaded, "")
            dst = param.data[self._index(shard_id)]
            return _copy(dst, loaded.reshape(dst.shape) if loaded.numel() == dst.numel() else loaded, _what(shard_id))
        # a block-scale parameter (block FP8) holds one value per (rows, cols) block: count in blocks
        bn, bk = getattr(param, "block", (1, 1))
        full_sizes = [_blocks(n, bn) for n in self.output_sizes]
        local_sizes = [_blocks(n, bn) for n in self.local_output_sizes]
        if fused and out_dim is not None:  # a checkpoint tensor holding every section: cut it here
            if loaded.dim() <= out_dim or loaded.shape[out_dim] != sum(full_sizes):
                raise ValueError(
                    f"has shape {tuple(loaded.shape)}, but its dim {out_dim} should hold the sections "
                    f"{dict(zip(self.shard_ids, full_sizes, strict=True))} (total {sum(full_sizes)})"
                )
            for sid, section in zip(self.shard_ids, loaded.split(full_sizes, dim=out_dim), strict=True):
                self.weight_loader(param, section, sid)
            return
        dst, src = param.data, loaded
        if out_dim is not None:
            i = self._index(shard_id)
            size, offset = local_sizes[i], sum(local_sizes[:i])
            _check_dim(src, out_dim, full_sizes[i], shard_id)
            dst = dst.narrow(out_dim, offset, size)
            src = src.narrow(out_dim, self.shard_ranks[i] * size, size)
        in_dim = getattr(param, "input_dim", None)
        if in_dim is not None and self.input_sharded:
            n = _blocks(self.input_size_per_partition, bk)
            _check_dim(src, in_dim, _blocks(self.input_size, bk), shard_id)
            src = src.narrow(in_dim, self.parallel.rank * n, n)
        _copy(dst, src, _what(shard_id))

    def _index(self, shard_id) -> int:
        try:
            return self.shard_ids.index(shard_id)
        except ValueError:
            raise ValueError(f"shard id {shard_id!r} is not one of {self.shard_ids}") from None


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def _what(shard_id) -> str:
    return "" if shard_id is None else f" (shard {shard_id!r})"


def _check_dim(t: torch.Tensor, dim: int, expected: int, shard_id) -> None:
    if t.dim() <= dim or t.shape[dim] != expected:
        raise ValueError(f"has shape {tuple(t.shape)}, but its dim {dim} should be {expected}{_what(shard_id)}")


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}{what}")
    dst.copy_(src)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (small projections, routers)."""

    def __init__(self, input_size, output_size, bias=False, parallel=SINGLE, linear_method=None):
        super().__init__(
            input_size, input_size, [output_size], [output_size], [0], (None,), bias, parallel, linear_method
        )


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank's output is its slice (no collective)."""

    def __init__(self, input_size, output_size, bias=False, parallel=SINGLE, linear_method=None):
        local = parallel.split(output_size, "output features")
        super().__init__(
            input_size, input_size, [output_size], [local], [parallel.rank], (None,), bias, parallel, linear_method
        )


class MergedColumnParallelLinear(LinearBase):
    """Column linears on the same input stacked into one GEMM (gate_proj, up_proj -> gate_up_proj).

    Shard ids are the section indices 0, 1, ...; each section is split across ranks on its own, so
    rank r holds [gate slice r, up slice r] and the MLP's split stays local. A section flagged in
    `replicated` is held whole by every rank instead (a ReplicatedLinear stacked beside column ones:
    DeepSeek's kv_a_proj_with_mqa next to its q projection)."""

    def __init__(
        self,
        input_size,
        output_sizes: Sequence[int],
        bias=False,
        parallel=SINGLE,
        linear_method=None,
        replicated: Sequence[bool] = (),
    ):
        whole = list(replicated) or [False] * len(output_sizes)
        if len(whole) != len(output_sizes):
            raise ValueError(f"replicated has {len(whole)} flags for {len(output_sizes)} sections")
        local = [
            n if w else parallel.split(n, f"section {i} output features")
            for i, (n, w) in enumerate(zip(output_sizes, whole, strict=True))
        ]
        ids = tuple(range(len(output_sizes)))
        ranks = [0 if w else parallel.rank for w in whole]
        super().__init__(input_size, input_size, output_sizes, local, ranks, ids, bias, parallel, linear_method)


class QKVParallelLinear(LinearBase):
    """q, k and v projections as one GEMM, split by heads across ranks (shard ids "q", "k", "v").

    With fewer KV heads than ranks, KV head h lives on ranks h*r .. h*r + r-1 (r = size / kv heads)."""

    def __init__(self, hidden_size, head_dim, num_heads, num_kv_heads, bias=False, parallel=SINGLE, linear_method=None):
        heads = parallel.split(num_heads, "attention heads")
        if num_kv_heads >= parallel.size:
            kv_heads, replicas = parallel.split(num_kv_heads, "KV heads"), 1
        else:
            if parallel.size % num_kv_heads:
                raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {parallel.size} ranks")
            kv_heads, replicas = 1, parallel.size // num_kv_heads
        kv_rank = parallel.rank // replicas
        super().__init__(
            hidden_size,
            hidden_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim],
            [parallel.rank, kv_rank, kv_rank],
            ("q", "k", "v"),
            bias,
            parallel,
            linear_method,
        )
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, heads, kv_heads  # this rank's


class RowParallelLinear(LinearBase):
    """Input features split across ranks (the input is a column layer's local slice); each rank's
    output is a partial sum, so the bias is added on rank 0 only and the sum needs an all-reduce.
    reduce_results=False leaves the sum to the caller, which adds other partial sums over the same
    ranks first and reduces them once (DeepSeek's shared experts beside the routed ones)."""

    def __init__(self, input_size, output_size, bias=False, parallel=SINGLE, linear_method=None, reduce_results=True):
        local_in = parallel.split(input_size, "input features")
        super().__init__(
            input_size, local_in, [output_size], [output_size], [0], (None,), bias, parallel, linear_method
        )
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.partial_forward(x)
        return all_reduce(self.parallel, partial) if self.reduce_results else partial

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum (the bias on rank 0 only), before the all-reduce."""
        return self.linear_method.apply(self, x, self.bias if self.parallel.rank == 0 else None)
