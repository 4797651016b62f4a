"""The Python client under `mypy --strict`, as a user's code meets it: keyword arguments typed by
GenerateParams, and the stubs mypy-protobuf writes for braid.v1 (make protos).

tests/data/typed_client.py uses Client, AsyncClient, stream(), generate() and completions() and must
type-check together with the client package itself; tests/data/mistyped_client.py holds mistakes mypy
must report. mypy runs as for Python 3.10, the oldest the client supports.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CLIENT = REPO / "clients" / "python"
DATA = Path(__file__).resolve().parent / "data"

Mypy = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def mypy() -> Mypy:
    """Runs mypy --strict on modules of the client and of tests/data, with an incremental cache kept
    between runs (build/mypy-cache/client, as tests/test_typing.py keeps the server's)."""
    if not (CLIENT / "src" / "braid" / "v1" / "generate_pb2_grpc.pyi").exists():
        pytest.fail("braid.v1 has no typed grpc stubs: `make protos` generates them (delete generate_pb2.py first)")
    cache = REPO / "build" / "mypy-cache" / "client"
    env = {**os.environ, "MYPYPATH": os.pathsep.join([str(CLIENT / "src"), str(DATA)])}

    def run(*modules: str) -> subprocess.CompletedProcess[str]:
        command = [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--python-version",
            "3.10",
            "--config-file",
            str(CLIENT / "pyproject.toml"),
            "--cache-dir",
            str(cache),
            "--no-pretty",
            *modules,
        ]
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=120, check=False)

    return run


def test_the_client_and_an_example_pass_mypy_strict(mypy: Mypy) -> None:
    result = mypy("-p", "braid.client", "-p", "braid.v1", "-m", "typed_client")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mistyped_and_unknown_keywords_are_errors(mypy: Mypy) -> None:
    result = mypy("-m", "mistyped_client")
    source = (DATA / "mistyped_client.py").read_text().splitlines()
    expected = {
        number: match.group(1) for number, line in enumerate(source, 1) if (match := re.search(r"# error: (.+)$", line))
    }
    errors = {
        int(match.group(1)): match.group(2)
        for match in re.finditer(r"^\S*mistyped_client\.py:(\d+): error: (.+)$", result.stdout, re.MULTILINE)
    }
    assert result.returncode == 1 and len(expected) == 5, result.stdout + result.stderr
    assert errors.keys() == expected.keys(), result.stdout
    for number, start in expected.items():
        assert errors[number].startswith(start), (number, errors[number])


TYPED_ERRORS = """
from __future__ import annotations

import grpc
from typing_extensions import assert_type

from braid.client import (BadRequestError, BraidError, Client, OverloadedError, UnavailableError,
                          from_rpc_error)


def run(client: Client) -> float | None:
    try:
        completion = client.generate("Hi", max_new_tokens=4)
        assert_type(completion.finish_reason, str)
        with client.stream("Hi") as generation:
            for _ in generation:
                pass
        assert_type(generation.finish_reason, str | None)
    except BadRequestError as error:
        assert_type(error.field, str | None)
        assert_type(error.description, str)
        assert_type(error.violations, list[tuple[str, str]])
    except OverloadedError as error:
        return error.retry_after
    except UnavailableError as error:
        assert_type(error.code(), grpc.StatusCode)
        assert_type(error.details(), str | None)
        print(dict(error.trailing_metadata()), error.status)
    except grpc.RpcError as error:
        assert_type(from_rpc_error(error), BraidError)
    return None
"""


def test_typed_errors_pass_mypy_strict(mypy: Mypy, tmp_path: Path) -> None:
    """A user's code catching the client's errors by kind and reading what each one carries."""
    example = tmp_path / "typed_errors.py"
    example.write_text(TYPED_ERRORS)
    result = mypy(str(example))
    assert result.returncode == 0, result.stdout + result.stderr
