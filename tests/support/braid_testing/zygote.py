"""`braid serve` forked from a process that has already imported it: the tests start well over a
hundred servers, and each spent most of its start (seconds of CPU on a slow core) importing torch,
transformers and llguidance. A zygote (the name Android gives its pre-imported app parent) imports
them once per test process; each server is a fork of it, which then runs `braid serve`'s own main
with its own arguments, environment, working directory and output, as the child process would.

The zygote runs on one thread (torch's import adds an idle one) and never runs a tensor op or opens
a channel before it forks: a fork copies only the calling thread, so a lock another thread held, or
an OpenMP pool, would be copied broken. It reseeds the random generators in each child. A variable
read when a module loads (libgomp's OMP_*/GOMP_*, huggingface_hub's HF_*, ...) cannot differ in a
fork: a server given one that this process lacks (any but RUNTIME_VARIABLES) is started as a plain
subprocess instead (`spawn` returns None), and once this process's own environment changes in one,
a new zygote imports under it. BRAID_TEST_FORK=0 turns the zygote off.

Protocol, one Unix-socket connection per server: the client sends one JSON line (argv, env, cwd)
with the fds for the server's stdout and stderr attached; the zygote answers one line with the
child's pid, and a second with its exit status once it has exited."""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

from braid_testing.faults import ENV as FAULT_ENV

# Read by braid at run time, not when a module loads: they may differ between the zygote and a fork.
# (torch sets TORCHINDUCTOR_CACHE_DIR to its default the first time it asks for the folder, and reads
# it each time it does: a test process's in-process runner set it, and the next server started a zygote.)
RUNTIME_VARIABLES = ("BRAID_", "OTEL_", "PYTEST_", "XDG_CACHE_HOME", "COVERAGE_", "TORCHINDUCTOR_CACHE_DIR")
SWITCH = "BRAID_TEST_FORK"


class ForkedProcess:
    """A forked server, as much of subprocess.Popen as the tests use: pid, returncode, poll, wait,
    send_signal, terminate, kill; safe from several threads as Popen is (a cluster's supervisor polls
    a replica while the test waits on it: the two read and closed the exit line at once, and the
    second got "I/O operation on closed file")."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self._file = conn.makefile("r")
        self._lock = threading.Lock()  # held by the one thread reading the exit line
        self.pid = pid
        self.returncode: int | None = None
        self.args = ["braid"]

    def poll(self) -> int | None:
        if not self._lock.acquire(blocking=False):
            return self.returncode  # another thread is waiting for it: as Popen.poll, not done yet
        try:
            return self._read(0)
        finally:
            self._lock.release()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        try:
            code = self._read(None if deadline is None else max(0.0, deadline - time.monotonic()))
        finally:
            self._lock.release()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def _read(self, timeout: float | None) -> int | None:
        """The exit code, once the zygote has sent it; called with the lock held."""
        if self.returncode is None and select.select([self._conn], [], [], timeout)[0]:
            line = self._file.readline()
            self.returncode = int(line) if line else -signal.SIGKILL  # the zygote died: so did its way to tell
            self._file.close()
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Client:
    """This process's zygotes: one for each environment this process has had (in the variables read at
    import) when it started a server, started on first use under it. The tests' loading of a model sets
    HF_HUB_OFFLINE, and a test's monkeypatch changes a variable and then restores it: the zygote of the
    environment restored serves again, where a new one imported braid anew (9 s of CPU) each time. Every
    zygote ends with this process. preload=False: zygotes that import nothing of braid first (a test of the
    zygote's own lifetime and bookkeeping needs no 9 s of CPU of imports per zygote it starts)."""

    def __init__(self, preload: bool = True) -> None:
        self._preload = preload
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None  # the zygote of the environment last seen
        self._path = ""
        self._zygotes: dict[frozenset[tuple[str, str]], tuple[subprocess.Popen, str]] = {}
        self._all: list[subprocess.Popen] = []
        self._folders: list[str] = []  # each zygote's socket's, removed when this process ends
        self._failed = False

    def spawn(
        self, argv: list[str], env: dict[str, str], stdout: int | None, stderr: int | None = None
    ) -> ForkedProcess | None:
        """`braid <argv>` forked with env, its output to the fd stdout (None: this process's) and its
        errors to stderr (None: where its output goes); None where it must be a plain subprocess."""
        if os.environ.get(SWITCH, "1") == "0" or _read_at_import(env) != _read_at_import(os.environ):
            return None  # a server's own variable that a fork could not honour
        with self._lock:
            if not self._started():
                return None
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self._path)
                message = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode() + b"\n"
                out = sys.stdout.fileno() if stdout is None else stdout
                socket.send_fds(conn, [message], [out, out if stderr is None else stderr])
                line = conn.makefile("r").readline()
                if not line:
                    raise OSError("the zygote closed the connection")
                return ForkedProcess(conn, int(line))
            except BaseException:
                conn.close()
                raise

    def _started(self) -> bool:
        """A zygote that imported what it did under this process's environment as it is now, started
        if need be; the others stay until this process ends, reporting their forks' exits."""
        key = frozenset(_read_at_import(os.environ).items())
        if key in self._zygotes and self._zygotes[key][0].poll() is not None:
            warnings.warn(
                f"the tests' zygote exited ({self._zygotes[key][0].returncode}): starting another", stacklevel=2
            )
            del self._zygotes[key]
        if key not in self._zygotes and not self._failed:
            self._start(key)
        self._proc, self._path = self._zygotes.get(key, (None, ""))
        return self._proc is not None

    def _start(self, key: frozenset[tuple[str, str]]) -> None:
        folder = tempfile.mkdtemp(prefix="braid-zygote-")
        if not self._folders:
            atexit.register(self._stop)
        self._folders.append(folder)
        socket_path = os.path.join(folder, "socket")
        support = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(filter(None, [support, os.environ.get("PYTHONPATH")]))
        proc = subprocess.Popen(
            [sys.executable, "-m", "braid_testing.zygote", socket_path, *([] if self._preload else ["--bare"])],
            env={**os.environ, "PYTHONPATH": path},
            stdin=subprocess.PIPE,
        )
        # It creates <socket>.ready once it listens.
        ready = Path(socket_path + ".ready")
        while not ready.exists():
            if proc.poll() is not None:
                self._failed = True  # the tests go on with plain subprocesses, as before the zygote
                return
            threading.Event().wait(0.05)
        self._zygotes[key] = proc, socket_path
        self._all.append(proc)

    def _stop(self) -> None:
        for proc in self._all:
            if proc.poll() is None:
                proc.stdin.close()  # its end: it exits when its stdin closes
        for proc in self._all:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for folder in self._folders:  # each suite's run left three behind in /tmp
            shutil.rmtree(folder, ignore_errors=True)


def _read_at_import(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of env that a module may have read when it loaded."""
    return {k: v for k, v in env.items() if not k.startswith(RUNTIME_VARIABLES)}


_client = _Client()


def spawn(argv: list[str], env: dict[str, str], stdout: int | None, stderr: int | None = None) -> ForkedProcess | None:
    return _client.spawn(argv, env, stdout, stderr)


# The zygote itself.


def _preload() -> None:
    """What `braid serve` imports before it serves, imported once here."""
    from braid.server import resources

    resources.bound_spinning()  # as braid's main does, before torch loads libgomp
    import braid.server.app  # noqa: F401
    import braid.server.cli  # noqa: F401
    import braid.server.engine.engine  # noqa: F401
    import braid.server.engine.grammars  # noqa: F401
    import braid.server.engine.tokenizer  # noqa: F401
    import braid.server.model.loader  # noqa: F401
    import braid.server.runner.model_runner  # noqa: F401
    import braid_testing.faults  # noqa: F401
    import transformers

    # What a server with --http-port imports besides (uvicorn, starlette, pydantic; OpenTelemetry's SDK
    # and exporters, prometheus_client: none starts a thread on import): 0.6 s of CPU in each such fork.
    import braid.server.http.server  # noqa: F401
    import braid.server.telemetry.setup  # noqa: F401

    # transformers imports lazily, on first use: what loading a checkpoint uses, with the modules
    # of the architectures the tests build (each's own is small once the shared ones are in).
    for name in ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM", "PreTrainedTokenizerFast", "GenerationConfig"):
        getattr(transformers, name)
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        with contextlib.suppress(ImportError, AttributeError):
            getattr(transformers, name)
    # Its table of checkpoint conversions (a thousand WeightRenamings, each compiling a regex: 0.6 s of
    # CPU, more than the rest of a tiny server's load) is built on a process's first load and kept.
    with contextlib.suppress(ImportError):
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        get_checkpoint_conversion_mapping("llama")


def _child(conn: socket.socket, request: dict, out: int, err: int) -> int:
    """In the fork: becomes `braid <argv>` and returns its exit code."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {out, err, devnull}:
        os.close(fd)
    conn.close()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _reseed()
    sys.argv = ["braid", *request["argv"]]
    from braid.server.cli import main
    from braid_testing.faults import Faults

    ports = None
    if os.environ.get(FAULT_ENV):
        try:
            ports = Faults.from_env()
        except ValueError as exc:
            print(f"braid: error: {exc}", file=sys.stderr)
            return 2
    return main(request["argv"], ports=ports)


def _reseed() -> None:
    """New seeds for the fork's random generators that the zygote imported (each would otherwise
    repeat its siblings' numbers); one imported after the fork seeds itself."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def _exit_in_child(code: int) -> None:
    """Ends the fork as an interpreter's exit would: non-daemon threads joined, atexit handlers run
    (OpenTelemetry flushes there), output flushed; never returns into the zygote's loop."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _serve(path: str, preload: bool = True) -> None:
    # Python 3.12 warns at each fork of a process with more than one thread: torch's import starts
    # one, which stays idle (no lock of it is taken by the child's code).
    warnings.filterwarnings("ignore", r"This process \(pid=\d+\) is multi-threaded", DeprecationWarning)
    if preload:
        _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    Path(path + ".ready").touch()
    children: dict[int, socket.socket] = {}
    while True:
        readable = select.select([listener, sys.stdin], [], [], 0.05)[0]
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return  # the test process has gone
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()
        if listener in readable:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
            while not message.endswith(b"\n"):
                more = conn.recv(1 << 16)
                if not more:
                    raise OSError("a client closed its connection mid-request")
                message += more
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            # What the zygote holds (torch, transformers, braid: millions of objects) out of the fork's
            # garbage collections: each traversed all of it, writing to every page it touched (a copy
            # of each), 0.4 s of a tiny server's 1.9 s of CPU. What of it a fork drops stays (a test's server
            # is short-lived).
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                code = 1
                try:
                    code = _child(conn, request, *fds)
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                except BaseException:
                    import traceback

                    traceback.print_exc()
                _exit_in_child(code)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn


if __name__ == "__main__":
    # It ends with the test process when its stdin closes (_serve). Not PR_SET_PDEATHSIG: that fires
    # when the *thread* that started it ends, and a test's first server may start on a thread of its
    # own (start_together): the zygote was killed with it, and the rest of the run lost its forks.
    _serve(sys.argv[1], preload="--bare" not in sys.argv[2:])
