"""braid's one C extension: the CPU kernels of the decoder (server/braid/server/runner/csrc).

Everything else about the package is in pyproject.toml. The extension is optional: without a C
compiler the install still succeeds and braid runs torch's own kernels instead (slower on a CPU).
"""

from pathlib import Path

from setuptools import Extension, setup

CSRC = "server/braid/server/runner/csrc"

setup(
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
            extra_compile_args=["-O3", "-fopenmp", "-fvisibility=hidden", "-ffp-contract=off"],
            # torch loads its own libgomp.so.1 first; this soname resolves to that same runtime, so the
            # kernels share torch's OpenMP threads instead of starting a second pool.
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
