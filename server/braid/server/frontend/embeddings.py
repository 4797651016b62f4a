"""Embeddings, as every front end serves them: the request's checks, and its inputs run as
prompt-only sessions whose vectors are gathered in order, cancelled with the call however it ends.
The gRPC servicer (Embed) and the HTTP front end (POST /v1/embeddings) both use these."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from braid.server.engine.handle import SessionHandle
from braid.server.engine.types import (
    EmbeddingRequest,
    EngineUnavailable,
    Finished,
    FinishReason,
    InvalidArgument,
    ModelInfo,
)
from braid.server.frontend.checks import (
    MAX_TEXT_BYTES,
    MAX_TOKEN_IDS,
    Spelling,
    braids,
    check_request_id,
    in_vocabulary,
)
from braid.server.frontend.lanes import TokenizerLanes
from braid.server.frontend.sessions import CallSessions

if TYPE_CHECKING:
    from braid.server.engine.client import EngineClient

MAX_EMBED_INPUTS = 2048  # inputs per call, as OpenAI's embeddings API allows


def check_embedding(req: EmbeddingRequest, info: ModelInfo, spelling: Spelling = braids) -> None:
    """Checks every field of an embedding request; an error names the field (and the input's index)
    in `spelling`. The inputs' lengths against the context are checked once tokenized (engine)."""
    try:
        _check(req, info)
    except InvalidArgument as exc:
        raise InvalidArgument(spelling(exc.field), exc.description) from None


def _check(req: EmbeddingRequest, info: ModelInfo) -> None:
    if not info.embedding_dimensions:
        raise InvalidArgument(
            "model", f"{info.model_name} serves no embeddings: it runs through transformers, not braid's decoder"
        )
    if req.texts and req.token_ids:
        raise InvalidArgument("token_ids", "set one of texts and token_ids, not both")
    field = "token_ids" if req.token_ids else "texts"
    if not req.inputs:
        raise InvalidArgument(field, "set texts or token_ids: one input at least")
    if len(req.inputs) > MAX_EMBED_INPUTS:
        raise InvalidArgument(field, f"{len(req.inputs)} inputs; at most {MAX_EMBED_INPUTS}")
    for i, text in enumerate(req.texts):
        if not text:
            raise InvalidArgument(f"texts[{i}]", "is empty")
    size = sum(len(t.encode()) for t in req.texts)
    if size > MAX_TEXT_BYTES:
        raise InvalidArgument("texts", f"are {size} bytes in all; at most {MAX_TEXT_BYTES}")
    if sum(map(len, req.token_ids)) > MAX_TOKEN_IDS:
        raise InvalidArgument("token_ids", f"{sum(map(len, req.token_ids))} ids in all; at most {MAX_TOKEN_IDS}")
    for i, ids in enumerate(req.token_ids):
        if not ids:
            raise InvalidArgument(f"token_ids[{i}]", "is empty")
        in_vocabulary(f"token_ids[{i}]", ids, info.vocab_size)
    if not 0 <= req.dimensions <= info.embedding_dimensions:
        raise InvalidArgument(
            "dimensions", f"{req.dimensions} is outside [1, {info.embedding_dimensions}] (the model's hidden size)"
        )
    if req.truncate_input_tokens < 0:
        raise InvalidArgument("truncate_input_tokens", f"{req.truncate_input_tokens} is negative")
    check_request_id(req.request_id)


async def embed(
    engine: EngineClient, lanes: TokenizerLanes, req: EmbeddingRequest, call: CallSessions
) -> list[Finished]:
    """The inputs' sessions, each Finished with its vector, in the request's order. `call` adopts
    the sessions the moment they exist (whoever ends the call cancels them); so does this
    coroutine's own cancellation. A session that did not finish its input raises: the server's
    shutdown EngineUnavailable, an engine failure RuntimeError."""
    ticket = engine.admit_embedding(req)  # the place in the queue, before a tokenizer thread is free
    future = lanes.run(ticket, engine.embed, req, asyncio.get_running_loop())

    def adopt(f: asyncio.Future[list[SessionHandle]]) -> None:
        if not f.cancelled() and f.exception() is None:
            call.adopt(f.result())

    future.add_done_callback(adopt)
    try:
        handles = await asyncio.shield(future)
        return [_result(await _finished(h)) for h in handles]
    finally:
        call.end()  # a no-op for the sessions that finished


async def _finished(handle: SessionHandle) -> Finished:
    async for _ in handle.batches():
        pass
    assert handle.finished is not None
    return handle.finished


def _result(finished: Finished) -> Finished:
    if finished.embedding is not None:
        return finished
    if finished.reason is FinishReason.ERROR:
        raise RuntimeError(finished.error or "the engine failed")
    if finished.reason is FinishReason.DEADLINE:
        raise EngineUnavailable("the call's deadline passed before its inputs were embedded")
    raise EngineUnavailable("the server is shutting down: the inputs were not embedded")
