"""One table: (atomc op, backend) -> the op a lowered graph calls.

Backends: "torch" (the atomc op itself: reference body, any device), "triton" (CUDA and ROCm),
"aiter" (ROCm, only when `import aiter` works). Each backend op has the atomc op's schema, so
lowering only swaps a node's target. Backend ops are defined lazily (their kernel modules import
triton/aiter); a process loading a lowered artifact must call `ensure_registered(platform)` first.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

import atomc.ops  # noqa: F401  (the atomc ops and their reference bodies)
from atomc.kv_spec import KVCacheSpec
from atomc.ops.fp8_fused import FUSED_QUANT_OPS

BACKENDS = ("torch", "triton", "aiter")
# preference order per platform; "torch" is always last so every op has an implementation
PLATFORM_BACKENDS = {"cpu": ("torch",), "cuda": ("triton", "torch"), "rocm": ("aiter", "triton", "torch")}

# ops lowering handles; each has a torch entry (itself)
OPS = (
    "attention",
    "paged_attention",
    "rope_and_write_kv",
    "qk_norm_rope_and_write_kv",
    "rope",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_mul",
    "silu_and_mul",
    "linear",
    "moe",
    "moe_quant",
    "mla_attention",
    "mla_latent_norm_rope",
    "head_matmul",
    "fp8_quant_static",
    "fp8_quant_dynamic",
    "fp8_gemm",
    "fp8_block_gemm",
    "fp8_gemm_shuffled",
    "fp8_block_gemm_shuffled",
    *FUSED_QUANT_OPS,
    "fp8_linear_dynamic",
    "all_reduce",
    "all_gather",
    "all_reduce_add_rms_norm",
)
# ops with a torch body only: every other backend falls back to it (silu_mul: Inductor fuses the
# separate gate/up itself). The FP8 ops' CUDA backends (Triton kernels and torch._scaled_mm, and the
# rule that picks one per call) are atomc/kernels/triton/fp8.py; on ROCm they lower to AITER
# (atomc/kernels/aiter/fp8.py), and without AITER to Triton, whose bodies run the references there.
# mla_latent_norm_rope and head_matmul have Triton kernels and no AITER ones: on ROCm they lower to Triton.
# The collectives (atomc/ops/collective.py) are torch.distributed's own on every platform. The
# all-reduce + add + RMSNorm (atomc/ops/all_reduce_norm.py) has a Triton entry (the collective, then
# the Triton add + norm; a one-shot kernel over symmetric memory on CUDA when asked for) and no
# AITER one: on ROCm it lowers to Triton.
TORCH_ONLY = ("silu_mul", "all_reduce", "all_gather")
# ops over AITER's pre-shuffled weight layout (atomc/ops/fp8_shuffled.py): the loader writes that
# layout only on ROCm with AITER, so only AITER and the torch reference (which unshuffles) run them
AITER_LAYOUT_OPS = ("fp8_gemm_shuffled", "fp8_block_gemm_shuffled")
# The one list of ops that read the forward context (KV cache, batch metadata): the graph is cut
# there (graphs/partition.py), in every backend namespace. tests/kernels/test_kernel_registry.py fails when
# an op reads the context and is missing here. rope_and_write_kv and qk_norm_rope_and_write_kv write
# the KV cache but declare no mutation; they are marked side-effectful below (see passes/README.md).
CONTEXT_OPS = ("attention", "paged_attention", "rope_and_write_kv", "qk_norm_rope_and_write_kv", "mla_attention")
# where each backend's ops live: torch.ops.<namespace>.*, defined by importing <module>
NAMESPACES = {"torch": "atomc", "triton": "atomc_triton", "aiter": "atomc_aiter"}
MODULES = {
    "torch": ("atomc.ops",),
    "triton": ("atomc.kernels.triton.ops", "atomc.kernels.triton.fp8", "atomc.kernels.triton.all_reduce_norm"),
    "aiter": (
        "atomc.kernels.aiter.ops",
        "atomc.kernels.aiter.attention",
        "atomc.kernels.aiter.moe",
        "atomc.kernels.aiter.moe_quant",
        "atomc.kernels.aiter.mla",
        "atomc.kernels.aiter.fp8",
    ),
}

# (op, backend) -> loader returning the op's overload in that backend's namespace
_LOADERS: dict[tuple[str, str], Callable[[], object]] = {}


def register(op: str, backend: str):
    def deco(loader):
        _LOADERS[(op, backend)] = loader
        return loader

    return deco


def entries() -> list[tuple[str, str]]:
    """Every (op, backend) pair the registry knows, available here or not."""
    return sorted(_LOADERS)


@functools.cache
def backend_available(backend: str) -> bool:
    if backend == "torch":
        return True
    if backend == "triton":
        from atomc.kernels.triton import TRITON_AVAILABLE

        return TRITON_AVAILABLE
    if backend == "aiter":
        from atomc.kernels.aiter import aiter_available

        return aiter_available()
    raise ValueError(f"unknown backend {backend!r} (valid: {', '.join(BACKENDS)})")


def lookup(op: str, backend: str):
    """The backend's overload for `op`, or None when the backend has no kernel for it."""
    loader = _LOADERS.get((op, backend))
    if loader is None:
        return None
    overload = loader()
    if op in CONTEXT_OPS:
        # an op that writes the KV cache through the context has an effect its schema does not show:
        # FX's dead-code elimination must keep it even if its outputs went unused
        torch.fx.node.has_side_effect(overload)
    return overload


def choose_backend(op: str, platform: str) -> str:
    """The first preferred backend on `platform` that implements `op` and can run here."""
    for backend in PLATFORM_BACKENDS[platform]:
        if (op, backend) in _LOADERS and backend_available(backend):
            return backend
    raise KeyError(f"no backend implements atomc::{op} on {platform}")


def choose(op: str, platform: str) -> tuple[str, object]:
    """(backend, overload) for `op` on `platform`: the first preferred backend that has it."""
    backend = choose_backend(op, platform)
    return backend, lookup(op, backend)


def chosen_modules(platform: str) -> list[str]:
    """The modules defining the backend ops `platform` lowers to (for the compile cache key)."""
    return sorted({m for op in OPS for m in MODULES[choose_backend(op, platform)]})


def ensure_registered(platform: str) -> list[str]:
    """Define every backend op `platform` may use (before loading an artifact that calls them)."""
    return [f"{op}:{choose(op, platform)[0]}" for op in OPS]


def splitting_op_names() -> list[str]:
    """Qualified names ("atomc::attention", "atomc_triton::paged_attention", ...) of the ops that read
    the forward context, in every backend namespace: the graph must be cut there."""
    return sorted(f"{NAMESPACES[b]}::{op}" for op, b in _LOADERS if op in CONTEXT_OPS)


def is_known(qualified: str) -> bool | None:
    """For 'ns::op': True if the registry lists it, False if it is in an atomc namespace but
    unlisted (an op nothing can classify), None if it is no atomc op at all."""
    ns, _, op = qualified.partition("::")
    if ns not in NAMESPACES.values():
        return None
    return (op, next(b for b, n in NAMESPACES.items() if n == ns)) in _LOADERS


# ---- torch: the atomc ops themselves ----
for _op in OPS:
    register(_op, "torch")(functools.partial(lambda name: getattr(torch.ops.atomc, name).default, _op))
for _op in CONTEXT_OPS:
    lookup(_op, "torch")  # the atomc ops are defined already: mark their effects now, before any pass


# ---- triton: torch.ops.atomc_triton.* (atomc/kernels/triton/ops.py, defined on first use) ----
@functools.cache
def _triton_ops():
    for module in MODULES["triton"]:
        importlib.import_module(module)
    return torch.ops.atomc_triton


for _op in OPS:
    if _op not in TORCH_ONLY and _op not in AITER_LAYOUT_OPS:
        register(_op, "triton")(functools.partial(lambda name: getattr(_triton_ops(), name).default, _op))


# ---- aiter: custom ops around AITER (ROCm only; untested on AMD hardware) ----
@functools.cache
def _aiter_ops():
    for module in MODULES["aiter"]:  # norms, activation, RoPE; attention and the KV cache; MoE; MLA; FP8
        importlib.import_module(module)
    importlib.import_module("atomc.kernels.aiter.attention").set_next_backend(_rocm_after_aiter)
    importlib.import_module("atomc.kernels.aiter.moe").set_next_backend(_rocm_moe_after_aiter)
    importlib.import_module("atomc.kernels.aiter.moe_quant").set_next_backend(_rocm_moe_quant_after_aiter)
    importlib.import_module("atomc.kernels.aiter.mla").set_next_backend(_rocm_mla_after_aiter)
    importlib.import_module("atomc.kernels.aiter.fp8").set_next_backend(_rocm_fp8_after_aiter)
    return torch.ops.atomc_aiter


def _after_aiter(op: str):
    """`op`'s overload on ROCm's first available backend after AITER (Triton, else torch)."""
    for backend in PLATFORM_BACKENDS["rocm"][1:]:
        if (op, backend) in _LOADERS and backend_available(backend):
            return lookup(op, backend)
    raise RuntimeError(f"no backend after aiter for atomc::{op}")  # torch is always there


def _rocm_after_aiter(q, k, v, out, layer_idx: int, scale: float, sliding_window: int, sinks=None) -> None:
    """atomc::paged_attention on ROCm's first available backend after AITER (Triton, else torch):
    what AITER cannot run (small pages for prefill, fp32, attention sinks)."""
    return _after_aiter("paged_attention")(q, k, v, out, layer_idx, scale, sliding_window, sinks)


def _rocm_moe_after_aiter(*args) -> torch.Tensor:
    """atomc::moe (its positional arguments) on ROCm's first available backend after AITER."""
    return _after_aiter("moe")(*args)


def _rocm_moe_quant_after_aiter(*args) -> torch.Tensor:
    """atomc::moe_quant on ROCm's first available backend after AITER: experts the loader did not lay
    out for AITER (Triton runs them), and the calls AITER declines."""
    return _after_aiter("moe_quant")(*args)


def _rocm_mla_after_aiter(*args) -> None:
    """atomc::mla_attention on ROCm's first available backend after AITER: what AITER's MLA kernels
    do not take (fp16/fp32, head counts or widths they are not built for, no cache)."""
    return _after_aiter("mla_attention")(*args)


def _rocm_fp8_after_aiter(op: str, *args) -> torch.Tensor:
    """atomc::fp8_gemm / fp8_block_gemm (and their `_shuffled` twins, whose next backend is the
    reference) on ROCm's first available backend after AITER: the calls its FP8 GEMMs do not take
    (fp32 outputs, blocks other than 128 x 128)."""
    return _after_aiter(op)(*args)


AITER_OPS = (
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rope",
    "rope_and_write_kv",
    "qk_norm_rope_and_write_kv",
    "attention",
    "paged_attention",
    "moe",
    "moe_quant",
    "mla_attention",
    "fp8_quant_static",
    "fp8_quant_dynamic",
    "fp8_gemm",
    "fp8_block_gemm",
    *AITER_LAYOUT_OPS,
    *FUSED_QUANT_OPS,
)
for _op in AITER_OPS:
    register(_op, "aiter")(functools.partial(lambda name: getattr(_aiter_ops(), name).default, _op))


# ---- KV-cache page layout ----
KV_LAYOUTS = ("NHD",)


def kv_cache_layout(platform: str, spec: KVCacheSpec) -> str:
    """Physical layout of a layer's KV pages on `platform`, as its attention backend reads them.

    Every backend reads NHD pages today ([num_blocks, block_size, num_kv_heads, head_dim]); one
    with its own layout (e.g. AITER's shuffled K for its asm decode kernel) answers here, and the
    allocator (atomc/runtime/kv_cache.py) follows."""
    if platform not in PLATFORM_BACKENDS:
        raise ValueError(f"unknown platform {platform!r} (valid: {', '.join(PLATFORM_BACKENDS)})")
    return "NHD"
