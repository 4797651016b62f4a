"""A request's output in OpenAI's shape: its sessions' deltas as chunks (a chat's or a
completion's), sent as server-sent events, or gathered into one whole response. Chat and
completions differ here only in the shape of a choice; everything else is one path."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from opentelemetry import trace

from braid.server.engine.types import Delta, Finished
from braid.server.frontend import spans
from braid.server.frontend.sessions import merged
from braid.server.http import choices
from braid.server.http.errors import ApiError, raise_failure
from braid.server.http.requests import Plan

if TYPE_CHECKING:
    from braid.server.engine.client import EngineClient
    from braid.server.engine.handle import SessionHandle
    from braid.server.http.observed import Record


class Events:
    """A request's output as OpenAI's chunks (`chunks`) or as one whole response (`whole`)."""

    def __init__(
        self,
        engine: EngineClient,
        plan: Plan,
        handles: list[SessionHandle],
        head: dict[str, Any],
        chat: bool,
        record: Record,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self._engine, self._plan, self._handles, self._chat, self.record = engine, plan, handles, chat, record
        self._draining = draining
        self._head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        self._choices = [choices.ChatChoice(plan) for _ in handles]
        self._offsets = [0] * len(handles)
        self.finals: list[Finished] = []

    async def frames(self) -> AsyncIterator[bytes]:
        """The chunks as server-sent events, then `data: [DONE]`."""
        async for chunk in self.chunks():
            yield b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    def error_frame(self, error: ApiError) -> bytes:
        """The last event of a stream an error cuts: the error in OpenAI's shape, and no [DONE]."""
        return b"data: " + json.dumps(error.body()).encode() + b"\n\n"

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        if self._chat:
            for i in range(len(self._handles)):
                yield self._chunk(i, {"role": "assistant", "content": ""})
        async for index, handle, batch in merged(self._handles):
            deltas = [e for e in batch if isinstance(e, Delta)]
            text = "".join(d.text for d in deltas)
            logprobs = await self._logprobs(index, deltas) if self._plan.logprobs and deltas else None
            if self._chat:
                delta = self._choices[index].feed(text, "".join(d.reasoning for d in deltas))
                if delta is not None or logprobs is not None:
                    yield self._chunk(index, delta or {}, logprobs=logprobs)
            elif text or logprobs is not None:
                yield self._chunk(index, text, logprobs=logprobs)
            if handle.finished is not None:
                self.finals.append(ended(handle, self.record, self._draining()))
                # the choice's whole text, read for tool calls: off the event loop (it grows with the output)
                last = await asyncio.to_thread(self._choices[index].end) if self._chat else None
                has_calls = self._choices[index].has_calls
                if last is not None:
                    yield self._chunk(index, last)
                reason = choices.finish_reason(handle.finished, has_calls)
                yield self._chunk(index, {} if self._chat else "", finish_reason=reason)
        if self._plan.include_usage:
            yield {**self._head, "choices": [], "usage": choices.usage(self.finals)}

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any] | str,
        logprobs: dict[str, Any] | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "delta": delta} if self._chat else {"index": index, "text": delta}
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
        chunk = {**self._head, "choices": [choice]}
        if self._plan.include_usage:
            chunk["usage"] = None
        return chunk

    async def whole(self) -> dict[str, Any]:
        """The response that is not streamed: every chunk gathered into one choice per sample."""
        texts = [""] * len(self._handles)
        logprobs: list[list[dict[str, Any]]] = [[] for _ in self._handles]
        reasons = [""] * len(self._handles)
        async for chunk in self.chunks():
            for choice in chunk["choices"]:
                i = choice["index"]
                if choice["logprobs"] is not None:
                    logprobs[i].append(choice["logprobs"])
                if not self._chat:
                    texts[i] += choice["text"]
                reasons[i] = choice["finish_reason"] or reasons[i]
        # assembled off the event loop: messages (read for tool calls again) and logprobs grow with the output
        return await asyncio.to_thread(self._whole, texts, logprobs, reasons)

    def _whole(self, texts: list[str], logprobs: list[list[dict[str, Any]]], reasons: list[str]) -> dict[str, Any]:
        out = []
        for i in range(len(self._handles)):
            lp = _joined(logprobs[i]) if self._plan.logprobs else None
            if self._chat:
                out.append(
                    {"index": i, "message": self._choices[i].message(), "logprobs": lp, "finish_reason": reasons[i]}
                )
            else:
                out.append({"index": i, "text": texts[i], "logprobs": lp, "finish_reason": reasons[i]})
        head = {**self._head, "object": "chat.completion" if self._chat else "text_completion"}
        return {**head, "choices": out, "usage": choices.usage(self.finals)}

    async def _logprobs(self, index: int, deltas: list[Delta]) -> dict[str, Any]:
        ids, lps = choices.token_logprobs(deltas)
        wanted = choices.logprob_ids(ids, lps)
        # a tokenizer's first use on a thread may copy it: off the event loop
        texts = await asyncio.get_running_loop().run_in_executor(None, self._engine.pieces, wanted)
        piece = dict(zip(wanted, texts))
        if self._chat:
            return choices.chat_logprobs(ids, lps, piece)
        out = choices.completion_logprobs(ids, lps, piece, self._offsets[index])
        self._offsets[index] += sum(len(piece[t]) for t in ids)
        return out


def ended(handle: SessionHandle, record: Record, draining: bool) -> Finished:
    """A session's end, as every API's output reads it: its failure raised (http/errors.py), else
    its Finished noted on the call's record and span."""
    finished = handle.finished
    assert finished is not None
    raise_failure(finished, draining)
    record.finished(finished)
    with trace.use_span(record.span, end_on_exit=False):
        spans.on_finished(handle)
    return finished


async def choice_deltas(
    handle: SessionHandle, choice: choices.ChatChoice, ended: Callable[[], Finished]
) -> AsyncIterator[dict[str, Any]]:
    """One session's output read as a chat choice, for an API that translates chat's deltas into
    its own events (Anthropic's, the Responses API's): its deltas as its text comes, then, once it
    has ended (`ended`: its failure raised, its Finished noted), the last one: the calls not sent
    yet, found in the whole text, read off the event loop (that grows with the output)."""
    async for batch in handle.batches():
        deltas = [e for e in batch if isinstance(e, Delta)]
        delta = choice.feed("".join(d.text for d in deltas), "".join(d.reasoning for d in deltas))
        if delta is not None:
            yield delta
        if handle.finished is not None:
            ended()
            last = await asyncio.to_thread(choice.end)
            if last is not None:
                yield last


def _joined(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not parts:
        return None
    if "content" in parts[0]:
        return {"content": [c for p in parts for c in p["content"]]}
    return {key: [v for p in parts for v in p[key]] for key in parts[0]}
