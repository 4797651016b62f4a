"""OpenAI's HTTP API on braid's engine (Starlette): /v1/chat/completions and /v1/completions,
streamed as server-sent events or not, OpenAI's Responses API (/v1/responses, stateless),
/v1/embeddings, /v1/models and /health; and Anthropic's Messages API, /v1/messages and /v1/messages/count_tokens. This module
holds the routes; each job around them has its own: observed.py (the API key, errors, the span, the
log line and the metric around every call), generation.py (the one path every generating route
shares), events.py (OpenAI's output), anthropic_*.py and responses_*.py (those APIs' requests and
output), streaming.py (SSE and disconnects), errors.py, body.py.

Like the gRPC servicer, it reaches the engine only through EngineClient, runs on the gRPC server's
event loop and never blocks it: admission, compiling and tokenizing go through the same lanes and
the same `submit` (frontend/sessions.py). A call's sessions are cancelled however it ends: a
client that disconnects mid-stream or while waiting for a whole response ends them at once.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING, Any, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from braid.server.config import ServerConfig
from braid.server.engine.types import EngineUnavailable, InvalidArgument
from braid.server.frontend.embeddings import embed
from braid.server.frontend.sessions import CallSessions
from braid.server.frontend.observer import CallObserver, NoCalls
from braid.server.http import observed
from braid.server.http.anthropic_events import MessageEvents
from braid.server.http.anthropic_protocol import CountTokensRequest, MessagesRequest
from braid.server.http.anthropic_requests import messages_plan
from braid.server.http.embeddings import EmbeddingsRequest, embedding_request, embeddings_body, spelling
from braid.server.http.errors import ApiError, not_allowed, not_found
from braid.server.http.generation import Generations, served_names, with_ignored
from braid.server.http.observed import Handler, Record
from braid.server.http.protocol import ChatRequest, CompletionRequest
from braid.server.http.requests import chat_plan, completion_plan
from braid.server.http.responses_events import ResponseEvents
from braid.server.http.responses_protocol import ResponsesRequest
from braid.server.http.responses_requests import echoed, responses_name, responses_plan
from braid.server.http.streaming import Output, unless_disconnected

if TYPE_CHECKING:
    from braid.server.engine.client import EngineClient
    from braid.server.engine.handle import SessionHandle

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
        self._api_key = config.api_key.encode() if config.api_key else None
        self.draining = False
        self._generations = Generations(engine, config, lambda: self.draining)
        self.created = int(time.time())
        self._metrics = metrics
        self.app = Starlette(
            routes=[
                *([Route("/metrics", self.metrics, methods=["GET"])] if metrics is not None else []),
                self._route("/v1/chat/completions", self.chat, methods=["POST"]),
                self._route("/v1/completions", self.completions, methods=["POST"]),
                self._route("/v1/responses", self.responses, methods=["POST"]),
                self._route("/v1/messages", self.messages, methods=["POST"]),
                self._route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                self._route("/v1/embeddings", self.embeddings, methods=["POST"]),
                self._route("/v1/models", self.models, methods=["GET"]),
                self._route("/v1/models/{id:path}", self.model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={404: not_found, 405: not_allowed},
        )

    def close(self) -> None:
        self._generations.close()

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

        served = [card(name, info.model_name) for name in served_names(self._engine)]
        return served + [card(a.name, info.model_name, info.model_name) for a in self._engine.loras()]

    async def chat(self, request: Request, record: Record) -> Response:
        body = await self._generations.body(request, ChatRequest, record)
        info = self._engine.info
        plan = chat_plan(body, self._config.default_max_new_tokens, info.vocab_size, info.chat_template_takes_tools)
        return await self._generations.respond(request, record, plan, body)

    async def completions(self, request: Request, record: Record) -> Response:
        body = await self._generations.body(request, CompletionRequest, record)
        plan = completion_plan(body, self._config.default_max_new_tokens, self._engine.info.vocab_size)
        return await self._generations.respond(request, record, plan, body)

    async def messages(self, request: Request, record: Record) -> Response:
        """Anthropic's Messages API, as a chat (http/anthropic_requests.py)."""
        body = await self._generations.body(request, MessagesRequest, record)
        info = self._engine.info
        plan = messages_plan(body, self._config.default_max_new_tokens, info.vocab_size, info.chat_template_takes_tools)

        def anthropic(handles: list[SessionHandle], model: str) -> Output:
            return MessageEvents(plan, handles[0], model, record, lambda: self.draining)

        return await self._generations.run(request, record, plan, body.model, body.stream, anthropic)

    async def responses(self, request: Request, record: Record) -> Response:
        """OpenAI's Responses API, stateless, as a chat (http/responses_requests.py). `store: true`
        is taken and named among the ignored fields: nothing is stored."""
        body = await self._generations.body(request, ResponsesRequest, record)
        if body.store and "store" not in record.ignored:
            record.ignored.append("store")
        info = self._engine.info
        plan, origins = responses_plan(
            body, self._config.default_max_new_tokens, info.vocab_size, info.chat_template_takes_tools
        )

        def responses(handles: list[SessionHandle], model: str) -> Output:
            head = {"model": model, **echoed(body)}
            rename = functools.partial(responses_name, origins=origins)
            return ResponseEvents(plan, handles[0], head, record, lambda: self.draining, rename)

        return await self._generations.run(request, record, plan, body.model, body.stream, responses)

    async def embeddings(self, request: Request, record: Record) -> Response:
        """OpenAI's embeddings (http/embeddings.py): each input a prompt-only session, gathered in
        order; a client that disconnects first cancels them all."""
        body = await self._generations.body(request, EmbeddingsRequest, record)
        req = embedding_request(body, self._engine.info)
        if self.draining:
            raise EngineUnavailable("the server is draining; retry on another replica")
        record.request_id = req.request_id
        call = CallSessions(req)
        try:
            finished = await unless_disconnected(request, embed(self._engine, self._generations.lanes, req, call))
        except InvalidArgument as exc:  # an input too long for the context, found once tokenized
            raise InvalidArgument(spelling(body)(exc.field), exc.description) from None
        finally:
            call.end()
        whole = await asyncio.to_thread(
            embeddings_body, finished, self._engine.info.model_name, body.encoding_format, req.request_id
        )
        return with_ignored(await asyncio.to_thread(JSONResponse, whole), record)

    async def count_tokens(self, request: Request, record: Record) -> Response:
        """The tokens of a message's prompt, as the chat template renders it, tools and thinking
        included: planned as /v1/messages plans it, so the count is the input_tokens its message
        would have."""
        body = await self._generations.body(request, CountTokensRequest, record)
        info = self._engine.info
        plan = messages_plan(body, self._config.default_max_new_tokens, info.vocab_size, info.chat_template_takes_tools)
        return with_ignored(JSONResponse({"input_tokens": await self._generations.count(request, plan)}), record)

    def _route(self, path: str, handler: Handler, methods: list[str]) -> Route:
        return observed.route(path, handler, methods, self._calls, self._api_key)
