"""The local cluster of `make cluster`: braid replicas behind a real HAProxy, scraped by a real
Prometheus (deploy/cluster.py, deploy/haproxy.cfg). The set-up installs both with
deploy/install-tools.sh when they are missing, as `make cluster` does; where it cannot, the tests
fail with the command that would.

One cluster of two tiny-model replicas serves the module. The rolling restart comes last: it
restarts every replica.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc as pb_grpc
from conftest import REPO, SLOW, free_port, tiny_server, wait_for

GRPCURL = Path(sys.executable).parent / "grpcurl"

# deploy/cluster.py as `make cluster` runs it; deploy/roll.py's clients, with braid-client's retry policy.
sys.path.insert(0, str(REPO / "deploy"))
from cluster import Cluster, Replica
from roll import Load

MAX_TOKENS = pb.FINISH_REASON_MAX_TOKENS


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    install = subprocess.run([str(REPO / "deploy" / "install-tools.sh"), "haproxy", "prometheus"],
                             capture_output=True, text=True, timeout=900, check=False)
    assert install.returncode == 0, (
        f"the cluster tests need HAProxy and Prometheus: `deploy/install-tools.sh haproxy prometheus` (as root: "
        f"apt-get install -y haproxy prometheus) failed: {install.stderr.strip()}")
    replicas = [Replica(f"replica-{n}", free_port(), free_port()) for n in (1, 2)]
    # SLOW: every forward pass 3 ms longer, so streams are still running when a replica is told to stop.
    cluster = Cluster(replicas, tmp_path_factory.mktemp("cluster"), port=free_port(), stats_port=free_port(),
                      prometheus_port=free_port(), scrape_interval="1s", env=SLOW, quiet=True,
                      braid_args=["--model", str(tiny_dir), "--threads", "1", "--kv-cache-memory", "64MiB",
                                  "--grace-period", "30",
                                  # HAProxy's connections to a replica are replaced every 5 s or so (GOAWAY)
                                  "--max-connection-age-ms", "5000"])
    cluster.start()
    yield cluster
    cluster.stop()


def status(cluster: Cluster, replica: Replica) -> pb.ServerStatusResponse:
    """The replica's own books, asked directly, not through the proxy."""
    with grpc.insecure_channel(f"{cluster.host}:{replica.port}") as channel:
        return pb_grpc.GenerateStub(channel).ServerStatus(pb.ServerStatusRequest(), timeout=10)


def request(max_new_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="The sea is", max_new_tokens=max_new_tokens, ignore_eos=True)


def test_the_haproxy_health_check_is_a_grpc_health_call_a_replica_answers(cluster):
    """deploy/haproxy.cfg's raw HTTP/2 frames, sent to a replica as HAProxy sends them, get back a
    HealthCheckResponse SERVING: the frame HAProxy's expect rules look for."""
    config = (REPO / "deploy" / "haproxy.cfg").read_text()
    sent = b"".join(bytes.fromhex(h) for h in re.findall(r"^\s*tcp-check send-binary (\w+)", config, re.MULTILINE))
    (serving,) = re.findall(r"^\s*tcp-check expect min-recv 1 binary (\w+)", config, re.MULTILINE)
    replica = cluster.replicas[0]
    received = b""
    with socket.create_connection((cluster.host, replica.port), timeout=5) as sock:
        sock.sendall(sent)
        while bytes.fromhex(serving) not in received:
            chunk = sock.recv(65536)
            assert chunk, f"the replica closed the connection; it sent {received.hex()}"
            received += chunk


def test_one_channels_concurrent_streams_spread_over_the_replicas(cluster):
    before = {r.name: status(cluster, r).sessions_submitted for r in cluster.replicas}
    with grpc.insecure_channel(cluster.target) as channel:  # one channel: one HTTP/2 connection to HAProxy
        stub = pb_grpc.GenerateStub(channel)
        calls = [stub.Stream(request(64), timeout=60) for _ in range(8)]  # each call starts at once
        finals = [list(call)[-1] for call in calls]
    assert [final.finish_reason for final in finals] == [MAX_TOKENS] * 8
    served = {r.name: status(cluster, r).sessions_submitted - before[r.name] for r in cluster.replicas}
    assert sum(served.values()) == 8 and all(served.values()), served


def test_trailers_come_through_the_proxy(cluster):
    """The ORCA load report a weighted balancer reads is a trailer (gRPC's own clients hand it to
    their balancer, not the caller: grpcurl shows it)."""
    out = subprocess.run([str(GRPCURL), "-plaintext", "-v", "-d", '{"prompt": "The sea is", "max_new_tokens": 4}',
                          cluster.target, "braid.v1.Generate/Stream"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    trailers = out[out.index("Response trailers received:"):]
    assert "endpoint-load-metrics-bin: " in trailers and "braid-total-ms: " in trailers


def test_prometheus_scrapes_each_replicas_generated_tokens(cluster):
    with grpc.insecure_channel(cluster.target) as channel:
        stub = pb_grpc.GenerateStub(channel)
        for call in [stub.Stream(request(24), timeout=60) for _ in range(4)]:
            list(call)
    books = {r.name: float(status(cluster, r).tokens_generated) for r in cluster.replicas}
    assert all(books.values()), books

    def query(promql: str) -> list[dict]:
        url = f"{cluster.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as response:
            answer = json.load(response)
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def scraped_tokens() -> dict[str, float]:
        result = query('braid_tokens_total{job="braid", braid_token_type="generated"}')
        return {series["metric"]["replica"]: float(series["value"][1]) for series in result}

    # Each replica's series is its own (label replica=replica-N): equal to its ServerStatus count once
    # a scrape (every second) has come after the calls.
    wait_for(lambda: scraped_tokens() == books, timeout=30)
    (total,) = query('sum(braid_tokens_total{job="braid", braid_token_type="generated"})')
    assert float(total["value"][1]) == sum(books.values())
    # HAProxy's own metrics too, as compose's Prometheus scrapes Envoy's: both replicas UP.
    up = wait_for(lambda: query('sum(haproxy_server_status{proxy="braid", state="UP"})'), timeout=15)
    assert float(up[0]["value"][1]) == len(cluster.replicas)


def restart(cluster: Cluster, replica: Replica) -> None:
    """SIGTERM to the replica while a long stream of its own runs: HAProxy takes it out while it is
    still draining, the stream ends with all its tokens, the process exits 0, the cluster starts it
    again and HAProxy puts it back."""
    old = replica.proc
    with grpc.insecure_channel(f"{cluster.host}:{replica.port}") as direct:
        canary = pb_grpc.GenerateStub(direct).Stream(request(900), timeout=60)  # at least 2.7 s (SLOW)
        next(canary)
        old.send_signal(signal.SIGTERM)
        wait_for(lambda: cluster.proxy_states()[replica.name].startswith("DOWN"), timeout=10)
        assert old.poll() is None, f"{replica.name} left the rotation only once it had exited"
        final = list(canary)[-1]
        assert final.finish_reason == MAX_TOKENS and final.usage.generated_tokens == 900
    assert old.wait(40) == 0
    wait_for(lambda: replica.proc is not old, timeout=10)
    wait_for(lambda: cluster.proxy_states()[replica.name] == "UP", timeout=180)


def test_a_rolling_restart_under_load_fails_no_call(cluster):
    """8 clients stream through HAProxy, in a loop, while the replicas are restarted one at a time:
    no call fails and every stream ends with all its tokens."""
    load = Load(cluster.target, clients=8, max_new_tokens=48)
    began = time.monotonic()
    try:
        time.sleep(2)
        for replica in cluster.replicas:
            restart(cluster, replica)
        time.sleep(2)
    finally:
        load.stop()
    print(f"rolling restart: {load.completed['ok']} calls ({load.resumed} resumed) in {time.monotonic() - began:.0f} s")
    assert load.failures == []
    assert load.completed["ok"] > 50
    # The restarted replicas take calls again.
    before = {r.name: status(cluster, r).sessions_submitted for r in cluster.replicas}
    with grpc.insecure_channel(cluster.target) as channel:
        stub = pb_grpc.GenerateStub(channel)
        for call in [stub.Stream(request(16), timeout=60) for _ in range(4)]:
            list(call)
    assert all(status(cluster, r).sessions_submitted > before[r.name] for r in cluster.replicas)


def test_max_connection_age_closes_a_connection_its_calls_done(tiny_dir):
    """--max-connection-age-ms: the server sends GOAWAY, the channel goes IDLE, and its next call
    connects again; a call in flight at that moment runs to its end (grace 0: no limit)."""
    server = tiny_server(tiny_dir, "--max-connection-age-ms", "1000", env=SLOW)
    try:
        with grpc.insecure_channel(server.target) as channel:
            states: list[grpc.ChannelConnectivity] = []
            channel.subscribe(states.append, try_to_connect=True)
            stub = pb_grpc.GenerateStub(channel)
            final = list(stub.Stream(request(900), timeout=60))[-1]  # 2.7 s at least: past the age
            assert final.finish_reason == MAX_TOKENS
            wait_for(lambda: states[-1] == grpc.ChannelConnectivity.IDLE, timeout=10)
            assert stub.ServerStatus(pb.ServerStatusRequest(), timeout=10).sessions_submitted == 1
    finally:
        server.stop()
