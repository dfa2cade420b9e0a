"""Read `model.aot` as a pickle before torch does, resolving no global in it, and refuse any global
it names that is not on atomc's allow-list.

This is defence in depth behind the entry's signature (signing.py), not a sandbox: the artifact
carries Python bytecode and Inductor's generated source, which run when it loads, and no pickle
check can make that safe. What the scan stops is the classic pickle gadget, a `__reduce__` that
calls `os.system`, `eval` or `importlib.import_module` while the file is read, in a file that got
past the signature (a leaked key, or a file someone loads by hand).

How: a dry run of the unpickler (C speed: an opcode walk in Python took 3.7 s on the default
model's 2.9 MB artifact, this takes a small fraction of the artifact's load) in which `find_class`
checks each GLOBAL, STACK_GLOBAL and INST against the allow-list and returns an inert stand-in
instead of the real object. Every call the pickle makes (REDUCE, NEWOBJ, BUILD, ...) then reaches
only stand-ins: nothing named by the file is imported or run. Two allowed callables are dangerous
with the wrong arguments (`getattr`, torch's `_unpickle_module` helpers): their stand-ins check the
arguments (a constant attribute that is itself on the list, a module under an allowed package).
Byte strings in the result that are themselves pickles (torch nests its AOTAutograd and Inductor
state that way, and unpickles them while loading) are scanned the same way.

The allow-list was read off artifacts of the tiny test families and the default model on CPU, and
off CUDA artifacts on an H200 (the Llama-3.1-8B shape and the tiny Llama; `audit()` found the
Triton launch state's names and bound methods, now listed). It is enforced for the platforms in
ENFORCED_PLATFORMS; on ROCm, whose artifacts have never been checked, the loader logs what the
scan would refuse and relies on the entry's signature (artifact.load_aot). `audit()` lists an
artifact's globals and every refusal; the fix for a refusal is an entry here (and a platform joins
ENFORCED_PLATFORMS once its real artifacts audit clean).
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
import sys
import types

# platforms whose artifacts a real build has been checked against the allow-list (tests/graphs)
ENFORCED_PLATFORMS = frozenset({"cpu", "cuda"})

# module -> names (qualnames; `Class.attr` for an attribute of a class) an artifact may name
ALLOWED: dict[str, frozenset[str]] = {
    module: frozenset(names.split())
    for module, names in {
        "builtins": "list dict set frozenset tuple slice range int float bool complex str bytes bytearray getattr",
        "collections": "OrderedDict defaultdict Counter deque",
        "copyreg": "_reconstructor",
        "functools": "partial",
        "inspect": "Signature Parameter _ParameterKind _empty",
        "traceback": "StackSummary FrameSummary",
        "torch": "Tensor device Size dtype float32 float16 bfloat16 float64 int64 int32 int16 int8 uint8 bool "
        "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz",
        "torch._C._dynamo.guards": "GlobalStateGuard",
        "torch._dynamo.aot_compile": " ".join(
            f"AOTCompilePickler._unpickle_{h}" for h in "cell module code bound_method nested_function".split()
        ),
        "torch._dynamo.aot_compile_types": "BundledAOTAutogradSerializableCallable "
        "BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts",
        "torch._dynamo.convert_frame": "GraphRuntimeEnv",
        "torch._dynamo.guards": "GuardsState GuardsStatePickler ShapeCodeParts _Missing "
        + " ".join(
            f"GuardsStatePickler._unpickle_{h}"
            for h in "module tensor traceable_wrapper_subclass python_module dispatch_key_set functorch_interpreter "
            "mapping_proxy dict_keys count_iter fsdp_module_type ddp_module c_op op bound_method sdp_backend cell "
            "named_tuple_type code nested_function".split()
        ),
        "torch._dynamo.output_graph": "OutputGraphGuardsState",
        "torch._dynamo.package": "SerializedCode SourceInfo SystemInfo InlinedSource",
        "torch._dynamo.source": "TensorProperty",
        "torch._functorch._aot_autograd.aot_autograd_result": "BundledAOTAutogradResult BundledCompiledForward "
        "BundledCompiledBackward",
        "torch._functorch._aot_autograd.runtime_wrappers": "AOTDedupeWrapper AOTSyntheticBaseWrapper "
        "RuntimeWrapper FakifiedOutWrapper FunctionalizedRngRuntimeWrapper EffectTokensWrapper",
        "torch._functorch._aot_autograd.schemas": "AOTConfig CacheableAOTConfig ViewAndMutationMeta InputAliasInfo "
        "OutputAliasInfo MutationType OutputType PlainTensorMeta SubclassCreationMeta MemoryFormatMeta",
        "torch._guards": "Guard GuardsSet GuardSource",
        "torch._inductor.cudagraph_utils": "BoxedDeviceIndex CudagraphCachedInfo PlaceholderInfo",
        "torch._inductor.decomposition": "select_decomp_table",
        "torch._inductor.metrics": "CachedMetricsDeltas",
        "torch._inductor.output_code": "CompiledFxGraph",
        # on CUDA: the Triton launch state torch pickles with each kernel (bound methods included)
        "torch._inductor.remote_cache": "RemoteCacheJsonSerde",
        "torch._inductor.runtime.autotune_cache": "AutotuneCache.save",
        "triton.runtime.jit": "JITFunction.create_binder",
        "torch._inductor.triton_bundler": "TritonBundle TritonBundleEntry TritonKernelArtifacts TritonKernelArtifact "
        "StaticallyLaunchedAutotuner TritonBundlerMetadata",
        "torch._inductor.utils": "BoxedBool GraphPartitionMap",
        "torch._subclasses.functional_tensor": "FunctionalTensor",
        "torch._utils": "_rebuild_meta_tensor_no_storage",
        "torch.fx.experimental.symbolic_shapes": "_ShapeGuardsHelper",
        "torch.nn.modules.container": "ModuleList ModuleDict Sequential",
        "torch.nn.parameter": "Parameter Buffer",
        "torch.torch_version": "TorchVersion",
        "torch.utils._ordered_set": "OrderedSet",
        "torch.utils._traceback": "CapturedTraceback",
    }.items()
}
# families of names, by pattern: Dynamo's guard kinds (GuardBuilder methods) and sources
ALLOWED_PATTERNS: dict[str, re.Pattern] = {
    "torch._dynamo.guards": re.compile(r"GuardBuilder\.[A-Z][A-Z0-9_]*\Z"),
    "torch._dynamo.source": re.compile(r"[A-Za-z]+Source\Z"),
}
# modules whose *classes* may be named (resolved, and checked to be a class): the model's own
# (type guards name them) and, on CUDA, the Triton launch state torch pickles with each kernel
_CLASS_MODULE_PREFIXES = ("models.", "atomc.")
_CLASS_MODULE_IMPORTABLE = ("torch._inductor.runtime.", "triton.")

# these may only be called with constant, checked arguments (each would otherwise reach anything)
_GETATTR = ("builtins", "getattr")
# callable -> index of its module-name argument: torch's helpers that import a module by name
_IMPORTERS = {
    ("torch._dynamo.aot_compile", "AOTCompilePickler._unpickle_module"): 0,
    ("torch._dynamo.aot_compile", "AOTCompilePickler._unpickle_nested_function"): 1,
    ("torch._dynamo.guards", "GuardsStatePickler._unpickle_python_module"): 0,
    ("torch._dynamo.guards", "GuardsStatePickler._unpickle_nested_function"): 1,
}
_IMPORTABLE_PREFIXES = ("torch", "models", "atomc", "math", "operator", "functools", "itertools", "collections")
# names under those that reach the operating system or arbitrary code (torch re-exports a few)
_IMPORT_REFUSED = re.compile(
    r"(^|\.)(os|sys|subprocess|importlib|builtins|shutil|socket|ctypes|pickle|marshal|runpy|code|codeop|pty|"
    r"multiprocessing|cpp_extension|hub|codecache|compile_worker)(\.|$)"
)


class UnsafePickle(ValueError):
    """The pickle names or calls something outside the allow-list (nothing of it was run)."""


def _allowed_global(module: str, name: str) -> bool:
    if name in ALLOWED.get(module, ()):
        return True
    pattern = ALLOWED_PATTERNS.get(module)
    if pattern is not None and pattern.match(name):
        return True
    if "." in name or not name.isidentifier():
        return False  # a dotted walk from a module is only admitted when listed
    if module.startswith(_CLASS_MODULE_PREFIXES):
        mod = sys.modules.get(module)  # the model is loaded before its artifact: never import here
    elif module.startswith(_CLASS_MODULE_IMPORTABLE):
        try:
            mod = importlib.import_module(module)  # torch's and Triton's own runtime modules
        except ImportError:
            return False
    else:
        return False
    return isinstance(getattr(mod, name, None), type)


def _importable(mod) -> bool:
    return (
        isinstance(mod, str)
        and any(mod == p or mod.startswith(p + ".") for p in _IMPORTABLE_PREFIXES)
        and not _IMPORT_REFUSED.search(mod)
    )


class _Stand:
    """An inert stand-in for whatever the pickle builds: accepts every call and every state, keeps
    nothing, runs nothing. (No `__new__` of its own: object's, in C, takes the arguments when
    `__init__` is overridden, which keeps the dry run near the C unpickler's speed.)"""

    _global: tuple[str, str] = ("", "")

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stand()

    def __setstate__(self, state):
        pass

    def append(self, item):
        pass

    def extend(self, items):
        pass

    def add(self, item):
        pass

    def __setitem__(self, key, value):
        pass


class _ModuleStand(_Stand):
    """A module one of torch's importer helpers would import (`_unpickle_module(name)`): remembers
    the name, so a `getattr` on it can be checked."""

    def __init__(self, name: str):
        self._module = name


def _describe(obj) -> str:
    """What a stand-in stands for, for a refusal's message: `an instance of module:Name`, a class."""
    if isinstance(obj, type) and issubclass(obj, _Stand):
        return "class {}:{}".format(*obj._global)
    if isinstance(obj, _ModuleStand):
        return f"module {obj._module}"
    if isinstance(obj, _Stand):
        where = "{}:{}".format(*type(obj)._global) if type(obj)._global[0] else "an object the pickle built"
        return f"an instance of {where}"
    return type(obj).__name__


class _Getattr(_Stand):
    """`getattr(cls, name)`: admitted only as `Class.name` on the allow-list (pickle's spelling of a
    classmethod); returns that attribute's stand-in."""

    def __new__(cls, *args, **kwargs):
        owner, attr = (args + (None, None))[:2]
        if len(args) != 2 or kwargs or not isinstance(attr, str):
            return _refuse(f"getattr({_describe(owner)}, {attr!r}) with a computed or missing attribute name")
        if isinstance(owner, _ModuleStand):
            return _module_attr(owner._module, attr)
        if isinstance(owner, _Stand) and type(owner)._global[0]:
            # a bound method of an object the pickle built (how pickle spells one): listed ones only
            module, qualname = type(owner)._global
            if f"{qualname}.{attr}" not in ALLOWED.get(module, ()):
                return _refuse(f"getattr({_describe(owner)}, {attr!r}): a method the allow-list does not admit")
            return _scanner_stand(module, f"{qualname}.{attr}")
        if not isinstance(owner, type) or not issubclass(owner, _Stand):
            return _refuse(f"getattr({_describe(owner)}, {attr!r}) on something other than an admitted class")
        return _scanner_stand(owner._global[0], f"{owner._global[1]}.{attr}")


def _module_attr(module: str, attr: str):
    """`getattr(module, attr)` on a module an importer helper admitted: admitted when the attribute
    is a submodule that is itself importable, or a class the allow-list admits by its own module and
    name (what a guard on a module's submodule or class pickles); never a function or another
    callable, which the real unpickle could then call."""
    name = f"{module}.{attr}"
    if attr.startswith("__") or _IMPORT_REFUSED.search(name):
        return _refuse(f"getattr(module {module}, {attr!r}), which the artifact allow-list does not admit")
    try:
        real = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return _refuse(f"getattr(module {module}, {attr!r}) names nothing there")
    if isinstance(real, types.ModuleType) and _importable(real.__name__):
        return _ModuleStand(real.__name__)
    if isinstance(real, type):
        return _scanner_stand(real.__module__, real.__qualname__)  # as if the pickle had named the class
    kind = type(real).__name__
    return _refuse(f"getattr(module {module}, {attr!r}) is a {kind}, which the artifact allow-list does not admit")


class _ImportModule(_Stand):
    """torch's helpers that import a module by name (`_unpickle_module`, `_unpickle_nested_function`):
    admitted for modules under the packages an artifact's code lives in."""

    _module_arg = 0

    def __new__(cls, *args, **kwargs):
        mod = args[cls._module_arg] if len(args) > cls._module_arg else kwargs.get("module")
        if not _importable(mod):
            return _refuse(f"imports module {mod!r} by name, which the artifact allow-list does not admit")
        return _ModuleStand(mod)


_SPECIAL = {
    _GETATTR: _Getattr,
    **{k: type("_ImportModule", (_ImportModule,), {"_module_arg": i}) for k, i in _IMPORTERS.items()},
}
_found: list[str] | None = None  # the scan in progress collects names here (one scan at a time per call)
_refusals: list[str] | None = None  # set by audit(): refusals are collected instead of raised


_stand_types: dict[tuple[str, str], type] = {}


def _refuse(message: str):
    """Refuse (the scan stops), or in an audit record the refusal and go on with an inert stand-in."""
    if _refusals is None:
        raise UnsafePickle(message)
    _refusals.append(message)
    return _Stand()


def _scanner_stand(module: str, name: str) -> type:
    if not _allowed_global(module, name):
        if _refusals is None:
            raise UnsafePickle(f"names {module}:{name}, which the artifact allow-list does not admit")
        _refusals.append(f"names {module}:{name}, which the artifact allow-list does not admit")
        return type(name.rpartition(".")[2] or "_", (_Stand,), {"_global": (module, name)})
    if _found is not None:
        _found.append(f"{module}:{name}")
    t = _stand_types.get((module, name))
    if t is None:
        base = _SPECIAL.get((module, name), _Stand)
        t = _stand_types[(module, name)] = type(name.rpartition(".")[2] or "_", (base,), {"_global": (module, name)})
    return t


class _DryRun(pickle.Unpickler):
    def find_class(self, module, name):
        return _scanner_stand(module, name)

    def persistent_load(self, pid):
        return _Stand()


_PICKLE_START = re.compile(rb"\x80[\x02-\x05]")
# the opcodes that put a byte string on the stack, and the width of their length field
_BYTES_HEADERS = ((0x43, 1), (0x42, 4), (0x8E, 8), (0x96, 8))  # SHORT_BINBYTES BINBYTES BINBYTES8 BYTEARRAY8


def _embedded_pickles(data: bytes) -> list[bytes]:
    """Byte strings inside `data` that start like a pickle (protocol 2 or later). A pickle stores a
    byte string right after its opcode and length, so a nested pickle at any depth is found by its
    start and the header before it, in one pass of the regex engine over the outer bytes (walking
    the unpickled objects for them took a second on the default model)."""
    out, n = [], len(data)
    for m in _PICKLE_START.finditer(data, 1):
        p = m.start()
        for op, width in _BYTES_HEADERS:
            h = p - 1 - width
            if h >= 0 and data[h] == op:
                length = int.from_bytes(data[h + 1 : p], "little")
                if 2 < length <= n - p:
                    out.append(data[p : p + length])
    return out


def _dry_run(blob: bytes, where: str, found: list[str], *, required: bool) -> None:
    global _found
    saved, _found = _found, found
    try:
        _DryRun(io.BytesIO(blob)).load()
    except UnsafePickle as e:
        raise UnsafePickle(f"{where}: {e}; it was not loaded") from None
    except Exception as e:
        if required:
            raise UnsafePickle(
                f"{where}: not a pickle atomc can check ({type(e).__name__}: {e}); it was not loaded"
            ) from None
        # bytes that only look like the start of a pickle: torch cannot unpickle them either
    finally:
        _found = saved


def scan(data: bytes, *, where: str = "model.aot") -> list[str]:
    """Every `module:qualname` the pickle and the pickles nested in it name, each checked;
    UnsafePickle at the first refusal."""
    found: list[str] = []
    _dry_run(data, where, found, required=True)
    for blob in _embedded_pickles(data):
        _dry_run(blob, f"{where} (nested pickle)", found, required=False)
    return found


def artifact_globals(data: bytes) -> list[str]:
    """Sorted distinct globals of an artifact (what the allow-list must cover), for maintenance."""
    return sorted(set(scan(data)))


def audit(data: bytes) -> tuple[list[str], list[str]]:
    """(globals, refusals): the whole artifact scanned, every refusal collected instead of stopping
    at the first; what a maintainer reads to extend the allow-list to a new platform's artifacts."""
    global _refusals
    saved, _refusals = _refusals, []
    try:
        found = scan(data)
        return sorted(set(found)), list(dict.fromkeys(_refusals))
    finally:
        _refusals = saved
