"""Tokenize, ModelInfo, ServerStatus and health: the unary side of the service."""

from __future__ import annotations

import grpc
import pytest

from braid.v1 import generate_pb2 as pb
from conftest import MODES


def test_tokenize_returns_ids_and_their_pieces(servers):
    with servers("continuous").client() as client:
        out = client.tokenize("Hello, world")
        chat = client.tokenize(messages=[("user", "Hello, world")])
        with pytest.raises(grpc.RpcError) as err:
            client._stub.Tokenize(pb.TokenizeRequest())
    assert len(out.token_ids) == len(out.pieces) > 1
    assert "".join(out.pieces) == "Hello, world"
    assert len(chat.token_ids) > len(out.token_ids)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text" in err.value.details()


@pytest.mark.parametrize("mode", MODES)
def test_model_info_reports_the_mode_in_force(servers, mode):
    with servers(mode).client() as client:
        info = client.model_info()
    assert info.mode == pb.SchedulingMode.Value(f"SCHEDULING_MODE_{mode.upper()}")
    assert info.vocab_size == 49152 and info.context_length == 1024
    assert info.eos_token_ids == [2] and info.max_batch_size == 16 and info.parameters > 0


def test_server_status_counts_tokens_and_finishes(servers):
    with servers("continuous").client() as client:
        before = client.server_status()
        client.generate("Count", max_new_tokens=5, ignore_eos=True)
        after = client.server_status()
    assert after.tokens_generated - before.tokens_generated == 5
    assert after.sessions_finished.max_tokens - before.sessions_finished.max_tokens == 1
    assert after.prompt_tokens > before.prompt_tokens
    assert after.sessions_active == 0 and after.sessions_queued == 0
    assert after.forward_passes > before.forward_passes and after.uptime_seconds > 0


def test_health_is_serving_for_the_server_and_the_service(servers):
    with servers("continuous").client() as client:
        assert client.health() == "SERVING"
        assert client.health("braid.v1.Generate") == "SERVING"


def test_reflection_lists_the_services_and_describes_them_with_their_comments(servers):
    import subprocess
    import sys
    from pathlib import Path

    grpcurl = str(Path(sys.executable).parent / "grpcurl")
    target = servers("continuous").target
    listed = subprocess.run([grpcurl, "-plaintext", target, "list"], capture_output=True, text=True, timeout=30)
    assert {"braid.v1.Generate", "grpc.health.v1.Health"} <= set(listed.stdout.split())
    described = subprocess.run(
        [grpcurl, "-plaintext", target, "describe", "braid.v1.GenerateRequest"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert described.returncode == 0, described.stderr
    assert "max_new_tokens" in described.stdout
    assert "caps the number of generated tokens" in described.stdout  # the .proto's own comment
