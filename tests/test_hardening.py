"""Overload, deadlines, cancellation storms, faults and shutdown: the server tells every client exactly
what happened, and stays up."""

from __future__ import annotations

import asyncio
import functools
import random
import signal
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from braid.client import AsyncClient
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc as pb_grpc
from conftest import LONG, SLOW, SMALL_WINDOW, Server, start_together, tiny_server, wait_for


def _details(err: grpc.RpcError, kind):
    raw = dict(err.trailing_metadata())["grpc-status-details-bin"]
    detail = kind()
    status_pb2.Status.FromString(raw).details[0].Unpack(detail)
    return detail


@pytest.fixture(scope="module")
def small(tiny_dir):
    """Sequential, one running session and one queued at most: easy to fill."""
    server = tiny_server(tiny_dir, "--mode", "sequential", "--max-sessions", "1", "--max-queued", "1", env=SLOW)
    yield server
    server.stop()


def _settled(client, **expected):
    def check():
        s = client.server_status()
        return s if all(getattr(s, k) == v for k, v in expected.items()) else None

    return wait_for(check)


def test_invalid_utf8_is_invalid_argument_naming_the_field(servers):
    server = servers("continuous")
    good = pb.GenerateRequest(
        messages=[pb.Message(role="user", content="ok"), pb.Message(role="user", content="x")]
    ).SerializeToString()
    with grpc.insecure_channel(server.target) as channel:
        raw = channel.unary_stream(
            "/braid.v1.Generate/Stream", request_serializer=None, response_deserializer=pb.GenerateResponse.FromString
        )
        with pytest.raises(grpc.RpcError) as err:
            list(raw(good.replace(b"x", b"\xff\xfe")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _details(err.value, error_details_pb2.BadRequest).field_violations[0].field == "messages[1].content"


def test_past_the_queue_calls_are_refused_at_once_with_retry_info(small):
    # a channel without gRPC's retries (braid's client retries RESOURCE_EXHAUSTED by default)
    with small.client(options=[("grpc.enable_retries", 0)]) as client:
        running = client.stream("hold", **LONG)
        next(iter(running))
        queued = client.stream("wait", max_new_tokens=2)
        _settled(client, sessions_queued=1)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream("one too many", max_new_tokens=2))
        assert time.monotonic() - started < 2
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        delay_ms = _details(err.value, error_details_pb2.RetryInfo).retry_delay.ToMilliseconds()
        assert delay_ms > 0
        assert ("grpc-retry-pushback-ms", str(delay_ms)) in err.value.trailing_metadata()  # the same, for gRPC
        running.cancel()
        assert list(queued)[-1].finish_reason == pb.FINISH_REASON_MAX_TOKENS
        _settled(client, sessions_active=0, sessions_queued=0)


def test_the_default_client_retries_a_full_queue_after_the_delay_the_server_asks(small):
    with small.client() as client:
        running = client.stream("hold", **LONG)
        next(iter(running))
        queued = client.stream("wait", max_new_tokens=2)
        _settled(client, sessions_queued=1)
        # the call is refused (the queue is full), then the hold ends while it waits its pushback
        threading.Timer(0.3, running.cancel).start()
        completion = client.generate("one too many", max_new_tokens=2, ignore_eos=True)
        assert completion.usage.generated_tokens == 2
        assert list(queued)[-1].finish_reason == pb.FINISH_REASON_MAX_TOKENS


def _order_of_service(server: Server, priorities: list[int]) -> list[int]:
    """Holds the model with one stream, queues one request per priority (in order), releases the
    model, and returns the queued requests' indices in the order they got their first token."""

    async def run():
        async with AsyncClient(server.target) as client:
            hold = client.stream("hold", **LONG)
            await hold.__anext__()
            order = []

            async def one(i, priority):
                async for m in client.stream("go", max_new_tokens=3, ignore_eos=True, priority=priority):
                    if m.token_ids:
                        order.append(i)
                        break

            tasks = []
            for i, p in enumerate(priorities):
                tasks.append(asyncio.create_task(one(i, p)))
                await asyncio.sleep(0.15)
            hold.cancel()
            await asyncio.gather(*tasks)
            return order

    return asyncio.run(run())


def test_interactive_goes_before_batch_and_batch_is_not_starved(tiny_dir):
    b, i = pb.PRIORITY_BATCH, pb.PRIORITY_INTERACTIVE
    patient, aging = start_together(
        *[
            functools.partial(
                tiny_server,
                tiny_dir,
                "--mode",
                "sequential",
                "--max-sessions",
                "1",
                "--batch-max-wait-ms",
                wait,
                env=SLOW,
            )
            for wait in ("60000", "100")
        ]
    )
    try:
        assert _order_of_service(patient, [b, b, i])[0] == 2
        # Once a batch session has waited --batch-max-wait-ms, it goes before newer interactive ones.
        assert _order_of_service(aging, [b, i, i])[0] == 0
    finally:
        patient.stop()
        aging.stop()


def test_grpc_deadline_stops_generation_and_frees_the_session(slow):
    # A call whose deadline passes before grpc hands it to braid never becomes a session: the
    # deadline (2 s) leaves a loaded machine time to start it. LONG takes over 2.7 s here (SLOW).
    with slow.client() as client:
        before = client.server_status().sessions_finished.deadline
        messages = []
        with pytest.raises(grpc.RpcError) as err:
            messages.extend(client.stream("slow", timeout=2.0, **LONG))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert messages, "the deadline passed before the stream's first message"
        # (the session may end a moment after the client's deadline: wait for its count)
        wait_for(lambda: client.server_status().sessions_finished.deadline == before + 1)
        _settled(client, sessions_active=0, sessions_queued=0)


def test_a_deadline_that_passes_while_the_send_waits_is_counted_as_a_deadline(servers):
    """A client that stops reading, so grpc's send waits, until its deadline passes: grpc then
    cancels the handler inside its own send, not braid's generator. The session still ends as a
    deadline, not a cancel, and frees everything."""
    server = servers("continuous")
    with server.client() as client:
        before = client.server_status().sessions_finished
        with grpc.insecure_channel(server.target, options=SMALL_WINDOW) as channel:
            call = pb_grpc.GenerateStub(channel).Stream(pb.GenerateRequest(prompt="slow", **LONG), timeout=8)
            call.initial_metadata()
            wait_for(lambda: client.server_status(timeout=10).sessions_paused == 1, timeout=7)
            assert call.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # (waits for the deadline)
        after = _settled(client, sessions_active=0, sessions_queued=0).sessions_finished
    assert (after.deadline - before.deadline, after.cancelled - before.cancelled) == (1, 0)


def test_a_deadline_that_passes_while_the_prompt_is_tokenized_is_counted_as_a_deadline(tiny_dir):
    """A call whose deadline passes while its prompt is still being tokenized (each tokenization here
    takes 1 s longer): its session, once it exists, ends as a deadline, not a cancel, and frees all."""
    server = tiny_server(tiny_dir, env={"BRAID_INJECT_FAULT": "tokenize:1000"})
    try:
        with server.client() as client:
            before = client.server_status().sessions_finished
            with pytest.raises(grpc.RpcError) as err:
                list(client.stream("slow", timeout=0.9, **LONG))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            status = _settled(client, sessions_active=0, sessions_queued=0, sessions_submitted=1)
            assert wait_for(lambda: client.server_status().sessions_finished.deadline == before.deadline + 1)
            assert client.server_status().sessions_finished.cancelled == before.cancelled
            assert status.kv_pages_used == 0
    finally:
        server.stop()


def test_timeout_ms_ends_the_stream_with_a_deadline_final_message(slow):
    with slow.client() as client:
        stream = client.stream("slow", timeout_ms=400, **LONG)
        messages = list(stream)
    assert messages[-1].finish_reason == pb.FINISH_REASON_DEADLINE
    assert 0 < messages[-1].usage.generated_tokens < 900


def test_a_request_whose_deadline_passed_in_the_queue_never_runs(small):
    with small.client() as client:
        before = client.server_status()
        running = client.stream("hold", **LONG)
        next(iter(running))
        expired = client.stream("too late", timeout_ms=200, max_new_tokens=5)
        # its deadline passes while it waits in the queue (the engine expires queued sessions too)
        wait_for(lambda: client.server_status().sessions_finished.deadline == before.sessions_finished.deadline + 1)
        running.cancel()
        final = list(expired)[-1]
        after = _settled(client, sessions_active=0, sessions_queued=0)
    assert final.finish_reason == pb.FINISH_REASON_DEADLINE
    assert final.usage.generated_tokens == 0
    assert after.sessions_finished.deadline == before.sessions_finished.deadline + 1


def test_a_thousand_random_cancellations_leak_nothing(servers):
    server = servers("continuous")
    rng = random.Random(7)

    async def run():
        async with AsyncClient(server.target) as client:
            gate = asyncio.Semaphore(48)

            async def cancelled(n_messages):
                async with gate:
                    stream = client.stream("cancel me", **LONG)
                    async for _ in stream:
                        n_messages -= 1
                        if n_messages <= 0:
                            break
                    stream.cancel()

            async def normal():
                done = await client.generate("keep going", max_new_tokens=20, ignore_eos=True)
                return done.usage.generated_tokens

            jobs = [cancelled(rng.randint(0, 3)) for _ in range(1000)]
            results = await asyncio.gather(*jobs, *(normal() for _ in range(8)))
            return results[-8:]

    with server.client() as client:
        before = client.server_status().sessions_finished.cancelled
        assert asyncio.run(run()) == [20] * 8
        _settled(client, sessions_active=0, sessions_queued=0)
        wait_for(lambda: client.server_status().sessions_finished.cancelled == before + 1000)


def _token_id(server: Server, word: str) -> int:
    with server.client() as client:
        return client.tokenize(word).token_ids[-1]


def test_a_failed_forward_pass_ends_only_its_sessions(tiny_dir, servers):
    marker = _token_id(servers("continuous"), " zebra")
    server = tiny_server(tiny_dir, "--mode", "sequential", env={"BRAID_INJECT_FAULT": f"pass:{marker}"})
    try:
        with server.client() as client:
            with pytest.raises(grpc.RpcError) as err:
                list(client.stream("a zebra", max_new_tokens=4))
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "forward pass failed" in err.value.details()
            assert client.health() == "SERVING"
            assert client.generate("a horse", max_new_tokens=4, ignore_eos=True).usage.generated_tokens == 4
            assert client.server_status().sessions_finished.error == 1
    finally:
        server.stop()


def test_a_dead_model_thread_turns_health_off_and_exits_nonzero(tiny_dir, servers):
    marker = _token_id(servers("continuous"), " zebra")
    server = tiny_server(tiny_dir, env={"BRAID_INJECT_FAULT": f"thread:{marker}"})
    with server.client() as client:
        with pytest.raises(grpc.RpcError):
            list(client.stream("a zebra", max_new_tokens=4))
    assert server.proc.wait(timeout=30) != 0


def test_sigterm_drains_then_cancels_with_a_final_message_and_exits_zero(tiny_dir):
    server = tiny_server(tiny_dir, "--mode", "continuous", "--grace-period", "1.5", env=SLOW)
    client = server.client()
    try:
        short = client.stream("short", max_new_tokens=30, ignore_eos=True)
        long = client.stream("long", **LONG)
        next(iter(short)), next(iter(long))
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: client.health() == "NOT_SERVING", timeout=2)
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream("new", max_new_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert list(short)[-1].finish_reason == pb.FINISH_REASON_MAX_TOKENS
        assert list(long)[-1].finish_reason == pb.FINISH_REASON_CANCELLED
        assert server.proc.wait(timeout=30) == 0
    finally:
        client.close()
        server.stop()


def test_a_hand_over_ends_a_stream_unavailable_with_its_trailer_after_every_token(tiny_dir):
    # --handover-grace stopped the server with its calls in flight: they ended UNAVAILABLE
    # "Cancelling all calls", with nothing to tell a client why, or that it may resume.
    server = tiny_server(tiny_dir, "--handover-grace", "0.3", "--grace-period", "30", env=SLOW)
    try:
        with grpc.insecure_channel(server.target) as channel:
            call = pb_grpc.GenerateStub(channel).Stream(pb.GenerateRequest(prompt="long", **LONG), timeout=60)
            received = [next(call)]
            server.proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as err:
                for message in call:
                    received.append(message)
        tokens = [t for m in received for t in m.token_ids]
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert ("braid-handover", "resume") in tuple(err.value.trailing_metadata() or ())
        assert 0 < len(tokens) < LONG["max_new_tokens"] and not any(m.finish_reason for m in received)
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()
