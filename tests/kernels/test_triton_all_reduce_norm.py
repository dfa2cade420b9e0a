"""atomc_triton::all_reduce_add_rms_norm's kernels on CPU through the Triton interpreter.

The one-shot kernel reads every rank's partial sum from a buffer: on a GPU those are the peers'
symmetric-memory buffers, here plain tensors stand in for them, so what is checked is the
arithmetic (the sum in rank order, the residual add, the norm, the dtype rounding), never the
workspace or the barriers (which have not run anywhere: atomc/kernels/triton/all_reduce_norm.py).
The default path (the collective, then the Triton add + norm) runs in a world of one gloo rank.
"""

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import

pytest.importorskip("triton")
import torch.distributed as dist  # noqa: E402

from atomc.kernels.triton import all_reduce_norm as backend  # noqa: E402
from atomc.ops import collective  # noqa: E402
from atomc.ops.norm import fused_add_rms_norm  # noqa: E402

EPS = 1e-6


def _case(world: int, rows: int, n: int, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(rows, n, generator=g).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, n, generator=g).to(dtype)
    weight = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype)
    return parts, residual, weight


def _reference(parts, residual, weight):
    """What the all-reduce then the add + norm give: the sum in fp32, rounded to the dtype once."""
    reduced = torch.stack([p.float() for p in parts]).sum(0).to(residual.dtype)
    return fused_add_rms_norm(reduced, residual, weight, EPS)


@pytest.mark.parametrize("world, rows, n", [(2, 5, 64), (3, 1, 48), (8, 4, 96), (1, 3, 32)])
def test_one_shot_kernel_matches_the_reference(world, rows, n):
    parts, residual, weight = _case(world, rows, n)
    normed, summed = backend.one_shot_rows(parts, residual, weight, EPS)
    want_normed, want_summed = _reference(parts, residual, weight)
    torch.testing.assert_close(summed, want_summed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(normed, want_normed, atol=1e-5, rtol=1e-5)


def test_one_shot_kernel_in_bf16():
    """bf16 in, bf16 out, within two bf16 steps of the reference: the interpreter's bf16 casts do not
    round as torch's do (the add + norm kernel of rmsnorm.py differs from torch the same way here),
    so bit equality is for a GPU to check."""
    parts, residual, weight = _case(4, 6, 128, torch.bfloat16, seed=1)
    normed, summed = backend.one_shot_rows(parts, residual, weight, EPS)
    want_normed, want_summed = _reference(parts, residual, weight)
    assert summed.dtype == normed.dtype == torch.bfloat16
    step = 2**-6  # two steps of bf16's 8-bit mantissa, relative
    torch.testing.assert_close(summed.float(), want_summed.float(), atol=step, rtol=step)
    torch.testing.assert_close(normed.float(), want_normed.float(), atol=4 * step, rtol=step)


def test_one_shot_kernel_reads_rank_order_and_strided_rows():
    """Rows of a wider buffer (a workspace view is a prefix of the peer's buffer, any stride works),
    and every rank's part counted once: dropping one changes the answer."""
    parts, residual, weight = _case(3, 4, 40)
    wide = [torch.zeros(4, 64) for _ in parts]
    for w, p in zip(wide, parts, strict=True):
        w[:, :40] = p
    got = backend.one_shot_rows([w[:, :40] for w in wide], residual, weight, EPS)
    torch.testing.assert_close(got[1], _reference(parts, residual, weight)[1], atol=1e-5, rtol=1e-5)
    two = backend.one_shot_rows(parts[:2], residual, weight, EPS)[1]
    assert not torch.allclose(two, got[1])
    with pytest.raises(ValueError, match="1 to 8"):
        backend.one_shot_rows(parts * 3, residual, weight, EPS)
    empty = torch.zeros(0, 40)
    assert backend.one_shot_rows([empty, empty], empty, weight, EPS)[0].shape == (0, 40)


def test_the_binding_on_cpu_takes_the_collective_path(tmp_path, monkeypatch):
    """A CPU tensor never takes the one-shot path (even when asked for); the collective then the
    Triton add + norm give the reference's numbers."""
    monkeypatch.setattr(backend, "_one_shot_enabled", True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'one'}", rank=0, world_size=1)
    collective.set_group("tp", None)
    try:
        (x,), residual, weight = _case(1, 5, 64)
        assert backend._workspace(x, "tp") is None
        got = torch.ops.atomc_triton.all_reduce_add_rms_norm(x, residual, weight, EPS, "tp")
        want = torch.ops.atomc.all_reduce_add_rms_norm(x, residual, weight, EPS, "tp")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        collective.clear_groups()
        dist.destroy_process_group()
