"""The errors a failed braid call raises, one class per kind of failure, and readable descriptions.

Every method of Client and AsyncClient raises a BraidError for a failed call, whether it failed
before its first message or mid-stream: a subclass by the call's gRPC status (BadRequestError for
INVALID_ARGUMENT, OverloadedError for RESOURCE_EXHAUSTED, ...), holding the status code, its
details, the call's metadata and the google.rpc details braid attaches (grpc-status-details-bin):
the field at fault of a bad request, the delay to wait when the server is full.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TypeVar, cast

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc import aio
from grpc_status import rpc_status

PUSHBACK_KEY = "grpc-retry-pushback-ms"  # the server's retry delay, as gRPC's retry policy reads it
Metadatum = tuple[str, str | bytes]
# A call's metadata as gRPC gives it: a tuple of (key, value) pairs from a call of grpc's, a
# grpc.aio.Metadata from one of grpc.aio's. Both iterate as (key, value) pairs, and dict() takes both.
Metadata = aio.Metadata | tuple[Metadatum, ...]
DetailT = TypeVar("DetailT", error_details_pb2.BadRequest, error_details_pb2.RetryInfo)


class BraidError(aio.AioRpcError):
    """A failed braid call: `code()`, `details()`, `initial_metadata()`, `trailing_metadata()`
    and `debug_error_string()` as gRPC's own errors have them, and `status`, the google.rpc.Status
    the server attached (None if it attached none).

    A grpc.RpcError, so `except grpc.RpcError` catches it as before; a grpc.aio.AioRpcError (gRPC's
    snapshot of a finished call's status) too, so `except grpc.aio.AioRpcError` does as well. Its
    metadata is what the failed call had: a tuple of (key, value) pairs from Client, a
    grpc.aio.Metadata from AsyncClient. str() is one line: "invalid argument: temperature: ...".
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        initial_metadata: Metadata | None = None,
        trailing_metadata: Metadata | None = None,
        details: str | None = None,
        debug_error_string: str | None = None,
    ) -> None:
        """The arguments of grpc.aio.AioRpcError's, in its order; from_rpc_error() makes one of a gRPC error."""
        initial = () if initial_metadata is None else initial_metadata
        trailing = () if trailing_metadata is None else trailing_metadata
        super().__init__(code, cast(aio.Metadata, initial), cast(aio.Metadata, trailing), details, debug_error_string)
        self.status = _rich_status(self)

    def initial_metadata(self) -> Metadata:
        """The call's response headers."""
        return cast(Metadata, super().initial_metadata())

    # grpc.RpcError's stub says a tuple, AioRpcError's an aio.Metadata (overriding it as this does)
    def trailing_metadata(self) -> Metadata:  # type: ignore[override]
        """The call's trailers: its grpc-status-details-bin, braid's load report, ..."""
        return cast(Metadata, super().trailing_metadata())

    def _reason(self) -> str:
        return " ".join((self.details() or "").split("\n"))

    def __str__(self) -> str:
        return f"{self.code().name.lower().replace('_', ' ')}: {self._reason()}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code().name}, {self.details()!r})"

    def _details_of(self, kind: type[DetailT]) -> list[DetailT]:
        """The details of this kind that the server attached."""
        found = []
        for detail in self.status.details if self.status else ():
            message = kind()
            if detail.Unpack(message):
                found.append(message)
        return found


class BadRequestError(BraidError):
    """INVALID_ARGUMENT: a request field is wrong. `field` names it ("temperature",
    "constraint.regex", ...) and `description` says what is wrong with it, from the server's
    google.rpc.BadRequest; `violations` has every (field, description) it lists. Without one,
    `field` is None and `description` the status's details. Sending it again will not help."""

    @property
    def violations(self) -> list[tuple[str, str]]:
        """Every (field, description) of the server's google.rpc.BadRequest, in its order."""
        return [
            (v.field, v.description)
            for request in self._details_of(error_details_pb2.BadRequest)
            for v in request.field_violations
        ]

    @property
    def field(self) -> str | None:
        """The request field at fault (the first the server named), or None."""
        return self.violations[0][0] if self.violations else None

    @property
    def description(self) -> str:
        """What is wrong with the field; the status's details where the server named no field."""
        return self.violations[0][1] if self.violations else self.details() or ""


class OverloadedError(BraidError):
    """RESOURCE_EXHAUSTED: the server's queue is full. `retry_after` is how many seconds it asks the
    caller to wait before trying again (its google.rpc.RetryInfo, or grpc-retry-pushback-ms), or None.
    The client's retry policy has already tried again (up to 4 attempts) before raising it."""

    @property
    def retry_after(self) -> float | None:
        """Seconds to wait before sending the call again, as the server asks; None if it did not say."""
        for info in self._details_of(error_details_pb2.RetryInfo):
            if info.HasField("retry_delay"):
                return float(info.retry_delay.ToTimedelta().total_seconds())
        pushback = next((value for key, value in self.trailing_metadata() if key == PUSHBACK_KEY), None)
        if isinstance(pushback, str) and pushback.isdigit():
            return int(pushback) / 1000
        return None

    def _reason(self) -> str:
        retry_after = self.retry_after
        return super()._reason() + (f" (retry after {retry_after:g} s)" if retry_after is not None else "")


class UnavailableError(BraidError):
    """UNAVAILABLE: no server could take the call (none reachable, or each draining), or its stream
    broke and could not be resumed. The client's retry policy and resume have already tried again."""


class DeadlineExceededError(BraidError):
    """DEADLINE_EXCEEDED: the call's deadline (timeout=) passed; its generation was stopped. (A
    request's timeout_ms instead ends the stream normally, with finish reason DEADLINE.)"""


class CallCancelledError(BraidError):
    """CANCELLED: the call was cancelled other than by this Generation's cancel() (which just ends
    iteration): its channel was closed, or the server cancelled it."""


class NotFoundError(BraidError):
    """NOT_FOUND: e.g. health() of a service the server does not have."""


class PermissionDeniedError(BraidError):
    """PERMISSION_DENIED: the credentials may not make this call."""


class UnauthenticatedError(BraidError):
    """UNAUTHENTICATED: no API key, or a wrong one (Client(api_key=...))."""


class InternalError(BraidError):
    """INTERNAL: the server failed (its log says why); a proxy may also report a reset stream so."""


ERRORS: dict[grpc.StatusCode, type[BraidError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: BadRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CallCancelledError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.INTERNAL: InternalError,
}  # any other status (UNKNOWN, UNIMPLEMENTED, ...) is a plain BraidError


def _metadata(error: object, method: str) -> Metadata:
    """A gRPC error's initial or trailing metadata: grpc.aio's as it is, grpc's as plain (key, value)
    tuples (its own pairs are namedtuples that do not pickle); none, empty."""
    read = getattr(error, method, None)
    pairs: Metadata | Iterable[Metadatum] | None = read() if callable(read) else None
    if isinstance(pairs, aio.Metadata):
        return pairs
    return tuple((key, value) for key, value in pairs or ())


def from_rpc_error(error: grpc.RpcError) -> BraidError:
    """The BraidError of a gRPC error (sync or grpc.aio): the subclass of its status code, with its
    details and metadata. A BraidError is returned as it is."""
    if isinstance(error, BraidError):
        return error
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    debug = getattr(error, "debug_error_string", None)
    return ERRORS.get(code, BraidError)(
        code,
        _metadata(error, "initial_metadata"),
        _metadata(error, "trailing_metadata"),
        details,
        debug() if callable(debug) else None,
    )


@contextlib.contextmanager
def raising_braid_errors() -> Iterator[None]:
    """Turns a gRPC error raised in the block (by a call, or by awaiting one) into its BraidError."""
    try:
        yield
    except BraidError:
        raise
    except grpc.RpcError as error:
        raise from_rpc_error(error) from error


def _rich_status(error: grpc.RpcError) -> status_pb2.Status | None:
    """The google.rpc.Status in an error's grpc-status-details-bin trailer, or None: none there,
    details that do not parse, or that contradict the call's own status."""
    try:
        status: status_pb2.Status | None = rpc_status.from_call(error)
    except (DecodeError, ValueError):
        return None
    return status


def describe(error: grpc.RpcError) -> str:
    """Describes an RpcError (sync or grpc.aio, or a BraidError) in one or more lines.

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
    status = _rich_status(error)
    lines = []
    for detail in status.details if status else ():
        bad_request, retry = error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
        if detail.Unpack(bad_request):
            lines += [f"  {v.field}: {v.description}" for v in bad_request.field_violations]
        elif detail.Unpack(retry):
            lines.append(f"  retry after {retry.retry_delay.ToTimedelta().total_seconds():g} s")
    return lines
