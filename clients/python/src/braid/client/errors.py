"""Readable descriptions of the gRPC errors a braid server returns."""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

try:  # googleapis-common-protos is optional: without it, errors show their code and details only.
    from google.rpc import error_details_pb2, status_pb2
except ImportError:  # pragma: no cover - exercised only where the package is missing
    error_details_pb2 = status_pb2 = None

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


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
    if status_pb2 is None or not hasattr(error, "trailing_metadata"):
        return []
    blob = next((v for k, v in error.trailing_metadata() or () if k == _STATUS_DETAILS_KEY), None)
    if not isinstance(blob, bytes):
        return []
    try:
        status = status_pb2.Status.FromString(blob)
    except DecodeError:
        return []
    lines = []
    for detail in status.details:
        bad_request, retry = error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
        if detail.Unpack(bad_request):
            lines += [f"  {v.field}: {v.description}" for v in bad_request.field_violations]
        elif detail.Unpack(retry):
            lines.append(f"  retry after {retry.retry_delay.ToTimedelta().total_seconds():g} s")
    return lines
