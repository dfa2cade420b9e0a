"""Each family: atomc's logits and greedy tokens equal transformers' on the same checkpoint (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers

from atomc import LLM, SamplingParams
from models.loader import load_model
from tests.greedy import assert_greedy_agree

PROMPTS = ["The capital of France is", "Once upon a time there", "def add(a, b):\n"]


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    return {
        f: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for f, d in checkpoints.items()
    }


def test_prompt_logits_match_transformers(family, checkpoints, hf_models):
    model = load_model(checkpoints[family], torch.float32, "cpu")
    ids = torch.randint(0, model.arch.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_models[family](ids[None]).logits[0]
        out = model.compute_logits(model(ids, torch.arange(ids.numel())))
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-3


def test_greedy_tokens_match_transformers_generate(family, checkpoints, hf_models):
    llm = LLM(model=str(checkpoints[family]), dtype="float32", device="cpu", enforce_eager=True)
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        hf = hf_models[family]
        ref = hf.generate(ids, do_sample=False, max_new_tokens=32, min_new_tokens=32)

        def hf_logits(seq, hf=hf):
            with torch.no_grad():
                return hf(torch.tensor([seq])).logits[0]

        # atomc's kernels and transformers' round differently: they may part only at a near-tie
        assert_greedy_agree(out.outputs[0].token_ids, ref[0, ids.shape[1] :].tolist(), ids[0].tolist(), hf_logits)
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_rope_llama3_scaling_is_applied(checkpoints):
    # the llama fixture uses rope_type llama3: the inverse frequencies must differ from plain RoPE
    from models.layers.rotary import rope_inv_freq

    model = load_model(checkpoints["llama"], torch.float32, "cpu")
    cfg = model.config
    assert cfg.rope_scaling["rope_type"] == "llama3"
    scaled = rope_inv_freq(model.arch.head_dim, cfg.rope_theta, cfg.rope_scaling)
    plain = rope_inv_freq(model.arch.head_dim, cfg.rope_theta, None)
    assert not torch.allclose(scaled, plain)
    assert torch.allclose(scaled[0], plain[0])  # the highest frequency is kept
