"""The Python client as a user installs it: a wheel built from the repository's files alone (its
braid.v1 stubs are in no file: the build generates them), installed into a fresh virtual environment
that has nothing else, then imported and called.

pip builds the wheel and installs it, each in a new virtual environment that holds only what the
wheel's pyproject.toml requires for its build, or what the wheel requires (and what those require,
each at a version its requirement allows), linked from this interpreter's environment: where pip
found them on its index it spent 12 of the module's 16 s of CPU reading pypi.org's lists of grpcio's
and grpcio-tools' thousands of files, and proved no more about the client.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


def _installed(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """This environment's distributions that requirements name, and those that theirs name, each
    at a version its requirement allows (as pip would resolve them, had it none of them to fetch)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    wanted = [(Requirement(text), ("",)) for text in requirements]
    while wanted:
        requirement, extras = wanted.pop()
        if requirement.marker and not any(requirement.marker.evaluate({"extra": e}) for e in extras):
            continue
        try:
            dist = found.get(canonicalize_name(requirement.name)) or importlib.metadata.distribution(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{requirement} is not installed here: `make install-test` installs it")
        assert requirement.specifier.contains(dist.version, prereleases=True), f"{requirement}: {dist.version} here"
        if canonicalize_name(requirement.name) not in found:
            found[canonicalize_name(requirement.name)] = dist
            wanted += [(Requirement(text), ("", *requirement.extras)) for text in dist.requires or ()]
    return list(found.values())


def _environment(root: Path, requirements: list[str]) -> Path:
    """The python of a new virtual environment (no system site-packages) holding only the
    distributions _installed(requirements) gives, each of their files linked, their scripts run by it."""
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(root)
    python = root / "bin" / "python"
    site = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    for dist in _installed(requirements):
        assert dist.files is not None, f"{dist.metadata['Name']} lists no files (no RECORD)"
        for file in dist.files:
            source, target = Path(dist.locate_file(file)), Path(os.path.normpath(site / file))
            if not source.is_file() or not target.is_relative_to(root):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.parent == python.parent:  # a script: its first line names its interpreter
                text = source.read_text()
                target.write_text(f"#!{python}\n{text.split(chr(10), 1)[1]}" if text.startswith("#!") else text)
                target.chmod(0o755)
            else:
                target.symlink_to(source)
    return python


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of clients/python, built from a copy of the files git keeps (or would) in it and in protos/,
    by pip in an environment of its build requirements alone (and on a PATH of that environment's)."""
    checkout = tmp_path_factory.mktemp("checkout")
    listed = _run(
        "git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "clients/python", "protos"
    ).stdout
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():  # not a file deleted in the working tree
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, checkout / name)
    assert not (checkout / "clients/python/src/braid/v1").exists(), "generated stubs are never in git"
    build_requires = tomllib.loads((CLIENT / "pyproject.toml").read_text())["build-system"]["requires"]
    python = _environment(tmp_path_factory.mktemp("build-env"), build_requires)
    dist = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "wheel", "--no-build-isolation", "--no-deps"]
        + ["--wheel-dir", dist, checkout / "clients" / "python"],
        env={**os.environ, "PATH": f"{python.parent}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = dist.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def fresh_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter of a new virtual environment (no system site-packages) holding only the
    wheel, installed by pip, and what it requires."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    python = _environment(tmp_path_factory.mktemp("venv"), re.findall(r"^Requires-Dist: (.+)$", metadata, re.M))
    _pip("--python", python, "install", "--no-index", wheel)  # pip finds what the wheel requires installed
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
