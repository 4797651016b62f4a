"""TLS, mutual TLS and API keys, checked with real certificates and real channels."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc as pb_grpc
from conftest import LONG, SLOW, Server


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1/localhost, and two client certificates."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=braid test CA",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth"),
                      ("other", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(d / f"{name}.key"),
                 "-out", str(d / f"{name}.csr"))
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
                 "-CAcreateserial", "-days", "2", "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.pem"))
    return d


def test_tls_and_mutual_tls(tiny_dir, pki):
    server = Server(["--model", str(tiny_dir), "--threads", "1", "--tls-cert", str(pki / "server.pem"),
                     "--tls-key", str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.pem")],
                    client_kw=dict(root_certificates=pki / "ca.pem", client_cert=pki / "client.pem",
                                   client_key=pki / "client.key"))
    try:
        with server.client() as client:
            assert client.generate("hi", max_new_tokens=2, ignore_eos=True).usage.generated_tokens == 2
        with server.client(client_cert=None, client_key=None) as no_cert, pytest.raises(grpc.RpcError) as err:
            no_cert.model_info(timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(server.target) as plain, pytest.raises(grpc.RpcError):
            plain.unary_unary("/braid.v1.Generate/ModelInfo")(b"", timeout=5)
    finally:
        server.stop()


def _abort_as(server: Server, pki, name: str, request_id: str) -> list[str]:
    """Abort(request_id) over mutual TLS with client certificate `name`; what it aborted."""
    credentials = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes(), (pki / f"{name}.key").read_bytes(),
                                               (pki / f"{name}.pem").read_bytes())
    with grpc.secure_channel(server.target, credentials) as channel:
        response = pb_grpc.GenerateStub(channel).Abort(pb.AbortRequest(request_ids=[request_id]), timeout=10)
    return list(response.aborted)


def test_with_mutual_tls_only_the_same_client_identity_aborts(tiny_dir, pki):
    server = Server(["--model", str(tiny_dir), "--threads", "1", "--tls-cert", str(pki / "server.pem"),
                     "--tls-key", str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.pem")],
                    env=SLOW, client_kw=dict(root_certificates=pki / "ca.pem", client_cert=pki / "client.pem",
                                             client_key=pki / "client.key"))
    try:
        with server.client() as client:
            messages = []
            generation = client.stream("Tell me a story", request_id="tls-owned", **LONG)
            messages.append(next(iter(generation)))
            assert _abort_as(server, pki, "other", "tls-owned") == []
            count = len(messages)
            for message in generation:  # still streaming; the owner's certificate aborts it
                messages.append(message)
                if len(messages) == count + 3:
                    assert _abort_as(server, pki, "client", "tls-owned") == ["tls-owned"]
        final = messages[-1]
        assert final.finish_reason == pb.FINISH_REASON_CANCELLED
        assert final.usage.generated_tokens < LONG["max_new_tokens"]
    finally:
        server.stop()


def test_api_key_guards_every_call_but_health(tiny_dir):
    server = Server(["--model", str(tiny_dir), "--threads", "1"], env={"BRAID_API_KEY": "s3cret"})
    try:
        with server.client(api_key=None) as anonymous:
            assert anonymous.health() == "SERVING"
            for call in (anonymous.model_info, anonymous.server_status,
                         lambda: list(anonymous.stream("hi", max_new_tokens=2))):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with server.client(api_key="wrong") as wrong, pytest.raises(grpc.RpcError) as err:
            wrong.model_info()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with server.client(api_key="s3cret") as client:
            assert client.generate("hi", max_new_tokens=2, ignore_eos=True).usage.generated_tokens == 2
    finally:
        server.stop()
