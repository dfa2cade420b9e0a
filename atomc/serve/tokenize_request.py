"""POST /tokenize and /detokenize requests (vLLM's shapes).

/tokenize takes a prompt or chat messages (rendered by the chat template first, with the same
message models as chat); `tokenize_request_model` picks the shape from the body.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from atomc.serve.api_errors import bad_request
from atomc.serve.chat_messages import ChatMessage


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with chat messages, rendered by the chat template first (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes BOS and friends itself
    return_token_strs: bool | None = False
    tools: list[dict] | None = None  # rendered by the template as chat renders them
    chat_template_kwargs: dict[str, Any] | None = None  # the template's variables (enable_thinking, ...)

    def template_messages(self) -> list[dict]:
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
            )
        return [m.to_template() for m in self.messages]


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape): token ids in, `{"prompt": text}` out."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def tokenize_request_model(data: Any) -> type[BaseModel]:
    """/tokenize takes either shape; `messages` picks the chat one, as vLLM's union does."""
    return TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest
