"""Builds braid-llm-client, generating its braid.v1 stubs from protos/braid/v1/generate.proto.

The stubs are never kept in git: build_py writes them into src/braid/v1 (where `make protos` writes
them too, so an editable install sees them) before the packages are collected, with the command of
the Makefile's $(STUBS) rule (tests/test_client_packaging.py holds the two together). The .proto is
the repository's ../../protos, or the copy an sdist carries in protos/.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PROTO = "braid/v1/generate.proto"
STUBS = HERE / "src"

# What the client needs besides the grpcio and protobuf its stubs need (_stub_runtime).
REQUIRES = [
    "grpcio-health-checking>=1.66",  # grpc.health.v1's stubs, for health()
    "grpcio-status>=1.66",  # google.rpc.Status from a call's trailers, for describe()
    "typing_extensions>=4.6",  # Unpack, for the typed keyword arguments on Python 3.10
]


def proto_root() -> Path:
    """The folder the .proto is found under: an sdist's own protos/, else the repository's."""
    for root in (HERE / "protos", HERE.parent.parent / "protos"):
        if (root / PROTO).is_file():
            return root
    raise FileNotFoundError(f"{PROTO} is neither in {HERE / 'protos'} nor in the repository's protos/")


def protoc_args(root: Path, out: Path) -> list[str]:
    """grpc_tools.protoc's arguments: messages and grpc stubs with mypy-protobuf's typed .pyi, and a
    descriptor set that keeps the .proto's comments (for server reflection)."""
    return [
        "-I", str(root), f"--python_out={out}", f"--mypy_out={out}", f"--grpc_python_out={out}",
        f"--mypy_grpc_out={out}", "--include_source_info",
        f"--descriptor_set_out={out / 'braid' / 'v1' / 'generate.binpb'}", str(root / PROTO),
    ]


def generate_stubs() -> None:
    """Writes braid.v1 into src/: generate_pb2(_grpc).py(i), generate.binpb and py.typed."""
    (STUBS / "braid" / "v1").mkdir(parents=True, exist_ok=True)
    # mypy-protobuf's plugins are found on PATH: pip puts a build environment's scripts there, and
    # a build without isolation finds them beside this interpreter's.
    path = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    if shutil.which("protoc-gen-mypy", path=path) is None:
        sys.exit("protoc-gen-mypy not found: building braid-llm-client needs mypy-protobuf (a build requirement)")
    command = [sys.executable, "-m", "grpc_tools.protoc", *protoc_args(proto_root(), STUBS)]
    subprocess.run(command, check=True, env={**os.environ, "PATH": path})
    (STUBS / "braid" / "v1" / "py.typed").touch()


def _stub_runtime() -> list[str]:
    """The grpcio and protobuf that the grpcio-tools writing the stubs requires: the stubs refuse to
    import under older ones, so the wheel requires the same."""
    return [r for r in metadata.requires("grpcio-tools") or ()
            if re.match(r"(grpcio|protobuf)\b(?![-_.])", r, re.IGNORECASE)]


class BuildPyWithStubs(build_py):
    """build_py that generates braid.v1 as it is set up, not as it runs: egg_info (the metadata and
    its file list) asks it for the packages' files first, and an editable install never runs it."""

    def finalize_options(self) -> None:
        generate_stubs()
        super().finalize_options()


class SdistWithProto(sdist):
    """sdist that carries the .proto, so a wheel can be built from it away from the repository."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        target = Path(base_dir) / "protos" / PROTO
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(proto_root() / PROTO, target)


if __name__ == "__main__":  # as setuptools runs it; tests/test_client_packaging.py imports it
    setup(
        install_requires=[*_stub_runtime(), *REQUIRES],
        cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProto},
    )
