"""braid's Python client: stream LLM text generation from a braid server over gRPC.

    from braid.client import Client

    with Client("localhost:50051") as client:
        print(client.generate("The capital of France is", max_new_tokens=8).text)
"""

from braid.client.client import AsyncClient, Client
from braid.client.errors import describe
from braid.client.generation import AsyncGeneration, Completion, Generation
from braid.client.request import (GenerateParams, build_request, build_tokenize_request, choice, grammar, json_object,
                                  json_schema, regex)

__all__ = [
    "AsyncClient",
    "AsyncGeneration",
    "Client",
    "Completion",
    "GenerateParams",
    "Generation",
    "build_request",
    "build_tokenize_request",
    "choice",
    "describe",
    "grammar",
    "json_object",
    "json_schema",
    "regex",
]
