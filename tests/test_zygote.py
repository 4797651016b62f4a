"""The tests' servers are forks of a process that has imported braid (braid_testing/zygote.py): a
fork must behave as `braid` in a subprocess would, and what a fork cannot honour must not be forked."""

from __future__ import annotations

import os
import signal

import pytest

from braid_testing import zygote
from braid_testing.process import run_braid
from conftest import tiny_server


@pytest.mark.parametrize(
    "args",
    [
        ("serve", "--port", "abc"),  # argparse's usage error, exit 2
        ("serve", "--model", "/nonexistent/model", "--port", "0"),  # a start that fails loading, exit 1
        ("--version",),
    ],
    ids=["bad flag", "bad model", "version"],
)
def test_a_forked_braid_answers_as_a_spawned_one(monkeypatch, args):
    forked = run_braid(*args)
    monkeypatch.setenv(zygote.SWITCH, "0")
    spawned = run_braid(*args)
    assert (forked.returncode, forked.stdout, forked.stderr) == (spawned.returncode, spawned.stdout, spawned.stderr)


def test_a_variable_read_when_a_module_loads_is_honoured(monkeypatch):
    with open(os.devnull, "wb") as devnull:
        # a server's own: a plain subprocess
        assert zygote.spawn(["--version"], {**os.environ, "OMP_NUM_THREADS": "3"}, devnull.fileno()) is None
        forked = zygote.spawn(["--version"], {**os.environ, "BRAID_LOG_LEVEL": "debug"}, devnull.fileno())
        assert forked is not None and forked.wait(60) == 0
    # this process's own, changed after its zygote imported (loading a model sets HF_HUB_OFFLINE): a
    # new zygote imports under it, and the servers are forks still. A client of its own, whose zygotes
    # import no braid before they fork (the tests' client's would each import it: 9 s of CPU).
    client = zygote._Client(preload=False)
    try:
        with open(os.devnull, "wb") as devnull:
            forked = client.spawn(["--version"], dict(os.environ), devnull.fileno())
            assert forked is not None and forked.wait(60) == 0
        before = client._proc
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        with open(os.devnull, "wb") as devnull:
            forked = client.spawn(["--version"], dict(os.environ), devnull.fileno())
            assert forked is not None and forked.wait(60) == 0
        assert client._proc is not before
        # the environment restored (as monkeypatch restores it): its zygote forks again, none imports anew
        monkeypatch.undo()
        with open(os.devnull, "wb") as devnull:
            forked = client.spawn(["--version"], dict(os.environ), devnull.fileno())
            assert forked is not None and forked.wait(60) == 0
        assert client._proc is before and len(client._all) == 2
        folders = [os.path.dirname(path) for _, path in client._zygotes.values()]
    finally:
        client._stop()
    # the zygotes' sockets' folders go with them (each suite's run left three in /tmp)
    assert len(folders) == 2 and not any(os.path.exists(folder) for folder in folders)


def test_a_forked_server_drains_on_sigterm_and_reports_a_kill_as_popen_does(tiny_dir):
    server = tiny_server(tiny_dir)
    assert isinstance(server.proc, zygote.ForkedProcess)
    assert server.stop() == 0  # SIGTERM: a graceful drain, exit 0
    # A kill needs no server that has started: a fork of `braid serve`, killed while it loads (it
    # never exits by itself), is reported as Popen reports a killed child.
    with open(os.devnull, "wb") as devnull:
        forked = zygote.spawn(["serve", "--model", str(tiny_dir), "--port", "0"], dict(os.environ), devnull.fileno())
    assert forked is not None
    forked.send_signal(signal.SIGKILL)
    assert forked.wait(30) == -signal.SIGKILL


def test_a_forked_server_waited_on_by_two_threads_gives_both_its_exit_code(tiny_dir):
    """As Popen: deploy/cluster.py's supervisor polls a replica while the test waits for it to exit.
    The two read the exit line at once, and one failed with "I/O operation on closed file"."""
    import concurrent.futures
    import threading
    import time

    with open(os.devnull, "wb") as devnull:
        forked = zygote.spawn(["serve", "--model", str(tiny_dir), "--port", "0"], dict(os.environ), devnull.fileno())
    assert forked is not None
    ended = threading.Event()

    def poll_until_ended() -> set:
        seen = set()
        while not ended.is_set():
            seen.add(forked.poll())
        return seen

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        waits = [pool.submit(forked.wait, 60) for _ in range(2)]
        polls = [pool.submit(poll_until_ended) for _ in range(2)]
        time.sleep(0.5)  # the waiters into their wait first, so that they race for the exit line
        forked.send_signal(signal.SIGKILL)
        try:
            assert [w.result() for w in waits] == [-signal.SIGKILL] * 2
        finally:
            ended.set()
        assert set().union(*(p.result() for p in polls)) <= {None, -signal.SIGKILL}
    assert forked.poll() == forked.wait(0) == -signal.SIGKILL


def test_a_zygote_started_on_a_thread_outlives_the_thread():
    """A test's first server may start on a thread of its own (conftest.start_together): the zygote
    it starts must serve the rest of the run. It was killed when that thread ended (it asked for
    the parent-death signal, which is the starting thread's), and every later server ran unforked.
    (Its zygote imports no braid before it forks: what it outlives does not depend on what it holds.)"""
    import threading

    client = zygote._Client(preload=False)
    forked = []

    def first() -> None:
        with open(os.devnull, "wb") as devnull:
            forked.append(client.spawn(["--version"], dict(os.environ), devnull.fileno()))

    try:
        thread = threading.Thread(target=first)
        thread.start()
        thread.join()
        assert forked[0] is not None and forked[0].wait(60) == 0
        started = client._proc
        with open(os.devnull, "wb") as devnull:
            again = client.spawn(["--version"], dict(os.environ), devnull.fileno())
        assert again is not None and again.wait(60) == 0
        assert client._proc is started and started.poll() is None  # the same zygote, alive
    finally:
        client._stop()
