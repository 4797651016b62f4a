"""Server reflection that keeps the .proto's comments, so `grpcurl describe` shows them.

grpcio-reflection rebuilds each file from the runtime descriptor pool, which has no source info; for
braid's own files it serves instead the descriptor set `make protos` wrote with --include_source_info.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import AsyncIterable, AsyncIterator, Iterable

import grpc

from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from braid.server.edge.calls import Context
from braid.v1 import generate_pb2

_LOGGER = logging.getLogger(__name__)
# beside the generated stubs (braid.v1 is a namespace package, so importlib.resources cannot find it)
DESCRIPTOR_SET = Path(generate_pb2.__file__).with_name("generate.binpb")


def _commented_files() -> dict[str, bytes]:
    try:
        raw = DESCRIPTOR_SET.read_bytes()
    except OSError:
        _LOGGER.warning("no %s: reflection serves the .proto without comments", DESCRIPTOR_SET)
        return {}
    files = descriptor_pb2.FileDescriptorSet.FromString(raw).file
    for f in files:
        _drop_json_names(f.message_type)
    return {f.name: f.SerializeToString() for f in files}


def _drop_json_names(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    """protoc fills in json_name (tokenIds); without it, as the runtime pool serves it, grpcurl
    prints the .proto's own field names (token_ids), as the recipes in clients/grpcurl.md show."""
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


class CommentedReflectionServicer(reflection.aio.ReflectionServicer):
    def __init__(self, service_names: Iterable[str]) -> None:
        super().__init__(service_names)  # type: ignore[no-untyped-call]  # grpcio-reflection's is unannotated
        self._commented = _commented_files()

    async def ServerReflectionInfo(
        self, request_iterator: AsyncIterable[reflection_pb2.ServerReflectionRequest], context: Context
    ) -> AsyncIterator[reflection_pb2.ServerReflectionResponse]:
        async for response in super().ServerReflectionInfo(request_iterator, context):
            if response.HasField("file_descriptor_response"):
                protos = response.file_descriptor_response.file_descriptor_proto
                for i, raw in enumerate(protos):
                    name = descriptor_pb2.FileDescriptorProto.FromString(raw).name
                    protos[i] = self._commented.get(name, raw)
            yield response


def enable(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    from grpc_reflection.v1alpha import reflection_pb2_grpc

    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(CommentedReflectionServicer(service_names), server)
