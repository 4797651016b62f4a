"""Tool calls: the constraint that forces a valid call (tool_choice `required` or a named function),
and the parsers that find calls in free output (tool_choice `auto`): Hermes-style `<tool_call>`
blocks, as Qwen's templates ask for, and Llama 3's bare JSON.

As vLLM does, a forced call is generated as plain JSON under a JSON schema: for a named function,
its arguments object; for `required`, a list of {"name", "arguments"} objects, one of the tools each.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
HERMES_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# A call's JSON is written compactly, as OpenAI's are: no room for a model to loop on whitespace
# between its tokens (llguidance's option; the schema itself is unchanged)
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {
            "id": self.id or new_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def forced_schema(tools: list[dict[str, Any]], name: str | None, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema a forced call is generated under: the named function's parameters, or (for
    `required`) a non-empty list of calls to any of the tools (one, without parallel calls)."""
    functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if name is not None:
        return {**functions[name], **_COMPACT}
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for n, params in functions.items()
    ]
    most = {} if parallel else {"maxItems": 1}
    return {
        "type": "array",
        "minItems": 1,
        **most,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        **_COMPACT,
    }


def forced_calls(text: str, name: str | None) -> list[ToolCall]:
    """The calls in a forced call's output (see forced_schema); [] if it is cut short."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if name is not None:
        return [ToolCall(name, text.strip())]  # the arguments as generated (and as streamed)
    return [ToolCall(c["name"], json.dumps(c["arguments"])) for c in value]


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The content and the tool calls of a model's free output: Hermes `<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>` blocks anywhere in it, or, as Llama 3 writes them, the whole
    output one JSON call `{"name": ..., "parameters": {...}}` (or several joined by `;`), optionally
    after `<|python_tag|>`. Output that holds no well-formed call is all content."""
    if HERMES_OPEN in text:
        calls = [_call(block) for block in _HERMES.findall(text)]
        if calls and all(calls):
            return text[: text.index(HERMES_OPEN)].strip(), calls  # type: ignore[return-value]
        return text, []
    stripped = text.strip().removeprefix(_PYTHON_TAG).strip()
    if stripped.startswith("{"):
        calls = [_call(part) for part in _json_parts(stripped)]
        if calls and all(calls):
            return "", calls  # type: ignore[return-value]
    return text, []


def held_from(text: str) -> int:
    """Where free output so far might begin a tool call, so a stream sends the content before it
    and holds the rest back: at a `<tool_call>`, or at a tail that may grow into one, or at 0 for
    output that begins as Llama 3's JSON call does; len(text) when nothing could be a call."""
    if HERMES_OPEN in text:
        return text.index(HERMES_OPEN)
    stripped = text.lstrip()
    if stripped.startswith(("{", _PYTHON_TAG)) or (stripped and _PYTHON_TAG.startswith(stripped)):
        return 0
    for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(HERMES_OPEN[:k]):
            return len(text) - k
    return len(text)


def _json_parts(text: str) -> list[str]:
    parts, decoder, i = [], json.JSONDecoder(), 0
    while i < len(text):
        try:
            _, end = decoder.raw_decode(text, i)
        except ValueError:
            return []
        parts.append(text[i:end])
        i = end
        while i < len(text) and text[i] in " \n\t;":
            i += 1
    return parts


def _call(text: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments))
