"""Readable descriptions of the gRPC errors a braid server returns."""

from __future__ import annotations

from typing import cast

import grpc
from google.protobuf.message import DecodeError

from braid.client.generation import Metadata, metadata_value

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
    try:  # googleapis-common-protos is optional: without it, errors show their code and details only.
        from google.rpc import error_details_pb2, status_pb2
    except ImportError:  # pragma: no cover - exercised only where the package is missing
        return []
    if not hasattr(error, "trailing_metadata"):
        return []
    # (key, value) pairs from grpc and grpc.aio both, whatever types-grpcio says of RpcError's
    metadata = cast(Metadata | None, error.trailing_metadata())
    blob = metadata_value(metadata, _STATUS_DETAILS_KEY)
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
