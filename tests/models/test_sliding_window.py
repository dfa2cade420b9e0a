"""A Mistral checkpoint whose sliding window is shorter than its prompts: atomc's greedy tokens equal
transformers' (whose Mistral masks keys at or before position p - sliding_window, as atomc does),
through plain prefill, chunked prefill over a cached prefix longer than the window, and decode far
past it. The engine serves the model's full context, not just the window."""

from __future__ import annotations

import pytest
import torch
import transformers

from atomc import LLM, SamplingParams
from tests.conftest import FAMILIES, build_checkpoint

WINDOW = 8
PROMPTS = [
    "The capital of France is Paris. The capital of Italy is Rome. Once upon a time",
    "def add(a, b):\n    return a + b\n1 2 3 4 5 6 7 8 9 10 hello world",
]


@pytest.fixture(scope="module")
def mistral_window_dir(tmp_path_factory, monkeypatch_module):
    spec = dict(FAMILIES["mistral"], sliding_window=WINDOW)
    monkeypatch_module.setitem(FAMILIES, "mistral_window", spec)
    return build_checkpoint("mistral_window", tmp_path_factory.mktemp("mistral_window"))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("chunk", [None, 8])
def test_greedy_tokens_match_transformers_past_the_window(mistral_window_dir, chunk):
    hf = transformers.AutoModelForCausalLM.from_pretrained(mistral_window_dir, dtype=torch.float32).eval()
    assert hf.config.sliding_window == WINDOW
    kw = dict(max_num_batched_tokens=chunk) if chunk else {}  # chunks of 8 tokens: a cached prefix
    llm = LLM(model=str(mistral_window_dir), dtype="float32", device="cpu", enforce_eager=True, **kw)
    assert llm.engine.arch.sliding_window == WINDOW
    assert llm.engine.max_model_len == 512  # max_position_embeddings, not the window
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids.shape[1] > 2 * WINDOW  # the prompt alone is longer than the window
        ref = hf.generate(ids, do_sample=False, max_new_tokens=24, min_new_tokens=24)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist()


def test_window_changes_the_logits(mistral_window_dir):
    # the window is live in atomc's model: without it, the last position's logits differ
    from models.loader import load_model

    model = load_model(mistral_window_dir, torch.float32, "cpu")
    ids = torch.randint(0, model.arch.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        windowed = model.compute_logits(model(ids, torch.arange(30)))
        for layer in model.model.layers:
            layer.self_attn.sliding_window = 0
        full = model.compute_logits(model(ids, torch.arange(30)))
    torch.testing.assert_close(windowed[:WINDOW], full[:WINDOW], atol=1e-5, rtol=1e-5)
    assert (windowed[-1] - full[-1]).abs().max() > 1e-3
