"""braid's one C extension: the CPU kernels of the decoder (server/braid/server/runner/csrc).

Everything else about the package is in pyproject.toml. The extension is optional: without a C
compiler the install still succeeds and braid runs torch's own kernels instead (slower on a CPU).
"""

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = "server/braid/server/runner/csrc"


class ParallelBuildExt(build_ext):
    """build_ext that compiles an extension's sources at once, one compiler process per CPU:
    setuptools compiles one extension's files one after another (its --parallel is across
    extensions), and braid's one extension is six files, five of them the kernels under an
    instruction set each (a minute on one core, half that on two: the image build and `make install`)."""

    def build_extension(self, ext: Extension) -> None:
        compile_one = self.compiler.compile
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

        def compile_all(sources, *args, **kwargs):
            with ThreadPoolExecutor(max(1, min(jobs, len(sources)))) as pool:
                done = pool.map(lambda source: compile_one([source], *args, **kwargs), sources)
                return [obj for objects in done for obj in objects]

        self.compiler.compile = compile_all
        # setuptools runs each compiler command through `call` (newer) or `spawn` (older, as 77)
        runs = "call" if hasattr(self.compiler, "call") else "spawn"
        if os.environ.get(OBJECT_CACHE):
            setattr(self.compiler, runs, ObjectCache(Path(os.environ[OBJECT_CACHE]), getattr(self.compiler, runs)).run)
        try:
            super().build_extension(ext)
        finally:
            del self.compiler.compile
            vars(self.compiler).pop(runs, None)


# A folder of compiled objects, used only where this variable names one (`make install` and the
# image wheel's test in tests/test_deploy.py do; the image's own build does not): the suite's wheel
# build compiled the five ISA builds again after `make install` had (200 s of CPU on two cores).
OBJECT_CACHE = "BRAID_OBJECT_CACHE"


class ObjectCache:
    """ccache's preprocessor mode around the compiler's commands: an object is keyed by the compiler
    (its version and binary), the whole command but its output path, and the preprocessed source
    (every header's text). A hit copies the object and replays what the compiler wrote to stderr.
    Anything but a compile (the link), a source that does not preprocess (a header missing) and a
    compile that fails run through setuptools' own `run`, which says why and raises as it would."""

    def __init__(self, folder: Path, run) -> None:
        self.folder, self._run = folder, run

    def run(self, cmd: list[str], **kwargs) -> None:
        if "-c" not in cmd or "-o" not in cmd:
            return self._run(cmd, **kwargs)
        at = cmd.index("-o")
        obj, args = cmd[at + 1], cmd[:at] + cmd[at + 2 :]
        preprocessed = subprocess.run(["-E" if arg == "-c" else arg for arg in args], capture_output=True, check=False)
        if preprocessed.returncode != 0:
            return self._run(cmd, **kwargs)
        key = hashlib.sha256(compiler_identity(args[0]) + "\0".join(args).encode() + b"\0" + preprocessed.stdout)
        entry = self.folder / key.hexdigest()
        if not (entry / "object").exists():
            compiled = subprocess.run(cmd, capture_output=True, check=False)
            if compiled.returncode != 0:
                return self._run(cmd, **kwargs)  # again, to fail as setuptools fails
            sys.stderr.buffer.write(compiled.stderr)
            partial = entry.with_name(f"{entry.name}.{os.getpid()}.{threading.get_ident()}")
            partial.mkdir(parents=True)
            shutil.copyfile(obj, partial / "object")
            (partial / "stderr").write_bytes(compiled.stderr)
            try:
                partial.rename(entry)  # whole, or not there: another build may be filling it too
            except OSError:
                shutil.rmtree(partial)
            return None
        sys.stderr.buffer.write((entry / "stderr").read_bytes())
        Path(obj).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(entry / "object", obj)
        return None


@cache
def compiler_identity(compiler: str) -> bytes:
    """The compiler's version and configuration (`-v`), and its driver's and cc1's size and time."""
    version = subprocess.run([compiler, "-v"], capture_output=True, check=False).stderr
    cc1 = subprocess.run([compiler, "-print-prog-name=cc1"], capture_output=True, text=True, check=False).stdout
    stats = [os.stat(path) for path in (shutil.which(compiler), cc1.strip()) if path and os.path.exists(path)]
    return version + repr([(s.st_size, s.st_mtime_ns) for s in stats]).encode()


setup(
    cmdclass={"build_ext": ParallelBuildExt},
    ext_modules=[
        Extension(
            "braid.server.runner._cpu_kernels",
            # The kernels' source is compiled once per instruction set: each isa_*.c file (AVX-512 and AVX2,
            # each with and without VNNI; AVX-512 with VNNI and BF16) includes weights.c, int8.c, gemm.c,
            # bf16.c, elementwise.c, attention.c and decode_step.c under its target.
            sources=[
                f"{CSRC}/{name}.c"
                for name in (
                    "isa_avx512_bf16",
                    "isa_avx512_vnni",
                    "isa_avx512",
                    "isa_avx2_vnni",
                    "isa_avx2",
                    "bindings",
                )
            ],
            depends=[str(path) for path in Path(CSRC).glob("*.[ch]")],
            # Hidden visibility: the kernels call each other across files, and those calls must bind inside
            # this library, never to a same-named symbol (gemm, rope) another loaded library exports.
            # No contraction: a weight is dequantized as d * q + m with each step rounded, as GGUF's
            # reference does, and the sums' fused multiply-adds are written out where they are meant.
            # -g0: no debug information (Python's own flags ask for it): it doubled the compile time
            # and the library's size, and nobody steps through the kernels in a served image.
            extra_compile_args=["-O3", "-g0", "-fopenmp", "-fvisibility=hidden", "-ffp-contract=off"],
            # torch loads its own libgomp.so.1 first; this soname resolves to that same runtime, so the
            # kernels share torch's OpenMP threads instead of starting a second pool.
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ],
)
