"""One table: (atomc op, backend) -> the op a lowered graph calls.

Backends: "torch" (the atomc op itself: reference body, any device), "triton" (CUDA and ROCm),
"aiter" (ROCm, only when `import aiter` works). Each backend op has the atomc op's schema, so
lowering only swaps a node's target. Backend ops are defined lazily (their kernel modules import
triton/aiter); a process loading a lowered artifact must call `ensure_registered(platform)` first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

import atomc.ops  # noqa: F401  (the atomc ops and their reference bodies)

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
)
# ops that read the forward context (KV cache, batch metadata): graph cut points for CUDA graphs
CONTEXT_OPS = ("attention", "paged_attention", "rope_and_write_kv", "qk_norm_rope_and_write_kv")

# (op, backend) -> loader returning the op's overload in that backend's namespace
_LOADERS: dict[tuple[str, str], Callable[[], object]] = {}


def register(op: str, backend: str):
    def deco(loader):
        _LOADERS[(op, backend)] = loader
        return loader

    return deco


def platform_of(device: str) -> str:
    """The platform whose backends serve `device`: cpu, cuda, or rocm (a ROCm torch calls its GPUs cuda)."""
    if not str(device).startswith("cuda"):
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"


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
    return None if loader is None else loader()


def choose(op: str, platform: str) -> tuple[str, object]:
    """(backend, overload) for `op` on `platform`: the first preferred backend that has it."""
    for backend in PLATFORM_BACKENDS[platform]:
        if (op, backend) in _LOADERS and backend_available(backend):
            return backend, lookup(op, backend)
    raise KeyError(f"no backend implements atomc::{op} on {platform}")


def ensure_registered(platform: str) -> list[str]:
    """Define every backend op `platform` may use (before loading an artifact that calls them)."""
    return [f"{op}:{choose(op, platform)[0]}" for op in OPS]


def splitting_op_names() -> list[str]:
    """Qualified names ("atomc::attention", "atomc_triton::paged_attention", ...) of the ops that read
    the forward context, in every backend namespace: the graph must be cut there."""
    ns = {"torch": "atomc", "triton": "atomc_triton", "aiter": "atomc_aiter"}
    return sorted(f"{ns[b]}::{op}" for op, b in _LOADERS if op in CONTEXT_OPS)


# ---- torch: the atomc ops themselves ----
for _op in OPS:
    register(_op, "torch")(functools.partial(lambda name: getattr(torch.ops.atomc, name).default, _op))


# ---- triton: custom ops around atomc/kernels/triton (defined on first use) ----
# Defined with torch.library.Library rather than @custom_op: a call then costs about 2 us of
# dispatch instead of about 9 (measured on the CPU), which adds up over ~350 calls in every step
# that runs without a CUDA graph. The library object must stay alive for the ops to stay defined.
_TRITON_LIB: list[torch.library.Library] = []


@functools.cache
def _triton_ops():
    _define_triton_ops()
    return torch.ops.atomc_triton


for _op in OPS:
    if _op != "silu_mul":  # separate gate/up: Inductor fuses silu*mul itself; keep the reference
        register(_op, "triton")(functools.partial(lambda name: getattr(_triton_ops(), name).default, _op))


def same_fake(qualname: str, atomc_name: str) -> None:
    """A backend op's fake impl is the atomc op's: calling it on fake tensors reaches its fake."""
    torch.library.register_fake(qualname)(
        lambda *args, **kwargs: getattr(torch.ops.atomc, atomc_name).default(*args, **kwargs)
    )


def _define_triton_ops() -> None:
    from atomc.kernels import triton as tk
    from atomc.ops.attention import causal_attention
    from atomc.runtime.forward_context import layer_cache

    lib = torch.library.Library("atomc_triton", "DEF")
    _TRITON_LIB.append(lib)

    def custom(name: str, mutates=()):
        def deco(fn):
            lib.define(name + torch.library.infer_schema(fn, mutates_args=mutates))
            lib.impl(name, fn, "CompositeExplicitAutograd")
            same_fake(f"atomc_triton::{name}", name)
            return fn

        return deco

    def attend(q, out, meta, k_cache, v_cache, scale):
        tk.paged_attention(
            q.contiguous(), k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            scale, meta.max_query_len, meta.max_seq_len, meta.num_seqs,
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
        # the kernel rotates in place; the op is functional, so it rotates copies
        return tk.rope(positions, q.contiguous().clone(), k.contiguous().clone(), cos_sin_cache)

    def rope_on_copies(positions, q, k, v, cos_sin_cache, layer_idx, qk_norm):
        """The kernels work in place; the ops return new tensors. Writes the KV cache when the
        forward context has one for this layer, else only rotates."""
        q, k = q.contiguous().clone(), k.contiguous().clone()
        cache = layer_cache(layer_idx)
        if cache is None:
            return tk.rope(positions, q, k, cos_sin_cache, qk_norm=qk_norm)
        meta, k_cache, v_cache = cache
        return tk.rope_and_write_kv(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, meta.slot_mapping, qk_norm=qk_norm
        )

    @custom("rope_and_write_kv")
    def rope_and_write_kv(
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        layer_idx: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_on_copies(positions, q, k, v, cos_sin_cache, layer_idx, None)

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
        return rope_on_copies(positions, q, k, v, cos_sin_cache, layer_idx, norm)

    @custom("paged_attention", mutates=("out",))
    def paged_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_idx: int, scale: float
    ) -> None:
        cache = layer_cache(layer_idx)
        if cache is None:
            out.copy_(causal_attention(q, k, v, scale))
            return
        attend(q, out, *cache, scale)

    @custom("attention", mutates=("out",))
    def attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_idx: int, scale: float
    ) -> None:
        cache = layer_cache(layer_idx)
        if cache is None:
            out.copy_(causal_attention(q, k, v, scale))
            return
        meta, k_cache, v_cache = cache
        tk.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        attend(q, out, *cache, scale)


# ---- aiter: custom ops around AITER (ROCm only; untested on AMD hardware) ----
@functools.cache
def _aiter_ops():
    from atomc.kernels.aiter import ops  # noqa: F401  (defines torch.ops.atomc_aiter.*)

    return torch.ops.atomc_aiter


for _op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rope", "rope_and_write_kv"):
    register(_op, "aiter")(functools.partial(lambda name: getattr(_aiter_ops(), name).default, _op))
