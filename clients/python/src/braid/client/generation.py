"""One running Stream call: iterate over its messages, cancel it, read its outcome."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import grpc
from grpc import aio

from braid.client.errors import from_rpc_error
from braid.v1 import generate_pb2 as pb

REQUEST_ID_KEY = "braid-request-id"
SEED_KEY = "braid-seed"
# A stream that fails with these after it began is resumed (GenerateRequest.resume_token_ids): its
# server or the connection to it went away. RST_STREAM, or "Stream removed" (an END_STREAM with no
# status): a proxy cut the stream when its replica died or drained.
MAX_RESUMES = 3
RESUME_BACKOFF_S = 0.25  # before the first resume; doubled before each further one


def is_cut(error: grpc.RpcError) -> bool:
    """Whether a proxy, the network or a server's shutdown cut the stream: RST_STREAM, an END_STREAM
    with no status, or gRPC's own CANCELLED "CANCELLED" for a call that reached a server as it shut
    down, before any handler took it (grpc/grpc#41785: it should be UNAVAILABLE; the rolling-restart
    test's load saw it through HAProxy). braid's server never ends a call with CANCELLED itself (a
    cancelled session ends with a final message), and the client's own cancel() is told apart first."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.CANCELLED:
        return details == "CANCELLED"
    return code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and (
        "RST_STREAM" in details or "Stream removed" in details
    )


def is_broken(error: grpc.RpcError) -> bool:
    """Whether a failed stream broke (its server or connection went away) rather than failed."""
    return error.code() == grpc.StatusCode.UNAVAILABLE or is_cut(error)


# A call's metadata: (key, value) pairs, as both grpc and grpc.aio give them.
Metadata = Iterable[tuple[str, str | bytes]]


@dataclass
class Completion:
    """The outcome of a finished generation."""

    text: str
    token_ids: list[int]
    finish_reason: str  # the FinishReason's name without its prefix, e.g. "MAX_TOKENS" (finish_reason_name)
    usage: pb.Usage
    final: pb.GenerateResponse
    tool_calls: list[pb.ToolCall] = field(default_factory=list)  # the calls it made (GenerateRequest.tools)
    reasoning: str = ""  # a reasoning model's reasoning, apart from text (GenerateResponse.reasoning)


def finish_reason_name(value: pb.FinishReason.ValueType) -> str:
    """Returns a FinishReason's name without the FINISH_REASON_ prefix, e.g. "EOS" (its number for
    one this client's braid.v1 does not know)."""
    if value not in pb.FinishReason.values():
        return str(value)
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_")


def metadata_value(metadata: Metadata | None, key: str) -> str | bytes | None:
    """Returns the first value of key in a call's metadata, or None."""
    return next((value for name, value in metadata or () if name == key), None)


def _is_task_cancelling() -> bool:
    """Whether the running task itself is being cancelled (always False before Python 3.11)."""
    task = asyncio.current_task()
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0


class _Stream:
    """A Stream call and what its messages add up to, sample by sample; shared by Generation and
    AsyncGeneration. A stream of n > 1 samples (GenerateRequest.n) interleaves them: every message
    carries its sample's index, and each sample ends with its own final message."""

    def __init__(
        self, call: grpc.Call | aio.Call, n: int = 1, restart: Callable[[list[int], int | None], Any] | None = None
    ) -> None:
        self._call = call
        # restart(delivered token ids, seed or None: the request's) -> a new call that resumes
        # this one; None: never
        self._restart = restart if n <= 1 else None
        self._seed: int | None = None  # from the headers
        self.resumes = 0  # times the stream was resumed
        self.n = max(n, 1)  # the samples in the stream (GenerateRequest.n; 0 is 1)
        self.final: pb.GenerateResponse | None = None  # the message that ended the stream
        self._texts: defaultdict[int, list[str]] = defaultdict(list)  # by sample index
        self._token_ids: defaultdict[int, list[int]] = defaultdict(list)
        self._tool_calls: defaultdict[int, list[pb.ToolCall]] = defaultdict(list)
        self._reasoning: defaultdict[int, list[str]] = defaultdict(list)
        self._finals: dict[int, pb.GenerateResponse] = {}
        self._header_request_id: str | None = None  # "" once headers without one arrived
        self._is_cancelled = False

    @property
    def text(self) -> str:
        """The text received so far (of sample 0: the only one unless n > 1)."""
        return "".join(self._texts[0])

    @property
    def reasoning(self) -> str:
        """A reasoning model's reasoning received so far (of sample 0), apart from its text."""
        return "".join(self._reasoning[0])

    @property
    def token_ids(self) -> list[int]:
        """The generated token ids received so far (of sample 0: the only one unless n > 1)."""
        return self._token_ids[0]

    @property
    def tool_calls(self) -> list[pb.ToolCall]:
        """The tool calls received so far (of sample 0), each whole: id, name, arguments (JSON text)."""
        return self._tool_calls[0]

    @property
    def finish_reason(self) -> str | None:
        """The name of the finish reason that ended the stream ("MAX_TOKENS", "EOS", ...; see
        finish_reason_name), or None before its final message."""
        return finish_reason_name(self.final.finish_reason) if self.final is not None else None

    @property
    def request_id(self) -> str | None:
        """The request id: from the response headers once a message arrived, or the final message."""
        if self.final is not None and self.final.request_id:
            return self.final.request_id
        return self._header_request_id or None

    def completion(self) -> Completion:
        """Returns the Completion of a stream of one sample that has ended with its final message."""
        if self.n > 1:
            raise RuntimeError(f"the stream has {self.n} samples: use completions()")
        return self.completions()[0]

    def completions(self) -> list[Completion]:
        """Returns one Completion per sample, by index, once every sample has ended with its final message."""
        if self.final is None:
            raise RuntimeError("the stream has not ended with a final message for every sample")
        return [self._completion(index) for index in sorted(self._finals)]

    def _completion(self, index: int) -> Completion:
        final = self._finals[index]
        text, token_ids = "".join(self._texts[index]), list(self._token_ids[index])
        reason, calls = finish_reason_name(final.finish_reason), list(self._tool_calls[index])
        reasoning = "".join(self._reasoning[index])
        return Completion(text, token_ids, reason, final.usage, final, calls, reasoning)

    def cancel(self) -> None:
        """Cancels the call (and so the session on the server); iteration then stops."""
        self._is_cancelled = True
        self._call.cancel()

    def _record(self, message: pb.GenerateResponse) -> pb.GenerateResponse:
        self._texts[message.index].append(message.text)
        self._token_ids[message.index].extend(message.token_ids)
        self._tool_calls[message.index].extend(message.tool_calls)
        if message.reasoning:
            self._reasoning[message.index].append(message.reasoning)
        if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self._finals[message.index] = message
            if len(self._finals) >= self.n:
                self.final = message
        return message

    def _record_headers(self, metadata: Metadata | None) -> None:
        request_id = metadata_value(metadata, REQUEST_ID_KEY)
        self._header_request_id = request_id if isinstance(request_id, str) else ""
        seed = metadata_value(metadata, SEED_KEY)
        if isinstance(seed, str) and seed.isdigit():
            self._seed = int(seed)

    def _ended_but_for_its_status(self, error: grpc.RpcError) -> bool:
        """Whether the stream broke after every sample's final message: a proxy whose replica exited
        just then ends the stream with no status (the rolling-restart test's load saw UNKNOWN
        "Stream removed" so). The final message says how it ended, and every token came before
        it, so the stream has ended; only its OK status was lost."""
        return self.final is not None and is_broken(error)

    def _resumable(self, error: grpc.RpcError) -> bool:
        """Whether this broken stream is resumed: not if it is not resumable, or was resumed too
        often. A stream cut before its headers (a proxy whose replica exited as the call reached
        it: the rolling-restart test saw UNKNOWN "Stream removed") delivered nothing and is sent
        again as it was; gRPC's retry policy already sent one refused with UNAVAILABLE again."""
        if (
            self._restart is None
            or self._is_cancelled
            or self.final is not None
            or self.resumes >= MAX_RESUMES
            or not is_broken(error)
        ):
            return False
        return self._seed is not None or (not self._token_ids[0] and is_cut(error))

    def _resume_delay(self) -> float:
        """How long to wait before the next resume: a proxy that balances by least connections
        sends a call straight back to a replica that has just drained its streams until its health
        check takes it out, and a call resumed at once was cut there again (three times running)."""
        return float(RESUME_BACKOFF_S * 2**self.resumes)

    def _resume_call(self) -> Any:
        """A call that resumes this broken stream (_resumable) from the tokens it delivered."""
        assert self._restart is not None
        self.resumes += 1
        return self._restart(list(self._token_ids[0]), self._seed)


class Generation(_Stream):
    """A running Stream call: an iterator over its GenerateResponse messages.

    After iteration, `final` holds the last message (finish_reason, usage, timings,
    seed, request_id), `finish_reason` its finish reason's name, `text` the whole text and
    `completion()` all of it; with n > 1, `completions()` has each sample's. Leaving a `with`
    block early, `close()` or `cancel()` cancels the call, which cancels the session on the
    server. A call that fails raises a BraidError (braid.client.errors), mid-stream too.
    """

    def __init__(
        self, call: grpc.Call, n: int = 1, restart: Callable[[list[int], int | None], grpc.Call] | None = None
    ) -> None:
        super().__init__(call, n, restart)
        self._call: grpc.Call = call
        self._responses = cast(Iterator[pb.GenerateResponse], call)

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> pb.GenerateResponse:
        if self._is_cancelled:
            raise StopIteration
        while True:
            try:
                message = next(self._responses)
                break
            except grpc.RpcError as error:
                if self._is_cancelled and error.code() == grpc.StatusCode.CANCELLED:  # cancel() from a thread
                    raise StopIteration from None
                if self._ended_but_for_its_status(error):
                    raise StopIteration from None
                if not self._resumable(error):
                    raise from_rpc_error(error) from error
                time.sleep(self._resume_delay())
                resumed = self._resume_call()
                self._call, self._responses = resumed, cast(Iterator[pb.GenerateResponse], resumed)
        if self._header_request_id is None:
            self._record_headers(self._call.initial_metadata())
        return self._record(message)

    def close(self) -> None:
        """Cancels the call unless it has already ended."""
        if self._call.is_active():
            self.cancel()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncGeneration(_Stream):
    """A running grpc.aio Stream call: an async iterator over its GenerateResponse messages.

    Like Generation: `async with` (or `await aclose()`) cancels the call if it is still
    running when the block is left, and `cancel()` cancels it at once.
    """

    def __init__(
        self,
        call: aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse],
        n: int = 1,
        restart: Callable[[list[int], int | None], aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]]
        | None = None,
    ) -> None:
        super().__init__(call, n, restart)
        self._call: aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse] = call

    def __aiter__(self) -> AsyncGeneration:
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        if self._is_cancelled:
            raise StopAsyncIteration
        while True:
            try:
                message = await self._call.read()
                break
            except asyncio.CancelledError:
                if self._is_cancelled and not _is_task_cancelling():  # cancel() from another task: just stop
                    raise StopAsyncIteration from None
                raise
            except grpc.RpcError as error:
                if self._ended_but_for_its_status(error):
                    raise StopAsyncIteration from None
                if not self._resumable(error):
                    raise from_rpc_error(error) from error
                await asyncio.sleep(self._resume_delay())
                self._call = self._resume_call()
        if message is aio.EOF:
            raise StopAsyncIteration
        if self._header_request_id is None:
            self._record_headers(await self._call.initial_metadata())
        return self._record(cast(pb.GenerateResponse, message))

    async def aclose(self) -> None:
        """Cancels the call unless it has already ended."""
        if not self._call.done():
            self.cancel()

    async def __aenter__(self) -> AsyncGeneration:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
