"""braid's one C extension: the AVX-512 kernels of the CPU decode step (server/braid/server/runner/csrc).

Everything else about the package is in pyproject.toml. The extension is optional: without a C
compiler the install still succeeds and braid runs torch's own kernels instead (slower on a CPU).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "braid.server.runner._cpu_kernels",
    sources=[f"server/braid/server/runner/csrc/{name}.c"
             for name in ("gemm", "elementwise", "attention", "decode_step", "bindings")],
    depends=["server/braid/server/runner/csrc/kernels.h"],
    # Hidden visibility: the kernels call each other across files, and those calls must bind inside
    # this library, never to a same-named symbol (gemm, rope) another loaded library exports.
    extra_compile_args=["-O3", "-fopenmp", "-fvisibility=hidden"],
    # torch loads its own libgomp.so.1 first; this soname resolves to that same runtime, so the
    # kernels share torch's OpenMP threads instead of starting a second pool.
    extra_link_args=["-fopenmp"],
    optional=True,
)])
