"""Client (blocking) and AsyncClient (grpc.aio) for braid's Generate service."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf import wrappers_pb2
from grpc import aio

from braid.client.generation import AsyncGeneration, Completion, Generation
from braid.client.request import Chat, build_request, build_tokenize_request
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc

# grpc.health.v1 without its generated code: HealthCheckRequest is {1: string service} and
# HealthCheckResponse is {1: enum status}, the same wire format as StringValue and Int32Value.
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_HEALTH_STATUS = ("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")

GenerationT = TypeVar("GenerationT", Generation, AsyncGeneration)
Certificate = bytes | str | os.PathLike[str]


def _read(certificate: Certificate | None) -> bytes | None:
    if certificate is None or isinstance(certificate, bytes):
        return certificate
    return Path(certificate).read_bytes()


def _health_status(response: wrappers_pb2.Int32Value) -> str:
    status = response.value
    return _HEALTH_STATUS[status] if 0 <= status < len(_HEALTH_STATUS) else str(status)


class _BaseClient(Generic[GenerationT]):
    """Channel, stub, call options and stream(), shared by Client and AsyncClient."""

    _grpc: ModuleType  # grpc or grpc.aio: both have insecure_channel and secure_channel
    _generation: Callable[[Any], GenerationT]  # wraps a Stream call

    def __init__(
        self,
        target: str = "localhost:50051",
        *,
        tls: bool = False,
        root_certificates: Certificate | None = None,
        client_cert: Certificate | None = None,
        client_key: Certificate | None = None,
        api_key: str | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
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
        if tls or root_certificates is not None or client_cert is not None:
            credentials = grpc.ssl_channel_credentials(
                _read(root_certificates), _read(client_key), _read(client_cert)
            )
            self._channel = self._grpc.secure_channel(target, credentials, options)
        else:
            self._channel = self._grpc.insecure_channel(target, options)
        self._stub = generate_pb2_grpc.GenerateStub(self._channel)
        self._health = self._channel.unary_unary(
            _HEALTH_CHECK,
            request_serializer=wrappers_pb2.StringValue.SerializeToString,
            response_deserializer=wrappers_pb2.Int32Value.FromString,
        )

    def _call_options(self, timeout: float | None) -> dict[str, Any]:
        return {"timeout": timeout, "metadata": self._metadata}

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Chat | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> GenerationT:
        """Starts a generation from a prompt or a chat; params are GenerateRequest fields.

        Raises ValueError unless exactly one of prompt and messages is given, and TypeError
        for a param that is not a GenerateRequest field.
        """
        request = build_request(prompt, messages=messages, **params)
        return self._generation(self._stub.Stream(request, **self._call_options(timeout)))


class Client(_BaseClient[Generation]):
    """A blocking braid client. Use it as a context manager, or call close().

    Example:
        with Client("localhost:50051") as client:
            for message in client.stream("Once upon a time", max_new_tokens=32):
                print(message.text, end="", flush=True)
    """

    _grpc = grpc
    _generation = Generation

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Chat | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> Completion:
        """Runs a generation to its end and returns its Completion."""
        with self.stream(prompt, messages=messages, timeout=timeout, **params) as generation:
            for _ in generation:
                pass
        return generation.completion()

    def tokenize(
        self, text: str | None = None, *, messages: Chat | None = None, timeout: float | None = None
    ) -> pb.TokenizeResponse:
        """Returns the tokens the model would see for a text or a chat."""
        request = build_tokenize_request(text, messages=messages)
        return self._stub.Tokenize(request, **self._call_options(timeout))

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfoResponse:
        """Describes the served model and its scheduling."""
        return self._stub.ModelInfo(pb.ModelInfoRequest(), **self._call_options(timeout))

    def server_status(self, *, timeout: float | None = None) -> pb.ServerStatusResponse:
        """Returns the engine's live counts."""
        return self._stub.ServerStatus(pb.ServerStatusRequest(), **self._call_options(timeout))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """Returns the grpc.health.v1 status of a service ("" is the server): "SERVING", "NOT_SERVING", ..."""
        request = wrappers_pb2.StringValue(value=service)
        return _health_status(self._health(request, **self._call_options(timeout)))

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

    _grpc = aio
    _generation = AsyncGeneration

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Chat | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> Completion:
        """Runs a generation to its end and returns its Completion."""
        async with self.stream(prompt, messages=messages, timeout=timeout, **params) as generation:
            async for _ in generation:
                pass
        return generation.completion()

    async def tokenize(
        self, text: str | None = None, *, messages: Chat | None = None, timeout: float | None = None
    ) -> pb.TokenizeResponse:
        """Returns the tokens the model would see for a text or a chat."""
        request = build_tokenize_request(text, messages=messages)
        return await self._stub.Tokenize(request, **self._call_options(timeout))

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfoResponse:
        """Describes the served model and its scheduling."""
        return await self._stub.ModelInfo(pb.ModelInfoRequest(), **self._call_options(timeout))

    async def server_status(self, *, timeout: float | None = None) -> pb.ServerStatusResponse:
        """Returns the engine's live counts."""
        return await self._stub.ServerStatus(pb.ServerStatusRequest(), **self._call_options(timeout))

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """Returns the grpc.health.v1 status of a service ("" is the server): "SERVING", "NOT_SERVING", ..."""
        request = wrappers_pb2.StringValue(value=service)
        return _health_status(await self._health(request, **self._call_options(timeout)))

    async def close(self) -> None:
        """Closes the channel, cancelling any call still running."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
