"""Anthropic's Messages API request bodies, as braid reads them (pydantic), beside OpenAI's
(protocol.py): the fields braid serves, and the ones it knows only to refuse by name (an image's
`source`). Sampling fields (temperature, top_p, top_k), which Anthropic's newer
SDKs no longer send, are taken from the clients that do. A field braid does not know is treated as over OpenAI's API
(protocol.unknown_fields): named and ignored, or refused under --strict-request-fields.

A content block is one model whatever its type, so that a block braid does not take (image,
document) is refused naming its type's path (`messages[0].content[1].type`), not with
pydantic's account of every union member it failed to match."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Block(_Body):
    """text {text}, tool_use {id, name, input}, tool_result {tool_use_id, content, is_error}."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    source: dict[str, Any] | None = None  # an image's or a document's: refused with its block
    # an assistant's thinking block (thinking, signature) or redacted one (data): taken and dropped
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    # a prompt-caching hint: braid reuses every prompt's cached prefix by itself, so it is known and ignored
    cache_control: dict[str, Any] | None = None


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Body):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None  # a server tool's type (web_search_...) is Anthropic's to run
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]  # adaptive: the model (its chat template) decides
    budget_tokens: int | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None  # (effort is not known: it tunes thinking, which braid does not serve)


class Metadata(_Body):
    user_id: str | None = None


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens: the prompt's part of a message's body."""

    model: str
    messages: list[MessageParam]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint, known and ignored (as a block's)

    @property
    def user(self) -> str | None:
        return None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    stream: bool = False

    @property
    def user(self) -> str | None:
        return self.metadata.user_id if self.metadata else None
