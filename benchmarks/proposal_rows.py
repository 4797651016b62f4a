"""What a verification's proposal rows cost, in process: one sequence with `context` positions in the
cache, its last token and k proposals in one pass (ModelRunner.run, every row attending by itself in
the one C call), for each k, against k = 0 (a plain decode step). The embedded model on braid's C
kernels, default flags. Medians of wall time, each k timed in turn.

    .venv/bin/python benchmarks/proposal_rows.py [--context 150,600] [--proposals 0,1,2,4,5,6,8]
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


def prefilled(runner: ModelRunner, n: int, most_proposals: int) -> tuple[list[int], list[int]]:
    """A sequence of n tokens prefilled into the runner's cache, with pages for most_proposals more:
    (its token ids, its pages)."""
    context = [(i * 7919) % 40000 + 100 for i in range(n)]  # no token repeats nearby
    pages = list(range(-(-(n + most_proposals + 1) // runner.page_size)))
    runner.run(
        [Row(pages=pages, start=0, token_ids=context, sample=False, sampling=SAMPLING, rng=None, is_prompt=True)]
    )
    return context, pages


def verification(context: list[int], pages: list[int], k: int) -> Row:
    """The sequence's last token and k proposals in one row, as a verification runs them."""
    return Row(
        pages=pages,
        start=len(context) - 1,
        token_ids=[context[-1], *(101 + i for i in range(k))],
        sample=True,
        sampling=SAMPLING,
        rng=None,
        is_prompt=False,
        num_proposals=k,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--context", default="150,600", help="positions already in the cache")
    parser.add_argument("--proposals", default="0,1,2,3,4,5,6,7,8", help="values of k to time")
    args = parser.parse_args()
    runner = ModelRunner.build(EngineConfig(threads=args.threads), load(None, default_cache_dir()))
    ks = [int(k) for k in args.proposals.split(",")]
    print(f"{args.threads} threads, ms a pass (median of {args.repeats})")
    print("| context | " + " | ".join(f"k = {k}" for k in ks) + " |")
    print("|---:|" + "---:|" * len(ks))
    for n in (int(c) for c in args.context.split(",")):
        context, pages = prefilled(runner, n, max(ks))
        cells = []
        for k in ks:
            row = verification(context, pages, k)
            for _ in range(5):
                runner.run([row])
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                runner.run([row])
                times.append(time.perf_counter() - started)
            cells.append(f"{statistics.median(times) * 1e3:.2f}")
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
