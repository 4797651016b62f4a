"""Tool calls, whatever API asked for them: the constraint that forces a valid call (OpenAI's
tool_choice `required` or a named function, Anthropic's `any` or `tool`), and the parsers that find
calls in free output (`auto`): Hermes-style `<tool_call>` blocks, as Qwen's templates ask for, and
Llama 3's bare JSON. Tools are given as the chat templates take them (OpenAI's definitions,
{"type": "function", "function": {"name", "description", "parameters"}}); each front end renders
the calls found in its own API's shape.

As vLLM does, a forced call is generated as plain JSON under a JSON schema: for a named function,
its arguments object; for `required`, a list of {"name", "arguments"} objects, one of the tools each.
A forced call cut short (max_tokens) is read back as OpenAI sends one: the calls as far as they got,
their arguments unfinished JSON (`cut_calls`).

A chat template that does not render tools (SmolLM2's; engine/tokenizer.py finds out once per model)
gets them in a system message instead (`tools_prompt`), as llama.cpp's generic tool format does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# what reading a model's JSON may raise: not JSON, or nested deeper than json's recursion allows
# (output of `[` x 1,000 is JSON cut short; its parse must not end the call with a 500)
_UNREADABLE = (ValueError, RecursionError)
_NON_SPACE = re.compile(r"\S")
# A call's JSON is written compactly, as OpenAI's are: no room for a model to loop on whitespace
# between its tokens (llguidance's option; the schema itself is unchanged)
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = ""


def forced_schema(tools: list[dict[str, Any]], name: str | None, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema a forced call is generated under: the named function's parameters, or (for
    `required`) a non-empty list of calls to any of the tools (one, without parallel calls).

    In the list, a tool's parameters are no longer the schema's root, so their local references
    (`#/$defs/Item`, `#`) would point into the list's schema. Such a tool's parameters move to the
    root's `$defs` (`tool_<i>`), their references rebased there, and its call refers to them."""
    functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if name is not None:
        return {**functions[name], **_COMPACT}
    defs: dict[str, Any] = {}
    calls = []
    for i, (n, params) in enumerate(functions.items()):
        rebased, refers = _rebased(params, f"/$defs/tool_{i}")
        if refers:
            defs[f"tool_{i}"] = rebased
            params = {"$ref": f"#/$defs/tool_{i}"}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": n}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    most = {} if parallel else {"maxItems": 1}
    schema = {
        "type": "array",
        "minItems": 1,
        **most,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        **_COMPACT,
    }
    return {**schema, "$defs": defs} if defs else schema


# keywords whose values are data, not schemas: a "$ref" inside them is left as it is
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rebased(schema: dict[str, Any], base: str) -> tuple[dict[str, Any], bool]:
    """A copy of `schema` whose local references ("#", "#/...") point under the JSON pointer
    `base`, and whether it has any. Iterative, not recursive: a schema nested deeper than Python's
    recursion limit is the constraint compiler's to refuse, naming the field."""
    root = dict(schema)
    refers = False
    stack: list[Any] = [root]  # copies of the schema's objects and arrays, their members still the originals
    while stack:
        node = stack.pop()
        is_object = isinstance(node, dict)
        for key, value in list(node.items() if is_object else enumerate(node)):
            if is_object and key in _DATA_KEYWORDS:
                continue
            if is_object and key == "$ref" and isinstance(value, str) and value[:2] in ("#", "#/"):
                node[key], refers = "#" + base + value[1:], True
            elif isinstance(value, (dict, list)):
                node[key] = copied = type(value)(value)
                stack.append(copied)
    return root, refers


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """A system message that tells the model the tools and how to call them, for a chat template
    that does not render `tools` itself. braid's own, in the spirit of llama.cpp's generic tool
    format (common/chat.cpp) and minja's tools polyfill: the functions as JSON, then the shape of
    a call, which is the Hermes block that parse_tool_calls reads back."""
    functions = "\n".join(json.dumps(t["function"], separators=(",", ":")) for t in tools)
    return (
        "You can call these functions (each with a JSON Schema of its arguments):\n"
        f"{functions}\n\n"
        "To call one, answer with a block for each call, and nothing after the blocks:\n"
        f'{HERMES_OPEN}\n{{"name": <the function\'s name>, "arguments": <its arguments, a JSON object>}}\n</tool_call>\n'
        "Otherwise, answer the user directly."
    )


def forced_calls(text: str, name: str | None) -> list[ToolCall]:
    """The calls in a forced call's output (see forced_schema); [] if it is cut short."""
    try:
        value = json.loads(text)
        if name is not None:
            return [ToolCall(name, text.strip())]  # the arguments as generated (and as streamed)
        return [ToolCall(c["name"], json.dumps(c["arguments"])) for c in value]
    except _UNREADABLE:
        return []


_CALL_HEAD = re.compile(r'(?:\s*,)?\s*\{\s*"name"\s*:\s*')  # linear: a comma parts its runs of spaces
_ARGUMENTS_HEAD = re.compile(r'\s*,\s*"arguments"\s*:\s*')


def cut_calls(text: str, name: str | None, names: Sequence[str]) -> list[ToolCall]:
    """The calls of a forced call's output that was cut short, as OpenAI returns a call cut by
    max_tokens: each as far as it got, the last one's arguments an unfinished JSON text (a client
    that parses them fails, and finish_reason says why). For a named function, its one call; for
    `required` (compact JSON: `[{"name":"f","arguments":{...}},...`), the calls begun, a name cut
    short completed where only one of `names` begins so."""
    if name is not None:
        return [ToolCall(name, text.strip())]
    calls, decoder = [], json.JSONDecoder()
    at = text.find("[") + 1
    while at:
        head = _CALL_HEAD.match(text, at)
        if head is None:
            break
        try:  # a call generated whole
            value, at = decoder.raw_decode(text, head.start() + head.group().index("{"))
            calls.append(ToolCall(value["name"], json.dumps(value["arguments"])))
            continue
        except (ValueError, RecursionError):  # cut short (or nested past json's recursion: cut all the same)
            pass
        try:  # the call that was cut: its name, then its arguments so far
            called, end = decoder.raw_decode(text, head.end())
        except ValueError:  # its name itself was cut
            begun = text[head.end() + 1 :]
            matching = [n for n in names if n.startswith(begun)]
            calls.append(ToolCall(matching[0] if len(matching) == 1 else begun, ""))
            break
        arguments = _ARGUMENTS_HEAD.match(text, end)
        calls.append(ToolCall(called, text[arguments.end() :] if arguments else ""))
        break
    return calls


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The content and the tool calls of a model's free output: Hermes `<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>` blocks anywhere in it, or, as Llama 3 writes them, the whole
    output one JSON call `{"name": ..., "parameters": {...}}` (or several joined by `;`), optionally
    after `<|python_tag|>`. Output that holds no well-formed call is all content."""
    if HERMES_OPEN in text:
        calls = [_call(block) for block in _hermes_blocks(text)]
        if calls and all(calls):
            return text[: text.index(HERMES_OPEN)].strip(), calls  # type: ignore[return-value]
        return text, []
    stripped = text.strip().removeprefix(_PYTHON_TAG).strip()
    if stripped.startswith("{"):
        calls = [_call(part) for part in _json_parts(stripped)]
        if calls and all(calls):
            return "", calls  # type: ignore[return-value]
    return text, []


def _hermes_blocks(text: str) -> list[str]:
    """The bodies of text's `<tool_call>` blocks, each up to its `</tool_call>` (or the end), found
    in one pass: every search starts where the last one stopped, so each character is read once.
    (The regex this replaces, `<tool_call>\\s*(.*?)\\s*(?:</tool_call>|$)`, rescanned a run of
    spaces from each of its positions: 64,000 spaces in a call held the event loop for 78 s.)"""
    blocks = []
    at = text.find(HERMES_OPEN)
    while at >= 0:
        start = at + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, start)
        if end < 0:
            blocks.append(text[start:].strip())
            break
        blocks.append(text[start:end].strip())
        at = text.find(HERMES_OPEN, end + len(HERMES_CLOSE))
    return blocks


def held_from(text: str) -> int:
    """Where free output so far might begin a tool call, so a stream sends the content before it
    and holds the rest back: at a `<tool_call>`, or at a tail that may grow into one, or at 0 for
    output that begins as Llama 3's JSON call does; len(text) when nothing could be a call."""
    return HeldBack()(text)


class HeldBack:
    """held_from, for one stream's text as it grows: each call reads only what was added since the
    last one (and a tag's length before it), so a stream's calls read its text once in all. (Read
    whole at every token, a 32,000-token output took 7 s of the event loop.)"""

    def __init__(self) -> None:
        self._searched = 0  # no `<tool_call>` begins before this
        self._open = -1  # where the first one begins, once found
        self._blank = 0  # the text is whitespace up to here, while its first other character is not known
        self._lead: bool | None = None  # whether the text begins as Llama 3's call does (None: not known yet)

    def __call__(self, text: str) -> int:
        if self._open < 0:
            self._open = text.find(HERMES_OPEN, max(0, self._searched - len(HERMES_OPEN) + 1))
            self._searched = len(text)
        if self._open >= 0:
            return self._open
        if self._lead is None:
            first = _NON_SPACE.search(text, self._blank)
            self._blank = len(text) if first is None else first.start()
            head = text[self._blank : self._blank + len(_PYTHON_TAG)]
            if head.startswith(("{", _PYTHON_TAG)):
                self._lead = True
            elif head and not _PYTHON_TAG.startswith(head):  # (a tag not yet whole may still become one)
                self._lead = False
        if self._lead is not False and self._blank < len(text):
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
        except _UNREADABLE:
            return []
        parts.append(text[i:end])
        i = end
        while i < len(text) and text[i] in " \n\t;":
            i += 1
    return parts


def _call(text: str) -> ToolCall | None:
    try:
        value = json.loads(text)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments))
    except _UNREADABLE:
        return None
