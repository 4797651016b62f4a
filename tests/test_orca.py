"""ORCA load reports in every call's trailers, parsed with the standard message (xds-protos), as
gRPC's weighted round robin and Envoy read them: a replica with a long queue says so.

grpcurl reads the trailers: gRPC's own clients take `endpoint-load-metrics-bin` for their load
balancer and never show it to the application.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
from pathlib import Path

from xds.data.orca.v3.orca_load_report_pb2 import OrcaLoadReport

from conftest import LONG, SLOW, tiny_server, wait_for

GRPCURL = Path(sys.executable).parent / "grpcurl"


def _report(target: str, method: str, request: dict) -> OrcaLoadReport:
    """The load report in the trailers of one call, made with grpcurl -v."""
    out = subprocess.run(
        [str(GRPCURL), "-plaintext", "-v", "-d", json.dumps(request), target, f"braid.v1.Generate/{method}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    trailers = out[out.index("Response trailers received:") :]
    (value,) = [
        line.split(": ", 1)[1] for line in trailers.splitlines() if line.startswith("endpoint-load-metrics-bin: ")
    ]
    return OrcaLoadReport.FromString(base64.b64decode(value))


def _status_report(target: str) -> OrcaLoadReport:
    return _report(target, "ServerStatus", {})


def test_a_replica_with_a_long_queue_reports_it(tiny_dir):
    server = tiny_server(tiny_dir, "--mode", "sequential", "--max-sessions", "4", env=SLOW)
    try:
        idle = _status_report(server.target)
        assert idle.named_metrics["queue_depth"] == 0 and idle.application_utilization == 0
        with server.client() as client:
            # one runs, three wait (one token each: they are here to be counted in the queue)
            hold = client.stream("Hold the model", **LONG)
            # the long call runs before the others are sent: one that reached the server first would
            # run its one token and leave two in the queue (a race the test lost about one run in six)
            next(iter(hold))
            threads = [
                threading.Thread(target=lambda: client.generate("Wait in line", max_new_tokens=1), daemon=True)
                for _ in range(3)
            ]
            for thread in threads:
                thread.start()
            wait_for(lambda: client.server_status().sessions_queued == 3)
            busy = _status_report(server.target)
            hold.cancel()  # it has held the model long enough: the queue's report is taken
            busy_stream = threading.Thread(
                target=lambda: streamed.append(
                    _report(server.target, "Stream", {"prompt": "And one more", "max_new_tokens": 2})
                ),
                daemon=True,
            )
            streamed: list[OrcaLoadReport] = []
            busy_stream.start()
            threads.append(busy_stream)
            for thread in threads:
                thread.join(60)
        assert busy.named_metrics["queue_depth"] == 3 and busy.named_metrics["active_sessions"] == 1
        assert busy.application_utilization >= 1.0  # 4 sessions wanted, 4 allowed
        assert 0 < busy.utilization["kv_cache"] == busy.named_metrics["kv_cache_utilization"] <= 1
        assert busy.rps_fractional > 0
        assert "queue_depth" in streamed[0].named_metrics  # a Stream's trailers carry it too
    finally:
        server.stop()
