"""A rolling restart of a running local cluster (`make cluster`) under load: no call may fail.

    .venv/bin/python deploy/roll.py                            # the cluster on 50051: 8 clients, 2 minutes
    .venv/bin/python deploy/roll.py --clients 16 --duration 300 --port 50051

Clients stream through HAProxy in a loop, with braid-client's channel options (its retry policy),
while the replicas get SIGTERM one at a time: each next one only once HAProxy has taken the last
out, the cluster has started it again and HAProxy has put it back. Then it prints the calls that
completed and those that failed, and exits 1 if any did. tests/test_cluster.py runs the same clients.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
from braid.client import Client
from braid.v1 import generate_pb2 as pb
from cluster import START_TIMEOUT_S, default_run_dir, proxy_states, wait_until

COMPLETE = pb.FINISH_REASON_MAX_TOKENS


class Load:
    """Clients that each open streams through target, one after another, until stopped. A call
    counts as completed when it ends with its final message after all its tokens; anything else
    (an error status, a stream cut short) is a failure, described in `failures`."""

    def __init__(self, target: str, clients: int, max_new_tokens: int) -> None:
        self.completed: Counter[str] = Counter()
        self.failures: list[str] = []
        self.resumed = 0  # streams cut mid-way and resumed by the client
        self._stop = threading.Event()
        self._request = pb.GenerateRequest(prompt="The sea is", max_new_tokens=max_new_tokens, ignore_eos=True)
        self._threads = [threading.Thread(target=self._client, args=(target,), daemon=True) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _client(self, target: str) -> None:
        # braid's client, as a user runs it: its retry policy sends a call refused before its first
        # message (a draining replica's UNAVAILABLE, before HAProxy has taken it out) again, and a
        # stream the proxy cuts mid-way is resumed on another replica (resume_token_ids).
        with Client(target) as client:
            while not self._stop.is_set():
                try:
                    generation = client.stream(
                        self._request.prompt, max_new_tokens=self._request.max_new_tokens, ignore_eos=True, timeout=60
                    )
                    messages = list(generation)
                    self.resumed += generation.resumes
                except grpc.RpcError as exc:
                    self.failures.append(f"{exc.code().name}: {exc.details()}")
                    continue
                tokens = sum(len(m.token_ids) for m in messages)
                if messages[-1].finish_reason != COMPLETE or tokens != self._request.max_new_tokens:
                    self.failures.append(f"cut short: finish reason {messages[-1].finish_reason}, {tokens} tokens")
                else:
                    self.completed["ok"] += 1

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)


def restart(run_dir: Path, name: str) -> str:
    """SIGTERM to one replica; returns once HAProxy has it UP again, saying how long each step took."""

    def pid() -> int:
        (replica,) = [r for r in json.loads((run_dir / "cluster.json").read_text())["replicas"] if r["name"] == name]
        return replica["pid"]

    old, began, sock = pid(), time.monotonic(), run_dir / "haproxy.sock"
    os.kill(old, signal.SIGTERM)
    wait_until(lambda: proxy_states(sock).get(name, "").startswith("DOWN"), 60, f"{name} out of rotation")
    out = time.monotonic() - began
    wait_until(lambda: pid() != old, 120, f"{name} started again")
    wait_until(lambda: proxy_states(sock).get(name) == "UP", START_TIMEOUT_S, f"{name} back in rotation")
    return (
        f"{name}: pid {old} out of rotation {out:.1f} s after SIGTERM, pid {pid()} back in "
        f"{time.monotonic() - began:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=50051, help="the cluster's HAProxy port (default 50051)")
    parser.add_argument("--run-dir", type=Path, help="the cluster's run directory (default: from --port)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    run_dir = args.run_dir or default_run_dir(args.port)
    state = json.loads((run_dir / "cluster.json").read_text())
    load, began = Load(state["proxy"], args.clients, args.max_new_tokens), time.monotonic()
    try:
        time.sleep(min(10.0, args.duration / 6))
        for replica in state["replicas"]:
            print(restart(run_dir, replica["name"]), flush=True)
        time.sleep(max(0.0, args.duration - (time.monotonic() - began)))
    finally:
        load.stop()
    print(
        f"{load.completed['ok']} calls completed in {time.monotonic() - began:.0f} s ({load.resumed} resumed), "
        f"{len(load.failures)} failed"
    )
    for failure, count in Counter(load.failures).most_common():
        print(f"  {count} x {failure}")
    return 1 if load.failures else 0


if __name__ == "__main__":
    sys.exit(main())
