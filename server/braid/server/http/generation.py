"""The one path every generating route takes (chat, completions, Anthropic's messages, responses): its body
read and checked, the fields braid does not know named, the engine's request submitted through the
lanes, and its output streamed as server-sent events or sent whole, the call's sessions ended
however it ends. A route adds only how its body becomes a Plan (http/requests.py) and the shape of
its output (streaming.Output)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Callable, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from braid.server.config import ServerConfig
from braid.server.engine.types import EngineUnavailable, InvalidArgument
from braid.server.frontend import spans
from braid.server.frontend.lanes import TokenizerLanes
from braid.server.frontend.sessions import CallSessions, submit
from braid.server.http.anthropic_protocol import CountTokensRequest, MessagesRequest
from braid.server.http.body import read
from braid.server.http.events import Events
from braid.server.http.embeddings import EmbeddingsRequest
from braid.server.http.protocol import ChatRequest, CompletionRequest, shown, unknown_fields
from braid.server.http.requests import Plan
from braid.server.http.responses_protocol import ResponsesRequest
from braid.server.http.streaming import EventStream, Output, sse, unless_disconnected

if TYPE_CHECKING:
    from braid.server.engine.client import EngineClient
    from braid.server.engine.handle import SessionHandle
    from braid.server.http.observed import Record

_LOGGER = logging.getLogger("braid.server.http.app")  # the HTTP API's one logger name, in every line it writes
IGNORED_HEADER = "braid-ignored-fields"  # the request's fields braid does not know, and so ignored
_MOST_NAMED = 8  # unknown fields named per request (a header, a log line): the first ones
_MOST_WARNED = 1024  # distinct unknown fields logged as warnings, once each, in a process's life
Body = TypeVar(
    "Body", ChatRequest, CompletionRequest, MessagesRequest, CountTokensRequest, ResponsesRequest, EmbeddingsRequest
)
# a call's output in its API's shape, from its sessions and the model name it answers under
OutputOf = Callable[["list[SessionHandle]", str], Output]


def served_names(engine: EngineClient) -> tuple[str, ...]:
    """The names the base model answers to: --served-model-name's, else the model's own."""
    info = engine.info
    return info.served_model_names or (info.model_name,)


def with_ignored(response: Response, record: Record) -> Response:
    """The response, with a header naming the request's fields braid ignored, if it ignored any."""
    if record.ignored:
        response.headers[IGNORED_HEADER] = ", ".join(record.ignored)
    return response


class Generations:
    """The generating routes' shared path, and what it keeps between calls: the tokenizer lanes and
    the unknown fields already warned of."""

    def __init__(self, engine: EngineClient, config: ServerConfig, draining: Callable[[], bool]) -> None:
        self._engine = engine
        self._config = config
        self._draining = draining
        self._lanes = TokenizerLanes()
        self._warned: set[str] = set()  # unknown fields already logged

    def close(self) -> None:
        self._lanes.shutdown()

    @property
    def lanes(self) -> TokenizerLanes:
        """The tokenizer lanes, for a route that is not a generation (embeddings)."""
        return self._lanes

    async def body(self, request: Request, model: type[Body], record: Record) -> Body:
        """The request's body as `model` (up to --max-message-bytes), its unknown fields and its
        user noted on the call's record."""
        body = await read(request, model, self._config.max_message_bytes)
        await self._unknown_fields(body, record)
        record.user = body.user
        return body

    async def respond(
        self, request: Request, record: Record, plan: Plan, body: ChatRequest | CompletionRequest
    ) -> Response:
        """An OpenAI plan run: its output as chat's or completions' chunks."""
        chat = isinstance(body, ChatRequest)

        def openai(handles: list[SessionHandle], model: str) -> Output:
            head = {"id": plan.request.request_id, "created": int(time.time()), "model": model}
            return Events(self._engine, plan, handles, head, chat, record, self._draining)

        return await self.run(request, record, plan, body.model, body.stream, openai)

    async def run(
        self, request: Request, record: Record, plan: Plan, model: str | None, stream: bool, output: OutputOf
    ) -> Response:
        """The plan run, under the adapter `model` names: streamed where the body asks, else one
        whole response, each in `output`'s shape."""
        plan = self._with_adapter(plan, model)
        return with_ignored(await self._generate(request, plan, record, stream, output), record)

    async def count(self, request: Request, plan: Plan) -> int:
        """The tokens of the plan's prompt, as its chat template renders it with the plan's tools
        and template variables: those its generation's prompt would have (a Tokenize call's work)."""
        req = plan.request
        ticket = self._engine.admit(req.prompt, req.messages, for_session=False)
        args = (req.prompt, req.messages, False, req.tools, req.chat_template_kwargs)
        tokenized = self._lanes.run(ticket, self._engine.tokenize, *args)
        return len((await unless_disconnected(request, tokenized))[0])  # (ids, pieces, ...)

    async def _unknown_fields(self, body: BaseModel, record: Record) -> None:
        """The body's fields braid does not know (a misspelled option, another server's extra):
        refused under --strict-request-fields, naming the first; else ignored, each name logged
        once as a warning, and named in the request's log line and the response's header. Found
        off the event loop: the walk grows with the body."""
        names = [shown(name) for name in await asyncio.to_thread(unknown_fields, body)]
        if names and self._config.strict_request_fields:
            raise InvalidArgument(names[0], "is not a field braid knows (--strict-request-fields)")
        record.ignored = names[:_MOST_NAMED]
        new = [n for n in record.ignored if n not in self._warned]
        if new and len(self._warned) < _MOST_WARNED:
            self._warned.update(new)
            _LOGGER.warning("HTTP %s: ignoring fields braid does not know: %s", record.route, ", ".join(new))

    def _with_adapter(self, plan: Plan, model: str | None) -> Plan:
        """A `model` that names a loaded LoRA adapter runs with it; a served name (any of
        --served-model-name), and any other name, is the base model, as it was before adapters."""
        if model and model not in served_names(self._engine) and model in {a.name for a in self._engine.loras()}:
            return dataclasses.replace(plan, request=dataclasses.replace(plan.request, adapter=model))
        return plan

    async def _generate(self, request: Request, plan: Plan, record: Record, stream: bool, output: OutputOf) -> Response:
        if self._draining():
            raise EngineUnavailable("the server is draining; retry on another replica")
        req = plan.request
        record.request_id = req.request_id
        call = CallSessions(req)
        try:
            handles = await unless_disconnected(request, submit(self._engine, self._lanes, req, call))
        except BaseException:
            call.end()
            raise
        spans.on_session(handles[0], self._engine.info.mode)
        # the model's first served name, or the adapter the request runs with (as vLLM answers)
        events = output(handles, req.adapter or self._engine.info.model_name)
        if stream:
            record.streamed = True

            def closed() -> None:
                call.end()
                record.done()

            return EventStream(
                sse(events, record, call),
                on_close=closed,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            whole = await unless_disconnected(request, events.whole())
        finally:
            call.end()
        return await asyncio.to_thread(JSONResponse, whole)  # its JSON grows with the output: off the event loop
