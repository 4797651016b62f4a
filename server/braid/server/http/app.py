"""OpenAI's HTTP API on braid's engine (Starlette): /v1/chat/completions and /v1/completions,
streamed as server-sent events or not, /v1/models and /health.

Like the gRPC servicer, it reaches the engine only through EngineClient, runs on the gRPC server's
event loop and never blocks it: admission, compiling and tokenizing go through the same lanes and
the same `submit` (frontend/sessions.py). A call's sessions are cancelled however it ends: a
client that disconnects mid-stream or while waiting for a whole response ends them at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
import pydantic
from opentelemetry import propagate, trace
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from braid.server.config import ServerConfig
from braid.server.engine.types import (
    Delta,
    EngineUnavailable,
    Finished,
    FinishReason,
    InvalidArgument,
    NotFound,
    Overloaded,
)
from braid.server.frontend import spans
from braid.server.frontend.auth import bearer_matches
from braid.server.frontend.errors import capped
from braid.server.frontend.lanes import TokenizerLanes
from braid.server.frontend.observer import CallObserver, NoCalls
from braid.server.frontend.request_log import echoed
from braid.server.frontend.sessions import CallSessions, merged, submit
from braid.server.http import choices
from braid.server.http.body import decode
from braid.server.http.protocol import ChatRequest, CompletionRequest, shown, unknown_fields
from braid.server.http.requests import Plan, chat_plan, completion_plan, openai_error
from braid.server.logs import FIELDS, key_values

if TYPE_CHECKING:
    from braid.server.engine.client import EngineClient
    from braid.server.engine.handle import SessionHandle

_LOGGER = logging.getLogger(__name__)
_TRACER = trace.get_tracer("braid.server.http")
_OPEN_PATHS = ("/health",)
IGNORED_HEADER = "braid-ignored-fields"  # the request's fields braid does not know, and so ignored
_MOST_NAMED = 8  # unknown fields named per request (a header, a log line): the first ones
_MOST_WARNED = 1024  # distinct unknown fields logged as warnings, once each, in a process's life
T = TypeVar("T")
Body = TypeVar("Body", bound=pydantic.BaseModel)


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self, status: int, kind: str, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param, self.headers = status, kind, message, param, headers

    @classmethod
    def of(cls, exc: Exception) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, InvalidArgument):
            return cls(400, "invalid_request_error", str(exc), exc.field)
        if isinstance(exc, Overloaded):
            return cls(
                429, "rate_limit_error", str(exc), headers={"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
            )
        if isinstance(exc, EngineUnavailable):
            return cls(503, "service_unavailable", str(exc))
        if isinstance(exc, NotFound):  # an adapter unloaded since the request named it
            return cls(404, "not_found_error", str(exc), "model")
        _LOGGER.exception("unexpected error in an HTTP handler")
        return cls(500, "internal_error", f"internal error: {type(exc).__name__}: {exc}")

    def body(self) -> dict[str, Any]:
        param = None if self.param is None else capped(self.param)  # it may hold a client's own keys
        return {"error": {"message": capped(self.message), "type": self.kind, "param": param, "code": None}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


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
            exception_handlers={404: _not_found, 405: _not_allowed},
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
            self._authorize(request)
        except ApiError as exc:
            return exc.response()
        body, content_type = await asyncio.to_thread(self._metrics, request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    async def models(self, request: Request, record: _Record) -> Response:
        return JSONResponse({"object": "list", "data": self._model_cards()})

    async def model(self, request: Request, record: _Record) -> Response:
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

    async def chat(self, request: Request, record: _Record) -> Response:
        body = await _parse(request, ChatRequest, self._config.max_message_bytes)
        await self._unknown_fields(body, record)
        record.user = body.user
        info = self._engine.info
        plan = self._with_adapter(
            chat_plan(body, self._config.default_max_new_tokens, info.vocab_size, info.chat_template_takes_tools),
            body.model,
        )
        return _naming_ignored(await self._generate(request, plan, record, body.stream, chat=True), record)

    async def completions(self, request: Request, record: _Record) -> Response:
        body = await _parse(request, CompletionRequest, self._config.max_message_bytes)
        await self._unknown_fields(body, record)
        record.user = body.user
        plan = self._with_adapter(
            completion_plan(body, self._config.default_max_new_tokens, self._engine.info.vocab_size), body.model
        )
        return _naming_ignored(await self._generate(request, plan, record, body.stream, chat=False), record)

    async def _unknown_fields(self, body: pydantic.BaseModel, record: _Record) -> None:
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

    async def _generate(self, request: Request, plan: Plan, record: _Record, stream: bool, chat: bool) -> Response:
        if self.draining:
            raise EngineUnavailable("the server is draining; retry on another replica")
        req = plan.request
        record.request_id = req.request_id
        call = CallSessions(req)
        try:
            handles = await _unless_disconnected(request, submit(self._engine, self._lanes, req, call))
        except BaseException:
            call.end()
            raise
        spans.on_session(handles[0], self._engine.info.mode)
        # the model's first served name, or the adapter the request runs with (as vLLM answers)
        head = {"id": req.request_id, "created": int(time.time()), "model": req.adapter or self._engine.info.model_name}
        events = _Events(self._engine, plan, handles, head, chat, record, lambda: self.draining)
        if stream:
            record.streamed = True

            def closed() -> None:
                call.end()
                record.done()

            return _EventStream(
                _sse(events, call),
                on_close=closed,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            whole = await _unless_disconnected(request, events.whole())
        finally:
            call.end()
        return await asyncio.to_thread(JSONResponse, whole)  # its JSON grows with the output: off the event loop

    # ---- around every call: the API key, errors, the log line, the span and the metric ---------

    def _route(self, path: str, route: Callable[[Request, _Record], Awaitable[Response]], methods: list[str]) -> Route:
        """An observed route: its span and its metric are named by the route's template (OpenTelemetry's
        http.route, e.g. "GET /v1/models/{id}"), never by the path a client wrote, which would make a
        new metric series and span name of every id a client sends."""
        template = path.replace(":path}", "}")
        return Route(path, self._observed(route, template), methods=methods)

    def _observed(
        self, route: Callable[[Request, _Record], Awaitable[Response]], template: str
    ) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            # the span, a child of the caller's W3C trace context, lasts until the call's end: a
            # stream's last event, not the handler's return
            span = _TRACER.start_span(
                f"{request.method} {template}",
                kind=trace.SpanKind.SERVER,
                context=propagate.extract(request.headers),
                attributes={"http.route": template},
            )
            record = _Record(request, span, self._calls, f"{request.method} {template}")
            with trace.use_span(span, end_on_exit=False):
                try:
                    self._authorize(request)
                    response = await route(request, record)
                except Exception as exc:
                    error = ApiError.of(exc)
                    record.status, record.error = error.status, error
                    record.done()
                    return error.response()
            record.status = response.status_code
            if not record.streamed:
                record.done()
            return response

        return handle

    def _authorize(self, request: Request) -> None:
        """With --api-key: exactly one `Authorization: Bearer <key>`, as over gRPC (frontend/auth.py)."""
        if self._api_key is None:
            return
        if not bearer_matches(request.headers.getlist("authorization"), self._api_key):
            raise ApiError(401, "authentication_error", "missing or wrong `Authorization: Bearer <api key>` header")


class _Events:
    """A request's output as OpenAI's chunks (`chunks`) or as one whole response (`whole`)."""

    def __init__(
        self,
        engine: EngineClient,
        plan: Plan,
        handles: list[SessionHandle],
        head: dict[str, Any],
        chat: bool,
        record: _Record,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self._engine, self._plan, self._handles, self._chat, self._record = engine, plan, handles, chat, record
        self._draining = draining
        self._head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        self._choices = [choices.ChatChoice(plan) for _ in handles]
        self._offsets = [0] * len(handles)
        self.finals: list[Finished] = []

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        if self._chat:
            for i in range(len(self._handles)):
                yield self._chunk(i, {"role": "assistant", "content": ""})
        async for index, handle, batch in merged(self._handles):
            deltas = [e for e in batch if isinstance(e, Delta)]
            text = "".join(d.text for d in deltas)
            logprobs = await self._logprobs(index, deltas) if self._plan.logprobs and deltas else None
            if self._chat:
                delta = self._choices[index].feed(text)
                if delta is not None or logprobs is not None:
                    yield self._chunk(index, delta or {}, logprobs=logprobs)
            elif text or logprobs is not None:
                yield self._chunk(index, text, logprobs=logprobs)
            if handle.finished is not None:
                _raise_failure(handle.finished, self._draining())
                self._record.finished(handle.finished)
                with trace.use_span(self._record.span, end_on_exit=False):
                    spans.on_finished(handle)
                self.finals.append(handle.finished)
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


def _joined(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not parts:
        return None
    if "content" in parts[0]:
        return {"content": [c for p in parts for c in p["content"]]}
    return {key: [v for p in parts for v in p[key]] for key in parts[0]}


def _raise_failure(finished: Finished, draining: bool = False) -> None:
    """A session that failed ends its call with an error, as over gRPC (servicer._failure_status).
    So does one a draining server cancelled (its grace, or --handover-grace, over): 503, where gRPC
    ends UNAVAILABLE, so that an OpenAI client sees an error (mid-stream: an error event and no
    [DONE]), never a completion that only looks whole."""
    if finished.reason is FinishReason.CANCELLED and draining:
        raise ApiError(
            503,
            "service_unavailable",
            f"the server is draining: this generation was cut after {finished.generated_tokens} tokens; "
            "send it again to another replica",
        )
    if finished.reason is FinishReason.ERROR:
        raise ApiError(500, "internal_error", finished.error or "the engine failed")
    if finished.reason is FinishReason.INVALID_REQUEST:
        raise openai_error(
            InvalidArgument(finished.error_field or "request", finished.error or "cannot be carried out")
        )


def _naming_ignored(response: Response, record: _Record) -> Response:
    """The response, with a header naming the request's fields braid ignored (if any)."""
    if record.ignored:
        response.headers[IGNORED_HEADER] = ", ".join(record.ignored)
    return response


async def _sse(events: _Events, call: CallSessions) -> AsyncIterator[bytes]:
    """Server-sent events: a chunk per batch of tokens, `data: [DONE]` at the end. An error after
    the stream has begun is sent as a last event in OpenAI's error shape."""
    record = events._record
    try:
        async for chunk in events.chunks():
            yield b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    except asyncio.CancelledError:  # the client went away: its sessions end now
        call.end()
        record.status = 499
        raise
    except Exception as exc:
        error = ApiError.of(exc)
        record.status, record.error = error.status, error
        yield b"data: " + json.dumps(error.body()).encode() + b"\n\n"
    finally:
        call.end()
        record.done()


class _EventStream(StreamingResponse):
    """A streamed response that ends the moment its client disconnects: it listens for the
    disconnect while it streams, whatever ASGI version the server speaks, and closes its body and
    calls `on_close` (which cancels the call's sessions) however it ends, a body never started
    included."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self._on_close()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits work, cancelled if the client disconnects first (a response not streamed)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        raise ApiError(499, "client_closed_request", "the client disconnected")  # (no one reads it)
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _parse(request: Request, model: type[Body], most_bytes: int) -> Body:
    """The body as `model`, read up to `most_bytes` (--max-message-bytes, as over gRPC), then
    decoded and checked (http/body.py) off the event loop: that work grows with the body."""
    body, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > most_bytes:
                raise ApiError(
                    413, "invalid_request_error", f"the body is over {most_bytes} bytes (--max-message-bytes)", "body"
                )
            body.append(chunk)
    except ClientDisconnect:  # gone, or cut off by --http-body-timeout (http/connection.py)
        raise ApiError(499, "client_closed_request", "the client disconnected before its body was sent") from None
    return await asyncio.to_thread(decode, b"".join(body), model)


async def _not_found(request: Request, exc: Exception) -> Response:
    return ApiError(404, "not_found_error", f"no route {request.url.path}").response()


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return ApiError(405, "invalid_request_error", f"{request.method} is not allowed on {request.url.path}").response()


class _Record:
    """One HTTP call's request log line (as edge/request_log.py writes gRPC's) and its metric."""

    def __init__(self, request: Request, span: trace.Span, calls: CallObserver, route: str) -> None:
        """route: the method and the route's template, which the metric is labelled with."""
        self.span = span
        self.calls = calls
        self.started = time.perf_counter()
        client = request.client
        self.template = route
        self.route = f"{request.method} {request.url.path}"
        self.peer = f"{client.host}:{client.port}" if client else ""
        self.request_id = ""
        self.user: str | None = None
        self.status = 0
        self.error: ApiError | None = None
        self.streamed = False
        self.ignored: list[str] = []  # fields of the request braid does not know
        self._finals: list[Finished] = []
        self._logged = False

    def finished(self, finished: Finished) -> None:
        self._finals.append(finished)

    def done(self) -> None:
        if self._logged:
            return
        self._logged = True
        seconds = time.perf_counter() - self.started
        self.span.set_attribute("http.response.status_code", self.status)
        self.span.end()
        self.calls.on_call("http " + self.template, str(self.status), seconds)
        level = logging.INFO if self.route.startswith("POST") else logging.DEBUG  # generations, as gRPC's Stream
        if not _LOGGER.isEnabledFor(level):
            return
        line: dict[str, object] = {
            "request_id": self.request_id or None,
            "peer": self.peer,
            "route": echoed(self.route),  # what the client wrote is echoed capped: its path, user, keys
            "status": self.status,
        }
        if self.error is not None:
            line |= {"error": self.error.kind, "param": None if self.error.param is None else echoed(self.error.param)}
        if self.user:
            line["user"] = echoed(self.user)
        if self.ignored:
            line["ignored"] = echoed(",".join(self.ignored))
        finals = self._finals
        if finals:
            line |= {
                "finish": ",".join(sorted({f.reason.name.lower() for f in finals})),
                "prompt_tokens": finals[0].prompt_tokens,
                "cached_tokens": sum(f.cached_tokens for f in finals),
                "generated_tokens": sum(f.generated_tokens for f in finals),
                "queue_ms": min(f.timings.queue_ms for f in finals),
                "ttft_ms": min(f.timings.time_to_first_token_ms for f in finals),
                "tok_s": sum(f.timings.tokens_per_second for f in finals),
            }
        line["total_ms"] = seconds * 1000
        _LOGGER.log(level, "HTTP %s", key_values(line), extra={FIELDS: line})
