"""The packed matmul in every weight format, in process: time per call and weight bytes streamed
per second, at 1 row (one decoding session), 16 rows (a decode batch) and 256 rows (a prefill
chunk), on SmolLM2's and Llama-3.2-1B's layer shapes. Where a step's time goes, by format. The
K-quants (Q4_K, Q6_K: the bulk of a Q4_K_M file) are random blocks, which time the same.

    .venv/bin/python benchmarks/gemm_formats.py [--isa avx2] [--repeats 5] [--activations float32,int8,bf16]
    .venv/bin/python benchmarks/gemm_formats.py --threads 1 --cpu-time --rows 16,32 --activations int8

BRAID_KERNELS_ISA (or --isa) picks the instruction-set build; medians of --repeats runs. A quantized
format is timed with each of --activations that has a path for it (float32 rows, or int8 rows and
integer dot products), bf16 with float32 rows and bf16 rows (vdpbf16ps, where the build has it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from gguf import GGMLQuantizationType, quants

from braid.server.model.weights import unpack_gguf
from braid.server.runner.kernels import extension, pick

SHAPES = {
    "SmolLM2 gate_up 576x3072": (576, 3072),
    "SmolLM2 down 1536x576": (1536, 576),
    "1B gate_up 2048x16384": (2048, 16384),
    "1B down 8192x2048": (8192, 2048),
}
FORMATS = ("f32", "bf16", "f16", "q8_0", "q4_1", "q4_0", "q4_k", "q6_k")
# The K-quants' GGUF blocks: bytes per 256 weights, and where its fp16 scales (d, and Q4_K's dmin) lie.
K_QUANT_BLOCKS = {"q4_k": (144, (0, 2)), "q6_k": (210, (208,))}


def matrix(fmt: str, k: int, n: int):
    values = torch.randn(n, k)
    if fmt in ("f32", "bf16", "f16"):
        return values.to({"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[fmt])
    if fmt in K_QUANT_BLOCKS:  # gguf-py cannot quantize these: random blocks, their fp16 scales 2^-10
        size, scales = K_QUANT_BLOCKS[fmt]
        raw = torch.randint(0, 256, (n, k // 256, size), dtype=torch.uint8)
        for at in scales:
            raw[..., at : at + 2] = torch.tensor([2**-10], dtype=torch.float16).view(torch.uint8)
        return unpack_gguf(fmt, raw.view(n, -1).numpy())
    return unpack_gguf(fmt, quants.quantize(values.numpy(), GGMLQuantizationType[fmt.upper()]))


CLOCK = time.perf_counter  # --cpu-time: time.process_time (what a loaded machine's other jobs change less)


def seconds_per_call(layer, x: torch.Tensor, repeats: int) -> float:
    layer(x)
    calls = max(3, int(0.2 / max(1e-5, _once(layer, x))))
    times = []
    for _ in range(repeats):
        start = CLOCK()
        for _ in range(calls):
            layer(x)
        times.append((CLOCK() - start) / calls)
    return statistics.median(times)


def _once(layer, x) -> float:
    start = CLOCK()
    layer(x)
    return CLOCK() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", help=f"{extension.BUILDS} (default: BRAID_KERNELS_ISA, else the best)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="1,16,256")
    parser.add_argument("--activations", default="float32,int8,bf16")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated labels of SHAPES")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--threads", type=int, default=0, help="torch's and the kernels' threads (0: torch's default)")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="the process's CPU time per call instead of the wall time (with --threads 1: a build against "
        "another on a shared machine, run alternately in each tree)",
    )
    args = parser.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.isa:
        os.environ[extension.ISA_VARIABLE] = args.isa
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"kernels: {pick.pick_ops(torch.device('cpu'), torch.float32).name}, {torch.get_num_threads()} "
        f"threads; medians of {args.repeats}{' (CPU time)' if args.cpu_time else ''}\n"
    )
    print("| shape | format | activations | MB | " + " | ".join(f"{m} rows: us, GB/s" for m in rows) + " |")
    print("| --- | --- | --- | ---: | " + " | ".join("---:" for _ in rows) + " |")
    for label in args.shapes.split(","):
        k, n = SHAPES[label]
        for fmt in args.formats.split(","):
            weight = matrix(fmt, k, n)
            paths = {"float32"} | ({"int8"} if fmt.startswith("q") else {"bf16"} if fmt == "bf16" else set())
            for activations in [a for a in args.activations.split(",") if a in paths]:
                layer = pick.pick_ops(torch.device("cpu"), torch.float32, activations=activations).linear(weight, None)
                cells = []
                for m in rows:
                    s = seconds_per_call(layer, torch.randn(m, k), args.repeats)
                    cells.append(f"{s * 1e6:.0f}, {layer.nbytes / s / 1e9:.1f}")
                print(
                    f"| {label} | {fmt} | {activations} | {layer.nbytes / 1e6:.1f} | " + " | ".join(cells) + " |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
