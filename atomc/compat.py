"""Version shims for torch's experimental compile APIs, in one place (atomc runs on torch 2.11 and 2.13).

Everything here touches private or "experimental" torch surface; when a torch bump breaks
something, this is the only file that should need to change.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)


def mark_unbacked(t: torch.Tensor, dim: int) -> None:
    """Unbacked, not mark_dynamic: mark_dynamic adds a size>=2 guard that rejects a batch of one."""
    from torch._dynamo.decorators import mark_unbacked as _mark

    _mark(t, dim)


@contextlib.contextmanager
def aot_compile_enabled() -> Iterator[None]:
    # torch 2.11 ships the flag off; 2.13 defaults it on
    cfg = torch._dynamo.config
    if hasattr(cfg, "enable_aot_compile"):
        with cfg.patch(enable_aot_compile=True):
            yield
    else:
        yield


@contextlib.contextmanager
def static_but_marked() -> Iterator[None]:
    """Only the dims we mark are dynamic. Automatic dynamic would otherwise turn weight shapes and
    float constants dynamic when a second model of other shapes compiles the same forward in one
    process (then aot_compile fails with TensorifyScalarRestartAnalysis)."""
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, assume_static_by_default=True):
        yield


def inductor_partition_options(splitting_ops: list[str]) -> dict[str, Any]:
    """Inductor config that cuts its output at our splitting ops (graph partition: the ops that read
    the forward context run between the compiled pieces)."""
    cfg = torch._inductor.config
    opts: dict[str, Any] = {}
    if hasattr(cfg, "graph_partition"):
        opts["graph_partition"] = True
    if hasattr(cfg, "custom_should_partition_ops"):
        opts["custom_should_partition_ops"] = list(splitting_ops)
    return opts


def register_inductor_fallbacks(gm: torch.fx.GraphModule) -> list[str]:
    """Give Inductor an explicit fallback for every custom op `gm` calls that has no lowering yet,
    made exactly as Inductor makes its implicit one (the op's layout-constraint tag, else the default
    for custom ops); returns the ops registered.

    Why: on meeting an op without a lowering, torch 2.11's `GraphLowering.call_function` builds its
    "Creating implicit fallback for" log line eagerly, whatever the log level: `str()` of every
    argument, and an IR node prints its inputs recursively, once per path (no memo). An op first
    met deep in the graph (the FP8 graph's plain `fused_add_rms_norm` is the final norm: it first
    appears after the last layer) prints the whole graph, exponentially many times in the layer
    count: an FP8 Llama-3.1-8B never finished lowering. Later torch formats the line lazily, so it
    costs the same there only with Inductor's INFO logs on. With the fallback registered first, that
    branch is never taken; the lowering is unchanged (the same fallback, the same constraint)."""
    from torch._decomp import get_decompositions
    from torch._inductor import config, lowering
    from torch._library.utils import get_layout_constraint_tag, is_builtin

    if not config.implicit_fallbacks:  # Inductor would refuse these ops: leave that error to it
        return []
    registered: list[str] = []
    for node in gm.graph.nodes:
        op = node.target
        if (
            node.op != "call_function"
            or not isinstance(op, torch._ops.OpOverload)
            or is_builtin(op)  # aten/prims: Inductor's own lowerings, decompositions and allow list
            or op in lowering.lowerings
            or hasattr(op, "_inductor_lowering_function")
            or get_decompositions([op])
        ):
            continue
        constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        lowering.make_fallback(op, layout_constraint=constraint)
        registered.append(str(op))
    return registered


def aot_compile(fn: Callable, args: tuple, backend: Callable) -> Any:
    """One Dynamo trace of `fn(*args)`; returns torch's AOTCompiledFunction (serializable)."""
    with aot_compile_enabled(), static_but_marked(), dtypes_pickled_in_guards():
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        return compiled.aot_compile((args, {}))


@contextlib.contextmanager
def dtypes_pickled_in_guards() -> Iterator[None]:
    """torch 2.13's guard-state pickler marks, by id, the plain attributes of the modules it skips as
    "missing" (a parallel linear's `params_dtype`, say) and then writes every later occurrence of
    that object as a placeholder: once a float input is in the guard state (a pipeline stage's
    hidden states, of the weights' dtype), its dtype comes back as the placeholder and the artifact
    cannot be loaded. A dtype names itself, so it is always pickled as the dtype."""
    try:
        from torch._dynamo.guards import GuardsStatePickler
    except ImportError:  # torch 2.11: no such pickler
        yield
        return
    original = GuardsStatePickler.reducer_override

    def reducer_override(self, obj):
        return NotImplemented if isinstance(obj, torch.dtype) else original(self, obj)

    GuardsStatePickler.reducer_override = reducer_override
    try:
        yield
    finally:
        GuardsStatePickler.reducer_override = original


def _backend_guards_only(entries) -> list[bool]:
    # keep only the backend check (a guard on older torch): everything else the cache key pins, and
    # tensor guards would reject inference-mode inputs and force a static re-trace
    return [getattr(e, "guard_type", "") == "BACKEND_MATCH" for e in entries]


def compile_unguarded(fn: Callable, backend: Callable, *args) -> Callable:
    """torch.compile for the fallback format, traced now on `args`: one graph for every input, never
    a recompile (no guards to fail)."""
    compiled = torch.compile(fn, fullgraph=True, backend=backend, options={"guard_filter_fn": _backend_guards_only})
    with static_but_marked(), torch.no_grad():
        compiled(*args)
    return compiled


def save_compiled_function(compiled: Any, path: str) -> None:
    with dtypes_pickled_in_guards():
        compiled.save_compiled_function(path)


def load_compiled_function(data: bytes) -> Callable:
    """Load an aot_fn artifact with Dynamo's guards off: the cache key already pins everything they
    would check, and their tensor guards reject inference-mode inputs (a dispatch-key mismatch)."""
    with aot_compile_enabled():
        fn = torch.compiler.load_compiled_function(io.BytesIO(data))
    if hasattr(fn, "disable_guard_check"):
        fn.disable_guard_check()
    return fn


def serializable_callable(compiled_fn: Callable) -> Any:
    """Make an Inductor result picklable by aot_compile. 2.13 wraps results that carry `serialize`
    itself (and would double-wrap ours); older torch needs the private wrapper from the backend."""
    from torch._dynamo import aot_compile as _aot
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    if isinstance(compiled_fn, BundledAOTAutogradSerializableCallable):
        return compiled_fn
    if 'hasattr(compiled_fn, "serialize")' in inspect.getsource(_aot.aot_compile_fullgraph):
        return compiled_fn
    return BundledAOTAutogradSerializableCallable(compiled_fn)


def standalone_compile(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    return torch._inductor.standalone_compile(gm, example_inputs, dynamic_shapes="from_graph", aot=True)


def load_standalone(path: str) -> Callable:
    from torch._inductor import CompiledArtifact

    return CompiledArtifact.load(path=path, format="binary")


def traced_files(gm: torch.fx.GraphModule) -> set[str]:
    """File names of the Python code Dynamo traced into `gm` (call inside the backend). Two sources,
    for torch versions that lack one: the tracing context's list of inlined code objects (every
    function Dynamo stepped through, including those that produced no node), and the file names in
    each node's recorded stack trace."""
    import re

    from torch._guards import TracingContext

    files: set[str] = set()
    tc = TracingContext.try_get()
    for code in getattr(tc, "traced_code", None) or []:
        files.add(code.co_filename)
    for node in gm.graph.nodes:
        files.update(re.findall(r'File "([^"]+)"', node.meta.get("stack_trace") or ""))
    return files


# What loading an artifact imports (torch.compiler.load_compiled_function, then the generated code's
# own imports): about 4 s on the CPU box, most of a warm artifact load. Importing them first, apart,
# lets the start-up log tell them from the load and lets the CUDA context be made meanwhile.
COMPILER_MODULES = (
    "torch._inductor.codecache",
    "torch._dynamo.aot_compile",
    "torch._inductor.output_code",
    "torch._inductor.async_compile",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.select_algorithm",
)
GPU_COMPILER_MODULES = ("torch._inductor.runtime.triton_heuristics",)  # what CUDA kernels' code adds


def import_compiler(gpu: bool) -> None:
    """Import the modules an artifact load (or a compile) needs; a name missing in this torch is
    skipped (the load imports what it really needs itself)."""
    import importlib

    for name in COMPILER_MODULES + (GPU_COMPILER_MODULES if gpu else ()):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def torch_key() -> str:
    """Digest of torch's own sources; torch itself refuses artifacts built under another one."""
    try:
        from torch._inductor.codecache import torch_key as _tk

        return _tk().hex()
    except Exception:  # moved between versions: the version string still enters the key
        return ""


@contextlib.contextmanager
def inductor_cache_dir(path: str) -> Iterator[None]:
    """Pin Inductor's on-disk cache under atomc's cache, so CPU kernels built at compile time survive
    (a cold Inductor cache makes a warm load rebuild every C++ kernel)."""
    from torch._inductor.utils import clear_caches

    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    clear_caches()
    try:
        yield
    finally:
        clear_caches()
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


def compile_counters() -> dict[str, int]:
    """Dynamo graphs captured and AOTAutograd/Inductor compiles so far (a hit leaves all unchanged).
    Inductor's own counters are not used: a cache hit replays the pattern-matcher counts it saved."""
    from torch._dynamo.utils import counters

    return {
        "dynamo_calls_captured": int(counters["stats"]["calls_captured"]),
        "dynamo_unique_graphs": int(counters["stats"]["unique_graphs"]),
        "aot_autograd_compiles": int(counters["aot_autograd"]["total"]),
    }


# ---- torch._scaled_mm's DeepSeek recipe (1x128 activation groups x 128x128 weight blocks) ----

_BLOCKWISE: dict[tuple[int, torch.dtype], str] = {}  # (device index, out dtype) -> "" (runs right) or why not


def scaled_mm_blockwise_ok(device_index: int, out_dtype: torch.dtype, mm: Callable) -> bool | None:
    """Whether torch._scaled_mm runs DeepSeek's recipe on this CUDA device, with this output dtype,
    and gets it right. It needs torch 2.9+ built with cuBLASLt 12.9+ and an sm_90 GPU, and torch
    versions differ in the scale layouts they accept, so rather than a version check `mm` (the
    caller's call: (xq [M, K], x_scale [M, K/128], weight [N, K], weight_scale [N/128, K/128],
    out_dtype) -> [M, N]) is tried once per device and dtype on a small problem (3 rows, so the row
    padding runs too; a random power of two per scale, so a scale read from the wrong place shows)
    and checked against fp32. The answer is cached; None while a CUDA graph is being captured and
    it has not been tried yet (the check reads a result back), so the caller declines for now."""
    key = (device_index, out_dtype)
    if key not in _BLOCKWISE:
        if torch.cuda.is_current_stream_capturing():
            return None
        _BLOCKWISE[key] = _try_blockwise(torch.device("cuda", device_index), out_dtype, mm)
        if _BLOCKWISE[key]:
            log.info("torch._scaled_mm blockwise (1x128 x 128x128) not used on cuda:%d for %s: %s",
                     device_index, out_dtype, _BLOCKWISE[key])  # fmt: skip
    return not _BLOCKWISE[key]


def scaled_mm_blockwise_why(device_index: int, out_dtype: torch.dtype) -> str:
    """Why scaled_mm_blockwise_ok said no ("" where it said yes or has not been asked)."""
    return _BLOCKWISE.get((device_index, out_dtype), "")


def _try_blockwise(dev: torch.device, out_dtype: torch.dtype, mm: Callable) -> str:
    """Empty where `mm` computes a small block-scaled product right on `dev`, else why not."""
    m, n, k = 3, 256, 512
    g = torch.Generator(dev).manual_seed(0)
    xq = (torch.randn(m, k, device=dev, generator=g) * 32).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device=dev, generator=g) * 32).to(torch.float8_e4m3fn)
    xs = 2.0 ** torch.randint(-4, 5, (m, k // 128), device=dev, generator=g).float()
    ws = 2.0 ** torch.randint(-4, 5, (n // 128, k // 128), device=dev, generator=g).float()
    x = xq.float() * xs.repeat_interleave(128, 1)
    want = x @ (w.float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)).t()
    try:
        got = mm(xq, xs, w, ws, out_dtype)
    except Exception as exc:  # an older torch or cuBLAS, another GPU: torch raises before any launch
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    err = ((got.float() - want).norm() / want.norm()).item()
    return "" if err < 2e-2 else f"wrong result (relative error {err:.3g}): a scale layout read otherwise"


# ---- Triton's compile hooks ----


def triton_jit_hooks() -> Any | None:
    """The object whose `jit_cache_hook` (before a kernel variant compiles, or loads from Triton's
    disk cache) and `jit_post_compile_hook` (after) the JIT calls: `triton.knobs.runtime` (Triton
    3.4 on); None without Triton or those hooks."""
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    ok = runtime is not None and hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook")
    return runtime if ok else None
