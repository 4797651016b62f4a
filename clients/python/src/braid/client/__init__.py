"""braid's Python client: stream LLM text generation from a braid server over gRPC.

    from braid.client import Client

    with Client("localhost:50051") as client:
        print(client.generate("The capital of France is", max_new_tokens=8).text)

A failed call raises a BraidError, by its status: BadRequestError (with the field at fault),
OverloadedError (with retry_after), UnavailableError, DeadlineExceededError, ...
"""

from braid.client.client import AsyncClient, Client, KvEvents
from braid.client.errors import (
    BadRequestError,
    BraidError,
    CallCancelledError,
    DeadlineExceededError,
    InternalError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
    describe,
    from_rpc_error,
)
from braid.client.generation import AsyncGeneration, Completion, Generation, finish_reason_name
from braid.client.request import (
    GenerateParams,
    build_request,
    build_embed_request,
    build_tokenize_request,
    choice,
    function_choice,
    grammar,
    json_object,
    json_schema,
    regex,
    tool,
)
from braid.client.routing import ROUTE_KEY_HEADER, route_key

__all__ = [
    "AsyncClient",
    "AsyncGeneration",
    "BadRequestError",
    "BraidError",
    "CallCancelledError",
    "Client",
    "Completion",
    "DeadlineExceededError",
    "GenerateParams",
    "Generation",
    "InternalError",
    "KvEvents",
    "NotFoundError",
    "OverloadedError",
    "PermissionDeniedError",
    "ROUTE_KEY_HEADER",
    "UnauthenticatedError",
    "UnavailableError",
    "build_request",
    "build_embed_request",
    "build_tokenize_request",
    "choice",
    "describe",
    "finish_reason_name",
    "from_rpc_error",
    "function_choice",
    "grammar",
    "json_object",
    "json_schema",
    "regex",
    "route_key",
    "tool",
]
