"""Readable descriptions of the gRPC errors a braid server returns."""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status


def describe(error: grpc.RpcError) -> str:
    """Describes an RpcError (sync or grpc.aio) in one or more lines.

    The first line is "CODE: details". Where the server attached google.rpc details
    (BadRequest field violations on INVALID_ARGUMENT, RetryInfo on RESOURCE_EXHAUSTED),
    each adds a line.
    """
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else None
    lines = [f"{code.name if code else 'UNKNOWN'}: {details or error}"]
    lines += _rich_details(error)
    return "\n".join(lines)


def _rich_details(error: grpc.RpcError) -> list[str]:
    # from_call reads a grpc.Call; an AioRpcError has the same code(), details() and trailing_metadata().
    if not all(hasattr(error, method) for method in ("code", "details", "trailing_metadata")):
        return []
    try:
        status: status_pb2.Status | None = rpc_status.from_call(error)
    except (DecodeError, ValueError):  # details that do not parse, or that contradict the call's status
        return []
    lines = []
    for detail in status.details if status else ():
        bad_request, retry = error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
        if detail.Unpack(bad_request):
            lines += [f"  {v.field}: {v.description}" for v in bad_request.field_violations]
        elif detail.Unpack(retry):
            lines.append(f"  retry after {retry.retry_delay.ToTimedelta().total_seconds():g} s")
    return lines
