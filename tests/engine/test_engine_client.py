"""Both engines are EngineClients (engine/client.py): each implements what the protocol leaves to it,
and the request-side helpers written once in the protocol work on the in-process engine."""

from __future__ import annotations

import pytest

from atomc.engine.client import EngineClient
from atomc.engine.llm_engine import LLMEngine
from atomc.engine.process import EngineProcessClient
from tests.engine.helpers import make

LEFT_TO_EACH = ("add_request", "abort_request", "step", "has_unfinished_requests", "stats")


@pytest.mark.parametrize("cls", [LLMEngine, EngineProcessClient])
def test_each_engine_implements_the_protocol(cls):
    assert EngineClient in cls.__mro__
    for name in LEFT_TO_EACH:
        assert getattr(cls, name) is not getattr(EngineClient, name), f"{cls.__name__}.{name} is missing"
    assert EngineProcessClient.alive is not EngineClient.alive  # the process can die; watched


def test_shared_helpers_read_the_engines_tokenizer_and_defaults(llama_dir):
    eng = make(llama_dir).engine
    assert eng.tokenize("1 2 3") == eng.tokenizer("1 2 3")["input_ids"]
    text = eng.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>user\nhi<|im_end|>")
    assert eng.default_sampling_params().temperature == eng.sampling_defaults.get("temperature", 1.0)
    assert eng.alive
    eng.close()  # nothing to stop in process
