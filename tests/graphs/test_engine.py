"""The engine on the compiled artifact (paged KV cache, mixed prefill/decode batches) generates the
same tokens as the eager engine, on every family."""

from __future__ import annotations

import torch

from atomc import LLM, SamplingParams
from models.loader import load_model
from tests.greedy import assert_greedy_agree, model_logits

PROMPTS = ["The capital of France is", "Once upon a time there", "def add(a, b):\n"]


def test_compiled_engine_is_token_identical(family, checkpoints, shared_root, compiled):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(model=str(checkpoints[family]), dtype="float32", device="cpu", cache_dir=str(shared_root))
    compiled_llm = LLM(**kw)
    info = compiled_llm.engine.runner.compile_info
    assert info["key"] and info["format"] == "aot_fn"
    got = compiled_llm.generate(PROMPTS, params)
    want = LLM(**kw, enforce_eager=True).generate(PROMPTS, params)
    logits_of = model_logits(load_model(checkpoints[family], torch.float32, "cpu"))
    for g, w in zip(got, want, strict=True):
        assert g.prompt_token_ids == w.prompt_token_ids
        assert_greedy_agree(g.outputs[0].token_ids, w.outputs[0].token_ids, w.prompt_token_ids, logits_of)
