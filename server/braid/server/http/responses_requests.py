"""OpenAI's Responses API requests as chat requests, then braid's plan by the one path chat takes
(requests.chat_plan): so a field means the same and is checked the same on both APIs, tools and
tool calls included. Only the names differ: an error about a chat request's field is named as the
Responses body names it (`max_output_tokens`, `input[2].content`, `text.format.schema`).

Stateless: braid keeps no responses, so previous_response_id and conversation are refused, and
`store: true` is taken with nothing stored. The items map onto chat's turns as OpenAI's own
migration guide pairs them: instructions and system or developer messages are system messages; a
function_call item is a call of the assistant turn it follows (or of a turn of its own); a
function_call_output item is a `tool` message."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from pydantic import BaseModel

from braid.server.engine.types import InvalidArgument
from braid.server.frontend import checks
from braid.server.http.protocol import ChatMessage, ChatRequest, Function, NamedToolChoice, ResponseFormat, Tool
from braid.server.http.requests import Plan, chat_plan
from braid.server.http.responses_protocol import InputItem, NamedTool, Part, ResponsesRequest
from braid.server.http.responses_protocol import Tool as ResponsesTool

_TEXT_PARTS = ("input_text", "output_text")
_ROLES = {"developer": "system"}  # the Responses API's roles -> chat templates' own
# a chat request's names -> the Responses API's, where they differ
_RENAMES = {
    "response_format.json_schema.schema": "text.format.schema",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "tool_choice.function.name": "tool_choice.name",
}


def responses_plan(
    body: ResponsesRequest, default_max_new_tokens: int, vocab_size: int, takes_tools: bool
) -> tuple[Plan, list[str]]:
    """The body's plan, as chat's (its request id a response's, resp_...), and the Responses path
    of each of its chat messages (for responses_name)."""
    _refuse_state(body)
    chat, origins = _chat(body)
    try:
        plan = chat_plan(chat, default_max_new_tokens, vocab_size, takes_tools)
    except InvalidArgument as exc:
        raise InvalidArgument(responses_name(exc.field, origins), exc.description) from None
    request = dataclasses.replace(plan.request, request_id="resp_" + uuid.uuid4().hex)
    return dataclasses.replace(plan, request=request), origins


def responses_name(field: str, origins: list[str]) -> str:
    """A chat request's field as the Responses body names it; origins: where each chat message
    came from (`messages[k]...` is named by the item it was made of)."""
    for chat, name in _RENAMES.items():
        if field == chat or field.startswith((chat + "[", chat + ".")):
            return name + field[len(chat) :]
    if field.startswith("tools[") and "].function" in field:  # chat's tools nest a function; these do not
        return field.replace("].function", "]", 1)
    if field == "messages":
        return "input"
    if field.startswith("messages["):
        index, _, rest = field[len("messages[") :].partition("]")
        if index.isdigit() and int(index) < len(origins):
            return origins[int(index)] + rest
    return field


def echoed(body: ResponsesRequest) -> dict[str, Any]:
    """The request's fields a response repeats, as OpenAI's does."""
    fmt = body.text.format if body.text and body.text.format else None
    choice = body.tool_choice or "auto"
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "store": False,  # nothing is stored, whatever the request asked
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": _declared(fmt) if fmt else {"type": "text"}},
        "tool_choice": choice if isinstance(choice, str) else _declared(choice),
        "tools": [_declared(t) for t in body.tools or ()],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "user": body.user,
    }


def _declared(model: BaseModel) -> dict[str, Any]:
    """A model's fields braid knows, as the client sent them (not its unknown ones)."""
    return model.model_dump(include=set(type(model).model_fields), by_alias=True, exclude_none=True)


def _refuse_state(body: ResponsesRequest) -> None:
    stateless = "braid keeps no state: send the whole conversation as input"
    if body.previous_response_id is not None:
        raise InvalidArgument("previous_response_id", stateless)
    if body.conversation is not None:
        raise InvalidArgument("conversation", stateless)
    if body.background:
        raise InvalidArgument("background", "braid answers while the client waits: send background: false")


def _chat(body: ResponsesRequest) -> tuple[ChatRequest, list[str]]:
    """The body as a chat request, and the Responses path of each of its messages."""
    turns: list[tuple[str, dict[str, Any]]] = []
    if body.instructions:
        turns.append(("instructions", {"role": "system", "content": body.instructions}))
    if isinstance(body.input, str):
        turns.append(("input", {"role": "user", "content": body.input}))
    else:
        for i, item in enumerate(body.input):
            _add(turns, item, f"input[{i}]")
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": [ChatMessage.model_validate(turn) for _, turn in turns],
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.reasoning is not None and body.reasoning.effort is not None:
        # reasoning.effort's budget (frontend/checks.py's EFFORT_BUDGETS), named as this API names it
        fields["max_reasoning_tokens"] = checks.effort_budget(body.reasoning.effort, "reasoning.effort")
    if body.tools:
        fields["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    if body.text is not None and body.text.format is not None:
        fmt = body.text.format
        schema = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
        fields["response_format"] = ResponseFormat.model_validate(
            {"type": fmt.type, **({"json_schema": schema} if fmt.type == "json_schema" else {})}
        )
    return ChatRequest(**fields), [origin for origin, _ in turns]


def _add(turns: list[tuple[str, dict[str, Any]]], item: InputItem, path: str) -> None:
    """An input item onto the chat's turns: a message, a call (joining the assistant turn just
    before it) or a call's output."""
    kind = item.type or ("message" if item.role else None)
    if kind == "message":
        role = _field(item.role, f"{path}.role")
        if item.content is None:
            raise InvalidArgument(f"{path}.content", "is required")
        turns.append((path, {"role": _ROLES.get(role, role), "content": _text(item.content, f"{path}.content")}))
    elif kind == "function_call":
        if item.arguments is None:  # (an empty text is a call without arguments)
            raise InvalidArgument(f"{path}.arguments", "is required")
        function = {"name": _field(item.name, f"{path}.name"), "arguments": item.arguments}
        call = {"id": _field(item.call_id, f"{path}.call_id"), "type": "function", "function": function}
        last = turns[-1][1] if turns else None
        if last is not None and last["role"] == "assistant":
            last["tool_calls"] = [*(last.get("tool_calls") or ()), call]
        else:
            turns.append((path, {"role": "assistant", "content": None, "tool_calls": [call]}))
    elif kind == "function_call_output":
        if item.output is None:
            raise InvalidArgument(f"{path}.output", "is required")
        output = _text(item.output, f"{path}.output")
        turns.append(
            (path, {"role": "tool", "tool_call_id": _field(item.call_id, f"{path}.call_id"), "content": output})
        )
    elif kind == "reasoning":
        pass  # an earlier answer's reasoning, sent back: dropped, as chat templates (Qwen3's) drop it
    elif kind is None:
        raise InvalidArgument(f"{path}.type", "is required (or a message's role)")
    else:
        why = {
            "item_reference": "braid keeps no state: send the item itself",
        }.get(kind, "braid takes message, function_call and function_call_output items")
        raise InvalidArgument(f"{path}.type", f"{kind!r}: {why}")


def _text(content: str | list[Part], path: str) -> str:
    """A message's or a call output's text: a string, or text parts."""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS:
            raise InvalidArgument(f"{path}[{j}].type", f"{part.type!r}: braid takes input_text and output_text parts")
        if part.text is None:
            raise InvalidArgument(f"{path}[{j}].text", "is required")
    return "".join(part.text or "" for part in content)


def _tool(tool: ResponsesTool, path: str) -> Tool:
    if tool.type != "function":
        raise InvalidArgument(f"{path}.type", f"{tool.type!r}: braid runs function tools only")
    function = Function(
        name=_field(tool.name, f"{path}.name"),
        description=tool.description,
        parameters=tool.parameters,
        strict=tool.strict,
    )
    return Tool(function=function)


def _tool_choice(choice: str | NamedTool) -> str | NamedToolChoice:
    if isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise InvalidArgument("tool_choice.type", f"{choice.type!r}: braid takes 'function' (or none, auto, required)")
    return NamedToolChoice.model_validate({"function": {"name": _field(choice.name, "tool_choice.name")}})


def _field(value: str | None, path: str) -> str:
    if not value:
        raise InvalidArgument(path, "is required")
    return value
