"""TLS, mutual TLS and API keys, checked with real certificates and real channels: one server of each
kind, shared by the module."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc as pb_grpc
from conftest import LONG, SLOW, Server, tiny_server, wait_for
from test_abort import _abort, _stream_in_background


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1/localhost, and two client certificates."""
    d = tmp_path_factory.mktemp("pki")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=braid test CA",
        "-keyout",
        str(d / "ca.key"),
        "-out",
        str(d / "ca.pem"),
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
        ("other", "extendedKeyUsage=clientAuth"),
    ):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            str(d / f"{name}.key"),
            "-out",
            str(d / f"{name}.csr"),
        )
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            str(d / f"{name}.csr"),
            "-CA",
            str(d / "ca.pem"),
            "-CAkey",
            str(d / "ca.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            str(d / f"{name}.ext"),
            "-out",
            str(d / f"{name}.pem"),
        )
    return d


@pytest.fixture(scope="module")
def mtls(tiny_dir, pki):
    """A server that asks for a client certificate signed by the test CA (SLOW: a LONG stream lasts
    long enough to abort), shared by the module; its clients present `client`'s."""
    server = Server(
        [
            "--model",
            str(tiny_dir),
            "--threads",
            "1",
            "--tls-cert",
            str(pki / "server.pem"),
            "--tls-key",
            str(pki / "server.key"),
            "--tls-client-ca",
            str(pki / "ca.pem"),
        ],
        env=SLOW,
        client_kw=dict(root_certificates=pki / "ca.pem", client_cert=pki / "client.pem", client_key=pki / "client.key"),
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed(tiny_dir):
    """A server that wants the API key s3cret (SLOW, as mtls), shared by the module; its clients send it."""
    server = tiny_server(tiny_dir, "--mode", "continuous", env={**SLOW, "BRAID_API_KEY": "s3cret"})
    yield server
    server.stop()


def test_tls_and_mutual_tls(mtls):
    with mtls.client() as client:
        assert client.generate("hi", max_new_tokens=2, ignore_eos=True).usage.generated_tokens == 2
    with mtls.client(client_cert=None, client_key=None) as no_cert, pytest.raises(grpc.RpcError) as err:
        no_cert.model_info(timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(mtls.target) as plain, pytest.raises(grpc.RpcError):
        plain.unary_unary("/braid.v1.Generate/ModelInfo")(b"", timeout=5)


def _abort_as(server: Server, pki, name: str, request_id: str) -> list[str]:
    """Abort(request_id) over mutual TLS with client certificate `name`; what it aborted."""
    credentials = grpc.ssl_channel_credentials(
        (pki / "ca.pem").read_bytes(), (pki / f"{name}.key").read_bytes(), (pki / f"{name}.pem").read_bytes()
    )
    with grpc.secure_channel(server.target, credentials) as channel:
        response = pb_grpc.GenerateStub(channel).Abort(pb.AbortRequest(request_ids=[request_id]), timeout=10)
    return list(response.aborted)


def test_with_mutual_tls_only_the_same_client_identity_aborts(mtls, pki):
    with mtls.client() as client:
        messages = []
        generation = client.stream("Tell me a story", request_id="tls-owned", **LONG)
        messages.append(next(iter(generation)))
        assert _abort_as(mtls, pki, "other", "tls-owned") == []
        count = len(messages)
        for message in generation:  # still streaming; the owner's certificate aborts it
            messages.append(message)
            if len(messages) == count + 3:
                assert _abort_as(mtls, pki, "client", "tls-owned") == ["tls-owned"]
    final = messages[-1]
    assert final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert final.usage.generated_tokens < LONG["max_new_tokens"]


def test_api_key_guards_every_call_but_health(keyed):
    with keyed.client(api_key=None) as anonymous:
        assert anonymous.health() == "SERVING"
        for call in (
            anonymous.model_info,
            anonymous.server_status,
            lambda: list(anonymous.stream("hi", max_new_tokens=2)),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with keyed.client(api_key="wrong") as wrong, pytest.raises(grpc.RpcError) as err:
        wrong.model_info()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with keyed.client(api_key="s3cret") as client:
        assert client.generate("hi", max_new_tokens=2, ignore_eos=True).usage.generated_tokens == 2


def test_the_api_key_scheme_is_case_insensitive_and_a_second_header_is_refused(keyed):
    """One of issue 10's defects, called as a user hit it (the parsing alone: tests/unit/test_auth.py)."""
    stub_kw = dict(
        request_serializer=pb.ModelInfoRequest.SerializeToString, response_deserializer=pb.ModelInfoResponse.FromString
    )
    with grpc.insecure_channel(keyed.target) as channel:
        info = channel.unary_unary("/braid.v1.Generate/ModelInfo", **stub_kw)
        assert info(pb.ModelInfoRequest(), metadata=[("authorization", "bearer s3cret")]).vocab_size
        with pytest.raises(grpc.RpcError) as err:
            info(pb.ModelInfoRequest(), metadata=[("authorization", "Bearer nope"), ("authorization", "Bearer s3cret")])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_with_an_api_key_only_the_same_key_aborts(keyed):
    """Abort by request id (tests/test_abort.py) on a server with an API key: a caller with another
    key is refused, the stream goes on, and the caller with the same key aborts it."""
    with keyed.client() as client:
        thread, messages = _stream_in_background(client, "mine")
        with pytest.raises(grpc.RpcError) as err:
            _abort(keyed.target, ["mine"], key="wrong")
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        count = len(messages)
        wait_for(lambda: len(messages) > count)  # still streaming
        assert list(_abort(keyed.target, ["mine"], key="s3cret").aborted) == ["mine"]
        thread.join(30)
    assert messages[-1].finish_reason == pb.FINISH_REASON_CANCELLED
