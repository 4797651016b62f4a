"""The request log: one line per Stream call when it ends, at info; at debug, one more when it
arrives and one per other braid call. Who called and how it went, never what was asked or answered.

    Stream request_id=9c1f... peer=ipv4:10.0.0.7:51234 mode=continuous status=OK finish=max_tokens
    prompt_tokens=12 cached_tokens=0 generated_tokens=32 proposed_tokens=0 accepted_tokens=0 queue_ms=0.4
    ttft_ms=21.0 tok_s=88.2 total_ms=372.5

proposed_tokens and accepted_tokens count speculative decoding's proposals (--speculative). The figures are those of the call's final message (summed over its samples with `n`); a call that
ended before one (cancelled by its client, refused) has its status, and the tokens it was sent.

The request_id a client named is echoed capped (frontend/request_log.py), as the HTTP front end's
line echoes what a client wrote.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any, AsyncIterator, AsyncContextManager, Callable

import grpc

from braid.server.grpc.calls import Context, Continuation, Handler, Seen, wrap_calls
from braid.server.frontend.request_log import echoed
from braid.server.logs import FIELDS, key_values
from braid.v1 import generate_pb2 as pb

_LOGGER = logging.getLogger(__name__)


class RequestLogInterceptor(grpc.aio.ServerInterceptor):
    """Installed only when its logger is on at info. Health checks and reflection are left out."""

    def __init__(self) -> None:
        self.mode = ""  # the engine's scheduling mode: set once the model is loaded

    @staticmethod
    def wanted() -> bool:
        return _LOGGER.isEnabledFor(logging.INFO)

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith("/braid."):
            return handler
        if handler.unary_stream and handler_call_details.method.endswith("/Stream"):
            return wrap_calls(handler, self._stream)
        if _LOGGER.isEnabledFor(logging.DEBUG):
            method = handler_call_details.method.rsplit("/", 1)[-1]
            return wrap_calls(
                handler,
                lambda request, context: _logged(
                    context, lambda code: {"call": method, "peer": context.peer(), "status": code.name}
                ),
            )
        return handler

    def _stream(self, request: Any, context: Context) -> AsyncContextManager[Seen | None]:
        if isinstance(request, pb.GenerateRequest) and not request.request_id:
            # Named here, so a call that ends before its final message is logged under the id
            # its client was sent (the servicer keeps a request_id it is given).
            request.request_id = uuid.uuid4().hex
        record = _StreamRecord(echoed(getattr(request, "request_id", "")), context.peer(), self.mode)
        _LOGGER.debug("Stream arrived: request_id=%s peer=%s", record.request_id, record.peer)
        return _logged(context, record.fields, seen=record.saw)


class _StreamRecord:
    """What one Stream call's responses said: its final messages, and the tokens it was sent."""

    def __init__(self, request_id: str, peer: str, mode: str) -> None:
        self.request_id, self.peer, self.mode = request_id, peer, mode
        self.finals: list[pb.GenerateResponse] = []
        self.tokens_sent = 0

    def saw(self, response: pb.GenerateResponse) -> None:
        self.tokens_sent += len(response.token_ids)
        if response.finish_reason:
            self.finals.append(response)

    def fields(self, code: grpc.StatusCode) -> dict[str, object]:
        fields: dict[str, object] = {
            "request_id": self.request_id,
            "peer": self.peer,
            "mode": self.mode,
            "status": code.name,
        }
        if not self.finals:
            return fields | {"finish": None, "generated_tokens": self.tokens_sent}
        timings = [f.timings for f in self.finals]
        fields |= {
            "finish": ",".join(
                sorted(
                    {pb.FinishReason.Name(f.finish_reason).removeprefix("FINISH_REASON_").lower() for f in self.finals}
                )
            ),
            "prompt_tokens": self.finals[0].usage.prompt_tokens,
            "cached_tokens": sum(f.usage.cached_tokens for f in self.finals),
            "generated_tokens": sum(f.usage.generated_tokens for f in self.finals),
            "proposed_tokens": sum(f.usage.proposed_tokens for f in self.finals),
            "accepted_tokens": sum(f.usage.accepted_tokens for f in self.finals),
            "queue_ms": min(t.queue_ms for t in timings),
            "ttft_ms": min(t.time_to_first_token_ms for t in timings),
            "tok_s": sum(t.tokens_per_second for t in timings),
            "total_ms": max(t.total_ms for t in timings),
        }
        if len(self.finals) > 1:
            fields["samples"] = len(self.finals)
        return fields


@contextlib.asynccontextmanager
async def _logged(
    context: Context, fields: Callable[[grpc.StatusCode], dict[str, object]], seen: Seen | None = None
) -> AsyncIterator[Seen | None]:
    """Logs the call once grpc says it is over: `fields(its final status)`. A Stream call (one
    whose responses are `seen`) at info, any other at debug."""
    started = time.perf_counter()
    handler_code = None  # how the handler itself ended; None if grpc dropped it (cancelled)

    def end(done: Context) -> None:
        line = fields(done.code() or handler_code or _dropped(done))
        line.setdefault("total_ms", (time.perf_counter() - started) * 1000)
        level = logging.INFO if seen is not None else logging.DEBUG
        _LOGGER.log(level, "%s %s", "Stream" if seen is not None else "call", key_values(line), extra={FIELDS: line})

    context.add_done_callback(end)  # type: ignore[arg-type]  # grpc-stubs: a class, where any callable will do
    try:
        yield seen
        handler_code = grpc.StatusCode.OK
    except grpc.aio.AbortError:  # its code is the context's
        raise
    except Exception:  # grpc answers UNKNOWN
        handler_code = grpc.StatusCode.UNKNOWN
        raise


def _dropped(context: Context) -> grpc.StatusCode:
    remaining = context.time_remaining()
    return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED
