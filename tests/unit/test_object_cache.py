"""setup.py's object cache (BRAID_OBJECT_CACHE): the image wheel's test (tests/test_deploy.py) takes
its kernels' objects from it where `make install` compiled the same thing. An object is reused only
for the same preprocessed source, command and compiler; what the compiler said is said again; a
source whose header is missing still fails; the link runs as it would."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPILER = shutil.which("gcc") or shutil.which("cc")
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler: the kernels are not built either")


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module, its setup() call not run."""
    spec = importlib.util.spec_from_file_location("braid_setup_py", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    with mock.patch("setuptools.setup"):
        spec.loader.exec_module(module)
    return module


class Run:
    """setuptools' way to run a compiler command (`call`, or `spawn`), counting the commands it ran."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def __call__(self, cmd: list[str], **kwargs) -> None:
        self.commands.append(cmd)
        subprocess.run(cmd, check=True)


def compile_command(source: Path, obj: Path) -> list[str]:
    return [COMPILER, "-O1", "-Wall", "-I", str(source.parent), "-c", str(source), "-o", str(obj)]


def test_an_object_is_reused_only_for_the_same_source_and_command(setup_py, tmp_path, capfd):
    (tmp_path / "value.h").write_text("#define VALUE 1\n")
    source = tmp_path / "unit.c"
    source.write_text('#include "value.h"\nint value(void) { int unused; return VALUE; }\n')
    run = Run()
    cache = setup_py.ObjectCache(tmp_path / "cache", run)
    cache.run(compile_command(source, tmp_path / "first.o"))
    compiled = capfd.readouterr().err
    assert "unused" in compiled  # -Wall's warning, from the compile itself

    cache.run(compile_command(source, tmp_path / "out" / "second.o"))  # another output path: a hit
    assert (tmp_path / "out" / "second.o").read_bytes() == (tmp_path / "first.o").read_bytes()
    assert capfd.readouterr().err == compiled  # the warning said again
    assert len(list((tmp_path / "cache").iterdir())) == 1

    (tmp_path / "value.h").write_text("#define VALUE 2\n")  # a header's text: a miss
    cache.run(compile_command(source, tmp_path / "third.o"))
    cache.run([*compile_command(source, tmp_path / "fourth.o"), "-O2"])  # the command: a miss
    assert len(list((tmp_path / "cache").iterdir())) == 3
    assert run.commands == []  # compiles run by the cache itself, to keep their stderr


@pytest.mark.parametrize(
    "text",
    [
        '#include "absent.h"\nint value(void) { return 1; }\n',  # a header the build lacks: no preprocessing
        "int value(void) { return undeclared; }\n",  # preprocessed, then the compile fails
    ],
)
def test_a_failing_source_fails_as_without_the_cache_and_is_never_cached(setup_py, tmp_path, text):
    source = tmp_path / "unit.c"
    source.write_text(text)
    run = Run()
    with pytest.raises(subprocess.CalledProcessError):
        setup_py.ObjectCache(tmp_path / "cache", run).run(compile_command(source, tmp_path / "unit.o"))
    assert len(run.commands) == 1  # run by setuptools' own way, which says why and raises
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_the_link_runs_as_it_would(setup_py, tmp_path):
    source = tmp_path / "unit.c"
    source.write_text("int main(void) { return 0; }\n")
    run = Run()
    cache = setup_py.ObjectCache(tmp_path / "cache", run)
    cache.run(compile_command(source, tmp_path / "unit.o"))
    cache.run([COMPILER, str(tmp_path / "unit.o"), "-o", str(tmp_path / "unit")])
    assert run.commands == [[COMPILER, str(tmp_path / "unit.o"), "-o", str(tmp_path / "unit")]]
    assert subprocess.run([str(tmp_path / "unit")], check=False).returncode == 0


def test_setuptools_compiles_through_the_cache_where_the_variable_names_one(setup_py, tmp_path, monkeypatch):
    """setup.py's build_ext hooks the method this setuptools runs its compiles with (`call`; `spawn`
    was hooked first, and nothing was ever cached): one entry per source, the same for a second build."""
    from setuptools import Distribution, Extension

    (tmp_path / "tiny.c").write_text(
        '#include <Python.h>\nstatic struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "tiny"};\n'
        "PyMODINIT_FUNC PyInit_tiny(void) { return PyModule_Create(&def); }\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(setup_py.OBJECT_CACHE, str(tmp_path / "cache"))
    for build in ("first", "second"):
        dist = Distribution(
            {"ext_modules": [Extension("tiny", ["tiny.c"])], "cmdclass": {"build_ext": setup_py.ParallelBuildExt}}
        )
        command = dist.get_command_obj("build_ext")
        command.build_lib, command.build_temp = f"{build}/lib", f"{build}/temp"
        dist.run_command("build_ext")
        assert len(list((tmp_path / "cache").iterdir())) == 1
        assert list((tmp_path / build / "lib").glob("tiny*.so"))
