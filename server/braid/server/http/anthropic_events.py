"""A message's output in Anthropic's shape: its session's deltas as the Messages API's events
(message_start, content_block_start/delta/stop, message_delta, message_stop), sent as server-sent
events with their `event:` lines, or gathered into one whole message.

Its text is read exactly as a chat's (choices.ChatChoice: content streamed as it comes, the text
that may begin a tool call held back, forced calls' arguments streamed as they are generated), and
each of the chat's deltas becomes Anthropic's: reasoning a thinking block's thinking_delta, content a
text block's text_delta, a call a tool_use block whose input streams as input_json_delta."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator

from braid.server.engine.types import Finished, FinishReason
from braid.server.http.choices import ChatChoice
from braid.server.http.errors import ApiError
from braid.server.http.events import choice_deltas, ended
from braid.server.http.requests import Plan
from braid.server.http.streaming import named_frame

if TYPE_CHECKING:
    from braid.server.engine.handle import SessionHandle
    from braid.server.http.observed import Record

Event = tuple[str, dict[str, Any]]  # (its name, its data)


def stop_reason(finished: Finished, has_calls: bool) -> str:
    """Anthropic's name for how a message ended; a forced call cut by max_tokens is `max_tokens`."""
    if finished.reason is FinishReason.MAX_TOKENS:
        return "max_tokens"
    if has_calls:
        return "tool_use"
    return "stop_sequence" if finished.reason is FinishReason.STOP_SEQUENCE else "end_turn"


class MessageEvents:
    """One message's output (Anthropic has no n: one session) as events, frames or a whole message."""

    def __init__(
        self, plan: Plan, handle: SessionHandle, model: str, record: Record, draining: Callable[[], bool]
    ) -> None:
        self._handle, self._record, self._draining = handle, record, draining
        self._choice = ChatChoice(plan)
        self._message: dict[str, Any] = {
            "id": plan.request.request_id,
            "type": "message",
            "role": "assistant",
            "model": model,
        }
        self._blocks = 0  # the open (or the next) block's index
        # the open block: ("thinking", 0), ("text", 0) or ("tool_use", its call's index)
        self._open: tuple[str, int] | None = None

    async def events(self) -> AsyncIterator[Event]:
        usage = {"input_tokens": self._handle.prompt_tokens, "output_tokens": 0}
        start: dict[str, Any] = {
            **self._message,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        yield "message_start", {"type": "message_start", "message": start}
        async for delta in choice_deltas(self._handle, self._choice, self._ended):
            for event in self._converted(delta):
                yield event
        finished = self._handle.finished
        assert finished is not None
        for event in self._closed():
            yield event
        reason = stop_reason(finished, self._choice.has_calls)
        delta = {"stop_reason": reason, "stop_sequence": finished.stop_sequence or None}
        yield (
            "message_delta",
            {
                "type": "message_delta",
                "delta": delta,
                "usage": {"output_tokens": finished.generated_tokens},
            },
        )
        yield "message_stop", {"type": "message_stop"}

    def _ended(self) -> Finished:
        return ended(self._handle, self._record, self._draining())

    def _converted(self, delta: dict[str, Any] | None) -> Iterator[Event]:
        """A chat delta (content, or tool calls: each begun with its id, then arguments) as events."""
        if delta is None:
            return
        if delta.get("reasoning_content"):  # a reasoning model's reasoning: a thinking block, before the answer
            if self._open != ("thinking", 0):
                # braid signs nothing: the signature Anthropic's blocks carry is empty
                yield from self._started(("thinking", 0), {"type": "thinking", "thinking": "", "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            if self._open != ("text", 0):
                yield from self._started(("text", 0), {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls", ()):
            function = call["function"]
            if self._open != ("tool_use", call["index"]):
                block = {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": function["name"]}
                yield from self._started(("tool_use", call["index"]), {**block, "input": {}})
            if function.get("arguments"):
                yield self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})

    def _started(self, kind: tuple[str, int], block: dict[str, Any]) -> Iterator[Event]:
        yield from self._closed()
        self._open = kind
        yield "content_block_start", {"type": "content_block_start", "index": self._blocks, "content_block": block}
        if self._blocks == 0:  # where Anthropic's own stream pings
            yield "ping", {"type": "ping"}

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": self._blocks, "delta": delta}

    def _closed(self) -> Iterator[Event]:
        if self._open is not None:
            yield "content_block_stop", {"type": "content_block_stop", "index": self._blocks}
            self._open, self._blocks = None, self._blocks + 1

    async def frames(self) -> AsyncIterator[bytes]:
        async for name, data in self.events():
            yield named_frame(name, data)

    def error_frame(self, error: ApiError) -> bytes:
        """An `error` event, in Anthropic's error shape; no message_stop follows."""
        return named_frame("error", error.body(anthropic=True))

    async def whole(self) -> dict[str, Any]:
        """The message not streamed: its events gathered, each tool_use's input parsed (a call cut
        short by max_tokens, its JSON unfinished, has the input {}: stop_reason says why)."""
        content: list[dict[str, Any]] = []
        arguments: list[str] = []  # each block's input's JSON text, as streamed
        message: dict[str, Any] = {}
        async for name, data in self.events():
            if name == "message_start":
                message = data["message"]
            elif name == "content_block_start":
                content.append(dict(data["content_block"]))
                arguments.append("")
            elif name == "content_block_delta":
                delta = data["delta"]
                if delta["type"] == "text_delta":
                    content[-1]["text"] += delta["text"]
                elif delta["type"] == "thinking_delta":
                    content[-1]["thinking"] += delta["thinking"]
                else:
                    arguments[-1] += delta["partial_json"]
            elif name == "message_delta":
                message = {**message, **data["delta"], "usage": {**message["usage"], **data["usage"]}}
        for block, text in zip(content, arguments):
            if block["type"] == "tool_use":
                block["input"] = _object(text)
        return {**message, "content": content}


def _object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}
