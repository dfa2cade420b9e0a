"""The engine on the compiled artifact (paged KV cache, mixed prefill/decode batches) generates the
same tokens as the eager engine, on every family."""

from __future__ import annotations

from atomc import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time there", "def add(a, b):\n"]


def test_compiled_engine_is_token_identical(family, checkpoints, shared_root, compiled):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(model=str(checkpoints[family]), dtype="float32", device="cpu", cache_dir=str(shared_root))
    compiled_llm = LLM(**kw)
    info = compiled_llm.engine.runner.compile_info
    assert info["key"] and info["format"] == "aot_fn"
    got = [o.outputs[0].token_ids for o in compiled_llm.generate(PROMPTS, params)]
    want = [o.outputs[0].token_ids for o in LLM(**kw, enforce_eager=True).generate(PROMPTS, params)]
    assert got == want
