"""`torch.ops.atomc_triton.*`: atomc ops implemented with atomc's Triton kernels (CUDA and ROCm).

Same schemas as the atomc ops, so lowering only swaps a node's target. Imported (and so defined)
on first use by the kernel registry, through atomc/kernels/binding.py (the atomc op's schema, and
torch.library.Library rather than @custom_op for its cheaper dispatch).

The eager model's `atomc::attention` gets the Triton body as its CUDA kernel here too, so an
eager forward on a GPU runs the same attention as a lowered graph (the op contract itself never
imports a kernel).
"""

from __future__ import annotations

import torch

from atomc.forward_context import layer_cache, layer_kv_scales
from atomc.kernels import triton as tk
from atomc.kernels.binding import bind_as_atomc, named_args
from atomc.kernels.triton.moe_quant import fused_moe_quant
from atomc.ops.attention import attention_without_cache
from atomc.ops.mla import mla_without_cache
from atomc.ops.moe_quant import SHUFFLED_FORMATS


def custom(name: str, mutates=()):
    """Define `atomc_triton::<name>` with the decorated body and atomc::<name>'s own schema
    (atomc/kernels/binding.py), `mutates` checked against the op's."""
    return bind_as_atomc("atomc_triton", name, mutates)


def attend(q, out, meta, k_cache, v_cache, scale, sliding_window, sinks, kv_scales):
    """`kv_scales`: the layer's (k_scale, v_scale) from the forward context (read for FP8 pages only)."""
    tk.paged_attention(
        q.contiguous(), k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale, meta.max_query_len, meta.max_seq_len, meta.num_seqs, sliding_window=sliding_window,
        sinks=sinks, kv_scales=kv_scales,
    )  # fmt: skip


@custom("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return tk.rms_norm(x.contiguous(), weight, eps)


@custom("fused_add_rms_norm")
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return tk.fused_add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)


@custom("silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return tk.silu_and_mul(x.contiguous())


@custom("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return tk.linear(x, weight, bias)


@custom("rope")
def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return tk.rope(positions, unit_stride(q), unit_stride(k), cos_sin_cache, out=rotated_outputs(q, k))


def rotated_outputs(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New contiguous (q, k) for a functional RoPE op (its fake's `empty_like` of the qkv slices):
    the kernel reads the slices where they are and writes here, so they are never copied first."""
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k))


def rope_into_new(positions, q, k, v, cos_sin_cache, layer_idx, qk_norm):
    """The functional RoPE ops: the kernel reads q and k with their strides and writes new
    tensors. Writes the KV cache when the forward context has one for this layer, else only rotates."""
    out = rotated_outputs(q, k)
    q, k = unit_stride(q), unit_stride(k)
    cache = layer_cache(layer_idx)
    if cache is None:
        return tk.rope(positions, q, k, cos_sin_cache, qk_norm=qk_norm, out=out)
    meta, k_cache, v_cache = cache
    return tk.rope_and_write_kv(
        positions, q, k, unit_stride(v), cos_sin_cache, k_cache, v_cache, meta.slot_mapping, qk_norm=qk_norm,
        kv_scales=layer_kv_scales(layer_idx), out=out,
    )  # fmt: skip


@custom("rope_and_write_kv")
def rope_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    layer_idx: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_into_new(positions, q, k, v, cos_sin_cache, layer_idx, None)


@custom("qk_norm_rope_and_write_kv")
def qk_norm_rope_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    q_eps: float,
    k_weight: torch.Tensor,
    k_eps: float,
    cos_sin_cache: torch.Tensor,
    layer_idx: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    norm = (q_weight, q_eps, k_weight, k_eps)
    return rope_into_new(positions, q, k, v, cos_sin_cache, layer_idx, norm)


@custom("head_matmul")
def head_matmul(x: torch.Tensor, w: torch.Tensor, transpose_w: bool) -> torch.Tensor:
    return tk.head_matmul(x, w, transpose_w)


@custom("mla_latent_norm_rope")
def mla_latent_norm_rope(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tk.mla_latent_norm_rope(*args)  # atomc::mla_latent_norm_rope's arguments (it has no defaults)


@custom("paged_attention", mutates=("out",))
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    cache = layer_cache(layer_idx)
    if cache is None:
        return attention_without_cache(q, k, v, out, scale, sliding_window, sinks)
    attend(q, out, *cache, scale, sliding_window, sinks, layer_kv_scales(layer_idx))


@custom("attention", mutates=("out",))
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    cache = layer_cache(layer_idx)
    if cache is None:
        return attention_without_cache(q, k, v, out, scale, sliding_window, sinks)
    meta, k_cache, v_cache = cache
    scales = layer_kv_scales(layer_idx)
    tk.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, scales)
    attend(q, out, *cache, scale, sliding_window, sinks, scales)


@custom("moe")
def moe(*args) -> torch.Tensor:
    return tk.fused_moe(*args)  # atomc::moe's arguments as the dispatcher passes them (defaults left out)


@custom("moe_quant")
def moe_quant(*args) -> torch.Tensor:
    if named_args("moe_quant", args).weight_format in SHUFFLED_FORMATS:
        # AITER's layouts (laid out at load only where AITER runs; here a call it declined): the reference
        return torch.ops.atomc.moe_quant.default(*args)
    return fused_moe_quant(*args)  # atomc::moe_quant's arguments as the dispatcher passes them


@custom("mla_attention", mutates=("out",))
def mla_attention(
    q_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    out: torch.Tensor,
    layer_idx: int,
    scale: float,
) -> None:
    cache = layer_cache(layer_idx)
    if cache is None:
        return mla_without_cache(q_absorbed, q_pe, c_kv, k_pe, out, scale)
    meta, latent_cache, _ = cache  # the second tensor is a view of the latent's c_kv part
    scales = layer_kv_scales(layer_idx)  # FP8 pages: (the latent's one scale, the same tensor)
    kv_scale = None if scales is None else scales[0]
    tk.write_latent_cache(unit_stride(c_kv), unit_stride(k_pe), latent_cache, meta.slot_mapping, kv_scale)
    # any token/head strides will do (the model's q_absorbed is a transposed bmm output)
    tk.mla_attention(
        unit_stride(q_absorbed), unit_stride(q_pe), latent_cache, out, meta.query_start_loc, meta.seq_lens,
        meta.block_tables, scale, meta.max_query_len, meta.max_seq_len, meta.num_seqs, kv_scale=kv_scale,
    )  # fmt: skip


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# eager atomc::attention and atomc::mla_attention on a GPU run the Triton bodies (the references
# stay the CPU kernels), so an eager forward can be captured in a CUDA graph too
torch.library.register_kernel("atomc::attention", "cuda", attention)
torch.library.register_kernel("atomc::mla_attention", "cuda", mla_attention)
