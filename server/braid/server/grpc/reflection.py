"""Server reflection that keeps the .proto's comments, so `grpcurl describe` shows them, under both
of its names: grpc.reflection.v1 (what buf and newer grpcurl ask first) and v1alpha.

grpcio-reflection rebuilds each file from the runtime descriptor pool, which has no source info; for
braid's own files it serves instead the descriptor set `make protos` wrote with --include_source_info.

grpcio-reflection serves only v1alpha (grpc/grpc#38576). v1 is the same protocol under another
package: the same messages with the same field numbers, so the same bytes on the wire. braid serves
it by hand, with v1alpha's servicer and messages at v1's method path, and adds v1's file (v1alpha's
renamed) to the descriptor pool, so that reflection can describe v1 itself.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import AsyncIterable, AsyncIterator, Iterable

import grpc

from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from braid.server.grpc.calls import Context
from braid.v1 import generate_pb2

_LOGGER = logging.getLogger(__name__)
# beside the generated stubs (braid.v1 is a namespace package, so importlib.resources cannot find it)
DESCRIPTOR_SET = Path(generate_pb2.__file__).with_name("generate.binpb")
V1ALPHA_SERVICE = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"
SERVICE_NAMES = (V1_SERVICE, V1ALPHA_SERVICE)


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


def _add_v1_file() -> None:
    """grpc/reflection/v1/reflection.proto into the default pool: v1alpha's file, its package renamed."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return  # added already (or by a grpcio-reflection that has it)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto.FromString(reflection_pb2.DESCRIPTOR.serialized_pb)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    for message in proto.message_type:
        for f in message.field:
            if f.HasField("type_name"):
                f.type_name = f.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type, method.output_type = (
                method.input_type.replace(old, new),
                method.output_type.replace(old, new),
            )
    pool.AddSerializedFile(proto.SerializeToString())


def enable(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Reflection on `server` under v1 and v1alpha, listing `service_names` and both of its own."""
    _add_v1_file()
    servicer = CommentedReflectionServicer((*service_names, *SERVICE_NAMES))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE, handlers),))
