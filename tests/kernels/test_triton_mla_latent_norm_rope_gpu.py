"""The Triton kernel of atomc::mla_latent_norm_rope on CUDA in bf16 at DeepSeek-V3's widths (128
heads, kv_lora 512, rope 64), through the atomc_triton op the lowered graph calls."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from mla_latent_cases import layer_inputs  # noqa: E402

from atomc.ops.mla_latent import mla_latent_norm_rope_reference  # noqa: E402


@pytest.mark.parametrize("tokens", [1, 37, 1024])
@pytest.mark.parametrize("interleaved", [True, False])
def test_kernel_matches_the_reference_in_bf16(tokens, interleaved):
    from atomc.kernels import registry

    _, op = registry.choose("mla_latent_norm_rope", "cuda")
    args = layer_inputs(tokens, 128, 512, 64, torch.bfloat16, "cuda", interleaved, nope=128)
    got = op(*args)
    want = mla_latent_norm_rope_reference(*args)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)
