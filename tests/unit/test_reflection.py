"""Server reflection in process, under both of its names: grpc.reflection.v1 (which buf and grpcurl
1.9+ ask first) and v1alpha (older grpcurl), each listing every service and describing braid's
types with the .proto's comments."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb

from braid.server.grpc import reflection
from braid.server.grpc.server import SERVICE_NAME


HEALTH = "grpc.health.v1.Health"


async def _ask(service: str, *requests: rpb.ServerReflectionRequest) -> list[rpb.ServerReflectionResponse]:
    """The responses of one reflection stream to `service` on a fresh server (v1's messages are
    v1alpha's bytes under another package)."""
    server = grpc.aio.server()
    reflection.enable((SERVICE_NAME, HEALTH), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(
                f"/{service}/ServerReflectionInfo",
                request_serializer=rpb.ServerReflectionRequest.SerializeToString,
                response_deserializer=rpb.ServerReflectionResponse.FromString,
            )
            return [response async for response in call(iter(requests))]
    finally:
        await server.stop(None)


def _files(response: rpb.ServerReflectionResponse) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    protos = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in response.file_descriptor_response.file_descriptor_proto
    ]
    return {p.name: p for p in protos}


@pytest.mark.parametrize("service", ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"])
def test_both_reflection_services_list_every_service_and_describe_braids_with_comments(service):
    listed, braid, itself = asyncio.run(
        _ask(
            service,
            rpb.ServerReflectionRequest(list_services=""),
            rpb.ServerReflectionRequest(file_containing_symbol="braid.v1.GenerateRequest"),
            rpb.ServerReflectionRequest(file_containing_symbol=service),
        )
    )
    names = {s.name for s in listed.list_services_response.service}
    assert names == {
        SERVICE_NAME,
        HEALTH,
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    generate = _files(braid)["braid/v1/generate.proto"]
    assert generate.source_code_info.location, "the .proto's comments are served"
    (own,) = _files(itself).values()
    assert own.package == service.rsplit(".", 1)[0]
    assert [m.input_type for m in own.service[0].method] == [f".{own.package}.ServerReflectionRequest"]
