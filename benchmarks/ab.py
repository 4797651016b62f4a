"""A/B: the targets workload (16 requests at once, 30-60-token prompts, 64 new tokens) on braid at an
earlier commit and on this tree, server restarts alternating, in one run. For "no slowdown" checks.

    .venv/bin/python benchmarks/ab.py --before 82e61da [--starts 4] [--mode continuous]

The earlier commit's server/ is checked out into ~/.cache/braid/bench/ab-<commit>, its C kernels
built there, and its server run with that folder first on PYTHONPATH (the client and stubs are this
tree's; the .proto only ever grows, so they talk to any earlier server). Each request gets a fresh
cache_salt: where the server has a prefix cache, it runs but never hits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from transformers import AutoTokenizer

from braid.client import AsyncClient
from braid.server.model.loader import default_cache_dir, resolve
from braid.server.process import BraidProcess

import machine
import workloads

CACHE = Path.home() / ".cache" / "braid" / "bench"


def checkout(commit: str) -> Path:
    """The commit's repository files, with its C kernels built in place."""
    folder = CACHE / f"ab-{commit}"
    if not (folder / "server").exists():
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(machine.REPO), "archive", commit], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=folder, check=True,
                       capture_output=True)
    return folder


async def run_once(target: str, requests: list[workloads.Request]) -> tuple[float, float]:
    """(output tok/s, TTFT p50 s) of all requests sent at once."""
    async with AsyncClient(target) as client:
        async def one(request: workloads.Request) -> tuple[float, int]:
            sent, first, count = time.perf_counter(), 0.0, 0
            async for message in client.stream(request.prompt, max_new_tokens=request.max_new_tokens,
                                               ignore_eos=True, cache_salt=uuid.uuid4().hex):
                if message.token_ids:
                    first = first or time.perf_counter() - sent
                    count += len(message.token_ids)
            return first, count

        start = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in requests))
        return sum(n for _, n in results) / (time.perf_counter() - start), statistics.median(f for f, _ in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the earlier commit")
    parser.add_argument("--starts", type=int, default=4, help="server starts per side (two timed runs each)")
    parser.add_argument("--mode", default="continuous")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve(None, default_cache_dir())[1])
    requests = workloads.PromptMaker(tokenizer).batch(16, 30, 60)
    sides = {"before": {**os.environ, "PYTHONPATH": str(checkout(args.before) / "server")}, "after": None}
    runs: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for _ in range(args.starts):
        for side, env in sides.items():
            server = BraidProcess(["--mode", args.mode, "--max-batch-size", "32", "--threads", str(args.threads),
                                   "--log-level", "warning"], env=env)
            try:
                asyncio.run(run_once(server.target, requests))  # warm-up
                for _ in range(2):
                    runs[side].append(asyncio.run(run_once(server.target, requests)))
            finally:
                server.stop()
            print(side, " ".join(f"{tps:.1f} tok/s, TTFT p50 {ttft:.3f} s;" for tps, ttft in runs[side][-2:]))
    tps = {side: statistics.median(t for t, _ in r) for side, r in runs.items()}
    ttft = {side: statistics.median(f for _, f in r) for side, r in runs.items()}
    print(f"before ({args.before}): {tps['before']:.1f} tok/s, TTFT p50 {ttft['before']:.3f} s")
    print(f"after (this tree):  {tps['after']:.1f} tok/s, TTFT p50 {ttft['after']:.3f} s")
    print(f"after / before: {tps['after'] / tps['before']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
