"""Chat messages and tool definitions as requests carry them, and as chat templates get them.

Shared by the chat request (chat_request.py) and the chat form of /tokenize (tokenize_request.py),
which render the same messages through the same template. Only text content parts are accepted
(non-text content is refused with 400 rather than dropped); other message fields (name,
reasoning_content, ...) pass through to the template.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from atomc.serve.api_errors import bad_request


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str


class ToolCallItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, reasoning_content, ... pass through to the template
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict:
        if self.role == "tool" and not self.tool_call_id:
            raise bad_request("a message with role 'tool' needs its tool_call_id", "messages")
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(p.type != "text" or p.text is None for p in self.content):
                raise bad_request("only text content parts are supported", "messages")
            msg["content"] = "".join(p.text for p in self.content)
        msg.setdefault("content", "")
        for call in msg.get("tool_calls", []):
            # chat templates expect the arguments as a mapping (transformers' convention), where
            # OpenAI's history carries their JSON text
            call["function"]["arguments"] = _arguments_for_template(call["function"]["arguments"])
        return msg


def _arguments_for_template(arguments: str):
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
