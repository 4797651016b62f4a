"""The server's torch-free layers under `mypy --strict` ([tool.mypy] in pyproject.toml): the gRPC edge,
the OpenAI front end, what the front ends share, the engine, telemetry, the composition root and the
configuration, and the modules of braid they import (logs, the runner's row types). A type error fails the suite, listed as
mypy writes it.

mypy reads braid.v1 through the stubs mypy-protobuf writes (make protos), as tests/test_client_typing.py
does for the client.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STUBS = REPO / "clients" / "python" / "src" / "braid" / "v1"
# mypy's incremental cache, kept between runs (build/ is neither in git nor in the image): a module
# whose source, options and dependencies are unchanged is not checked again (18 s of CPU -> a few on
# this 2-core machine); one with errors is never cached, so they are reported on every run.
CACHE = REPO / "build" / "mypy-cache" / "server"


def test_the_server_passes_mypy_strict() -> None:
    if not (STUBS / "generate_pb2.pyi").exists():
        pytest.fail("braid.v1 has no typed stubs: `make protos` generates them (delete generate_pb2.py first)")
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(REPO / "pyproject.toml"),
        "--cache-dir",
        str(CACHE),
        "--no-pretty",
        "--no-error-summary",
    ]
    # braid is found through the config's mypy_path alone: mypy keeps quiet about modules it finds on
    # PYTHONPATH, and would not report those braid modules it follows but is not told to check
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=300, check=False)
    errors = [line for line in result.stdout.splitlines() if ": error: " in line]
    assert result.returncode == 0 and not errors, "\n".join(errors) or result.stdout + result.stderr
