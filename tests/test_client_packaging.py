"""The Python client as a user installs it: a wheel built from the repository's files alone (its
braid.v1 stubs are in no file: the build generates them), installed into a fresh virtual environment
that has nothing else, then imported and called.

pip reaches its index (or its cache) for the build's requirements and the client's dependencies.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
CLIENT = REPO / "clients" / "python"

# Run in the fresh environment: a server with a health service and a Stream that refuses its request
# with a google.rpc.BadRequest, called through the client as a user would.
USER_SCRIPT = """
from concurrent import futures

import grpc
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from braid.client import Client, describe
from braid.v1 import generate_pb2_grpc


class Refusing(generate_pb2_grpc.GenerateServicer):
    def Stream(self, request, context):
        violation = error_details_pb2.BadRequest.FieldViolation(field="temperature", description="below 0")
        status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message="temperature: below 0")
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
        context.abort_with_status(rpc_status.to_status(status))


server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
generate_pb2_grpc.add_GenerateServicer_to_server(Refusing(), server)
health_servicer = health.HealthServicer()
health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
with Client(f"127.0.0.1:{port}") as client:
    print(client.health())
    try:
        client.generate("hi", temperature=-1)
    except grpc.RpcError as error:
        print(describe(error))
server.stop(0)
"""


def _run(*command: str | Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def _pip(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return _run(sys.executable, "-m", "pip", *args)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of clients/python, built from a copy of the files git keeps (or would) in it and in protos/."""
    checkout = tmp_path_factory.mktemp("checkout")
    listed = _run(
        "git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "clients/python", "protos"
    ).stdout
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():  # not a file deleted in the working tree
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, checkout / name)
    assert not (checkout / "clients/python/src/braid/v1").exists(), "generated stubs are never in git"
    dist = tmp_path_factory.mktemp("dist")
    _pip("wheel", "--no-deps", "--wheel-dir", dist, checkout / "clients" / "python")
    (built,) = dist.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter of a new virtual environment (no system site-packages) holding only the
    wheel and what it requires."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(root)
    python = root / "bin" / "python"
    _pip("--python", python, "install", wheel)
    return python


def _setup_py() -> ModuleType:
    spec = importlib.util.spec_from_file_location("braid_client_setup", CLIENT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_fresh_venv_imports_the_client_and_its_stubs(fresh_python: Path) -> None:
    _run(fresh_python, "-c", "import braid.client, braid.v1.generate_pb2, braid.v1.generate_pb2_grpc")
    version = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]["version"]
    result = _run(fresh_python.with_name("braid-client"), "--version")
    assert result.stdout == f"braid-client {version}\n"


def test_health_and_error_details_need_nothing_the_client_does_not_require(fresh_python: Path) -> None:
    result = _run(fresh_python, "-c", USER_SCRIPT)
    assert result.stdout == "SERVING\nINVALID_ARGUMENT: temperature: below 0\n  temperature: below 0\n"


def test_the_wheel_requires_the_grpcio_and_protobuf_its_stubs_check(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        messages = archive.read("braid/v1/generate_pb2.py").decode()
        services = archive.read("braid/v1/generate_pb2_grpc.py").decode()
        assert {"braid/v1/generate_pb2.pyi", "braid/v1/generate.binpb", "braid/v1/py.typed"} <= set(archive.namelist())
    requires = re.findall(r"^Requires-Dist: (.+)$", metadata, re.MULTILINE)
    grpc_version = re.search(r"^GRPC_GENERATED_VERSION = '(.+)'$", services, re.MULTILINE).group(1)
    protobuf_version = re.search(r"^# Protobuf Python Version: (\S+)$", messages, re.MULTILINE).group(1)
    assert f"grpcio>={grpc_version}" in requires
    assert any(r.startswith("protobuf") and f">={protobuf_version}" in r for r in requires), requires
    assert {"grpcio-health-checking", "grpcio-status"} <= {re.split(r"[<>=!~ ;]", r)[0] for r in requires}
    assert re.search(r"^Name: braid-llm-client$", metadata, re.MULTILINE)


def test_the_build_generates_stubs_with_the_makefile_command() -> None:
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    proto = re.search(r"^PROTO\s*:?=\s*(\S+)", makefile, re.MULTILINE).group(1)
    (make_line,) = [line for line in makefile.splitlines() if "grpc_tools.protoc" in line]
    make_args = make_line.replace("$(PROTO)", proto).split("grpc_tools.protoc", 1)[1].split()
    setup_args = _setup_py().protoc_args(Path("protos"), Path("clients/python/src"))
    assert sorted(setup_args) == sorted(make_args)


def test_the_server_requires_the_client_by_its_distribution_name() -> None:
    server = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    assert client["name"] in server["dependencies"]
    assert (server["name"], client["name"]) == ("braid-llm-server", "braid-llm-client")  # free names on PyPI
