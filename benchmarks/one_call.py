"""Passes with several rows of one sequence, in process: a prompt chunk and a speculating row (its
last token and k proposals), in the one C call (csrc/decode_step.c, every row attending by itself
through its page table) against the per-op path with torch's attention for the chunk (a Python call
per kernel: how such passes ran before), beside a plain 1-row decode step. The embedded model on
braid's C kernels, default flags. Each kind timed in turn, wall and CPU time (every thread's), medians.

    .venv/bin/python benchmarks/one_call.py [--repeats 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from braid.server.config import EngineConfig
from braid.server.model.loader import default_cache_dir, load
from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import Row, Sampling

SAMPLING = Sampling()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prompts", default="64,512", help="prompt chunk lengths to time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner.build(EngineConfig(threads=args.threads), load(None, default_cache_dir()))
    runner.governor = None  # the threads stay --threads: the kinds compare on the same
    decoder, page = runner.decoder, runner.page_size
    context = [(i * 7919) % 40000 + 100 for i in range(200)]
    pages = list(range(-(-(len(context) + 16) // page)))
    runner.run(
        [Row(pages=pages, start=0, token_ids=context, sample=False, sampling=SAMPLING, rng=None, is_prompt=True)]
    )
    kinds = {
        "decode step, 1 row": Row(
            pages=pages, start=len(context), token_ids=[5], sample=True, sampling=SAMPLING, rng=None
        ),
        "speculating row, k = 4": Row(
            pages=pages,
            start=len(context),
            token_ids=[5, 6, 7, 8, 9],
            sample=True,
            sampling=SAMPLING,
            rng=None,
            num_proposals=4,
        ),
    }
    base = len(pages)
    for n in (int(p) for p in args.prompts.split(",")):
        chunk_pages = list(range(base, base + -(-n // page)))
        kinds[f"prompt chunk, {n} tokens"] = Row(
            pages=chunk_pages,
            start=0,
            token_ids=context[:1] * n,
            sample=True,
            sampling=SAMPLING,
            rng=None,
            is_prompt=True,
        )
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for repeat in range(args.repeats + 1):  # the first a warm-up
        for name, row in kinds.items():
            for one_call in (True, False):
                decoder.one_call = decoder.fused_attention = one_call  # off: per op, torch's attention
                wall, cpu = time.perf_counter(), time.process_time()
                runner.run([row])
                if repeat:
                    times.setdefault((name, one_call), []).append(
                        (time.perf_counter() - wall, time.process_time() - cpu)
                    )
    decoder.one_call = decoder.fused_attention = True
    print(f"{args.threads} threads, medians of {args.repeats} (ms: wall / CPU)\n")
    print("| pass | one C call | per op, torch's attention | per op / one call (wall) |")
    print("|---|---:|---:|---:|")
    for name in kinds:
        one, per_op = (
            [statistics.median(t[i] for t in times[name, flag]) * 1000 for i in (0, 1)] for flag in (True, False)
        )
        print(
            f"| {name} | {one[0]:.1f} / {one[1]:.1f} | {per_op[0]:.1f} / {per_op[1]:.1f} | {per_op[0] / one[0]:.2f}x |"
        )


if __name__ == "__main__":
    main()
