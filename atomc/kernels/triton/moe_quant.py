"""`fused_moe_quant`: atomc::moe_quant on Triton: quantised experts dequantised in registers.

The routes of moe.py's `fused_experts` on the same kernels with the format as a constexpr
(moe_tiles.py): one token (MXFP4: up to moe_config.GEMV_MAX_TOKENS), the two GEMVs with the
weighted sum done in the down GEMV (the "fuse_combine" tile flag is not read: this route always
fuses; FP8 on moe_gemv.py's kernels, MXFP4 on its own, moe_mxfp4_gemv.py); few pairs,
moe_gemm.py's unsorted tensor-core kernels (at one token the down kernel may sum the experts
itself: moe.py's COMBINE_IN_DOWN_ONE_TOKEN); many pairs, the expert-sorted ones, then
`moe_combine_kernel`. Tiles come from moe_config.py with the
format as `weight_format` (its own tuned files, else its defaults); `block_k` counts input values,
for MXFP4 a multiple of 32 (whole scale groups).
"""

from __future__ import annotations

import torch
import triton

from atomc.kernels.triton import moe_config, pdl, tuned_files
from atomc.kernels.triton.moe import ACTIVATION_CODES, COMBINE_BLOCK_H, down_combine_args
from atomc.kernels.triton.moe_align import align_by_expert
from atomc.kernels.triton.moe_gemm import moe_combine_kernel, moe_down_kernel, moe_gate_up_kernel
from atomc.kernels.triton.moe_gemv import moe_down_combine_gemv_kernel, moe_gate_up_gemv_kernel
from atomc.kernels.triton.moe_mxfp4_gemv import mxfp4_down_combine_gemv_kernel, mxfp4_gate_up_gemv_kernel
from atomc.kernels.triton.moe_routing import route
from atomc.kernels.triton.moe_tiles import MXFP4_GROUP, WEIGHT_CODES
from atomc.kernels.triton.packed_f16 import e4m3_weight_x_top
from atomc.ops.moe import check_shared_experts
from atomc.ops.moe_quant import WEIGHT_FORMATS

FP8_FORMATS = ("fp8_channel", "fp8_block")


def _block_k(tile: dict, weight_format: str) -> int:
    """The tile's K step (input values); an MXFP4 step is whole 32-value scale groups."""
    block_k = tile["block_k"]
    if weight_format == "mxfp4" and block_k % MXFP4_GROUP:
        raise ValueError(f"fused_moe_quant: an MXFP4 tile's block_k ({block_k}) must be a multiple of 32")
    return block_k


def _check_shapes(x, w13, w13_scale, w2, w2_scale, weight_format: str) -> tuple[int, int, int]:
    """(experts, H, I) of quantised experts that fit x, else a ValueError."""
    t, h = x.shape
    e, two_i = w13.shape[:2]
    inter = two_i // 2
    if weight_format == "mxfp4":
        want = {"w13": (e, two_i, h // 2), "w13_scale": (e, two_i, h // 32),
                "w2": (e, h, inter // 2), "w2_scale": (e, h, inter // 32)}  # fmt: skip
    elif weight_format in FP8_FORMATS:
        cd = lambda a: -(-a // 128)  # noqa: E731
        block = weight_format == "fp8_block"
        want = {"w13": (e, two_i, h), "w13_scale": (e, cd(two_i), cd(h)) if block else (e, two_i),
                "w2": (e, h, inter), "w2_scale": (e, cd(h), cd(inter)) if block else (e, h)}  # fmt: skip
    else:
        raise ValueError(
            f"fused_moe_quant: weight format {weight_format!r} has no Triton kernel "
            f"(supported: {', '.join(WEIGHT_FORMATS)})"
        )
    got = {"w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale}
    if any(tuple(got[k].shape) != v for k, v in want.items()):
        shapes = ", ".join(f"{k} {tuple(t.shape)}" for k, t in got.items())
        raise ValueError(f"fused_moe_quant: x {tuple(x.shape)}, {shapes} are not {weight_format} experts of this width")
    return e, h, inter


def _packed_mxfp4_knob(tile: dict, x: torch.Tensor, k: int, w: torch.Tensor) -> dict:
    """The MXFP4 GEMV tile with the kernels' PACKED / ASM constexprs (under "packed") where the
    tile asks for `packed_f16` and the step can run: it reads int32 words, so the weights must be
    4-byte aligned (a row of K values is K / 2 bytes, and K is whole 32-value groups: rows are
    whole words); its FMAs are PTX on CUDA, emulated in the interpreter, and have no ROCm form
    (the fp32 step runs there)."""
    want = tile.get("packed_f16", False)
    cuda = x.is_cuda and torch.version.hip is None
    if not want or k % 8 or w.data_ptr() % 4 or (x.is_cuda and not cuda):
        return tile
    return {**tile, "packed": {"PACKED": True, "ASM": cuda}}


def _packed_fp8_knob(tile: dict, k: int, block_rows: bool = True) -> dict:
    """The FP8 GEMV tile with PACKED / X_TOP (under "packed") where it asks for `packed_f16`
    (moe_gemv.py's f16-pair loop: plain Triton, so every backend runs it). Block scales are folded
    into x, one row block a program: that needs `block_rows` (the program's rows in one 128-row
    block: block_n dividing 128, and for gate/up an intermediate size that is whole blocks, so the
    up rows start a block); a tile that cannot keeps the dequantising loop."""
    if not tile.get("packed_f16", False) or not block_rows:
        return tile
    return {**tile, "packed": {"PACKED": True, "X_TOP": e4m3_weight_x_top(k, tile["block_k"])}}


def _a8_knob(tile: dict, weight_format: str) -> dict:
    """{"A8": True} where an FP8 tile of the tensor-core routes asks for `a8` (activations quantised
    to e4m3 in the kernel, moe_gemm.py), else nothing. Block scales quantise each 128-value group
    with its own scale, so a step is exactly one group; an e4m3 dot takes K in 32s."""
    if not tile.get("a8", False):
        return {}
    if weight_format not in FP8_FORMATS:
        raise ValueError(f"fused_moe_quant: `a8` takes FP8 experts, not {weight_format}")
    if tile["block_k"] < 32 or (weight_format == "fp8_block" and tile["block_k"] != 128):
        raise ValueError(
            f"fused_moe_quant: an a8 tile steps 128 columns for block scales (>= 32 for per-row), got {tile['block_k']}"
        )
    return {"A8": True}


def _scale_strides(scale: torch.Tensor) -> tuple[int, int, int]:
    """(expert, row, column) strides of a scale tensor; column 0 for per-row scales."""
    return scale.stride(0), scale.stride(1), scale.stride(2) if scale.dim() == 3 else 0


def fused_experts_quant(
    x, weights, ids, w13, w13_scale, w2, w2_scale, w13_bias=None, w2_bias=None, expert_map=None,
    activation="silu", alpha=1.702, limit=7.0, weight_format: str = "mxfp4", config: dict | None = None,
    num_shared: int = 0,
) -> torch.Tensor:  # fmt: skip
    """`experts_reference` on the dequantised experts (atomc/ops/moe_quant.py's layouts), on the
    kernels: x [T, H], weights fp32 [T, k], ids int32 [T, k] (global) -> [T, H]. `config`
    overrides the tuned/default configuration; `num_shared` as moe.py's fused_experts takes it."""
    e_local, h, inter = _check_shapes(x, w13, w13_scale, w2, w2_scale, weight_format)
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"fused_moe_quant: activation {activation!r} (supported: {', '.join(ACTIVATION_CODES)})")
    t, k = x.shape[0], ids.shape[1]
    x = x.contiguous()
    w13, w2, w13_scale, w2_scale = w13.contiguous(), w2.contiguous(), w13_scale.contiguous(), w2_scale.contiguous()
    p = t * k
    local = ids.reshape(p).to(torch.int32)
    if expert_map is not None:
        local = expert_map.to(torch.int32)[local.long()]
    if config is None:
        dev = tuned_files.tile_device(x.device)
        config = moe_config.pick_config(
            t, e_local - num_shared, h, inter, k - num_shared, x.dtype, dev.name, weight_format=weight_format,
            family=dev.family, num_shared=num_shared,
        )  # fmt: skip
    out = torch.empty_like(x)
    if t == 0:
        return out
    mx = weight_format == "mxfp4"
    code = ACTIVATION_CODES[activation]
    act = x.new_empty(p, inter)
    weights = weights.float().contiguous()
    gu, dn = config["gate_up"], config["down"]
    b13 = w13_bias if w13_bias is not None else x
    b2 = w2_bias if w2_bias is not None else x
    sb13 = 0 if w13_bias is None else w13_bias.stride(0)
    sb2 = 0 if w2_bias is None else w2_bias.stride(0)
    s13, s2 = _scale_strides(w13_scale), _scale_strides(w2_scale)
    if config["path"] == "gemv":
        if not moe_config.fits("gemv", t, k, weight_format):
            raise ValueError(
                f"fused_moe_quant: the gemv route takes {moe_config.gemv_max_tokens(weight_format)} token(s) "
                f"with {weight_format} experts, got {t}"
            )
        if mx:  # scales indexed by (row, group): the group stride is 1 (contiguous); a few tokens
            gate_up, down = mxfp4_gate_up_gemv_kernel, mxfp4_down_combine_gemv_kernel
            s13, s2 = s13[:2], s2[:2]
            gu, dn = _packed_mxfp4_knob(gu, x, h, w13), _packed_mxfp4_knob(dn, x, inter, w2)
            fmt_gu, fmt_dn = dict(stride_xm=x.stride(0), TOPK=k), dict(stride_om=out.stride(0))
        else:
            gate_up, down = moe_gate_up_gemv_kernel, moe_down_combine_gemv_kernel
            fmt_gu = fmt_dn = {"WEIGHTS": WEIGHT_CODES[weight_format]}
            if weight_format == "fp8_channel":
                gu, dn = _packed_fp8_knob(gu, h), _packed_fp8_knob(dn, inter)
            else:
                gu = _packed_fp8_knob(gu, h, 128 % gu["block_n"] == 0 and inter % 128 == 0)
                dn = _packed_fp8_knob(dn, inter, 128 % dn["block_n"] == 0)
        gate_up[(t * k, triton.cdiv(inter, gu["block_n"]))](
            x, w13, w13_scale, b13, act, local,
            h, inter, w13.stride(0), w13.stride(1), *s13, sb13, act.stride(0),
            float(alpha), float(limit),
            ACT=code, HAS_BIAS=w13_bias is not None, **fmt_gu, BLOCK_N=gu["block_n"],
            BLOCK_K=_block_k(gu, weight_format), num_warps=gu["num_warps"], num_stages=gu["num_stages"],
            **pdl.launch(x), **gu.get("packed", {}),
        )  # fmt: skip
        down[(triton.cdiv(h, dn["block_n"]), t)](
            act, w2, w2_scale, b2, weights, local, out,
            h, inter, act.stride(0), w2.stride(0), w2.stride(1), *s2, sb2,
            TOPK=k, HAS_BIAS=w2_bias is not None, **fmt_dn, BLOCK_N=dn["block_n"],
            BLOCK_K=_block_k(dn, weight_format), num_warps=dn["num_warps"], num_stages=dn["num_stages"],
            **pdl.launch(x), **dn.get("packed", {}),
        )  # fmt: skip
        return out
    sorted_route = config["path"] == "sorted"
    if sorted_route:
        block_m = gu["block_m"]
        if dn.get("block_m", block_m) != block_m:
            raise ValueError("fused_moe_quant: both GEMMs of the sorted path share one block_m (one alignment)")
        sorted_ids, block_expert, num_padded = align_by_expert(local, e_local, block_m)
        row_groups = block_expert.numel()
    else:
        if p > moe_config.SMALL_PATH_MAX_PAIRS:
            raise ValueError(
                f"fused_moe_quant: the small path takes <= {moe_config.SMALL_PATH_MAX_PAIRS} pairs, got {p}"
            )
        block_m = max(16, triton.next_power_of_2(t))
        sorted_ids = block_expert = num_padded = local  # unused by the small route
        row_groups = p
    ieee = x.dtype == torch.float32
    slots = triton.next_power_of_2(k)
    route = (local, sorted_ids, block_expert, num_padded)
    y = x.new_empty(p, h)
    wcode = WEIGHT_CODES[weight_format]
    moe_gate_up_kernel[(row_groups, triton.cdiv(inter, gu["block_n"]))](
        x, w13, w13_scale, b13, act, *route,
        p, h, inter,
        x.stride(0), w13.stride(0), w13.stride(1), *s13, sb13, act.stride(0),
        float(alpha), float(limit),
        TOPK=k, ACT=code, HAS_BIAS=w13_bias is not None, ROUTE_SORTED=sorted_route, IEEE=ieee, WEIGHTS=wcode,
        BLOCK_M=block_m, BLOCK_N=gu["block_n"], BLOCK_K=_block_k(gu, weight_format), BLOCK_SLOTS=slots,
        num_warps=gu["num_warps"], num_stages=gu["num_stages"], **pdl.launch(x), **_a8_knob(gu, weight_format),
    )  # fmt: skip
    combine = down_combine_args(x, config["path"], h, dn["block_n"], weights, local, out)
    moe_down_kernel[(row_groups, triton.cdiv(h, dn["block_n"]))](
        act, w2, w2_scale, b2, y, *route,
        p, h, inter,
        act.stride(0), w2.stride(0), w2.stride(1), *s2, sb2, y.stride(0),
        TOPK=k, HAS_BIAS=w2_bias is not None, ROUTE_SORTED=sorted_route, IEEE=ieee, WEIGHTS=wcode,
        BLOCK_M=block_m, BLOCK_N=dn["block_n"], BLOCK_K=_block_k(dn, weight_format), BLOCK_SLOTS=slots,
        num_warps=dn["num_warps"], num_stages=dn["num_stages"], **pdl.launch(x), **_a8_knob(dn, weight_format),
        **combine,
    )  # fmt: skip
    if combine["COMBINE_LAST"]:
        return out
    block_h = min(COMBINE_BLOCK_H, triton.next_power_of_2(h))
    moe_combine_kernel[(t, triton.cdiv(h, block_h))](
        y, weights, local, out, h, y.stride(0), out.stride(0), TOPK=k, BLOCK_H=block_h, **pdl.launch(x),
    )  # fmt: skip
    return out


def fused_experts_mxfp4(*args, **kwargs) -> torch.Tensor:
    """`fused_experts_quant` with weight_format "mxfp4" (the benchmark's and tests' entry)."""
    return fused_experts_quant(*args, weight_format="mxfp4", **kwargs)


def fused_moe_quant(
    x, router_logits, w13, w13_scale, w2, w2_scale, w13_bias, w2_bias, expert_map, correction_bias, top_k: int,
    weight_format: str, scoring="softmax", renormalize=True, num_expert_group=0, topk_group=0,
    routed_scaling_factor=1.0, activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0, num_shared_experts=0,
) -> torch.Tensor:  # fmt: skip
    """`atomc::moe_quant` (same arguments): routing as `fused_moe` does it, then the quantised experts."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(
            f"fused_moe_quant: weight format {weight_format!r} has no Triton kernel "
            f"(supported: {', '.join(WEIGHT_FORMATS)})"
        )
    check_shared_experts(num_shared_experts, expert_map)
    weights, ids = route(
        router_logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group,
        routed_scaling_factor, num_shared_experts,
    )  # fmt: skip
    return fused_experts_quant(x, weights, ids, w13, w13_scale, w2, w2_scale, w13_bias, w2_bias, expert_map,
                               activation, swiglu_alpha, swiglu_limit, weight_format,
                               num_shared=num_shared_experts)  # fmt: skip
