"""The thin servicer: protobuf to domain objects, the engine's events back to protobuf.

Runs on the asyncio event loop and never touches the model: tokenization goes to a worker thread,
generation to the model thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import time
from typing import TYPE_CHECKING, AsyncIterator

import grpc

from braid.server.config import ServerConfig
from braid.server.grpc import convert
from braid.server.grpc.calls import Context
from braid.server.grpc.errors import abort_with, status, status_for, with_trailers
from braid.server.grpc.orca import LoadReporter
from braid.server.engine.handle import SessionHandle
from braid.server.engine.types import Busy, Delta, Event, Finished, FinishReason, InvalidArgument, Queued
from braid.server.frontend import spans
from braid.server.frontend.embeddings import embed
from braid.server.frontend.lanes import TokenizerLanes
from braid.server.frontend.sessions import CallSessions, merged, submit
from braid.server.frontend.tool_plan import CallReader, Read
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from braid.server.engine.client import EngineClient

MAX_ABORT_IDS = 256
MAX_UNLOAD_WAIT_S = 600.0  # longest UnloadAdapter waits for the generations using the adapter
ADAPTER_LOAD_THREADS = 2  # LoadAdapter calls reading files at once; more wait their turn
# The trailer a stream handed over by a draining server ends with (status UNAVAILABLE): resume it
# on another replica from the tokens it delivered (resume_token_ids, and the braid-seed header).
HANDOVER_TRAILER = ("braid-handover", "resume")


class GenerateServicer(pb_grpc.GenerateServicer):
    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        """engine: the only way in (engine/client.py)."""
        self._engine = engine
        self._config = config
        self._tokenizers = TokenizerLanes()
        self._adapter_loads = concurrent.futures.ThreadPoolExecutor(
            ADAPTER_LOAD_THREADS, thread_name_prefix="braid-adapter-load"
        )
        # Running Stream calls by request_id, with the credentials they came with (for Abort). A
        # request_id is the caller's: two calls may share one.
        self._by_request_id: dict[str, list[tuple[SessionHandle, _Credentials]]] = {}
        self._load = LoadReporter(engine.max_sessions)
        self._handing_over = False  # set by a drain's hand-over: cancelled streams end UNAVAILABLE

    def _trailers(self, context: Context, *pairs: tuple[str, str]) -> None:
        """Sets a call's trailers: these pairs and the replica's ORCA load report."""
        context.set_trailing_metadata(pairs + (self._load.report(self._engine.stats()),))

    def hand_over(self) -> None:
        """From now on a stream whose session is cancelled (the drain cancels them all next) ends
        with UNAVAILABLE and the braid-handover trailer, after every token it made, instead of a
        final CANCELLED message: braid's clients, and anyone who reads the trailer, resume it on
        another replica."""
        self._handing_over = True

    def end_subscriptions(self) -> None:
        """Ends the SubscribeKvEvents streams (the server is stopping: they would never end)."""
        self._engine.kv_events.close()

    def close(self) -> None:
        """Drops the tokenizations and adapter loads still waiting for a thread (after the server
        has stopped)."""
        self._tokenizers.shutdown()
        self._adapter_loads.shutdown(wait=False, cancel_futures=True)

    async def Stream(self, request: pb.GenerateRequest, context: Context) -> AsyncIterator[pb.GenerateResponse]:
        info = self._engine.info
        req, tools = convert.planned_from_pb(
            request,
            self._config.default_max_new_tokens,
            info.vocab_size,
            context.time_remaining(),
            info.chat_template_takes_tools,
        )
        self._load.count_call()
        # However the call ends (the client cancels, resets the stream or vanishes, at any await
        # below or none, before its sessions exist or after), its sessions go with it: the
        # callback runs when the RPC terminates, even if this generator is never resumed.
        call = CallSessions(req)
        context.add_done_callback(call.end)  # type: ignore[arg-type]  # grpc-stubs: a class, where any callable will do
        handles = await submit(self._engine, self._tokenizers, req, call)
        spans.on_session(handles[0], self._engine.info.mode)
        entries = [(h, _credentials(context)) for h in handles]
        readers = [CallReader(tools) for _ in handles]  # each sample's text, read for tool calls
        self._by_request_id.setdefault(req.request_id, []).extend(entries)
        try:
            # the seed in the headers: a client can resume a broken stream (resume_token_ids) with it
            await context.send_initial_metadata(
                (("braid-request-id", req.request_id), ("braid-seed", str(handles[0].seed)))
            )
            async for index, handle, batch in merged(handles):
                reader = readers[index]
                reads = [reader.feed("".join(e.text for e in batch if isinstance(e, Delta)))]
                if handle.finished is not None:
                    # the whole text, read for tool calls: off the event loop (it grows with the output)
                    reads.append(await asyncio.to_thread(reader.end) if tools.mode else reader.end())
                message = self._message(batch, handle, reads)
                if len(handles) > 1:
                    message.index = index
                if handle.finished is not None:
                    spans.on_finished(handle)
                    failure = _failure_status(handle.finished, context, self._handing_over)
                    if failure is not None:
                        if message.text or message.reasoning or message.token_ids:
                            yield pb.GenerateResponse(
                                text=message.text,
                                reasoning=message.reasoning,
                                token_ids=message.token_ids,
                                index=message.index,
                            )
                        await abort_with(context, failure)
                    self._trailers(
                        context,
                        *_timing_metadata(message.timings),
                        ("braid-cached-tokens", str(message.usage.cached_tokens)),
                    )
                yield message
        except asyncio.CancelledError:
            # The client closed the stream (or its deadline passed): free the sessions now.
            call.end()
            raise
        finally:
            call.end()  # a no-op for the sessions that finished; covers a generator closed early
            calls = self._by_request_id.get(req.request_id, [])
            for entry in entries:
                if entry in calls:
                    calls.remove(entry)
            if not calls:
                self._by_request_id.pop(req.request_id, None)

    @staticmethod
    def _message(batch: list[Event], handle: SessionHandle, reads: list[Read]) -> pb.GenerateResponse:
        """The batch's message: its tokens, and its text as read for tool calls (`reads`)."""
        deltas = [e for e in batch if isinstance(e, Delta)]
        if handle.finished is not None:
            message = convert.final_to_pb(handle.finished, handle.request_id, handle.seed)
        else:
            message = pb.GenerateResponse()
            queued = [e.position for e in batch if isinstance(e, Queued)]
            if queued and not deltas:
                message.queue_position = queued[-1]
        message.text = "".join(r.content for r in reads)
        message.reasoning = "".join(d.reasoning for d in deltas)
        message.tool_calls.extend(convert.tool_calls_to_pb([c for r in reads for c in r.calls]))
        for d in deltas:
            message.token_ids.extend(d.token_ids)
            message.logprobs.extend(convert.logprobs_to_pb(d.logprobs))
            message.prompt_token_ids.extend(d.prompt_token_ids)
            message.prompt_logprobs.extend(convert.logprobs_to_pb(d.prompt_logprobs))
        return message

    async def Tokenize(self, request: pb.TokenizeRequest, context: Context) -> pb.TokenizeResponse:
        args = convert.tokenize_args_from_pb(request, self._engine.info.chat_template_takes_tools)
        text, messages, *_ = args  # and offsets, tools, template variables
        ticket = self._engine.admit(text, messages, for_session=False)
        tokenized = await self._tokenizers.run(ticket, self._engine.tokenize, *args)
        self._trailers(context)
        return convert.tokenize_to_pb(*tokenized)

    async def Detokenize(self, request: pb.DetokenizeRequest, context: Context) -> pb.DetokenizeResponse:
        ids = convert.detokenize_args_from_pb(request, self._engine.info.vocab_size)
        ticket = self._engine.admit(None, (), for_session=False, token_ids=ids)
        text, held_back = await self._tokenizers.run(ticket, self._engine.detokenize, ids)
        self._trailers(context)
        return pb.DetokenizeResponse(text=text, held_back_tokens=held_back)

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        info = self._engine.info
        req = convert.embedding_from_pb(request, info, context.time_remaining())
        self._load.count_call()
        call = CallSessions(req)
        context.add_done_callback(call.end)  # type: ignore[arg-type]  # as Stream's: the call's end frees its inputs
        finished = await embed(self._engine, self._tokenizers, req, call)
        self._trailers(context)
        return convert.embeddings_to_pb(req, finished, req.pooling or info.embedding_pooling)

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: Context) -> pb.ModelInfoResponse:
        self._trailers(context)
        return convert.model_info_to_pb(self._engine.info, self._engine.loras())

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: Context) -> pb.LoadAdapterResponse:
        # reading the files and stacking the matrices takes a while: off the event loop, on threads
        # of its own, so that loads neither wait behind other work in asyncio's default pool nor fill it
        loop = asyncio.get_running_loop()
        info = await loop.run_in_executor(self._adapter_loads, self._engine.load_lora, request.name, request.path)
        self._trailers(context)
        return pb.LoadAdapterResponse(adapter=convert.adapter_to_pb(info))

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: Context) -> pb.UnloadAdapterResponse:
        # waits for the generations still using it, until the call's deadline (at most 600 s), on the
        # event loop: the engine completes the future when the last lets go, and no thread waits
        remaining = context.time_remaining()
        timeout = max(0.0, min(MAX_UNLOAD_WAIT_S, remaining - 0.1 if remaining is not None else MAX_UNLOAD_WAIT_S))
        freed = self._engine.unload_lora(request.name)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(freed)), timeout)
        except TimeoutError:
            self._engine.keep_lora(request.name, timeout)  # Busy: it stays (unless freed meanwhile)
        except asyncio.CancelledError:  # the caller gave up: the unload is called off too
            with contextlib.suppress(Busy):
                self._engine.keep_lora(request.name, timeout)
            raise
        self._trailers(context)
        return pb.UnloadAdapterResponse()

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        if len(request.request_ids) > MAX_ABORT_IDS:
            raise InvalidArgument("request_ids", f"{len(request.request_ids)} ids; at most {MAX_ABORT_IDS}")
        who = _credentials(context)
        aborted = []
        for request_id in dict.fromkeys(request.request_ids):
            owned = [
                handle
                for handle, owner in self._by_request_id.get(request_id, ())
                if owner == who and handle.finished is None
            ]
            for handle in owned:
                handle.cancel(FinishReason.CANCELLED)
            if owned:
                aborted.append(request_id)
        self._trailers(context)
        return pb.AbortResponse(aborted=aborted)

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[pb.KvEvent]:
        async for batch in self._engine.kv_events.follow(request.after_sequence):
            for event in batch:
                yield convert.kv_event_to_pb(event)

    async def ServerStatus(self, request: pb.ServerStatusRequest, context: Context) -> pb.ServerStatusResponse:
        self._trailers(context)
        return convert.stats_to_pb(self._engine.stats(), self._engine.info, time.monotonic() - self._engine.started_at)


# who a call is: a hash of its `authorization` metadata, and its TLS client certificate's names
_Credentials = tuple[str, tuple[bytes, ...]]


def _credentials(context: Context) -> _Credentials:
    """Who a call is, for Abort: its `authorization` metadata (a hash of it, never the key) and its
    TLS client certificate's identity, each empty where absent."""
    auth = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
    peer = context.auth_context() or {}
    identity = tuple(peer.get("x509_subject_alternative_name", ())) + tuple(peer.get("x509_common_name", ()))
    return hashlib.sha256(repr(auth).encode()).hexdigest(), identity


def _failure_status(finished: Finished, context: Context, handing_over: bool = False) -> grpc.Status | None:
    """How a session that failed ends its call: an engine error with INTERNAL, a request found
    impossible while it ran with INVALID_ARGUMENT naming the field, a passed gRPC deadline with
    DEADLINE_EXCEEDED, a session a draining server hands over with UNAVAILABLE and the
    braid-handover trailer; each with its own message. Every other end, the request's own
    timeout_ms included, is a normal final message."""
    if finished.reason is FinishReason.CANCELLED and handing_over:
        handed = status(
            grpc.StatusCode.UNAVAILABLE,
            "the server is draining: resume this stream on another replica from the tokens it delivered",
        )
        return with_trailers(handed, HANDOVER_TRAILER)
    if finished.reason is FinishReason.ERROR:
        return status(grpc.StatusCode.INTERNAL, finished.error or "the engine failed")
    if finished.reason is FinishReason.INVALID_REQUEST:
        return status_for(InvalidArgument(finished.error_field or "request", finished.error or "cannot be carried out"))
    remaining = context.time_remaining()
    if finished.reason is FinishReason.DEADLINE and remaining is not None and remaining <= 0.05:
        return status(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed")
    return None


def _timing_metadata(t: pb.Timings) -> tuple[tuple[str, str], ...]:
    return (
        ("braid-queue-ms", f"{t.queue_ms:.3f}"),
        ("braid-time-to-first-token-ms", f"{t.time_to_first_token_ms:.3f}"),
        ("braid-total-ms", f"{t.total_ms:.3f}"),
        ("braid-tokens-per-second", f"{t.tokens_per_second:.3f}"),
    )
