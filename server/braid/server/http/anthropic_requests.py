"""Anthropic's Messages API requests as OpenAI's chat requests, then braid's plan by the one path
chat takes (requests.chat_plan): so a field means the same and is checked the same on both APIs,
tools and tool calls included. Only the names differ: an error about a chat request's field is
named as Anthropic's body names it (`stop_sequences[1]`, `messages[2].content[0].content`).

Structured output (output_config.format) is chat's json_schema response_format. The turns map as
Anthropic's own docs pair them with OpenAI's: the system prompt is a system message; an assistant's
tool_use blocks are its tool_calls; a user's tool_result blocks are `tool` messages (before the
user's text, where Anthropic puts them)."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from braid.server.engine.types import InvalidArgument
from braid.server.http.anthropic_protocol import Block, CountTokensRequest, MessageParam, MessagesRequest, ToolChoice
from braid.server.http.protocol import ChatMessage, ChatRequest, Function, NamedToolChoice, ResponseFormat, Tool
from braid.server.http.requests import Plan, chat_plan

_TAKEN = "braid takes text, tool_use, tool_result and (an assistant's) thinking blocks"
_THINKING = ("thinking", "redacted_thinking")
# a chat request's names -> Anthropic's, where they differ
_RENAMES = {
    "response_format.json_schema.schema": "output_config.format.schema",
    "response_format": "output_config.format",
    "stop": "stop_sequences",
    "tool_choice.function.name": "tool_choice.name",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "user": "metadata.user_id",
    "max_reasoning_tokens": "thinking.budget_tokens",
}
_TOOL_FIELD = re.compile(r"(tools\[\d+\])\.function\.(name|parameters)")  # a chat tool's, from tool_plan


def messages_plan(
    body: MessagesRequest | CountTokensRequest, default_max_new_tokens: int, vocab_size: int, takes_tools: bool
) -> Plan:
    """The body's plan, as chat's; its request id a message's (msg_...)."""
    chat, origins = _chat(body)
    try:
        plan = chat_plan(chat, default_max_new_tokens, vocab_size, takes_tools)
    except InvalidArgument as exc:
        raise InvalidArgument(anthropic_name(exc.field, origins), exc.description) from None
    request = dataclasses.replace(plan.request, request_id="msg_" + uuid.uuid4().hex)
    return dataclasses.replace(plan, request=request)


def anthropic_name(field: str, origins: list[str] | None = None) -> str:
    """A chat request's field as Anthropic's body names it; origins: where each chat message came
    from (`messages[k]...` is named by the block it was made of)."""
    tool = _TOOL_FIELD.fullmatch(field)
    if tool:
        return f"{tool[1]}.{'name' if tool[2] == 'name' else 'input_schema'}"
    for chat, anthropic in _RENAMES.items():
        if field == chat or field.startswith((chat + "[", chat + ".")):
            return anthropic + field[len(chat) :]
    if origins and field.startswith("messages["):
        index, _, rest = field[len("messages[") :].partition("]")
        if index.isdigit() and int(index) < len(origins):
            return origins[int(index)] + rest
    return field


def _chat(body: MessagesRequest | CountTokensRequest) -> tuple[ChatRequest, list[str]]:
    """The body as a chat request, and the Anthropic path of each of its messages."""
    messages: list[ChatMessage] = []
    origins: list[str] = []
    if body.system:
        messages.append(ChatMessage(role="system", content=_text(body.system, "system")))
        origins.append("system")
    for i, message in enumerate(body.messages):
        for origin, turn in _turns(message, f"messages[{i}]"):
            messages.append(turn)
            origins.append(origin)
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        fields["tools"] = [
            Tool(function=Function(name=t.name, description=t.description, parameters=t.input_schema))
            for t in body.tools
        ]
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
        if body.tool_choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if body.output_config is not None and body.output_config.format is not None:
        schema = {"name": "output", "schema": body.output_config.format.schema_}
        fields["response_format"] = ResponseFormat.model_validate({"type": "json_schema", "json_schema": schema})
    if body.thinking is not None:
        fields |= _thinking(body)
    if isinstance(body, MessagesRequest):
        fields |= {
            "max_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "user": body.user,
        }
    return ChatRequest(**fields), origins


def _thinking(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """Extended thinking as a chat's fields: `enabled` and `disabled` are the chat template's
    enable_thinking (a template without that switch ignores it), and budget_tokens the reasoning
    budget; `adaptive` leaves both to the template."""
    thinking = body.thinking
    assert thinking is not None
    if thinking.type == "adaptive":
        return {}
    if thinking.type == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if thinking.budget_tokens is None:
        raise InvalidArgument("thinking.budget_tokens", "is required with thinking enabled")
    if isinstance(body, MessagesRequest) and thinking.budget_tokens >= body.max_tokens:
        raise InvalidArgument("thinking.budget_tokens", f"must be less than max_tokens ({body.max_tokens})")
    return {"chat_template_kwargs": {"enable_thinking": True}, "max_reasoning_tokens": thinking.budget_tokens}


def _tool_choice(choice: ToolChoice) -> str | NamedToolChoice:
    if choice.type == "tool":
        if not choice.name:
            raise InvalidArgument("tool_choice.name", "is required for type 'tool'")
        return NamedToolChoice.model_validate({"function": {"name": choice.name}})
    return {"any": "required"}.get(choice.type, choice.type)


def _turns(message: MessageParam, path: str) -> list[tuple[str, ChatMessage]]:
    """A message's chat messages, each with its origin: a user's tool results and its text, or an
    assistant's text and its calls."""
    if isinstance(message.content, str):
        return [(path, ChatMessage(role=message.role, content=message.content))]
    # an assistant's thinking is dropped: chat templates (Qwen3's) drop an earlier turn's reasoning themselves
    wanted = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", *_THINKING)}[message.role]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[tuple[str, ChatMessage]] = []
    for j, block in enumerate(message.content):
        where = f"{path}.content[{j}]"
        if block.type not in wanted:
            known = ("text", "tool_use", "tool_result", *_THINKING)
            why = _TAKEN if block.type not in known else f"not in a {message.role} turn"
            raise InvalidArgument(f"{where}.type", f"{block.type!r}: {why}")
        if block.type in _THINKING:
            continue
        if block.type == "text":
            texts.append(_field(block.text, f"{where}.text"))
        elif block.type == "tool_use":
            function = {"name": _field(block.name, f"{where}.name"), "arguments": json.dumps(block.input or {})}
            calls.append({"id": _field(block.id, f"{where}.id"), "type": "function", "function": function})
        else:
            results.append((where, _result(block, where)))
    if message.role == "assistant":
        turn = {"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls or None}
        return [(path, ChatMessage.model_validate(turn))]
    text = [(path, ChatMessage(role="user", content="".join(texts)))] if texts or not results else []
    return results + text


def _result(block: Block, where: str) -> ChatMessage:
    """A tool_result block as a `tool` message: its text, said to be an error where it is one."""
    content = block.content if block.content is not None else ""
    text = content if isinstance(content, str) else _text(content, f"{where}.content")
    if block.is_error:
        text = f"Error: {text}"
    return ChatMessage(role="tool", tool_call_id=_field(block.tool_use_id, f"{where}.tool_use_id"), content=text)


def _text(value: str | list[Block], path: str) -> str:
    """A system prompt's or a tool result's text: a string, or text blocks."""
    if isinstance(value, str):
        return value
    for j, block in enumerate(value):
        if block.type != "text":
            raise InvalidArgument(f"{path}[{j}].type", f"{block.type!r}: braid takes text blocks here")
    return "".join(_field(b.text, f"{path}[{j}].text") for j, b in enumerate(value))


def _field(value: str | None, path: str) -> str:
    if not value:
        raise InvalidArgument(path, "is required")
    return value
