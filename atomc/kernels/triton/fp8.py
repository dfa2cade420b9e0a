"""`atomc_triton::fp8_*`: the FP8 ops on NVIDIA GPUs, and the rule that picks a kernel per call.

Registered in the GPU backend's namespace beside the Triton bindings, so lowering picks them on
CUDA like any other backend op, and as the atomc ops' CUDA kernels, so an eager model runs them
too. Which kernel runs is decided per call from the row count (the token dim is symbolic in the
graph), by the rule below. It is written here, in a module the lowering hashes into the compile
cache key, so changing it rebuilds the artifacts:

- `fp8_gemm`: one row (decode at batch 1, when GEMV_ONE_ROW): the Triton FP8 GEMV (fp8_gemv.py);
  2..TRITON_GEMM_MAX_ROWS rows: the Triton GEMM (fp8_gemm.py); more: torch._scaled_mm (cuBLASLt).
  [1] scales on both sides: tensorwise, at any row count. A row scale on either side (per-token x
  and/or per-channel weight): up to UNIT_SCALE_MAX_ROWS rows `scaled_mm_unit` (tensorwise with unit
  scales into fp32, then the Triton scale epilogue, fp8_epilogue.py: the row scales, the bias and
  one rounding), above it rowwise (`scaled_mm`). Where _scaled_mm cannot run (N or K not a multiple
  of 16; rowwise: an out dtype other than bf16) the Triton GEMM.
- `fp8_block_gemm`: one row: the Triton block GEMV; 2..CUBLAS_BLOCK_MIN_ROWS - 1 rows: the Triton
  block GEMM; more: torch._scaled_mm with DeepSeek's recipe (cuBLASLt: 1x128 activation groups x
  128x128 weight blocks; `scaled_mm_block`), and where it cannot run (not sm_90, a torch or cuBLAS
  without it, blocks other than 128x128, K not a multiple of 512, N not of 16) the Triton GEMM.
- `fp8_quant_*` and the fused norm / SiLU quants: Triton (fp8_quant.py).

GEMV_ONE_ROW, TRITON_GEMM_MAX_ROWS, UNIT_SCALE_MAX_ROWS and CUBLAS_BLOCK_MIN_ROWS are the rule's
settings: whether the GEMV beats _scaled_mm at one row, up to which M the Triton GEMM beats it, up to
which M tensorwise-plus-epilogue beats rowwise, and from which M cuBLAS's block GEMM beats the Triton
one, is what benchmarks/fp8_linear.py measures on the H200 (until then: the GEMV at one row,
_scaled_mm everywhere else, the unit-scale route up to 128 rows, cuBLAS's block GEMM from 128 rows).
The unit-scale route exists because on the H200 (torch 2.11) rowwise _scaled_mm took 1.25-2x the
time of tensorwise on Llama-3.1-8B's linears at 16 and 64 rows (benchmarks/fp8_linear.py); the
route itself has not run on a GPU yet, and its threshold is a first guess. None of these kernels
runs before sm_89 (no e4m3 there) or on ROCm: the reference bodies (atomc/ops/fp8.py, fp8_fused.py)
run there (ROCm lowers to AITER first: atomc/kernels/aiter/fp8.py). Under TRITON_INTERPRET=1 the
Triton kernels run on CPU tensors, which is how the tests check the bodies without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from atomc import compat
from atomc.kernels.triton import fp8_quant
from atomc.kernels.triton.activation import silu_and_mul as triton_silu_and_mul
from atomc.kernels.triton.fp8_epilogue import scale_epilogue
from atomc.kernels.triton.fp8_gemm import fp8_gemm as triton_fp8_gemm
from atomc.kernels.triton.fp8_gemv import fp8_gemv, w8a16_gemv
from atomc.kernels.triton.ops import custom
from atomc.ops import fp8 as ref
from atomc.ops import fp8_fused as fused_ref
from atomc.ops.norm import rms_norm_reference

# the choice rule (table above)
GEMV_ONE_ROW = True  # a one-row call runs the Triton FP8 GEMV
TRITON_GEMM_MAX_ROWS = 0  # fp8_gemm calls of 2..this many rows run the Triton GEMM, not _scaled_mm
# fp8_gemm calls with a row scale of 2..this many rows run scaled_mm_unit (tensorwise + the Triton
# epilogue), more run rowwise _scaled_mm. benchmarks/fp8_linear.py on an H100 (2026-12-06), a Llama
# layer's four GEMMs: 98 against 123 us at 16 rows, 105 against 118 at 64, 115 against 113 at 128
# (the epilogue's fp32 round trip grows with M x N: gate_up loses from 64 rows)
UNIT_SCALE_MAX_ROWS = 64
# fp8_block_gemm calls of this many rows or more run cuBLAS's block GEMM (scaled_mm_block), fewer the
# Triton one; a first guess until benchmarks/fp8_linear.py decides it (--dsv3-tokens at small M)
CUBLAS_BLOCK_MIN_ROWS = 128
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _scaled_mm_supported(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (8, 9)


def kernels_run_on(t: torch.Tensor) -> bool:
    """Whether the Triton FP8 kernels can run on t's device (sm_89+ CUDA, or the interpreter)."""
    if t.is_cuda:
        return _scaled_mm_supported(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return _INTERPRETED and t.device.type == "cpu"


def _scaled_mm_device_ok(xq: torch.Tensor) -> bool:
    """A CUDA device whose _scaled_mm takes e4m3 (sm_89+, not ROCm)."""
    return xq.is_cuda and _scaled_mm_supported(xq.device.index or 0)


def _scaled_mm_applies(xq: torch.Tensor, weight: torch.Tensor) -> bool:
    """_scaled_mm runs this call: such a device, and N and K multiples of 16."""
    n, k = weight.shape
    return _scaled_mm_device_ok(xq) and not (n % 16 or k % 16)


def scaled_mm(xq, x_scale, weight, weight_scale, bias, out_dtype):
    """torch._scaled_mm for [..., K] x [N, K], or None where it does not apply."""
    n, k = weight.shape
    if not _scaled_mm_applies(xq, weight):
        return None
    x2 = xq.reshape(-1, k)
    m = x2.shape[0]
    tensorwise = x_scale.numel() == 1 and weight_scale.numel() == 1
    if not tensorwise and out_dtype != torch.bfloat16:
        return None
    if tensorwise:
        sa, sb = x_scale.float().reshape(()), weight_scale.float().reshape(())
    else:
        sa = x_scale.float().reshape(-1, 1).expand(m, 1).contiguous()
        sb = weight_scale.float().reshape(1, -1).expand(1, n).contiguous()
    out = torch._scaled_mm(x2, weight.t(), sa, sb, out_dtype=out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out.reshape(*xq.shape[:-1], n)


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}  # per device: the fp32 1.0 scaled_mm_unit hands cuBLAS


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A 0-d fp32 one on `device`, made on the first eager call and kept. A CUDA graph capture that
    comes first (no eager warm-up) gets a fresh one that is not kept: made under capture, its fill
    runs only when the graph replays, so outside that graph its value is undefined."""
    one = _UNIT_SCALES.get(device)
    if one is None:
        one = torch.ones((), dtype=torch.float32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return one
        _UNIT_SCALES[device] = one
    return one


def scaled_mm_unit(xq, x_scale, weight, weight_scale, bias, out_dtype):
    """fp8_gemm with row scales through tensorwise torch._scaled_mm: unit scales and an fp32 output
    (the raw fp32-accumulated dot), then the Triton epilogue (fp8_epilogue.py) applies x_scale ([1]
    or one per row) and weight_scale ([1] or one per output row) in fp32, adds the bias and rounds
    once to out_dtype: rowwise _scaled_mm's math. None where _scaled_mm does not apply (not an
    sm_89+ CUDA device, N or K not a multiple of 16)."""
    n, k = weight.shape
    if not _scaled_mm_applies(xq, weight):
        return None
    x2 = xq.reshape(-1, k)
    one = _unit_scale(xq.device)
    acc = torch._scaled_mm(x2, weight.t(), one, one, out_dtype=torch.float32)
    out = scale_epilogue(acc, x_scale, weight_scale, bias, out_dtype)
    return out.reshape(*xq.shape[:-1], n)


def _blockwise_mm(xq, x_scale, weight, weight_scale, out_dtype):
    """torch._scaled_mm with DeepSeek's recipe: xq [M, K] x weight [N, K] -> [M, N], x_scale
    [M, K/128] fp32, weight_scale [ceil(N/128), K/128] fp32, K a multiple of 512.

    Layouts (torch's checks in aten/src/ATen/native/cuda/ScaledBlas.cpp, get_joint_scaling and
    is_blockwise_1x128 / 128x128_scaling; its test_scaled_mm_block_wise_numerics; pytorch PR
    166752 for what cuBLAS reads): mat2 column-major (weight.t()); scale_a [M, K/128] with strides
    (1, M), M-major; scale_b [K/128, N/128] with strides (1, L), the weight's row-major scales
    transposed, where cuBLAS reads L as K/128 rounded up to 4. Torch versions differ in which L
    _scaled_mm checks (the unpadded one in some, the padded one in others), and with the unpadded
    one and K/128 not a multiple of 4 cuBLAS reads the wrong scales, silently; with K a multiple
    of 512 both are the same, so only that is taken. M is padded to a multiple of 4 (zero rows, cut
    off after) so that scale_a's leading dimension is 16 bytes too, as Transformer Engine pads its
    1x128 scales for cuBLAS (and M is never 1, where scale_a would also pass for a 128x128 scale,
    the pair torch tries first); it costs an activation copy only where M % 4 != 0."""
    m, k = xq.shape
    pad = -m % 4
    if xq.stride() != (k, 1):
        xq = xq.contiguous()
    if pad:  # through uint8: zero bytes are e4m3 +0
        xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(xq.dtype)
        x_scale = F.pad(x_scale, (0, 0, 0, pad), value=1.0)
    scale_a = x_scale.float().t().contiguous().t()
    scale_b = weight_scale.float().contiguous().t()
    out = torch._scaled_mm(xq, weight.t(), scale_a, scale_b, out_dtype=out_dtype)
    return out[:m] if pad else out


_CUBLAS_BLOCK_OUT = (torch.bfloat16, torch.float16, torch.float32)  # the dtypes cuBLAS writes here


@functools.cache
def _sm90(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] == 9


def _cublas_block_device_ok(xq: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """An sm_90 CUDA device whose torch runs the recipe right (atomc/compat.py tries it once)."""
    if not xq.is_cuda:
        return False
    index = xq.device.index if xq.device.index is not None else torch.cuda.current_device()
    return _sm90(index) and bool(compat.scaled_mm_blockwise_ok(index, out_dtype, _blockwise_mm))


def cublas_block_applies(xq, x_scale, weight, weight_scale, block_n, block_k, out_dtype) -> bool:
    """Whether scaled_mm_block runs this call (the benchmark asks it too)."""
    n, k = weight.shape
    fp8 = torch.float8_e4m3fn
    return (
        (block_n, block_k) == (128, 128)
        and k % 512 == 0
        and n % 16 == 0
        and xq.dtype == fp8
        and weight.dtype == fp8
        and weight.stride(-1) == 1
        and out_dtype in _CUBLAS_BLOCK_OUT
        and tuple(x_scale.shape) == (*xq.shape[:-1], k // 128)
        and tuple(weight_scale.shape) == (-(-n // 128), k // 128)
        and _cublas_block_device_ok(xq, out_dtype)
    )


def scaled_mm_block(xq, x_scale, weight, weight_scale, block_n, block_k, bias, out_dtype):
    """fp8_block_gemm through cuBLASLt (torch._scaled_mm, 1x128 x 128x128; `_blockwise_mm`), or None
    where it does not apply (cublas_block_applies)."""
    if not cublas_block_applies(xq, x_scale, weight, weight_scale, block_n, block_k, out_dtype):
        return None
    n, k = weight.shape
    x2 = xq.reshape(-1, k)
    out = _blockwise_mm(x2, x_scale.reshape(x2.shape[0], -1), weight, weight_scale, out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out.reshape(*xq.shape[:-1], n)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _per_tensor(x_scale: torch.Tensor | None, weight_scale: torch.Tensor | None) -> bool:
    return x_scale is not None and weight_scale is not None and x_scale.numel() == weight_scale.numel() == 1


def pick_gemm(
    xq: torch.Tensor,
    weight: torch.Tensor,
    block: bool,
    x_scale: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> str:
    """The choice rule: "gemv", "scaled_mm" / "scaled_mm_unit" / "scaled_mm_block" (tried first;
    "triton" if it declines), "triton" or "reference". fp8_gemm's scales pick between tensorwise /
    rowwise "scaled_mm" and "scaled_mm_unit" (a scale left out counts as a row scale). The benchmark
    and the tests call this to know what a call runs."""
    if weight.stride(-1) != 1 or not kernels_run_on(xq):
        return "reference"
    rows = _rows(xq)
    if GEMV_ONE_ROW and rows == 1:
        return "gemv"
    if xq.is_cuda and not block and rows > TRITON_GEMM_MAX_ROWS:
        if 2 <= rows <= UNIT_SCALE_MAX_ROWS and not _per_tensor(x_scale, weight_scale):
            return "scaled_mm_unit"
        return "scaled_mm"
    if xq.is_cuda and block and rows >= CUBLAS_BLOCK_MIN_ROWS:
        return "scaled_mm_block"
    return "triton"


@custom("fp8_gemm")
def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    route = pick_gemm(xq, weight, block=False, x_scale=x_scale, weight_scale=weight_scale)
    if route == "gemv":
        return fp8_gemv(xq, x_scale, weight, weight_scale, bias, out_dtype)
    cublas = {"scaled_mm_unit": scaled_mm_unit, "scaled_mm": scaled_mm}.get(route)
    if cublas is not None:
        out = cublas(xq, x_scale, weight, weight_scale, bias, out_dtype)
        if out is not None:
            return out
        route = "triton"  # _scaled_mm declined
    if route == "triton":
        return triton_fp8_gemm(xq, x_scale, weight, weight_scale, bias, out_dtype)
    return ref.fp8_gemm_reference(xq, x_scale, weight, weight_scale, bias, out_dtype)


@custom("fp8_block_gemm")
def fp8_block_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    route = pick_gemm(xq, weight, block=True)
    k = weight.shape[1]
    if route != "reference" and (k % block_k or block_k & (block_k - 1) or block_k < 16):
        route = "reference"  # the kernels step K in whole power-of-two groups
    if route == "scaled_mm_block":
        out = scaled_mm_block(xq, x_scale, weight, weight_scale, block_n, block_k, bias, out_dtype)
        if out is not None:
            return out
        route = "triton"
    block = (block_n, block_k)
    if route == "gemv":
        return fp8_gemv(xq, x_scale, weight, weight_scale, bias, out_dtype, block=block)
    if route == "triton":
        return triton_fp8_gemm(xq, x_scale, weight, weight_scale, bias, out_dtype, block=block)
    return ref.fp8_block_gemm_reference(xq, x_scale, weight, weight_scale, block_n, block_k, bias, out_dtype)


@custom("fp8_quant_static")
def fp8_quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if not kernels_run_on(x):
        return ref.to_fp8(x, scale.float())
    return fp8_quant.quant_static(x, scale)


@custom("fp8_quant_dynamic")
def fp8_quant_dynamic(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not kernels_run_on(x):
        return ref.fp8_quant_dynamic_reference(x, group_size)
    return fp8_quant.quant_dynamic(x, group_size)


# fp8_linear_dynamic (atomc/ops/fp8_linear.py) at one row: the activation as it is times the e4m3
# weights (W8A16), so the step has no quant kernel before the o and down projections. Timed and
# off: Llama-3.1-8B FP8 batch 1 ran 280.7 tok/s with it (and the attention switches, worth +0.5%
# in bf16) against 286.5 without, on an H100 (docs/performance.md section 20): its fp32 GEMV loop
# is slower than the packed-f16 one the W8A8 GEMV runs, more than the quant launch it saves. Off,
# the op runs the quant and fp8_gemm, the kernels the graph ran before the pass.
ONE_ROW_W8A16 = False


@custom("fp8_linear_dynamic")
def fp8_linear_dynamic(
    x: torch.Tensor,
    group_size: int,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    silu_and_mul: bool,
) -> torch.Tensor:
    """Where fp8_gemm's rule picks its GEMV (one row, ONE_ROW_W8A16): SiLU·mul in its own kernel
    when asked, then the W8A16 GEMV (fp8_gemv.w8a16_gemv). Else the quant (after SiLU·mul when
    asked) and fp8_gemm, each on its kernel or its reference as the unfused graph ran them."""
    if ONE_ROW_W8A16 and pick_gemm(x, weight, block=False) == "gemv":
        a = triton_silu_and_mul(x.contiguous()) if silu_and_mul else x
        return w8a16_gemv(a, _unit_scale(x.device), weight, weight_scale, bias, out_dtype)
    q, s = _silu(x, None, group_size) if silu_and_mul else fp8_quant_dynamic(x, group_size)
    return fp8_gemm(q, s, weight, weight_scale, bias, out_dtype)


# ---- the fused quants (atomc/ops/fp8_fused.py): kernel, else the reference composition ----


def _norm(x, residual, weight, eps, scale, group_size):
    out = fp8_quant.rms_norm_quant(x, residual, weight, eps, scale, group_size) if kernels_run_on(x) else None
    if out is not None:
        return out
    summed = x + residual if residual is not None else None
    normed = rms_norm_reference(summed if summed is not None else x, weight, eps)
    if scale is not None:
        return ref.to_fp8(normed, scale.float()), None, summed
    q, s = ref.fp8_quant_dynamic_reference(normed, group_size)
    return q, s, summed


def _silu(x, scale, group_size):
    out = fp8_quant.silu_and_mul_quant(x, scale, group_size) if kernels_run_on(x) else None
    if out is not None:
        return out
    y = fused_ref.silu_and_mul_reference(x)
    if scale is not None:
        return ref.to_fp8(y, scale.float()), None
    return ref.fp8_quant_dynamic_reference(y, group_size)


@custom("rms_norm_fp8_quant_dynamic")
def rms_norm_fp8_quant_dynamic(
    x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    q, s, _ = _norm(x, None, weight, eps, None, group_size)
    return q, s


@custom("rms_norm_fp8_quant_static")
def rms_norm_fp8_quant_static(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor) -> torch.Tensor:
    return _norm(x, None, weight, eps, scale, None)[0]


@custom("fused_add_rms_norm_fp8_quant_dynamic")
def fused_add_rms_norm_fp8_quant_dynamic(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _norm(x, residual, weight, eps, None, group_size)


@custom("fused_add_rms_norm_fp8_quant_static")
def fused_add_rms_norm_fp8_quant_static(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    q, _, summed = _norm(x, residual, weight, eps, scale, None)
    return q, summed


@custom("silu_and_mul_fp8_quant_dynamic")
def silu_and_mul_fp8_quant_dynamic(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _silu(x, None, group_size)


@custom("silu_and_mul_fp8_quant_static")
def silu_and_mul_fp8_quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _silu(x, scale, None)[0]


assert set(fused_ref.FUSED_QUANT_OPS) <= set(globals())  # every fused op has a binding here

# the eager model's FP8 ops on CUDA run the same kernels as a lowered graph
for _name in ("fp8_gemm", "fp8_block_gemm", "fp8_quant_static", "fp8_quant_dynamic"):
    torch.library.register_kernel(f"atomc::{_name}", "cuda", globals()[_name])
