"""`braid serve` as a child process on a free port, healthy before it is handed over, stopped with
SIGTERM: the one helper the tests, the benchmarks and the soak script start servers with. Where its
environment names a fault (BRAID_INJECT_FAULT), it runs `python -m braid_testing.serve` instead,
braid serve with the faults wrapped around the engine's ports (faults.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from braid_testing import zygote
from braid_testing.faults import ENV as FAULT_ENV

BRAID = Path(sys.executable).with_name("braid")
SUPPORT = Path(__file__).resolve().parent.parent  # tests/support: where braid_testing is found
START_TIMEOUT_S = 180.0


# free_port's ports lie below the kernel's ephemeral range, the ports it gives bind(0) and the
# source ports of outgoing connections. A port bind(0) picked and released, handed to a server that
# binds it seconds later, could meanwhile become the source port of any connection on the machine
# (a gRPC client of the other test worker's): the server then fails "address already in use" (a
# cluster replica's --metrics-port did, issue 39). Each pytest-xdist worker (and any other process)
# takes ports from a band of its own, so two processes never pick the same one at once.
_BAND = 2000
_FIRST = 10000
_next_port: dict[int, int] = {}


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now and that no outgoing connection will take."""
    bands = max(1, (_ephemeral_low() - _FIRST) // _BAND)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    slot = (int(worker.removeprefix("gw")) if worker.startswith("gw") else os.getpid()) % bands
    first = _FIRST + slot * _BAND
    for _ in range(_BAND):
        port = _next_port.get(slot, first)
        _next_port[slot] = first + (port + 1 - first) % _BAND
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + _BAND - 1}")


def run_braid(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`braid <args>` run to its end, its output and errors captured as text, as subprocess.run's
    would be; forked from the zygote where its environment allows."""
    command, env = [str(BRAID), *args], {**os.environ, **(env or {})}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = zygote.spawn(list(args), env, out.fileno(), err.fileno())
        if proc is None:
            return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, code, out.read().decode(), err.read().decode())


class BraidProcess:
    """A running `braid serve`: `target` is its host:port, `proc` the process."""

    def __init__(
        self,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        show_output: bool = False,
        host: str = "127.0.0.1",
        start_timeout: float = START_TIMEOUT_S,
        channel_credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """args: `braid serve` flags beyond --host and --port; log_path: where its output goes
        (default: nowhere, or this process's own output with show_output); channel_credentials: to
        health-check a TLS server."""
        self.port = free_port()
        self.target = f"{host}:{self.port}"
        self.log = open(log_path, "w") if log_path is not None else None if show_output else subprocess.DEVNULL
        env = {**os.environ, **(env or {})}
        argv = ["serve", "--host", host, "--port", str(self.port), *args]
        self.proc = self._fork(argv, env) or self._popen(argv, env)
        self._credentials = channel_credentials
        try:
            self._wait_serving(start_timeout)
        except BaseException:
            self.stop()
            raise

    def _fork(self, argv: list[str], env: dict[str, str]) -> zygote.ForkedProcess | None:
        """braid serve forked from this process's zygote (zygote.py), where its environment allows."""
        if self.log is subprocess.DEVNULL:
            with open(os.devnull, "wb") as devnull:
                return zygote.spawn(argv, env, devnull.fileno())
        return zygote.spawn(argv, env, None if self.log is None else self.log.fileno())

    def _popen(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        command = [str(BRAID)]
        if env.get(FAULT_ENV):
            command = [sys.executable, "-m", "braid_testing.serve"]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SUPPORT), env.get("PYTHONPATH")]))
        return subprocess.Popen([*command, *argv], env=env, stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        # Until the server listens, each connect fails; gRPC's default backoff then waits 1 s, 1.6 s,
        # ... before it tries again, and a check in between fails at once. Short, flat backoff: the
        # server is seen serving within a poll of its start.
        options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 50)]
        channel = (
            grpc.secure_channel(self.target, self._credentials, options)
            if self._credentials is not None
            else grpc.insecure_channel(self.target, options)
        )
        with channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"braid serve exited with {self.proc.returncode}{self._last_words()}")
                with contextlib.suppress(grpc.RpcError):
                    if (
                        check(health_pb2.HealthCheckRequest(), timeout=1).status
                        == health_pb2.HealthCheckResponse.SERVING
                    ):
                        return
                time.sleep(0.05)
        raise TimeoutError(f"braid serve not healthy after {timeout:.0f} s")

    def _last_words(self) -> str:
        """The last line it wrote (a failed start says why in one), where its output went to a file."""
        name = getattr(self.log, "name", None)
        if not isinstance(name, str):
            return ""
        self.log.flush()
        lines = Path(name).read_text(errors="replace").strip().splitlines()
        return f": {lines[-1]}" if lines else ""

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (a graceful drain), then SIGKILL after `timeout` s; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log not in (None, subprocess.DEVNULL):
            self.log.close()
        return self.proc.returncode
