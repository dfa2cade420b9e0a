"""Sampling values a request leaves unset come from the checkpoint's generation_config.json (as in vLLM)."""

from __future__ import annotations

import json
import shutil

import pytest

from atomc import LLM, SamplingParams
from atomc.engine.generation_defaults import generation_defaults
from atomc.serve.chat_request import ChatCompletionRequest
from atomc.serve.completion_request import CompletionRequest


@pytest.fixture(scope="module")
def greedy_default_dir(llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("gencfg") / "m"
    shutil.copytree(llama_dir, d)
    cfg = json.loads((d / "generation_config.json").read_text())
    cfg.update(temperature=0.0, top_k=5, repetition_penalty=1.1, max_new_tokens=4096)
    (d / "generation_config.json").write_text(json.dumps(cfg))
    return d


def test_defaults_read_and_switch_off(greedy_default_dir, llama_dir):
    assert generation_defaults(greedy_default_dir, "auto") == dict(temperature=0.0, top_k=5, repetition_penalty=1.1)
    assert generation_defaults(greedy_default_dir, "none") == {}
    assert generation_defaults(llama_dir, "auto") == {}  # no sampling keys in the file
    with pytest.raises(ValueError, match="auto or none"):
        generation_defaults(llama_dir, "vllm")


def test_requests_fill_unset_fields_only():
    defaults = dict(temperature=0.0, top_k=5)
    p = CompletionRequest(model="m", prompt="hi").sampling_params(defaults)
    assert p.temperature == 0.0 and p.top_k == 5 and p.max_tokens == 16
    p = CompletionRequest(model="m", prompt="hi", temperature=0.7).sampling_params(defaults)
    assert p.temperature == 0.7 and p.top_k == 5
    c = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}]).sampling_params(defaults)
    assert c.temperature == 0.0 and c.max_tokens is None
    assert CompletionRequest(model="m", prompt="hi").sampling_params().temperature == 1.0


def test_llm_uses_model_defaults_when_no_params_given(greedy_default_dir):
    llm = LLM(model=str(greedy_default_dir), device="cpu", enforce_eager=True, dtype="float32")
    params = llm.engine.default_sampling_params()
    assert params.temperature == 0.0 and params.top_k == 5 and params.repetition_penalty == 1.1
    # temperature 0 from the file: generation without params is greedy, so two runs agree
    a = llm.generate("The capital of France is")[0].outputs[0].token_ids
    b = llm.generate("The capital of France is")[0].outputs[0].token_ids
    assert a == b
    off = LLM(model=str(greedy_default_dir), device="cpu", enforce_eager=True, generation_config="none")
    assert off.engine.default_sampling_params() == SamplingParams()
