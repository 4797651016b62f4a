"""OpenAI's request bodies, as braid reads them (pydantic): the fields of OpenAI's API that braid
serves, and braid's own extras beside them (top_k, min_p, chat_template_kwargs, ...), as vLLM
accepts them; a numeric sampling parameter (runner/rows.py's Sampling) is read by its name. A field
braid does not know is named by `unknown_fields`: the front end logs it and answers with it in a
header (vLLM logs them), or refuses it under --strict-request-fields; a field braid cannot honour
(echo, suffix, best_of > 1, non-text content) is refused naming it."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class Function(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: Function


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class CalledFunction(_Body):
    name: str
    arguments: str


class AssistantToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None


class JsonSchema(_Body):
    name: str = ""
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class _Generation(_Body):
    """What chat and completions share: OpenAI's sampling fields, then braid's extras."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # braid's extras (vLLM's names where it has them)
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    cache_salt: str = ""
    priority: Literal["interactive", "batch"] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False


class ChatRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extra: more variables for the chat template ({"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # a reasoning model's budget, as an effort (frontend/checks.py's EFFORT_BUDGETS) or, braid's extra,
    # in tokens (GenerateRequest.max_reasoning_tokens)
    reasoning_effort: str | None = None
    max_reasoning_tokens: int | None = None


class CompletionRequest(_Generation):
    # a text, or token ids (OpenAI's [1, 2, 3]); a list of either is a batch of prompts, of which braid takes one
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None  # braid's extra: JSON output for completions too


def unknown_fields(body: BaseModel) -> list[str]:
    """The fields of a body, at any depth, that braid does not know, named as OpenAI names a
    parameter (`messages[0].refusal`), first to last. A field sent as null is not among them:
    leaving it out means the same. Walked with a stack, not recursion: a body's models nest only as
    deep as braid's declared fields do, but a walk should never depend on that."""
    found: list[str] = []
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, BaseModel):
            prefix = f"{path}." if path else ""
            found.extend(prefix + key for key, extra in (value.model_extra or {}).items() if extra is not None)
            declared = type(value).model_fields
            stack.extend((prefix + name, getattr(value, name)) for name in reversed(list(declared)))
    return found


def shown(name: str) -> str:
    """A field's name as a log line or an HTTP header may carry it: ASCII, escaped, at most 100
    characters (a client chooses it)."""
    text = json.dumps(name)[1:-1]
    return text if len(text) <= 100 else text[:97] + "..."
