"""Client (blocking) and AsyncClient (grpc.aio) for braid's Generate service."""

from __future__ import annotations

import abc
import json
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Generic, Protocol, TypeVar, cast

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from typing_extensions import Unpack

from braid.client.errors import from_rpc_error, raising_braid_errors
from braid.client.generation import AsyncGeneration, Completion, Generation
from braid.client.request import (
    Chat,
    GenerateParams,
    ToolLike,
    build_embed_request,
    build_request,
    build_tokenize_request,
)
from braid.client.routing import ROUTE_KEY_HEADER, route_key
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc

GenerationT = TypeVar("GenerationT", Generation, AsyncGeneration)
Certificate = bytes | str | os.PathLike[str]
ChannelOptions = Sequence[tuple[str, Any]]  # e.g. [("grpc.max_receive_message_length", -1)]
Credentials = grpc.ChannelCredentials
ChannelT_co = TypeVar("ChannelT_co", covariant=True)
Metadata = tuple[tuple[str, str], ...]


# gRPC's own load balancing and retries, through the channel's service config: each call (not
# each connection) goes to the next ready address (round_robin), and a call that fails with
# UNAVAILABLE, or RESOURCE_EXHAUSTED (after the server's grpc-retry-pushback-ms), before its first
# response message is tried again; gRPC commits a stream at its first message, so nothing is
# duplicated. A stream that breaks later is resumed by Generation (resume_token_ids).
SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [
        {
            "name": [{"service": "braid.v1.Generate"}],
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.1s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
            },
        }
    ],
}
# Prefix-affinity routing on the client, over several replicas (docs/deployment.md): gRPC's ring
# hash picks each call's replica by its braid-route-key header. grpcio (1.85 checked) reads the
# header only with GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY=true in the environment before
# it loads; without it every call fails INTERNAL "hash attribute not present", so it is not the
# default: pass options=[("grpc.service_config", json.dumps(RING_HASH_SERVICE_CONFIG))] to opt in.
# It has no bounded load (a hot key stays on one replica), and grpc-js has no ring hash outside xDS.
RING_HASH_SERVICE_CONFIG = {
    **SERVICE_CONFIG,
    "loadBalancingConfig": [{"ring_hash_experimental": {"requestHashHeader": "braid-route-key"}}],
}
DEFAULT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
    ("grpc.enable_retries", 1),
    ("grpc.keepalive_time_ms", 30_000),  # notice a dead server or proxy within a minute on an idle stream
    ("grpc.keepalive_timeout_ms", 10_000),
)


def channel_target(target: str | Sequence[str]) -> str:
    """One gRPC target for one address or several: "host:port", "dns:///name:port" (every address
    the name resolves to), or a list of "ip:port" (joined as "ipv4:a:p,b:p", or "ipv6:")."""
    if isinstance(target, str):
        return target
    addresses = [a.replace("localhost:", "127.0.0.1:", 1) if a.startswith("localhost:") else a for a in target]
    if not addresses:
        raise ValueError("target: no address")
    if len(addresses) == 1:
        return addresses[0]
    scheme = "ipv6" if all(a.startswith("[") for a in addresses) else "ipv4"
    return f"{scheme}:{','.join(addresses)}"


def _read(certificate: Certificate | None) -> bytes | None:
    if certificate is None or isinstance(certificate, bytes):
        return certificate
    return Path(certificate).read_bytes()


class _Channels(Protocol[ChannelT_co]):
    """grpc or grpc.aio, as far as opening a channel goes."""

    def insecure_channel(self, target: str, options: ChannelOptions | None = ...) -> ChannelT_co: ...

    def secure_channel(
        self, target: str, credentials: Credentials, options: ChannelOptions | None = ...
    ) -> ChannelT_co: ...


def _open_channel(
    api: _Channels[ChannelT_co], target: str, credentials: Credentials | None, options: ChannelOptions | None
) -> ChannelT_co:
    if credentials is None:
        return api.insecure_channel(target, options)
    return api.secure_channel(target, credentials, options)


CallT = TypeVar("CallT")


def _restart(
    request: pb.GenerateRequest, call: Callable[[pb.GenerateRequest], CallT]
) -> Callable[[list[int], int | None], CallT]:
    """How a broken stream of this request starts again from the tokens it delivered, with the
    seed its server drew (None: the request's own, for a stream that never started)."""

    def restart(delivered: list[int], seed: int | None) -> CallT:
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(request)
        if seed is not None:
            resumed.seed = seed
        del resumed.resume_token_ids[:]
        resumed.resume_token_ids.extend(list(request.resume_token_ids) + delivered)
        return call(resumed)

    return restart


def _resumes(request: pb.GenerateRequest, resume: bool) -> bool:
    """Whether a broken stream of this request is resumed: not one with tools, whose calls the
    server reads from the whole output (it refuses resume_token_ids with tools)."""
    return resume and not request.tools


def _check_one_sample(params: GenerateParams) -> None:
    if (params.get("n") or 1) > 1:
        raise ValueError("generate() returns one Completion: for n > 1 samples, use stream() and completions()")


def _health_status(response: health_pb2.HealthCheckResponse) -> str:
    """The status's name ("SERVING", ...), or its number where this client does not know it."""
    statuses = health_pb2.HealthCheckResponse.ServingStatus
    return statuses.Name(response.status) if response.status in statuses.values() else str(response.status)


class _BaseClient(abc.ABC, Generic[GenerationT]):
    """Target, credentials, call metadata and stream(), shared by Client and AsyncClient."""

    def __init__(
        self,
        target: str | Sequence[str] = "localhost:50051",
        *,
        tls: bool = False,
        root_certificates: Certificate | None = None,
        client_cert: Certificate | None = None,
        client_key: Certificate | None = None,
        api_key: str | None = None,
        options: ChannelOptions | None = None,
        resume: bool = True,
        route_keys: bool = True,
    ) -> None:
        """Opens a channel to a braid server.

        Args:
            target: host:port of the server; "dns:///name:port" to balance over every address
                the name resolves to; or several "ip:port" addresses to balance over. Calls go
                round robin over the ready ones, and are retried on UNAVAILABLE before their
                first message.
            tls: use TLS. Implied by root_certificates and client_cert.
            root_certificates: PEM CA certificates (bytes or a path); default: the system's.
            client_cert, client_key: PEM certificate chain and key (bytes or paths) for mTLS.
            api_key: sent with every call as `authorization: Bearer <api_key>`.
            options: gRPC channel options, e.g. [("grpc.max_receive_message_length", -1)],
                added to (and overriding) DEFAULT_OPTIONS: the service config, keepalive.
            resume: a stream of one sample that breaks mid-way (UNAVAILABLE: its server died,
                its connection dropped) is resumed from the tokens it delivered, on whichever
                server the channel reaches, so the caller sees one unbroken stream.
            route_keys: every Stream call carries a `braid-route-key` header (braid.client.routing),
                the same for calls that start alike, so a proxy that hashes it (HAProxy, Envoy)
                sends them to the replica whose prefix cache holds their start.
        """
        if (client_cert is None) != (client_key is None):
            raise ValueError("client_cert and client_key go together")
        self.target = channel_target(target)
        self.resume = resume
        self.route_keys = route_keys
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        credentials = None
        if tls or root_certificates is not None or client_cert is not None:
            credentials = grpc.ssl_channel_credentials(_read(root_certificates), _read(client_key), _read(client_cert))
        given = dict(options or ())
        merged = [(k, v) for k, v in DEFAULT_OPTIONS if k not in given] + list(given.items())
        self._connect(self.target, credentials, merged)

    @abc.abstractmethod
    def _connect(self, target: str, credentials: Credentials | None, options: ChannelOptions | None) -> None:
        """Opens the channel (secure where credentials are given) and its stubs."""

    @abc.abstractmethod
    def _start(self, request: pb.GenerateRequest, timeout: float | None, metadata: Metadata) -> GenerationT:
        """Starts a Stream call with this metadata (its resumes too)."""

    def _stream_metadata(self, request: pb.GenerateRequest, key: str | None) -> Metadata:
        """The call's metadata: the API key's, and the routing key (given, or the request's own)."""
        key = key if key is not None else route_key(request) if self.route_keys else None
        return self._metadata + (((ROUTE_KEY_HEADER, key),) if key else ())

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Chat | None = None,
        timeout: float | None = None,
        route_key: str | None = None,
        **params: Unpack[GenerateParams],
    ) -> GenerationT:
        """Starts a generation from a prompt or a chat; params are GenerateRequest fields.

        route_key: the `braid-route-key` header, e.g. a conversation id; default: the request's
        own (braid.client.routing.route_key), unless the client's route_keys is False.

        Raises ValueError unless exactly one of prompt, messages and params' prompt_token_ids
        is given, and TypeError for a param that is not a GenerateRequest field.
        """
        request = build_request(prompt, messages=messages, **params)
        return self._start(request, timeout, self._stream_metadata(request, route_key))


class KvEvents:
    """Client.kv_events' stream: iterate it for the KvEvents; close() ends it from any thread."""

    def __init__(self, call: Any) -> None:
        self._call = call  # a grpc unary-stream call: an iterator of KvEvent with cancel()
        self._closed = False

    def __iter__(self) -> Iterator[pb.KvEvent]:
        return self

    def __next__(self) -> pb.KvEvent:
        try:
            event: pb.KvEvent = next(self._call)
        except grpc.RpcError as error:
            if self._closed:  # our own cancel: the iteration ends (its error would wait on the call)
                raise StopIteration from None
            raise from_rpc_error(error) from error
        return event

    def close(self) -> None:
        self._closed = True
        self._call.cancel()

    def __enter__(self) -> KvEvents:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Client(_BaseClient[Generation]):
    """A blocking braid client. Use it as a context manager, or call close().

    Example:
        with Client("localhost:50051") as client:
            for message in client.stream("Once upon a time", max_new_tokens=32):
                print(message.text, end="", flush=True)
    """

    def _connect(self, target: str, credentials: Credentials | None, options: ChannelOptions | None) -> None:
        self._channel = _open_channel(grpc, target, credentials, options)
        self._stub = generate_pb2_grpc.GenerateStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _start(self, request: pb.GenerateRequest, timeout: float | None, metadata: Metadata) -> Generation:
        def call(req: pb.GenerateRequest) -> grpc.Call:
            return cast(grpc.Call, self._stub.Stream(req, timeout=timeout, metadata=metadata))

        return Generation(
            call(request), request.n, restart=_restart(request, call) if _resumes(request, self.resume) else None
        )

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Chat | None = None,
        timeout: float | None = None,
        route_key: str | None = None,
        **params: Unpack[GenerateParams],
    ) -> Completion:
        """Runs a generation of one sample to its end and returns its Completion.

        Raises ValueError for n > 1: stream() and its completions() have every sample.
        """
        _check_one_sample(params)
        with self.stream(prompt, messages=messages, timeout=timeout, route_key=route_key, **params) as generation:
            for _ in generation:
                pass
        return generation.completion()

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Chat | None = None,
        return_offsets: bool = False,
        tools: Sequence[ToolLike] | None = None,
        enable_thinking: bool | None = None,
        timeout: float | None = None,
    ) -> pb.TokenizeResponse:
        """Returns the tokens the model would see for a text or a chat; with return_offsets, each
        token's characters [start, end) in the text too (offsets). A chat's tools and
        enable_thinking are rendered as generate's are: its token count is the prompt_tokens of a
        generation with the same chat, tools and switch."""
        request = build_tokenize_request(
            text, messages=messages, return_offsets=return_offsets, tools=tools, enable_thinking=enable_thinking
        )
        with raising_braid_errors():
            return self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata)

    def detokenize(self, token_ids: Sequence[int], *, timeout: float | None = None) -> pb.DetokenizeResponse:
        """Returns the ids' text, as a stream would send it: ending on a whole character, with
        held_back_tokens saying how many of the last ids end in part of one (send them again with
        the next)."""
        request = pb.DetokenizeRequest(token_ids=list(token_ids))
        with raising_braid_errors():
            return self._stub.Detokenize(request, timeout=timeout, metadata=self._metadata)

    def embed(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int = 0,
        truncate_input_tokens: int = 0,
        timeout: float | None = None,
    ) -> pb.EmbedResponse:
        """Embeds a text, a list of texts or a list of token id lists: one Embedding per input, in
        order (each its values and prompt_tokens). pooling "last" or "mean" (None: the model's,
        ModelInfo's embedding_pooling); normalize None: unit length; dimensions: keep the leading
        ones; truncate_input_tokens: keep each input's last tokens."""
        request = build_embed_request(
            inputs,
            pooling=pooling,
            normalize=normalize,
            dimensions=dimensions,
            truncate_input_tokens=truncate_input_tokens,
        )
        with raising_braid_errors():
            return self._stub.Embed(request, timeout=timeout, metadata=self._metadata)

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfoResponse:
        """Describes the served model and its scheduling."""
        with raising_braid_errors():
            return self._stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    def server_status(self, *, timeout: float | None = None) -> pb.ServerStatusResponse:
        """Returns the engine's live counts."""
        with raising_braid_errors():
            return self._stub.ServerStatus(pb.ServerStatusRequest(), timeout=timeout, metadata=self._metadata)

    def abort(self, request_ids: Sequence[str], *, timeout: float | None = None) -> list[str]:
        """Cancels the generations started with these request ids (by calls with this client's
        credentials); returns the ids that were running or queued."""
        request = pb.AbortRequest(request_ids=list(request_ids))
        with raising_braid_errors():
            return list(self._stub.Abort(request, timeout=timeout, metadata=self._metadata).aborted)

    def load_adapter(self, name: str, path: str, *, timeout: float | None = None) -> pb.AdapterInfo:
        """Loads the LoRA adapter at the server's `path` (a PEFT folder, or a GGUF LoRA file) as `name`."""
        request = pb.LoadAdapterRequest(name=name, path=path)
        with raising_braid_errors():
            return self._stub.LoadAdapter(request, timeout=timeout, metadata=self._metadata).adapter

    def unload_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Unloads a LoRA adapter, once the generations using it have finished."""
        with raising_braid_errors():
            self._stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=timeout, metadata=self._metadata)

    def kv_events(self, after_sequence: int = 0, *, timeout: float | None = None) -> KvEvents:
        """The prefix cache's events (pages stored and evicted) after `after_sequence`, as they
        come, until the server stops; a KvEvent with `resync` set says the events asked for are
        gone: drop what you know of this server. close() (from any thread) ends the call."""
        request = pb.SubscribeKvEventsRequest(after_sequence=after_sequence)
        return KvEvents(self._stub.SubscribeKvEvents(request, timeout=timeout, metadata=self._metadata))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """Returns the grpc.health.v1 status of a service ("" is the server): "SERVING", "NOT_SERVING", ..."""
        request = health_pb2.HealthCheckRequest(service=service)
        with raising_braid_errors():
            return _health_status(self._health.Check(request, timeout=timeout, metadata=self._metadata))

    def close(self) -> None:
        """Closes the channel, cancelling any call still running."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient(_BaseClient[AsyncGeneration]):
    """A grpc.aio braid client, with the same methods as Client as coroutines.

    Example:
        async with AsyncClient("localhost:50051") as client:
            async with client.stream("Once upon a time") as generation:
                async for message in generation:
                    print(message.text, end="", flush=True)
    """

    def _connect(self, target: str, credentials: Credentials | None, options: ChannelOptions | None) -> None:
        self._channel = _open_channel(aio, target, credentials, options)
        self._stub = generate_pb2_grpc.GenerateStub(self._channel)  # a GenerateAsyncStub
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _start(self, request: pb.GenerateRequest, timeout: float | None, metadata: Metadata) -> AsyncGeneration:
        def call(req: pb.GenerateRequest) -> aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]:
            return self._stub.Stream(req, timeout=timeout, metadata=metadata)

        return AsyncGeneration(
            call(request), request.n, restart=_restart(request, call) if _resumes(request, self.resume) else None
        )

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Chat | None = None,
        timeout: float | None = None,
        route_key: str | None = None,
        **params: Unpack[GenerateParams],
    ) -> Completion:
        """Runs a generation of one sample to its end and returns its Completion.

        Raises ValueError for n > 1: stream() and its completions() have every sample.
        """
        _check_one_sample(params)
        async with self.stream(prompt, messages=messages, timeout=timeout, route_key=route_key, **params) as generation:
            async for _ in generation:
                pass
        return generation.completion()

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Chat | None = None,
        return_offsets: bool = False,
        tools: Sequence[ToolLike] | None = None,
        enable_thinking: bool | None = None,
        timeout: float | None = None,
    ) -> pb.TokenizeResponse:
        """Returns the tokens the model would see for a text or a chat; with return_offsets, each
        token's characters [start, end) in the text too (offsets). A chat's tools and
        enable_thinking are rendered as generate's are: its token count is the prompt_tokens of a
        generation with the same chat, tools and switch."""
        request = build_tokenize_request(
            text, messages=messages, return_offsets=return_offsets, tools=tools, enable_thinking=enable_thinking
        )
        with raising_braid_errors():
            return await self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata)

    async def detokenize(self, token_ids: Sequence[int], *, timeout: float | None = None) -> pb.DetokenizeResponse:
        """Returns the ids' text, as a stream would send it: ending on a whole character, with
        held_back_tokens saying how many of the last ids end in part of one (send them again with
        the next)."""
        request = pb.DetokenizeRequest(token_ids=list(token_ids))
        with raising_braid_errors():
            return await self._stub.Detokenize(request, timeout=timeout, metadata=self._metadata)

    async def embed(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int = 0,
        truncate_input_tokens: int = 0,
        timeout: float | None = None,
    ) -> pb.EmbedResponse:
        """Embeds a text, a list of texts or a list of token id lists, as Client.embed."""
        request = build_embed_request(
            inputs,
            pooling=pooling,
            normalize=normalize,
            dimensions=dimensions,
            truncate_input_tokens=truncate_input_tokens,
        )
        with raising_braid_errors():
            return await self._stub.Embed(request, timeout=timeout, metadata=self._metadata)

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfoResponse:
        """Describes the served model and its scheduling."""
        with raising_braid_errors():
            return await self._stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    async def server_status(self, *, timeout: float | None = None) -> pb.ServerStatusResponse:
        """Returns the engine's live counts."""
        with raising_braid_errors():
            return await self._stub.ServerStatus(pb.ServerStatusRequest(), timeout=timeout, metadata=self._metadata)

    async def abort(self, request_ids: Sequence[str], *, timeout: float | None = None) -> list[str]:
        """Cancels the generations started with these request ids (by calls with this client's
        credentials); returns the ids that were running or queued."""
        request = pb.AbortRequest(request_ids=list(request_ids))
        with raising_braid_errors():
            return list((await self._stub.Abort(request, timeout=timeout, metadata=self._metadata)).aborted)

    async def load_adapter(self, name: str, path: str, *, timeout: float | None = None) -> pb.AdapterInfo:
        """Loads the LoRA adapter at the server's `path` (a PEFT folder, or a GGUF LoRA file) as `name`."""
        request = pb.LoadAdapterRequest(name=name, path=path)
        with raising_braid_errors():
            return (await self._stub.LoadAdapter(request, timeout=timeout, metadata=self._metadata)).adapter

    async def unload_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Unloads a LoRA adapter, once the generations using it have finished."""
        with raising_braid_errors():
            await self._stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=timeout, metadata=self._metadata)

    async def kv_events(self, after_sequence: int = 0, *, timeout: float | None = None) -> AsyncIterator[pb.KvEvent]:
        """As Client.kv_events, on the event loop."""
        request = pb.SubscribeKvEventsRequest(after_sequence=after_sequence)
        call = self._stub.SubscribeKvEvents(request, timeout=timeout, metadata=self._metadata)
        try:
            with raising_braid_errors():
                async for event in call:
                    yield event
        finally:
            call.cancel()

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """Returns the grpc.health.v1 status of a service ("" is the server): "SERVING", "NOT_SERVING", ..."""
        request = health_pb2.HealthCheckRequest(service=service)
        with raising_braid_errors():
            return _health_status(await self._health.Check(request, timeout=timeout, metadata=self._metadata))

    async def close(self) -> None:
        """Closes the channel, cancelling any call still running."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
