"""The same tree served with different flags, server restarts alternating, in one run: by default
--activations int8 against float32 rows on the embedded model, and plain fp32 weights
(--dtype float32 --quantization none), at 16 requests at once and one (ab.py's workload):

    .venv/bin/python benchmarks/activations.py [--starts 3] [--streams 16 1]
    .venv/bin/python benchmarks/activations.py --sides "int8=--activations int8" "fp32=--dtype float32 --quantization none"

Each --sides entry is name=flags. Output tok/s counts every token over the whole run (prefill
included); decode tok/s is each stream's tokens after its first over the time between them, summed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys

from transformers import AutoTokenizer

import workloads
from ab import Run, run_once
from braid.server.model.loader import default_cache_dir, resolve
from braid_server import BraidProcess

SIDES = ["int8=--activations int8", "float32=--activations float32", "fp32=--dtype float32 --quantization none"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", nargs="+", default=SIDES, help="name=flags, one server per side")
    parser.add_argument("--starts", type=int, default=3, help="server starts per side (two timed runs each)")
    parser.add_argument("--streams", nargs="+", type=int, default=[16, 1], help="requests at once")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--flags", default="", help="flags every side gets (e.g. --model FOLDER)")
    args = parser.parse_args()
    sides = dict(side.split("=", 1) for side in args.sides)
    tokenizer = AutoTokenizer.from_pretrained(resolve(None, default_cache_dir())[1])
    requests = workloads.PromptMaker(tokenizer).batch(max(16, *args.streams), 30, 60)  # the first 16: ab.py's
    runs: dict[tuple[str, int], list[Run]] = {(side, n): [] for side in sides for n in args.streams}
    for _ in range(args.starts):
        for side, flags in sides.items():
            server = BraidProcess(
                [
                    *args.flags.split(),
                    *flags.split(),
                    "--mode",
                    "continuous",
                    "--max-batch-size",
                    str(max(32, *args.streams)),
                    "--threads",
                    str(args.threads),
                    "--log-level",
                    "warning",
                ]
            )
            try:
                asyncio.run(run_once(server.target, requests[: max(args.streams)]))  # warm-up
                for n in args.streams:
                    for _ in range(2):
                        runs[side, n].append(asyncio.run(run_once(server.target, requests[:n])))
                    print(
                        side,
                        f"{n} at once:",
                        " ".join(
                            f"{r.output_tps:.1f} tok/s ({r.decode_tps:.1f} decoding);" for r in runs[side, n][-2:]
                        ),
                        flush=True,
                    )
            finally:
                server.stop()
    first = next(iter(sides))
    print(f"\nmedians of {2 * args.starts} runs each; ratios against {first}")
    print("| side | flags | streams | output tok/s | decode tok/s | output / " + first + " |")
    print("|---|---|---:|---:|---:|---:|")
    for n in args.streams:
        median = {side: statistics.median(r.output_tps for r in runs[side, n]) for side in sides}
        for side, flags in sides.items():
            decode = statistics.median(r.decode_tps for r in runs[side, n])
            print(
                f"| {side} | `{flags}` | {n} | {median[side]:.1f} | {decode:.1f} | {median[side] / median[first]:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
