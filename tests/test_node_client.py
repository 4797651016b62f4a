"""The Node.js client (clients/node) against a real braid server, as a user runs it.

The CLI streams a generation, cancels it after N tokens (the README's command), and cancels it on
Ctrl-C; each time the server's ServerStatus shows the session gone and, when cancelled, counted as
cancelled. It prints log probabilities, n samples, finish reasons by name and errors in one line as
braid-client does, and constrains the output to a choice or a regex. Over two replicas, a stream
whose replica is killed mid-way is resumed on the other and prints an unbroken run's text. The
library's own node:test suite (clients/node/test) runs against the same server, and `npm pack`
yields a package that loads its .proto. node and npm must be on the PATH; `npm ci` installs
clients/node/node_modules on first use.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from braid.client import BadRequestError
from braid.client.client import DEFAULT_OPTIONS, SERVICE_CONFIG
from conftest import SLOW, start_together, tiny_server

NODE_DIR = Path(__file__).resolve().parents[1] / "clients" / "node"
STREAM_TIMEOUT_S = 60


def wait_for(predicate, timeout: float = 20.0):
    """Polls predicate() until it returns something truthy, which it returns."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
    return value


@pytest.fixture(scope="session")
def node() -> str:
    """The node binary, with clients/node's dependencies installed (`npm ci`, once)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "node and npm must be on the PATH"
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=600)
    return node


def status(server):
    with server.client() as client:
        return client.server_status(timeout=5)


def cancelled_since(server, before) -> bool:
    """True once no session is active and one more session than before finished as cancelled."""
    now = status(server)
    return now.sessions_active == 0 and now.sessions_finished.cancelled > before.sessions_finished.cancelled


def cli(node: str, server, *args: str) -> list[str]:
    return [node, "cli.js", "--target", server.target, *args]


def run_cli(node: str, server, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli(node, server, *args), cwd=NODE_DIR, capture_output=True, text=True, timeout=STREAM_TIMEOUT_S
    )


def run_readme_command(node: str, server, flag: str) -> subprocess.CompletedProcess[str]:
    """Runs the README's `node cli.js ...` example that uses flag, exactly, with BRAID_TARGET set to server."""
    readme = (NODE_DIR / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("node cli.js ") and flag in line)
    _, *args = shlex.split(line)
    return subprocess.run(
        [node, *args],
        cwd=NODE_DIR,
        env={**os.environ, "BRAID_TARGET": server.target},
        capture_output=True,
        text=True,
        timeout=STREAM_TIMEOUT_S,
    )


def test_cli_streams_a_generation(node, smol):
    result = run_cli(node, smol, "--max-new-tokens", "4", "--stats", "The capital of France is")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert re.search(r"^finish_reason: (MAX_TOKENS|EOS) ", result.stderr, re.M), result.stderr  # by name
    assert "4 generated tokens" in result.stderr or "finish_reason: EOS" in result.stderr


def test_cli_cancel_after_n_tokens_as_the_readme_shows(node, smol):
    before = status(smol)
    result = run_readme_command(node, smol, "--cancel-after")
    assert result.returncode == 0, result.stderr
    assert "[cancelled after 10 tokens]" in result.stderr
    wait_for(lambda: cancelled_since(smol, before))


def test_cli_prints_each_tokens_logprob_and_top_list(node, smol):
    result = run_cli(
        node, smol, "--max-new-tokens", "3", "--ignore-eos", "--top-logprobs", "2", "The capital of France is"
    )
    assert result.returncode == 0, result.stderr
    assert "logprobs: 3 tokens, mean -" in result.stderr
    # "   7042 " Paris"   -0.258  rank 1  top: 7042 -0.258, 260 -2.741": id, text, logprob, rank, top 2
    rows = re.findall(
        r"^ +(\d+) .*? (-?\d+\.\d{3})  rank (\d+)  top: (\d+ -?\d+\.\d{3}), (\d+ -?\d+\.\d{3})$", result.stderr, re.M
    )
    assert len(rows) == 3, result.stderr
    token, logprob, rank, best, _ = rows[0]
    assert rank == "1" and best == f"{token} {logprob}"  # greedy: the top token, first in the top list


def test_cli_prints_n_samples_by_index(node, smol):
    result = run_cli(
        node,
        smol,
        "-n",
        "2",
        "--temperature",
        "0.8",
        "--seed",
        "1",
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--stats",
        "Once upon a time",
    )
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"--- sample 0 ---\n.+\n--- sample 1 ---\n.+\n", result.stdout, re.S), result.stdout
    for index in (0, 1):  # each sample's own final message, seeded seed + index
        assert f"[sample {index}] finish_reason: MAX_TOKENS" in result.stderr
        assert f"seed: {1 + index}" in result.stderr
    assert result.stderr.count("4 generated tokens") == 2


def test_a_bad_request_fails_alike_in_both_clients(node, smol):
    """The server's INVALID_ARGUMENT and its google.rpc.BadRequest: a BadRequestError naming the
    field in Python (Node's library: test/client.test.js), one line from each command line."""
    with smol.client() as client, pytest.raises(BadRequestError) as error:
        client.generate("hello", top_logprobs=50)
    assert (error.value.field, error.value.description) == ("top_logprobs", "50 is more than 20")
    line = "invalid argument: top_logprobs: 50 is more than 20\n"
    assert str(error.value) + "\n" == line
    result = run_cli(node, smol, "--top-logprobs", "50", "hello")
    assert (result.returncode, result.stderr) == (1, f"braid-node: {line}")
    braid_client = Path(sys.executable).parent / "braid-client"
    python = subprocess.run(
        [braid_client, "--target", smol.target, "--top-logprobs", "50", "hello"],
        capture_output=True,
        text=True,
        timeout=STREAM_TIMEOUT_S,
    )
    assert (python.returncode, python.stderr) == (1, f"braid-client: {line}")


def test_cli_constrains_the_output(node, smol):
    chosen = run_readme_command(node, smol, "--choice")  # --choice yes,no --stats
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout in ("yes\n", "no\n"), chosen.stdout
    assert "finish_reason: CONSTRAINT" in chosen.stderr
    digits = run_cli(node, smol, "--regex", "[0-9]{3}", "--stats", "My lucky number is")
    assert digits.returncode == 0, digits.stderr
    assert re.fullmatch(r"[0-9]{3}\n", digits.stdout), digits.stdout
    assert "finish_reason: CONSTRAINT" in digits.stderr
    bad = run_cli(node, smol, "--regex", "(unclosed", "hello")
    assert bad.returncode == 1
    assert bad.stderr.startswith("braid-node: invalid argument: constraint.regex: "), bad.stderr
    assert bad.stderr.count("\n") == 1, bad.stderr  # one line


def test_cli_ctrl_c_cancels_the_stream(node, smol):
    before = status(smol)
    proc = subprocess.Popen(
        cli(node, smol, "--max-new-tokens", "500", "--ignore-eos", "Tell me a long story."),
        cwd=NODE_DIR,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: status(smol).sessions_active == 1)  # streaming now
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        _, stderr = proc.communicate(timeout=STREAM_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "[cancelled]" in stderr
    wait_for(lambda: cancelled_since(smol, before))


def read_some(proc: subprocess.Popen, count: int) -> bytes:
    """At least count bytes of proc's stdout, as they arrive."""
    head = b""
    while len(head) < count:
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, f"stdout ended after {head!r}"
        head += chunk
    return head


@pytest.fixture(scope="module")
def replicas(tiny_dir):
    """Three replicas for the hand-over cases: each case stops the one serving its stream, and the
    next case runs on those left (two cases, three starts instead of four)."""
    started = start_together(
        *[functools.partial(tiny_server, tiny_dir, "--mode", "continuous", "--handover-grace", "0.3", env=SLOW)] * 3
    )
    yield started
    for r in started:
        r.stop()


@pytest.mark.parametrize("stop", ["kill", "handover"])
def test_cli_resumes_on_another_replica_when_one_is_killed_mid_stream(node, replicas, stop):
    """Replicas behind the CLI's --target list (two or three: those the other case left). The
    replica serving a long greedy stream is killed with SIGKILL after some text, or drained with
    SIGTERM, which hands the stream over after --handover-grace (it ends UNAVAILABLE); the CLI goes
    on, on another replica, and prints exactly the text of an unbroken run."""
    replicas = [r for r in replicas if r.proc.poll() is None]
    assert len(replicas) >= 2, "a replica stopped that no case stopped"
    args = ["--max-new-tokens", "300", "--ignore-eos", "--stats", "The lighthouse keeper wrote in his log"]
    proc = subprocess.Popen(
        [node, "cli.js", "--target", ",".join(r.target for r in replicas), *args],
        cwd=NODE_DIR,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        head = read_some(proc, 40)  # some messages in
        (serving,) = [r for r in replicas if status(r).sessions_active == 1]
        serving.proc.kill() if stop == "kill" else serving.proc.send_signal(signal.SIGTERM)
        rest, stderr = proc.communicate(timeout=STREAM_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    serving.proc.wait(STREAM_TIMEOUT_S)  # killed, or drained: gone before the next case
    survivor = next(r for r in replicas if r is not serving)
    unbroken = subprocess.run(
        cli(node, survivor, *args), cwd=NODE_DIR, capture_output=True, timeout=STREAM_TIMEOUT_S
    )  # bytes: the text as printed, "\r" and all
    stderr = stderr.decode()
    assert proc.returncode == 0, stderr
    assert len(re.findall(r"^\[resumed after (UNAVAILABLE|INTERNAL): ", stderr, re.M)) == 1, stderr
    assert "finish_reason: MAX_TOKENS" in stderr and "300 generated tokens" in stderr, stderr
    assert unbroken.returncode == 0, unbroken.stderr
    assert head + rest == unbroken.stdout


def test_the_service_config_is_the_python_clients(node):
    """Both clients balance, retry and keep alive alike: the same service config and channel options."""
    script = "const c = require('./index.js'); console.log(JSON.stringify(c.DEFAULT_CHANNEL_OPTIONS))"
    result = subprocess.run([node, "-e", script], cwd=NODE_DIR, capture_output=True, text=True, check=True, timeout=60)
    options = json.loads(result.stdout)
    assert json.loads(options.pop("grpc.service_config")) == SERVICE_CONFIG
    assert options == {k: v for k, v in DEFAULT_OPTIONS if k != "grpc.service_config"}


def test_both_clients_compute_the_same_route_key(node):
    """docs/deployment.md's routing key, computed by each client for the same requests: prompts and
    chats, salted or not, short and past the 1,024 bytes that count, in several scripts."""
    from braid.client.request import build_request
    from braid.client.routing import route_key

    chat = [
        {"role": "system", "content": "Réponds en une ligne. " * 60},
        {"role": "user", "content": "Où? 🌊"},
        {"role": "assistant", "content": "Ici."},
        {"role": "user", "content": "Et là?"},
    ]
    requests = [
        {"prompt": "The capital of France is"},
        {"prompt": "数" * 500, "cacheSalt": "tenant-b"},
        {"messages": chat},
        {"messages": chat[:2], "cacheSalt": "s"},
        {"messages": [{"role": "user", "content": ""}]},
    ]
    script = (
        "const { routeKey } = require('./index.js');"
        "process.stdout.write(JSON.stringify(JSON.parse(process.argv[1]).map(routeKey)));"
    )
    out = subprocess.run(
        [node, "-e", script, json.dumps(requests)], cwd=NODE_DIR, capture_output=True, text=True, check=True, timeout=60
    ).stdout
    python = [
        route_key(
            build_request(
                r.get("prompt"),
                messages=[(m["role"], m["content"]) for m in r["messages"]] if "messages" in r else None,
                cache_salt=r.get("cacheSalt"),
            )
        )
        for r in requests
    ]
    assert json.loads(out) == python


def test_node_library_suite(node, smol):
    npm = shutil.which("npm")
    result = subprocess.run(
        [npm, "test"],
        cwd=NODE_DIR,
        env={**os.environ, "BRAID_TARGET": smol.target},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The summary lines of node:test's reporters: "# pass 6" (tap) or "ℹ pass 6" (spec).
    counts = dict(re.findall(r"^(?:#|ℹ) (tests|pass|fail|skipped|todo|cancelled) (\d+)$", result.stdout, re.M))
    assert int(counts["tests"]) > 0 and counts["pass"] == counts["tests"], result.stdout  # nothing skipped


def test_npm_pack_ships_the_proto(node, tmp_path):
    """The packed package lists generate.proto and loads it with no repository around it."""
    npm = shutil.which("npm")
    packed = subprocess.run(
        [npm, "pack", "--json", "--pack-destination", str(tmp_path)],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    (package,) = json.loads(packed.stdout)  # what `npm pack --dry-run --json` lists, and the file it wrote
    assert "protos/braid/v1/generate.proto" in [f["path"] for f in package["files"]]
    with tarfile.open(tmp_path / package["filename"]) as tar:
        tar.extractall(tmp_path, filter="data")
    assert not (NODE_DIR / "protos").exists()  # postpack removed the copy
    loads = "const c = require('./package/index.js'); console.log(c.PROTO_DIR); c.loadBraid().GenerateRequest"
    result = subprocess.run(
        [node, "-e", loads],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NODE_PATH": str(NODE_DIR / "node_modules")},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "package" / "protos")
