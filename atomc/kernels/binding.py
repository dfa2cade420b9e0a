"""What every backend's op bindings share: a backend op is the atomc op's schema with a kernel body.

`bind_as_atomc(namespace, name)` defines `<namespace>::<name>` with the schema of `atomc::<name>`
itself (the contract lowering relies on: only a node's target changes), so a backend never spells
out a signature that could drift from the op's. A body that lists its arguments is checked against
that schema (a mismatch is refused at import); a body may take `*args` and pass them on instead.
Ops are defined through torch.library.Library rather than @custom_op: a call then costs about 2 us
of dispatch instead of about 9 (measured on the CPU), which adds up over the hundreds of op calls in
a step that runs without a CUDA graph.

`named_args` reads a `*args` body's arguments by name: the dispatcher leaves trailing arguments
that equal their defaults out, so it fills them in from the schema.

`fake_as_atomc` gives the backend op the atomc op's fake implementation (calling the atomc op on
fake tensors reaches its fake impl), so the shapes a backend op promises have one source of truth.
A binding whose outputs differ from the atomc op's only in dtype (AITER's FP8 quants write
float8_e4m3fnuz on MI300) passes `fake=`, a function of the atomc fake's outputs and the arguments.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable

import torch

# one library fragment per backend namespace; they must stay alive for the ops to stay defined
_LIBRARIES: dict[str, torch.library.Library] = {}


def fake_as_atomc(namespace: str, name: str) -> None:
    torch.library.register_fake(f"{namespace}::{name}")(
        lambda *args, **kwargs: getattr(torch.ops.atomc, name).default(*args, **kwargs)
    )


def atomc_schema(name: str) -> torch.FunctionSchema:
    return getattr(torch.ops.atomc, name).default._schema


def bind_as_atomc(
    namespace: str, name: str, mutates: tuple[str, ...] | None = None, fake: Callable | None = None
) -> Callable[[Callable], Callable]:
    """Decorator: define `<namespace>::<name>` with the decorated function as its body (on every
    device) and `atomc::<name>`'s schema, its arguments, defaults and mutations included. `mutates`,
    when a binding states it, must be the atomc op's mutated arguments. `fake(outputs, *args)`, when
    given, adjusts the atomc op's fake outputs (e.g. their dtype) for this backend."""

    def deco(fn: Callable) -> Callable:
        schema = atomc_schema(name)
        declared = str(schema).split("::", 1)[1]
        writes = tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
        if mutates is not None and tuple(mutates) != writes:
            said = tuple(mutates)
            raise TypeError(f"{namespace}::{name} is said to mutate {said}, but atomc::{name} mutates {writes}")
        if not any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(fn).parameters.values()):
            inferred = name + torch.library.infer_schema(fn, mutates_args=writes)
            if inferred != declared:
                raise TypeError(f"{namespace}::{name} is declared {inferred}, but atomc::{name} is {declared}")
        lib = _LIBRARIES.get(namespace)
        if lib is None:
            lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
        lib.define(declared)
        lib.impl(name, fn, "CompositeExplicitAutograd")
        if fake is None:
            fake_as_atomc(namespace, name)
        else:
            atomc_op = getattr(torch.ops.atomc, name).default
            torch.library.register_fake(f"{namespace}::{name}")(
                lambda *args, **kwargs: fake(atomc_op(*args, **kwargs), *args, **kwargs)
            )
        return fn

    return deco


@functools.cache
def _arguments(name: str) -> tuple[tuple[str, ...], tuple[object, ...]]:
    arguments = atomc_schema(name).arguments
    defaults = tuple(a.default_value if a.has_default_value() else None for a in arguments)
    return tuple(a.name for a in arguments), defaults


def named_args(name: str, args: tuple) -> types.SimpleNamespace:
    """`atomc::<name>`'s arguments by name, from the positional `args` a `*args` body receives (the
    dispatcher leaves out trailing ones left at their defaults: filled in here)."""
    names, defaults = _arguments(name)
    if len(args) > len(names):
        raise TypeError(f"atomc::{name} takes {len(names)} arguments, got {len(args)}")
    return types.SimpleNamespace(**dict(zip(names, (*args, *defaults[len(args) :]), strict=True)))
