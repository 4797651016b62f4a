"""Issue 10's defects, each called the way a user hit it; every test here failed before its fix.

(Long prompts in every mode, cancellation storms, vanishing clients and floods: test_adversarial.py;
the API key's scheme and a second header: test_security.py; sessions that end admitted but before
their first pass, in interleaved mode: unit/test_engine_core.py.)
"""

from __future__ import annotations

import signal
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from braid.v1 import generate_pb2 as pb
from conftest import LONG, SLOW, free_port, tiny_server, wait_for


def test_a_prompt_past_the_prefill_chunk_works_in_sequential_mode(servers):
    """Was INTERNAL 'gemm: bad shape': a pass of prompt chunks only sampled zero rows."""
    with servers("sequential").client() as client:
        done = client.generate("hello " * 600, max_new_tokens=3, ignore_eos=True)
    assert done.usage.prompt_tokens > 512 and done.usage.generated_tokens == 3


def test_a_timeout_ms_deadline_keeps_the_text_held_back_for_a_stop_string(slow):
    """The .proto promises 'the text so far'. Text that might begin a stop string is held back; a
    deadline used to drop it, so tokens arrived whose text never did."""
    with slow.client() as client:
        held, count = "", 0  # the greedy output's first tokens, up to a stop string's 256 bytes
        for message in client.stream("once upon", max_new_tokens=60, ignore_eos=True):
            if len((held + message.text).encode()) > 240:
                break
            held, count = held + message.text, count + len(message.token_ids)
        assert count >= 10
        # Every prefix of that output begins the stop string, so all its text is held back; each
        # pass takes over 3 ms, so the deadline passes before the output can leave the stop string.
        messages = list(client.stream("once upon", stop=[held + "\x07"], timeout_ms=3 * (count - 2), **LONG))
    final = messages[-1]
    assert final.finish_reason == pb.FINISH_REASON_DEADLINE and 0 < final.usage.generated_tokens < count
    text = "".join(m.text for m in messages)
    assert text and held.startswith(text)
    assert len([t for m in messages for t in m.token_ids]) == final.usage.generated_tokens


def test_max_new_tokens_left_at_zero_is_clipped_to_what_fits(servers):
    """0 means the server default (256) clipped to the context, not INVALID_ARGUMENT naming a field
    the caller never set. The tiny model's context is 1024 tokens."""
    with servers("continuous").client() as client:
        prompt = "hello " * 990
        n = len(client.tokenize(prompt).token_ids)
        done = client.generate(prompt, ignore_eos=True)
        assert done.usage.prompt_tokens == n and done.usage.generated_tokens == 1024 - n
        with pytest.raises(grpc.RpcError) as err:  # set by the caller: still refused, naming it
            client.generate(prompt, max_new_tokens=256)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # a minimum that cannot fit is named too
            client.generate(prompt, min_new_tokens=200)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_new_tokens" in err.value.details()


def test_a_temperature_near_zero_decodes_greedily(servers):
    with servers("continuous").client() as client:
        greedy = client.generate("the sea", max_new_tokens=16, ignore_eos=True)
        for temperature in (1e-38, 1e-30, 1e-6):
            tiny_t = client.generate("the sea", max_new_tokens=16, ignore_eos=True, temperature=temperature, seed=3)
            assert tiny_t.token_ids == greedy.token_ids, temperature


def test_a_prompt_far_past_the_context_is_refused_without_tokenizing(servers):
    with servers("continuous").client() as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("x" * 500_000, max_new_tokens=1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt: is at least" in err.value.details() and "context length" in err.value.details()
        assert client.generate("ok", max_new_tokens=1, ignore_eos=True).usage.generated_tokens == 1


def test_max_concurrent_streams_bounds_one_connection(tiny_dir):
    server = tiny_server(tiny_dir, "--max-concurrent-streams", "2", env=SLOW)
    # A connection of its own: gRPC Python channels to one target may otherwise share one.
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    try:
        with server.client(options=own_connection) as client, server.client(options=own_connection) as observer:
            # One at a time: gRPC does not start a connection's queued calls in the order they
            # were made, so with all three made at once the third could take a slot and leave the
            # second waiting for a stream this test never finishes reading (it hung once).
            streams = []
            for _ in range(3):
                streams.append(client.stream("hold", timeout=120, **LONG))
                if len(streams) < 3:
                    next(iter(streams[-1]))
            time.sleep(0.5)
            assert observer.server_status().sessions_submitted == 2  # the third waits in the client
            streams[0].cancel()
            next(iter(streams[2]))  # and starts once a stream of its connection ends
            assert observer.server_status().sessions_submitted == 3
            for stream in streams[1:]:
                stream.cancel()
    finally:
        server.stop()


def test_metrics_listen_on_metrics_host(tiny_dir):
    port = free_port()
    server = tiny_server(tiny_dir, "--metrics-port", str(port), "--metrics-host", "127.0.0.2")
    try:
        with urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=5) as response:
            assert b"braid_sessions" in response.read()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
        # Metrics without OTLP: spans are not recorded, and a call that ends well still counts as OK.
        with server.client() as client:
            client.generate("Hello", max_new_tokens=2, ignore_eos=True)

        def calls() -> dict[str, float]:
            with urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=5) as response:
                text = response.read().decode()
            return {
                s.labels["rpc_response_status_code"]: s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "rpc_server_call_duration_seconds_count"
            }

        assert wait_for(calls) == {"OK": 1}
    finally:
        server.stop()


def test_the_shutdown_log_counts_queued_sessions_too(tiny_dir, tmp_path):
    log = tmp_path / "server.log"
    server = tiny_server(tiny_dir, "--mode", "sequential", "--grace-period", "0.3", env=SLOW, log_path=log)
    client = server.client()
    try:
        running = client.stream("hold", **LONG)
        next(iter(running))
        queued = [client.stream("wait", **LONG) for _ in range(2)]  # noqa: F841  (held open, so they stay queued)
        wait_for(lambda: client.server_status().sessions_queued == 2)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
    finally:
        client.close()
        server.stop()
    assert "cancelling 1 active and 2 queued sessions" in log.read_text()
