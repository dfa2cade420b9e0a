"""The Triton kernel of atomc::mla_latent_norm_rope vs the op's reference, through the Triton
interpreter (fp32 and fp16), on inputs laid out as DeepSeek's layer hands them over: q_pe a slice of
the per-head q, c_kv and k_pe the two parts of one projection."""

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import; the GPU test is below

pytest.importorskip("triton")
from mla_latent_cases import layer_inputs  # noqa: E402

from atomc.kernels.triton import mla_latent_norm_rope  # noqa: E402
from atomc.ops.mla_latent import mla_latent_norm_rope_reference  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads,lora,rope", [(5, 32, 8), (20, 48, 16)])  # 20 heads: two head blocks, one masked
def test_kernel_matches_the_reference(dtype, interleaved, heads, lora, rope):
    args = layer_inputs(7, heads, lora, rope, dtype, "cpu", interleaved)
    got = mla_latent_norm_rope(*args)
    want = mla_latent_norm_rope_reference(*args)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous()
        torch.testing.assert_close(g, w, atol=TOL[dtype], rtol=TOL[dtype])


def test_interleave_flag_changes_the_pairing():
    """The same inputs with the flag off give other numbers (the gather is really done)."""
    args = list(layer_inputs(3, 4, 16, 8, torch.float32, "cpu", True))
    on = mla_latent_norm_rope(*args)
    args[-1] = False
    off = mla_latent_norm_rope(*args)
    assert not torch.allclose(on[0], off[0]) and not torch.allclose(on[1], off[1])
    torch.testing.assert_close(on[2], off[2], atol=0, rtol=0)  # the norm does not depend on it


def test_no_tokens():
    args = layer_inputs(0, 4, 16, 8, torch.float32, "cpu", True)
    q, k, c = mla_latent_norm_rope(*args)
    assert q.shape == (0, 4, 8) and k.shape == (0, 1, 8) and c.shape == (0, 16)


@pytest.mark.parametrize("interleaved", [True, False])
def test_backend_op_matches_the_atomc_op(interleaved):
    import atomc.kernels.triton.ops  # noqa: F401  (defines torch.ops.atomc_triton.mla_latent_norm_rope)

    args = layer_inputs(5, 3, 16, 8, torch.float32, "cpu", interleaved)
    got = torch.ops.atomc_triton.mla_latent_norm_rope(*args)
    want = torch.ops.atomc.mla_latent_norm_rope(*args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=TOL[torch.float32], rtol=TOL[torch.float32])
