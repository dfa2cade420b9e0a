"""YaRN RoPE (GPT-OSS's `rope_type: yarn`) against transformers' own rope init function: the inverse
frequencies and the attention factor that scales cos/sin, for GPT-OSS's parameters and variants
(truncate on and off, explicit attention_factor, mscale / mscale_all_dim, no factor)."""

import math

import pytest
import torch
from transformers import GptOssConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.layers.rotary import RotaryEmbedding, rope_attention_factor, rope_inv_freq, rope_parameters

GPT_OSS = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
VARIANTS = {
    "gpt_oss": GPT_OSS,
    "truncated": {**GPT_OSS, "truncate": True},
    "small_factor": {**GPT_OSS, "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0},
    "attention_factor": {**GPT_OSS, "attention_factor": 0.7},
    "mscale": {**GPT_OSS, "mscale": 0.707, "mscale_all_dim": 1.0},
}


def hf_yarn(params: dict, head_dim=64, max_positions=131072):
    cfg = GptOssConfig(
        hidden_size=256, num_attention_heads=4, head_dim=head_dim, num_hidden_layers=2,
        max_position_embeddings=max_positions, rope_parameters={**params, "rope_theta": 150000.0},
    )  # fmt: skip
    return ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_yarn_matches_transformers(variant):
    params = VARIANTS[variant]
    want_freq, want_factor = hf_yarn(params)
    theta, scaling = rope_parameters({"rope_parameters": {**params, "rope_theta": 150000.0}})
    assert theta == 150000.0 and scaling["rope_type"] == "yarn"
    got = rope_inv_freq(64, theta, scaling, 131072)
    torch.testing.assert_close(got, want_freq, atol=0, rtol=1e-6)
    assert math.isclose(rope_attention_factor(scaling, 131072), want_factor, rel_tol=1e-12)
    # YaRN really changes the low frequencies and keeps the highest
    plain = rope_inv_freq(64, theta, None)
    assert torch.allclose(got[0], plain[0]) and not torch.allclose(got[-1], plain[-1])


def test_yarn_without_factor_takes_the_context_ratio():
    params = {k: v for k, v in GPT_OSS.items() if k != "factor"} | {"factor": None}
    want_freq, want_factor = hf_yarn(params, max_positions=16384)
    scaling = dict(params)
    torch.testing.assert_close(rope_inv_freq(64, 150000.0, scaling, 16384), want_freq, atol=0, rtol=1e-6)
    assert math.isclose(rope_attention_factor(scaling, 16384), want_factor, rel_tol=1e-12)
    assert math.isclose(want_factor, 0.1 * math.log(4) + 1)


def test_table_is_scaled_by_the_attention_factor():
    """cos and sin both carry the attention factor, as transformers' rotary embedding multiplies them."""
    yarn = RotaryEmbedding(64, 256, 150000.0, GPT_OSS)
    freq, factor = hf_yarn(GPT_OSS, max_positions=256)
    pos = torch.arange(256).float()[:, None] * freq
    torch.testing.assert_close(yarn.cos_sin, torch.cat([pos.cos(), pos.sin()], -1) * factor, atol=1e-6, rtol=1e-5)
    assert factor > 1.3
    plain = RotaryEmbedding(64, 256, 150000.0, None)
    assert torch.equal(plain.cos_sin[0, :32], torch.ones(32))  # position 0 of plain RoPE: cos 1, unscaled
    torch.testing.assert_close(yarn.cos_sin[0, :32], torch.full((32,), factor))


def test_other_scaling_kinds_still_fail_clearly():
    with pytest.raises(ValueError, match="'longrope' is not supported"):
        rope_parameters({"rope_scaling": {"rope_type": "longrope"}})
