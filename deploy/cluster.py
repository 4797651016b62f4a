"""A braid cluster on this machine: replicas of `braid serve` behind HAProxy, scraped by Prometheus.

    make cluster                                  # 2 replicas; gRPC on localhost:50051 through HAProxy
    make cluster REPLICAS=3 ARGS="--mode batched"
    .venv/bin/python deploy/cluster.py --replicas 3 -- --model ./my-model
    .venv/bin/python deploy/roll.py               # another terminal: a rolling restart under load

Replica N (from 1) serves gRPC on --first-port + N - 1 and its metrics on --first-metrics-port + N - 1.
HAProxy (deploy/haproxy.cfg) balances each call over the replicas that pass its gRPC health check
(by its braid-route-key header where it has one: consistent hashing with bounded load);
its status page and /metrics are on --stats-port. Prometheus, with a variant of deploy/prometheus.yml
that scrapes every replica and HAProxy, is on --prometheus-port (0: not run).

A replica that exits is started again on its ports, as compose's `restart: unless-stopped` does: a
SIGTERM (`kill -TERM <pid>`, or deploy/roll.py) restarts it, the replica draining first. Ctrl-C
stops everything. Logs and the generated configs are in --run-dir; cluster.json there says where
everything is and each replica's pid.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEPLOY = Path(__file__).resolve().parent
BRAID = Path(sys.executable).with_name("braid")
HEALTH_SERVICE = "braid.v1.Generate"
BACKEND = "braid"  # deploy/haproxy.cfg's backend
START_TIMEOUT_S = 180.0


@dataclass
class Replica:
    """One `braid serve` on fixed ports; `proc` is its current process (a new one after a restart)."""

    name: str
    port: int
    metrics_port: int
    proc: subprocess.Popen | None = None
    restarts: int = 0


@dataclass
class Cluster:
    """The replicas, HAProxy in front of them on host:port, and Prometheus (when prometheus_port)."""

    replicas: list[Replica]
    run_dir: Path
    host: str = "127.0.0.1"
    port: int = 50051
    stats_port: int = 8404
    prometheus_port: int = 0
    scrape_interval: str = "5s"
    braid_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # for the replicas, over this process's
    quiet: bool = False

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._haproxy: subprocess.Popen | None = None
        self._prometheus: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="cluster-supervisor", daemon=True)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def socket_path(self) -> Path:
        return self.run_dir / "haproxy.sock"

    def start(self) -> None:
        """Starts the replicas (together), then HAProxy once they serve, then Prometheus; returns when
        HAProxy has every replica UP. Stops what it started if any of it fails."""
        try:
            for replica in self.replicas:
                self._spawn(replica)
            for replica in self.replicas:
                self.wait_serving(replica)
            self._haproxy = self._run(
                [binary("haproxy"), "-f", str(self._haproxy_config())],
                "haproxy.log",
                env={**os.environ, **self._haproxy_env()},
            )
            wait_until(self._all_up, 30, "HAProxy has every replica UP", self._haproxy)
            if self.prometheus_port:
                self._prometheus = self._run(
                    [
                        binary("prometheus"),
                        f"--config.file={self._prometheus_config()}",
                        f"--storage.tsdb.path={self.run_dir / 'prometheus'}",
                        f"--web.listen-address={self.host}:{self.prometheus_port}",
                    ],
                    "prometheus.log",
                )
                wait_until(lambda: _http_ok(f"{self.prometheus_url}/-/ready"), 60, "Prometheus ready", self._prometheus)
            self._supervisor.start()
            self.write_state()
        except BaseException:
            self.stop()
            raise

    @property
    def prometheus_url(self) -> str:
        return f"http://{self.host}:{self.prometheus_port}"

    def stop(self) -> None:
        """SIGTERM to everything (the replicas drain), SIGKILL to what is still there after 30 s."""
        self._stopping.set()
        procs = [r.proc for r in self.replicas] + [self._haproxy, self._prometheus]
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in procs:
            if proc is not None:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    # --- the replicas --------------------------------------------------------------------------

    def _spawn(self, replica: Replica) -> None:
        args = [
            str(BRAID),
            "serve",
            *self.braid_args,
            "--host",
            self.host,
            "--port",
            str(replica.port),
            "--metrics-port",
            str(replica.metrics_port),
        ]
        replica.proc = self._run(args, f"{replica.name}.log", env={**os.environ, **self.env})

    def wait_serving(self, replica: Replica, timeout: float = START_TIMEOUT_S) -> None:
        """Until the replica's health says SERVING for braid.v1.Generate."""
        proc = replica.proc
        with grpc.insecure_channel(f"{self.host}:{replica.port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            request = health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)

            def serving() -> bool:
                with contextlib.suppress(grpc.RpcError):
                    return check(request, timeout=1).status == health_pb2.HealthCheckResponse.SERVING
                return False

            wait_until(serving, timeout, f"{replica.name} serving (see {self.run_dir / replica.name}.log)", proc)

    def _supervise(self) -> None:
        """Starts again a replica whose process ended, while the cluster runs; says when HAProxy
        takes a replica out of rotation or puts it back."""
        seen = self.proxy_states()
        while not self._stopping.wait(0.2):
            states = self.proxy_states()
            for name, state in states.items():
                if (
                    name in seen and state.split()[:1] != seen[name].split()[:1]
                ):  # UP, DOWN ("UP 1/2": one check failed)
                    self._say(f"{name} is {state.split()[0]} in HAProxy")
            seen = states or seen
            for replica in self.replicas:
                if replica.proc is not None and replica.proc.poll() is not None and not self._stopping.is_set():
                    self._say(
                        f"{replica.name} (pid {replica.proc.pid}) exited with {replica.proc.returncode}; "
                        "starting it again"
                    )
                    replica.restarts += 1
                    self._spawn(replica)
                    self.write_state()

    # --- HAProxy -------------------------------------------------------------------------------

    def _haproxy_env(self) -> dict[str, str]:
        return {
            "BRAID_CLUSTER_DIR": str(self.run_dir),
            "BRAID_CLUSTER_DEPLOY": str(DEPLOY),
            "BRAID_CLUSTER_HOST": self.host,
            "BRAID_CLUSTER_PORT": str(self.port),
            "BRAID_CLUSTER_STATS_PORT": str(self.stats_port),
        }

    def _haproxy_config(self) -> Path:
        """deploy/haproxy.cfg with one server line per replica under each backend's `# servers:`
        line: checked in backend braid, tracking those in backend braid-affinity."""
        lines = []
        for line in (DEPLOY / "haproxy.cfg").read_text().splitlines(keepends=True):
            lines.append(line)
            if line.strip().startswith("# servers:"):
                track = " track braid/{name}" if "track" in line else ""
                lines += [
                    f"    server {r.name} {self.host}:{r.port}{track.format(name=r.name)}\n" for r in self.replicas
                ]
        path = self.run_dir / "haproxy.cfg"
        path.write_text("".join(lines))
        return path

    def proxy_states(self) -> dict[str, str]:
        return proxy_states(self.socket_path)

    def _all_up(self) -> bool:
        """Every replica UP in HAProxy (not merely no replica down: HAProxy still starting answers nothing)."""
        states = self.proxy_states()
        return len(states) == len(self.replicas) and all(state == "UP" for state in states.values())

    # --- Prometheus ----------------------------------------------------------------------------

    def _prometheus_config(self) -> Path:
        """deploy/prometheus.yml for this machine: the braid job lists the replicas (labelled
        replica=replica-N) instead of finding them in Docker's DNS, HAProxy's /metrics replaces
        Envoy's, and there is no collector."""
        config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        config["global"]["scrape_interval"] = self.scrape_interval
        jobs = {job["job_name"]: job for job in config["scrape_configs"]}
        braid = jobs["braid"]
        del braid["dns_sd_configs"]
        braid["static_configs"] = [
            {"targets": [f"{self.host}:{r.metrics_port}"], "labels": {"replica": r.name}} for r in self.replicas
        ]
        haproxy = {
            "job_name": "haproxy",
            "metrics_path": "/metrics",
            "static_configs": [{"targets": [f"{self.host}:{self.stats_port}"]}],
        }
        config["scrape_configs"] = [braid, haproxy]
        path = self.run_dir / "prometheus.yml"
        path.write_text("# Generated by deploy/cluster.py from deploy/prometheus.yml.\n" + yaml.safe_dump(config))
        return path

    # --- bookkeeping ---------------------------------------------------------------------------

    def _run(self, args: list[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.run_dir / log_name, "a") as log:  # the child keeps its own descriptor
            return subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env or os.environ
            )

    def write_state(self) -> None:
        state = {
            "proxy": self.target,
            "stats": f"http://{self.host}:{self.stats_port}/",
            "prometheus": self.prometheus_url if self.prometheus_port else None,
            "socket": str(self.socket_path),
            "replicas": [
                {
                    "name": r.name,
                    "target": f"{self.host}:{r.port}",
                    "metrics": f"http://{self.host}:{r.metrics_port}/metrics",
                    "pid": r.proc.pid if r.proc else None,
                    "restarts": r.restarts,
                }
                for r in self.replicas
            ],
        }
        path = self.run_dir / "cluster.json"
        path.with_suffix(".tmp").write_text(json.dumps(state, indent=2) + "\n")
        path.with_suffix(".tmp").replace(path)

    def _say(self, line: str) -> None:
        if not self.quiet:
            print(f"cluster: {line}", flush=True)


def wait_until(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, interval: float = 0.1):
    """Polls predicate() until it is truthy (and returns it); raises naming `what` after timeout, or
    at once if proc, which predicate needs, has exited."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"waiting for {what}: {proc.args[0]} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waiting for {what}: not after {timeout:g} s")
        time.sleep(interval)
    return value


def proxy_command(socket_path: Path, command: str) -> str:
    """One command on HAProxy's stats socket (`show stat`, ...), and its answer."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(socket_path))
        sock.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def proxy_states(socket_path: Path) -> dict[str, str]:
    """Each replica's state in HAProxy: UP, DOWN, or on its way (`UP 1/2`: one check failed);
    empty while HAProxy is not answering."""
    try:
        text = proxy_command(socket_path, "show stat")
    except OSError:
        return {}
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    return {
        row["svname"]: row["status"]
        for row in rows
        if row["pxname"] == BACKEND and row["svname"] not in ("FRONTEND", "BACKEND")
    }


def default_run_dir(port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"braid-cluster-{port}"


def find_binary(name: str) -> str | None:
    """A command on PATH, or in /usr/sbin where Debian puts haproxy (not on a user's PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")


def binary(name: str) -> str:
    found = find_binary(name)
    if found is None:
        raise RuntimeError(f"no {name} on this machine: deploy/install-tools.sh {name} installs it")
    return found


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], usage="cluster.py [options] [-- braid serve flags]"
    )
    parser.add_argument("--replicas", type=int, default=int(os.environ.get("REPLICAS", "2")))
    parser.add_argument("--host", default="127.0.0.1", help="where everything listens (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50051, help="HAProxy's gRPC port (default 50051)")
    parser.add_argument("--first-port", type=int, default=50061, help="replica 1's gRPC port (default 50061)")
    parser.add_argument("--first-metrics-port", type=int, default=9465, help="replica 1's metrics port (default 9465)")
    parser.add_argument("--stats-port", type=int, default=8404, help="HAProxy's status page and /metrics")
    parser.add_argument("--prometheus-port", type=int, default=9090, help="Prometheus (0: not run; default 9090)")
    parser.add_argument("--scrape-interval", default="5s")
    parser.add_argument("--run-dir", type=Path, help="logs, configs, cluster.json (default: <tmp>/braid-cluster-PORT)")
    parser.add_argument("braid_args", nargs="*", help="flags for every `braid serve`, after --")
    args = parser.parse_args(argv)
    run_dir = args.run_dir or default_run_dir(args.port)
    replicas = [
        Replica(f"replica-{n}", args.first_port + n - 1, args.first_metrics_port + n - 1)
        for n in range(1, args.replicas + 1)
    ]
    # The replicas share this machine: torch threads and KV-cache memory are split between them
    # unless the flags (which win over these variables) or the environment say otherwise. A
    # replica that drains hands its streams over after 5 s, as in compose and Kubernetes.
    env = {
        "BRAID_THREADS": str(max(1, (os.cpu_count() or 1) // args.replicas)),
        "BRAID_KV_CACHE_MEMORY": "1GiB",
        "BRAID_HANDOVER_GRACE": "5",
    }
    env = {name: value for name, value in env.items() if name not in os.environ}
    cluster = Cluster(
        replicas,
        run_dir,
        host=args.host,
        port=args.port,
        stats_port=args.stats_port,
        prometheus_port=args.prometheus_port if find_binary("prometheus") else 0,
        scrape_interval=args.scrape_interval,
        braid_args=args.braid_args,
        env=env,
    )
    print(f"cluster: starting {args.replicas} replicas (logs in {run_dir})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster.start()
    for r in replicas:
        print(
            f"cluster: {r.name}  pid {r.proc.pid}  gRPC {args.host}:{r.port}  "
            f"metrics http://{args.host}:{r.metrics_port}/metrics",
            flush=True,
        )
    print(
        f"cluster: gRPC through HAProxy on {cluster.target}; HAProxy status http://{args.host}:{args.stats_port}/",
        flush=True,
    )
    if cluster.prometheus_port:
        print(f"cluster: Prometheus {cluster.prometheus_url}", flush=True)
    elif args.prometheus_port:
        print("cluster: no Prometheus (deploy/install-tools.sh prometheus installs it)", flush=True)
    print(
        f'cluster: try  .venv/bin/braid-client --target {cluster.target} --chat "Hello";  a rolling restart '
        f"under load: .venv/bin/python deploy/roll.py --port {args.port};  Ctrl-C stops",
        flush=True,
    )
    stop.wait()
    print("cluster: stopping (the replicas drain first)", flush=True)
    cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
