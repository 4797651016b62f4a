"""OpenAI's Responses API request body (POST /v1/responses), as braid reads it (pydantic), beside
chat's (protocol.py) and Anthropic's (anthropic_protocol.py): the fields braid serves, and those it
knows only to refuse by name (previous_response_id and conversation: braid keeps no state; an
image's or a file's part). A field braid does not know is treated as over
chat (protocol.unknown_fields): named and ignored, or refused under --strict-request-fields.

An input item, a content part and a tool are each one model whatever their type, so that one braid
does not take (an input_image, a web_search tool) is refused naming its type's
path (`input[2].content[0].type`), not with pydantic's account of every union member it failed to
match. Each list comes before the string in a union, so that pydantic's first error is the item's
(`input[2].role`), not "input should be a valid string"."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Part(_Body):
    """input_text or output_text {text}; the others are refused with their type."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None  # an output_text's, as a response gave it back
    logprobs: list[Any] | None = None
    # an input_image's or an input_file's: refused with its part
    image_url: str | None = None
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None
    detail: str | None = None


class InputItem(_Body):
    """A message {role, content} (its type "message", or left out), a function_call {call_id,
    name, arguments} or a function_call_output {call_id, output}. An id and a status, as a
    response's own output items carry them when a client sends them back, are known and ignored."""

    type: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: list[Part] | str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: list[Part] | str | None = None
    id: str | None = None
    status: str | None = None
    # a reasoning item's, as a response's own carry them when a client sends them back: dropped
    summary: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


class Tool(_Body):
    """A function tool {name, description, parameters, strict}; a hosted tool's type (web_search,
    file_search, ...) is OpenAI's to run, and refused."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(_Body):
    type: str
    name: str | None = None


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class Reasoning(_Body):
    effort: str | None = None  # a reasoning model's budget (frontend/checks.py's EFFORT_BUDGETS)
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses."""

    model: str | None = None
    input: list[InputItem] | str
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None  # taken; braid stores nothing (named in braid-ignored-fields where true)
    reasoning: Reasoning | None = None
    # braid keeps no state, and answers while its client waits: refused where set
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
