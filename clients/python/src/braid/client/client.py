"""Client (blocking) and AsyncClient (grpc.aio) for braid's Generate service."""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from typing_extensions import Unpack

from braid.client.generation import AsyncGeneration, Completion, Generation
from braid.client.request import Chat, GenerateParams, build_request, build_tokenize_request
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc

GenerationT = TypeVar("GenerationT", Generation, AsyncGeneration)
Certificate = bytes | str | os.PathLike[str]
ChannelOptions = Sequence[tuple[str, Any]]  # e.g. [("grpc.max_receive_message_length", -1)]
Credentials = grpc.ChannelCredentials
ChannelT_co = TypeVar("ChannelT_co", covariant=True)


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
        target: str = "localhost:50051",
        *,
        tls: bool = False,
        root_certificates: Certificate | None = None,
        client_cert: Certificate | None = None,
        client_key: Certificate | None = None,
        api_key: str | None = None,
        options: ChannelOptions | None = None,
    ) -> None:
        """Opens a channel to a braid server.

        Args:
            target: host:port of the server.
            tls: use TLS. Implied by root_certificates and client_cert.
            root_certificates: PEM CA certificates (bytes or a path); default: the system's.
            client_cert, client_key: PEM certificate chain and key (bytes or paths) for mTLS.
            api_key: sent with every call as `authorization: Bearer <api_key>`.
            options: gRPC channel options, e.g. [("grpc.max_receive_message_length", -1)].
        """
        if (client_cert is None) != (client_key is None):
            raise ValueError("client_cert and client_key go together")
        self.target = target
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        credentials = None
        if tls or root_certificates is not None or client_cert is not None:
            credentials = grpc.ssl_channel_credentials(
                _read(root_certificates), _read(client_key), _read(client_cert)
            )
        self._connect(target, credentials, options)

    @abc.abstractmethod
    def _connect(self, target: str, credentials: Credentials | None, options: ChannelOptions | None) -> None:
        """Opens the channel (secure where credentials are given) and its stubs."""

    @abc.abstractmethod
    def _start(self, request: pb.GenerateRequest, timeout: float | None) -> GenerationT:
        """Starts a Stream call."""

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Chat | None = None,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> GenerationT:
        """Starts a generation from a prompt or a chat; params are GenerateRequest fields.

        Raises ValueError unless exactly one of prompt and messages is given, and TypeError
        for a param that is not a GenerateRequest field.
        """
        return self._start(build_request(prompt, messages=messages, **params), timeout)


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

    def _start(self, request: pb.GenerateRequest, timeout: float | None) -> Generation:
        return Generation(self._stub.Stream(request, timeout=timeout, metadata=self._metadata), request.n)

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Chat | None = None,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> Completion:
        """Runs a generation of one sample to its end and returns its Completion.

        Raises ValueError for n > 1: stream() and its completions() have every sample.
        """
        _check_one_sample(params)
        with self.stream(prompt, messages=messages, timeout=timeout, **params) as generation:
            for _ in generation:
                pass
        return generation.completion()

    def tokenize(
        self, text: str | None = None, *, messages: Chat | None = None, timeout: float | None = None
    ) -> pb.TokenizeResponse:
        """Returns the tokens the model would see for a text or a chat."""
        request = build_tokenize_request(text, messages=messages)
        return self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata)

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfoResponse:
        """Describes the served model and its scheduling."""
        return self._stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    def server_status(self, *, timeout: float | None = None) -> pb.ServerStatusResponse:
        """Returns the engine's live counts."""
        return self._stub.ServerStatus(pb.ServerStatusRequest(), timeout=timeout, metadata=self._metadata)

    def abort(self, request_ids: Sequence[str], *, timeout: float | None = None) -> list[str]:
        """Cancels the generations started with these request ids (by calls with this client's
        credentials); returns the ids that were running or queued."""
        request = pb.AbortRequest(request_ids=list(request_ids))
        return list((self._stub.Abort(request, timeout=timeout, metadata=self._metadata)).aborted)

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """Returns the grpc.health.v1 status of a service ("" is the server): "SERVING", "NOT_SERVING", ..."""
        request = health_pb2.HealthCheckRequest(service=service)
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

    def _start(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncGeneration:
        return AsyncGeneration(self._stub.Stream(request, timeout=timeout, metadata=self._metadata), request.n)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Chat | None = None,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> Completion:
        """Runs a generation of one sample to its end and returns its Completion.

        Raises ValueError for n > 1: stream() and its completions() have every sample.
        """
        _check_one_sample(params)
        async with self.stream(prompt, messages=messages, timeout=timeout, **params) as generation:
            async for _ in generation:
                pass
        return generation.completion()

    async def tokenize(
        self, text: str | None = None, *, messages: Chat | None = None, timeout: float | None = None
    ) -> pb.TokenizeResponse:
        """Returns the tokens the model would see for a text or a chat."""
        request = build_tokenize_request(text, messages=messages)
        return await self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata)

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfoResponse:
        """Describes the served model and its scheduling."""
        return await self._stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    async def server_status(self, *, timeout: float | None = None) -> pb.ServerStatusResponse:
        """Returns the engine's live counts."""
        return await self._stub.ServerStatus(pb.ServerStatusRequest(), timeout=timeout, metadata=self._metadata)

    async def abort(self, request_ids: Sequence[str], *, timeout: float | None = None) -> list[str]:
        """Cancels the generations started with these request ids (by calls with this client's
        credentials); returns the ids that were running or queued."""
        request = pb.AbortRequest(request_ids=list(request_ids))
        return list((await self._stub.Abort(request, timeout=timeout, metadata=self._metadata)).aborted)

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """Returns the grpc.health.v1 status of a service ("" is the server): "SERVING", "NOT_SERVING", ..."""
        request = health_pb2.HealthCheckRequest(service=service)
        return _health_status(await self._health.Check(request, timeout=timeout, metadata=self._metadata))

    async def close(self) -> None:
        """Closes the channel, cancelling any call still running."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
