"""atomc/kernels/binding.py: a backend op takes its atomc op's own schema (so a backend never spells
out a signature that could drift), a body that spells its arguments out is checked against it, and
a `*args` body reads its arguments by name with the defaults the dispatcher leaves out filled in."""

from __future__ import annotations

import fake_aiter
import pytest
import torch

from atomc.kernels import registry
from atomc.kernels.binding import bind_as_atomc, named_args


def test_every_aiter_op_has_its_atomc_ops_schema(monkeypatch):
    fake_aiter.install(monkeypatch)
    for op in registry.AITER_OPS:
        registry.lookup(op, "aiter")
        aiter_schema = str(getattr(torch.ops.atomc_aiter, op).default._schema)
        assert aiter_schema.replace("atomc_aiter::", "atomc::", 1) == str(getattr(torch.ops.atomc, op).default._schema)


def test_a_binding_that_strays_from_the_atomc_schema_is_refused():
    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # eps missing
        return x

    with pytest.raises(TypeError, match="atomc_test_binding::rms_norm is declared .* but atomc::rms_norm is"):
        bind_as_atomc("atomc_test_binding", "rms_norm")(rms_norm)

    def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_idx: int,
                        scale: float, sliding_window: int = 0, sinks: torch.Tensor | None = None) -> None:  # fmt: skip
        return None

    # the schema mutates `out`: a binding that says otherwise is refused
    with pytest.raises(TypeError, match="said to mutate"):
        bind_as_atomc("atomc_test_binding", "paged_attention", mutates=())(paged_attention)


def test_a_star_args_body_gets_the_schema_and_its_defaults():
    seen = []

    @bind_as_atomc("atomc_test_binding", "moe")
    def moe(*args):
        seen.append(named_args("moe", args))
        return args[0].clone()

    x = torch.randn(3, 4)
    torch.ops.atomc_test_binding.moe(x, x, x, x, None, None, None, None, 2, routed_scaling_factor=2.5)
    got = seen[0]
    assert got.top_k == 2 and got.routed_scaling_factor == 2.5  # given
    assert got.scoring == "softmax" and got.renormalize is True and got.num_expert_group == 0  # before it, passed
    assert got.activation == "silu" and got.swiglu_limit == 7.0  # after it, left out by the dispatcher: filled in
    assert got.num_shared_experts == 0
    with pytest.raises(TypeError, match="takes 18 arguments"):
        named_args("moe", tuple(range(19)))
