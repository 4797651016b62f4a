"""OpenAI's HTTP API on braid's engine (Starlette): /v1/chat/completions and /v1/completions,
streamed as server-sent events or not, /v1/models and /health. This module holds the routes; each
job around them has its own: observed.py (the API key, errors, the span, the log line and the
metric around every call), events.py (chat's and completions' output in OpenAI's shape),
streaming.py (SSE and disconnects), errors.py, body.py.

Like the gRPC servicer, it reaches the engine only through EngineClient, runs on the gRPC server's
event loop and never blocks it: admission, compiling and tokenizing go through the same lanes and
the same `submit` (frontend/sessions.py). A call's sessions are cancelled however it ends: a
client that disconnects mid-stream or while waiting for a whole response ends them at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import pydantic
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from braid.server.config import ServerConfig
from braid.server.engine.types import EngineUnavailable, InvalidArgument
from braid.server.frontend import spans
from braid.server.frontend.lanes import TokenizerLanes
from braid.server.frontend.observer import CallObserver, NoCalls
from braid.server.frontend.sessions import CallSessions, submit
from braid.server.http import observed
from braid.server.http.body import read
from braid.server.http.errors import ApiError, not_allowed, not_found
from braid.server.http.events import Events
from braid.server.http.observed import Handler, Record
from braid.server.http.protocol import ChatRequest, CompletionRequest, shown, unknown_fields
from braid.server.http.requests import Plan, chat_plan, completion_plan
from braid.server.http.streaming import EventStream, sse, unless_disconnected

if TYPE_CHECKING:
    from braid.server.engine.client import EngineClient

_LOGGER = logging.getLogger(__name__)
IGNORED_HEADER = "braid-ignored-fields"  # the request's fields braid does not know, and so ignored
_MOST_NAMED = 8  # unknown fields named per request (a header, a log line): the first ones
_MOST_WARNED = 1024  # distinct unknown fields logged as warnings, once each, in a process's life


# /metrics' page for a scraper's Accept header: (body, content type). Blocking.
MetricsPage = Callable[[str], tuple[bytes, str]]


class OpenAIApi:
    def __init__(
        self,
        engine: EngineClient,
        config: ServerConfig,
        calls: CallObserver | None = None,
        metrics: MetricsPage | None = None,
    ) -> None:
        """metrics: serves GET /metrics where given (telemetry's Prometheus page, which the root
        passes in: the front end never imports telemetry)."""
        self._engine = engine
        self._config = config
        self._calls = calls or NoCalls()
        self._lanes = TokenizerLanes()
        self._api_key = config.api_key.encode() if config.api_key else None
        self.draining = False
        self._warned: set[str] = set()  # unknown fields already logged
        self.created = int(time.time())
        self._metrics = metrics
        self.app = Starlette(
            routes=[
                *([Route("/metrics", self.metrics, methods=["GET"])] if metrics is not None else []),
                self._route("/v1/chat/completions", self.chat, methods=["POST"]),
                self._route("/v1/completions", self.completions, methods=["POST"]),
                self._route("/v1/models", self.models, methods=["GET"]),
                self._route("/v1/models/{id:path}", self.model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={404: not_found, 405: not_allowed},
        )

    def close(self) -> None:
        self._lanes.shutdown()

    # ---- routes -------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        """Prometheus' page, as --metrics-port serves it; with --api-key, only to a scraper that
        sends the key (Prometheus: `authorization: {credentials: <key>}`), as every route but
        /health. A scrape is no call: it has no span, log line or call metric, as health checks."""
        assert self._metrics is not None
        try:
            observed.authorize(request, self._api_key)
        except ApiError as exc:
            return exc.response()
        body, content_type = await asyncio.to_thread(self._metrics, request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    async def models(self, request: Request, record: Record) -> Response:
        return JSONResponse({"object": "list", "data": self._model_cards()})

    async def model(self, request: Request, record: Record) -> Response:
        """GET /v1/models/{id}: one of the list's cards (a served name, or an adapter's)."""
        wanted = request.path_params["id"]
        card = next((c for c in self._model_cards() if c["id"] == wanted), None)
        if card is None:
            raise ApiError(404, "not_found_error", f"the model {wanted!r} does not exist", "model")
        return JSONResponse(card)

    def _model_cards(self) -> list[dict[str, Any]]:
        """What /v1/models lists, as vLLM lists it: a card per served name (--served-model-name),
        then one per LoRA adapter, whose parent is the model's first name. The root is that name too,
        where vLLM puts --model: a path would tell every caller where the server keeps its files
        (ModelInfo.model_path says it over gRPC)."""
        info = self._engine.info

        def card(name: str, root: str, parent: str | None = None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "braid",
                "root": root,
                "parent": parent,
                "max_model_len": info.context_length,
            }

        served = [card(name, info.model_name) for name in self._served_names()]
        return served + [card(a.name, info.model_name, info.model_name) for a in self._engine.loras()]

    def _served_names(self) -> tuple[str, ...]:
        info = self._engine.info
        return info.served_model_names or (info.model_name,)

    def _with_adapter(self, plan: Plan, model: str | None) -> Plan:
        """A `model` that names a loaded LoRA adapter runs with it; a served name (any of
        --served-model-name), and any other name, is the base model, as it was before adapters."""
        if model and model not in self._served_names() and model in {a.name for a in self._engine.loras()}:
            return dataclasses.replace(plan, request=dataclasses.replace(plan.request, adapter=model))
        return plan

    async def chat(self, request: Request, record: Record) -> Response:
        body = await read(request, ChatRequest, self._config.max_message_bytes)
        await self._unknown_fields(body, record)
        record.user = body.user
        info = self._engine.info
        plan = self._with_adapter(
            chat_plan(body, self._config.default_max_new_tokens, info.vocab_size, info.chat_template_takes_tools),
            body.model,
        )
        return _naming_ignored(await self._generate(request, plan, record, body.stream, chat=True), record)

    async def completions(self, request: Request, record: Record) -> Response:
        body = await read(request, CompletionRequest, self._config.max_message_bytes)
        await self._unknown_fields(body, record)
        record.user = body.user
        plan = self._with_adapter(
            completion_plan(body, self._config.default_max_new_tokens, self._engine.info.vocab_size), body.model
        )
        return _naming_ignored(await self._generate(request, plan, record, body.stream, chat=False), record)

    async def _unknown_fields(self, body: pydantic.BaseModel, record: Record) -> None:
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

    # ---- generation ---------------------------------------------------------------------------

    async def _generate(self, request: Request, plan: Plan, record: Record, stream: bool, chat: bool) -> Response:
        if self.draining:
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
        head = {"id": req.request_id, "created": int(time.time()), "model": req.adapter or self._engine.info.model_name}
        events = Events(self._engine, plan, handles, head, chat, record, lambda: self.draining)
        if stream:
            record.streamed = True

            def closed() -> None:
                call.end()
                record.done()

            return EventStream(
                sse(events, call),
                on_close=closed,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            whole = await unless_disconnected(request, events.whole())
        finally:
            call.end()
        return await asyncio.to_thread(JSONResponse, whole)  # its JSON grows with the output: off the event loop

    def _route(self, path: str, handler: Handler, methods: list[str]) -> Route:
        return observed.route(path, handler, methods, self._calls, self._api_key)


def _naming_ignored(response: Response, record: Record) -> Response:
    """The response, with a header naming the request's fields braid ignored (if any)."""
    if record.ignored:
        response.headers[IGNORED_HEADER] = ", ".join(record.ignored)
    return response
