"""A request's tools, whatever API brought them (OpenAI's chat, Anthropic's messages, braid's
GenerateRequest): how they become the engine's request (`plan_tools`), and how a choice's output is
read back for calls (`CallReader`). A front end translates its tools into OpenAI's definitions (the
shape chat templates take) and its tool_choice into a mode, and renders what the reader reads in its
own API's shape; the rest is this one implementation, so a request means the same on every API.

The checks name braid's fields (the .proto's: `tools[1].name`, `tool_choice.function`); `spelling`
names each as the calling front end does, as frontend/checks.py's do."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from braid.server.engine.types import Constraint, GenerationRequest, InvalidArgument, Message
from braid.server.frontend import checks, tools
from braid.server.frontend.checks import Spelling, braids

AUTO, NONE, REQUIRED = "auto", "none", "required"  # the modes of a tool_choice that names no function


@dataclass(frozen=True)
class ToolPlan:
    """How a request's output is read for tool calls: `mode` None (plain text), "auto" (parsed from
    free output) or "forced" (the output is the call: of `function`, or, with None, a list of calls
    of any of `names`)."""

    mode: str | None = None
    function: str | None = None
    names: tuple[str, ...] = ()


def plan_tools(
    req: GenerationRequest,
    definitions: Sequence[dict[str, Any]],
    choice: str | None = None,
    function: str | None = None,
    parallel: bool = True,
    takes_tools: bool = True,
    spelling: Spelling = braids,
) -> tuple[GenerationRequest, ToolPlan]:
    """The request with its tools, and how its output is read back: a forced call's constraint, the
    tools for the chat template (or, where the template does not render them, takes_tools False, in
    its system message), its tool messages checked.

    definitions: OpenAI's, {"type": "function", "function": {"name", "description", "parameters"}};
    choice: AUTO, NONE, REQUIRED, or None (left out: auto with tools); function: the one tool a call
    is forced to (a named tool_choice); parallel: whether a REQUIRED call may call several."""
    try:
        return _planned(req, list(definitions), choice, function, parallel, takes_tools, spelling)
    except InvalidArgument as exc:
        raise InvalidArgument(spelling(exc.field), exc.description) from None


def _planned(
    req: GenerationRequest,
    definitions: list[dict[str, Any]],
    choice: str | None,
    function: str | None,
    parallel: bool,
    takes_tools: bool,
    spelling: Spelling,
) -> tuple[GenerationRequest, ToolPlan]:
    for i, m in enumerate(req.messages):
        if m.role == "tool" and not m.tool_call_id:
            raise InvalidArgument(f"messages[{i}].tool_call_id", "is required in a tool message")
    names = _names(definitions)
    mode = _mode(names, choice, function)
    if mode is None:
        return req, ToolPlan(names=names)
    if req.params.skip_detokenize:
        raise InvalidArgument("tools", "tool calls are read from the text, and skip_detokenize makes none")
    if req.resume_token_ids:
        raise InvalidArgument("resume_token_ids", "tool calls are read from the whole output: not with tools")
    constraint = req.constraint
    if mode == "forced":
        if constraint is not None:
            raise InvalidArgument("tool_choice", f"a forced tool call and {spelling('constraint')} cannot go together")
        schema = tools.forced_schema(definitions, function, parallel)
        constraint = Constraint("json_schema", json.dumps(schema), "tools")
        if len(constraint.text.encode()) > checks.MAX_CONSTRAINT_BYTES:
            raise InvalidArgument("tools", f"the tools' schemas are over {checks.MAX_CONSTRAINT_BYTES} bytes")
    messages, rendered = for_template(req.messages, definitions, takes_tools)
    req = dataclasses.replace(req, messages=messages, constraint=constraint, tools=rendered)
    return req, ToolPlan(mode, function, names)


def for_template(
    messages: tuple[Message, ...], definitions: list[dict[str, Any]], takes_tools: bool
) -> tuple[tuple[Message, ...], str]:
    """The chat and its tools as the chat template gets them: the tools as JSON text, or, where
    the template does not render them (takes_tools False), in the chat's system message, with
    how to call them, and "". Used for a generation's prompt and for counting its tokens alike."""
    if not definitions:
        return messages, ""
    if not takes_tools and messages:  # the template would drop them without a word
        return _with_system(messages, tools.tools_prompt(definitions)), ""
    return messages, json.dumps(definitions)


def tokenized_tools(
    messages: tuple[Message, ...], definitions: list[dict[str, Any]], takes_tools: bool = True
) -> tuple[tuple[Message, ...], str]:
    """A chat to be tokenized with these tools (a Tokenize call's): the tools checked as a
    generation's are (naming braid's fields, tools[i].name), then as the template gets them."""
    _names(definitions)
    return for_template(messages, definitions, takes_tools)


def _names(definitions: list[dict[str, Any]]) -> tuple[str, ...]:
    """The tools' names, each checked: given, unique, its parameters a JSON object."""
    names: list[str] = []
    for i, definition in enumerate(definitions):
        function = definition["function"]
        name = function.get("name")
        if not name:
            raise InvalidArgument(f"tools[{i}].name", "is required")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidArgument(f"tools[{i}].parameters", "must be a JSON Schema: a JSON object")
        if name in names:
            raise InvalidArgument("tools", f"tools[{names.index(name)}] and tools[{i}] have the same name {name!r}")
        names.append(name)
    return tuple(names)


def _mode(names: tuple[str, ...], choice: str | None, function: str | None) -> str | None:
    """How tool calls are read back (ToolPlan.mode)."""
    if not names:
        if function is not None or choice not in (None, NONE):
            raise InvalidArgument("tool_choice", "needs tools")
        return None
    if function is not None:
        if function not in names:
            raise InvalidArgument("tool_choice.function", f"{function!r} is not one of the tools")
        return "forced"
    if choice in (None, AUTO):
        return "auto"
    if choice == REQUIRED:
        return "forced"
    if choice == NONE:
        return None
    raise InvalidArgument("tool_choice", f"{choice!r}: one of {AUTO}, {NONE} and {REQUIRED}, or a function")


def _with_system(messages: tuple[Message, ...], text: str) -> tuple[Message, ...]:
    """The chat with `text` at the end of its system message, or in a new one first."""
    if messages[0].role == "system":
        first = messages[0]
        content = f"{first.content}\n\n{text}" if first.content else text
        return (dataclasses.replace(first, content=content), *messages[1:])
    return (Message(role="system", content=text), *messages)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class Read:
    """What a piece of output adds: text to send as content, and the calls it completes."""

    content: str = ""
    calls: tuple[tools.ToolCall, ...] = ()


# what a scan of a forced list of calls looks at: quotes, escapes and brackets
_JSON_MARK = re.compile(r'["\\{}\[\]]')


class CallReader:
    """One choice's (one sample's) output, read for tool calls as it arrives (`feed`) and at its end
    (`end`): the text to send as content, and the calls completed. Content is sent as it comes; in
    `auto` mode the text that might begin a call is held back until the end, when the whole text is
    parsed (one malformed call makes all of it content). A forced call is never content: a list's
    calls complete as each one's JSON object closes, a named function's at the end. A forced call cut
    short (max_tokens) ends with its calls as far as they got (`cut`), as OpenAI sends them."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._pieces: list[str] = []  # the text, joined when read (without tools, never while streamed)
        self.content = ""  # the whole output's content, after `end`
        self.calls: list[tools.ToolCall] = []
        self.cut = False
        self.named_id = new_call_id()  # a named function's call's id, known before its arguments
        self._sent = 0  # characters of text sent as content (auto)
        self._held = tools.HeldBack()  # where a tool call may begin, read as the text grows
        # a forced list of calls, scanned once as it grows: how far, how deep, inside a string or not
        self._scanned, self._depth, self._in_string = 0, 0, False
        self._escaped_at = -1  # the character after a backslash in a string
        self._element = 0  # where the call being generated begins

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def has_calls(self) -> bool:
        """Whether the output ends in whole tool calls (OpenAI's finish_reason `tool_calls`)."""
        return bool(self.calls) and not self.cut

    def feed(self, text: str) -> Read:
        self._pieces.append(text)
        plan = self._plan
        if plan.mode is None:
            return Read(text)
        if plan.mode == AUTO:
            held = self._held(self.text)
            if held <= self._sent:
                return Read()
            content, self._sent = self.text[self._sent : held], held
            return Read(content)
        return Read(calls=tuple(self._closed_calls())) if plan.function is None else Read()

    def end(self) -> Read:
        """What the whole output adds at its end: the content held back, or the calls in it."""
        plan = self._plan
        if plan.mode is None:
            self.content = self.text
            return Read()
        if plan.mode == AUTO:
            self.content, found = tools.parse_tool_calls(self.text)
            if found:
                self.calls = [dataclasses.replace(c, id=new_call_id()) for c in found]
                return Read(calls=tuple(self.calls))
            rest, self._sent = self.text[self._sent :], len(self.text)
            return Read(rest)
        found = tools.forced_calls(self.text, plan.function)
        self.cut = not found
        if self.cut:  # by max_tokens, say: its calls all the same, never content
            found = tools.cut_calls(self.text, plan.function, plan.names)
        if plan.function is not None:
            self.calls = [tools.ToolCall(plan.function, found[0].arguments, self.named_id)]
            return Read(calls=tuple(self.calls))
        sent = len(self.calls)  # (the calls closed while streamed, found again in the same order)
        self.calls += [dataclasses.replace(c, id=new_call_id()) for c in found[sent:]]
        return Read(calls=tuple(self.calls[sent:]))

    def _closed_calls(self) -> list[tools.ToolCall]:
        """The calls of a forced list (`[{"name":...,"arguments":{...}},...]`) whose JSON objects
        closed since the last look. The text is scanned once, from mark to mark; each call is parsed
        once, when it closes."""
        closed = []
        text = self.text
        for mark in _JSON_MARK.finditer(text, self._scanned):
            at, c = mark.start(), mark.group()
            if at == self._escaped_at:
                continue
            if self._in_string:
                if c == "\\":
                    self._escaped_at = at + 1
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
                if self._depth == 2:
                    self._element = at
            else:
                self._depth -= 1
                if self._depth == 1:
                    for call in tools.forced_calls("[" + text[self._element : at + 1] + "]", None):
                        closed.append(dataclasses.replace(call, id=new_call_id()))
        self._scanned = len(text)
        self.calls += closed
        return closed
