"""braid's one C extension: the CPU kernels of the decoder (server/braid/server/runner/csrc).

Everything else about the package is in pyproject.toml. The extension is optional: without a C
compiler the install still succeeds and braid runs torch's own kernels instead (slower on a CPU).
"""

import os
from concurrent.futures import ThreadPoolExecutor
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
        try:
            super().build_extension(ext)
        finally:
            del self.compiler.compile


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
