"""Abort by request id, as a gateway that does not own the stream calls it. (Who may abort on a
server with an API key or mutual TLS: tests/test_security.py.)"""

from __future__ import annotations

import threading

import grpc
import pytest

from braid.client import Client
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc as pb_grpc
from conftest import LONG


def _abort(target: str, ids: list[str], key: str | None = None) -> pb.AbortResponse:
    metadata = [("authorization", f"Bearer {key}")] if key else []
    with grpc.insecure_channel(target) as channel:
        return pb_grpc.GenerateStub(channel).Abort(pb.AbortRequest(request_ids=ids), metadata=metadata, timeout=10)


def _stream_in_background(client: Client, request_id: str) -> tuple[threading.Thread, list]:
    """A LONG stream read on a thread; the list gets its messages."""
    messages: list = []
    started = threading.Event()

    def read():
        for message in client.stream("Tell me a story", request_id=request_id, **LONG):
            messages.append(message)
            started.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    assert started.wait(30)
    return thread, messages


def test_abort_ends_the_stream_with_a_final_cancelled_message(slow):
    with slow.client() as client:
        thread, messages = _stream_in_background(client, "abort-me")
        with slow.client() as gateway:  # another channel, as a gateway that does not own the stream
            aborted = gateway.abort(["abort-me", "nobody-has-this-id", "abort-me"])
        thread.join(30)
    assert aborted == ["abort-me"]
    final = messages[-1]
    assert final.finish_reason == pb.FINISH_REASON_CANCELLED and final.usage.generated_tokens > 0
    assert final.usage.generated_tokens < LONG["max_new_tokens"]
    assert list(_abort(slow.target, ["abort-me"]).aborted) == []  # finished: nothing left to abort


def test_too_many_ids_is_invalid_argument(slow):
    with pytest.raises(grpc.RpcError) as err:
        _abort(slow.target, [str(i) for i in range(257)])
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "request_ids" in err.value.details()
