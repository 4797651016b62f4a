"""A response's output in the Responses API's shape: its session's deltas as the API's events
(response.created, response.in_progress, then each output item's output_item.added, its text's
content_part.added, output_text.delta and .done and content_part.done, or its call's
function_call_arguments.delta and .done, and its output_item.done; then response.completed or
response.incomplete), each with its `event:` line and sequence_number, or gathered into one whole
response (the last event's).

Its text is read exactly as a chat's (choices.ChatChoice: content streamed as it comes, the text
that may begin a tool call held back, forced calls' arguments streamed as they are generated), and
each of the chat's deltas becomes the API's: reasoning a reasoning item's reasoning_text, content a
message item's output_text, a call a function_call item whose arguments stream."""

from __future__ import annotations

import copy
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator

from braid.server.engine.types import Finished, FinishReason, InvalidArgument
from braid.server.http.choices import ChatChoice
from braid.server.http.errors import ApiError
from braid.server.http.events import choice_deltas, ended
from braid.server.http.requests import Plan
from braid.server.http.streaming import named_frame

if TYPE_CHECKING:
    from braid.server.engine.handle import SessionHandle
    from braid.server.http.observed import Record

Event = tuple[str, dict[str, Any]]  # (its name, its data)
# the Responses API's error codes (ResponseError.code) for the statuses a stream can fail with
_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}


def usage(finished: Finished) -> dict[str, Any]:
    """A response's usage, a reasoning model's reasoning tokens counted apart."""
    return {
        "input_tokens": finished.prompt_tokens,
        "input_tokens_details": {"cached_tokens": finished.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": finished.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": finished.reasoning_tokens},
        "total_tokens": finished.prompt_tokens + finished.generated_tokens,
    }


class ResponseEvents:
    """One response's output (one session) as events, frames or a whole response.

    head: the response's fields that do not change as it is made (the request's, echoed);
    rename: a chat field's name as the Responses body names it (an error the engine finds late)."""

    def __init__(
        self,
        plan: Plan,
        handle: SessionHandle,
        head: dict[str, Any],
        record: Record,
        draining: Callable[[], bool],
        rename: Callable[[str], str],
    ) -> None:
        self._handle, self._record, self._draining, self._rename = handle, record, draining, rename
        self._choice = ChatChoice(plan)
        self._head = {"id": plan.request.request_id, "object": "response", "created_at": int(time.time()), **head}
        self._items: list[dict[str, Any]] = []  # the output items as they stand
        # the open item: ("reasoning", 0), ("message", 0) or ("function_call", its index)
        self._open: tuple[str, int] | None = None
        self._sequence = 0

    def _response(self, status: str, **fields: Any) -> dict[str, Any]:
        """The response as it stands."""
        base = {"status": status, "error": None, "incomplete_details": None, "usage": None}
        return {**self._head, **base, "output": copy.deepcopy(self._items), **fields}

    def _event(self, kind: str, /, **data: Any) -> Event:
        self._sequence += 1
        return kind, {"type": kind, "sequence_number": self._sequence - 1, **data}

    async def events(self) -> AsyncIterator[Event]:
        yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.in_progress", response=self._response("in_progress"))
        async for delta in choice_deltas(self._handle, self._choice, self._ended):
            for event in self._converted(delta):
                yield event
        finished = self._handle.finished
        assert finished is not None
        if not self._items:  # nothing said: an empty message, as OpenAI's
            for event in self._added(_message()):
                yield event
        cut = finished.reason is FinishReason.MAX_TOKENS
        for event in self._closed("incomplete" if cut else "completed"):
            yield event
        if cut:
            cause = {"reason": "max_output_tokens"}
            yield self._event(
                "response.incomplete",
                response=self._response("incomplete", incomplete_details=cause, usage=usage(finished)),
            )
        else:
            done = self._response("completed", completed_at=int(time.time()), usage=usage(finished))
            yield self._event("response.completed", response=done)

    def _ended(self) -> Finished:
        """The session's end (ended: its failure raised), an invalid field named as this API names it."""
        try:
            return ended(self._handle, self._record, self._draining())
        except InvalidArgument as exc:
            raise InvalidArgument(self._rename(exc.field), exc.description) from None

    def _converted(self, delta: dict[str, Any] | None) -> Iterator[Event]:
        """A chat delta (content, or tool calls: each begun with its id, then arguments) as events."""
        if delta is None:
            return
        if delta.get("reasoning_content"):  # a reasoning model's reasoning: a reasoning item, before the answer
            if self._open is None or self._open[0] != "reasoning":
                yield from self._added(_reasoning())
            self._items[-1]["content"][0]["text"] += delta["reasoning_content"]
            yield self._event(
                "response.reasoning_text.delta", **self._at(), content_index=0, delta=delta["reasoning_content"]
            )
        if delta.get("content"):
            if self._open is None or self._open[0] != "message":
                yield from self._added(_message())
            item = self._items[-1]
            item["content"][0]["text"] += delta["content"]
            yield self._event(
                "response.output_text.delta", **self._at(), content_index=0, delta=delta["content"], logprobs=[]
            )
        for call in delta.get("tool_calls", ()):
            function = call["function"]
            if self._open != ("function_call", call["index"]):
                item = {
                    "type": "function_call",
                    "id": "fc_" + uuid.uuid4().hex,
                    "call_id": call["id"],
                    "name": function["name"],
                    "arguments": "",
                    "status": "in_progress",
                }
                yield from self._added(item, call["index"])
            if function.get("arguments"):
                self._items[-1]["arguments"] += function["arguments"]
                yield self._event("response.function_call_arguments.delta", **self._at(), delta=function["arguments"])

    def _at(self) -> dict[str, Any]:
        """Where the open item is: its id and its index in the output."""
        return {"item_id": self._items[-1]["id"], "output_index": len(self._items) - 1}

    def _added(self, item: dict[str, Any], index: int = 0) -> Iterator[Event]:
        yield from self._closed("completed")
        self._items.append(item)
        self._open = (item["type"], index)
        yield self._event("response.output_item.added", output_index=len(self._items) - 1, item=copy.deepcopy(item))
        parts: dict[str, dict[str, Any]] = {
            "message": {"type": "output_text", "text": "", "annotations": []},
            "reasoning": {"type": "reasoning_text", "text": ""},
        }
        if item["type"] in parts:
            part = parts[item["type"]]
            item["content"].append(part)
            yield self._event("response.content_part.added", **self._at(), content_index=0, part=dict(part))

    def _closed(self, status: str) -> Iterator[Event]:
        """The open item's last events: its text's or its arguments', then its own, with `status`."""
        if self._open is None:
            return
        item = self._items[-1]
        if item["type"] == "message":
            part = item["content"][0]
            text = part["text"]
            yield self._event("response.output_text.done", **self._at(), content_index=0, text=text, logprobs=[])
            yield self._event("response.content_part.done", **self._at(), content_index=0, part=dict(part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            yield self._event("response.reasoning_text.done", **self._at(), content_index=0, text=part["text"])
            yield self._event("response.content_part.done", **self._at(), content_index=0, part=dict(part))
        else:
            arguments = item["arguments"]
            yield self._event(
                "response.function_call_arguments.done", **self._at(), name=item["name"], arguments=arguments
            )
        item["status"] = status
        yield self._event("response.output_item.done", output_index=len(self._items) - 1, item=copy.deepcopy(item))
        self._open = None

    async def frames(self) -> AsyncIterator[bytes]:
        async for name, data in self.events():
            yield named_frame(name, data)

    def error_frame(self, error: ApiError) -> bytes:
        """response.failed, its error in the API's shape (ResponseError); nothing follows it."""
        failure = {
            "code": _CODES.get(error.status, "server_error"),
            "message": error.message,
            "param": error.param,
            "type": error.kind,
        }
        name, data = self._event("response.failed", response=self._response("failed", error=failure))
        return named_frame(name, data)

    async def whole(self) -> dict[str, Any]:
        """The response not streamed: the last event's (response.completed or .incomplete)."""
        response: dict[str, Any] = {}
        async for _, data in self.events():
            response = data.get("response", response)
        return response


def _reasoning() -> dict[str, Any]:
    """A reasoning model's reasoning as an output item: its text in full (braid writes no summary)."""
    return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [], "content": [], "status": "in_progress"}


def _message() -> dict[str, Any]:
    return {
        "type": "message",
        "id": "msg_" + uuid.uuid4().hex,
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
