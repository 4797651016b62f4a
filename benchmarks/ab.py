"""A/B: braid at an earlier commit and on this tree, server restarts alternating, in one run. For "no
slowdown" checks, and for what a change gains. By default the targets workload (16 requests at once,
30-60-token prompts, 64 new tokens) on the embedded model:

    .venv/bin/python benchmarks/ab.py --before 82e61da [--starts 4] [--mode continuous]

--model picks other models (each its own series of restarts): `embedded`, a folder, or `qwen3` /
`gemma3` / `opt`, small random models of those families' structure (format_models.py, made once;
OPT's runs through the transformers fallback);
--streams the numbers of requests sent at once (the first N of the 16 prompts), e.g.

    .venv/bin/python benchmarks/ab.py --before 82e61da --model embedded qwen3 gemma3 --streams 1 8

The earlier commit's server/ is checked out into ~/.cache/braid/bench/ab-<commit>, its C kernels
built there, and its server run with that folder first on PYTHONPATH (the client and stubs are this
tree's; the .proto only ever grows, so they talk to any earlier server). Each request gets a fresh
cache_salt: where the server has a prefix cache, it runs but never hits. Output tok/s counts every
token over the whole run (prefill included); decode tok/s is each stream's tokens after its first
over the time between them, summed over the streams.
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
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from braid.client import AsyncClient
from braid.server.model.loader import default_cache_dir, resolve
from braid_server import BraidProcess

import format_models
import machine
import workloads

CACHE = Path.home() / ".cache" / "braid" / "bench"


def checkout(commit: str) -> Path:
    """The commit's repository files, with its C kernels built in place."""
    folder = CACHE / f"ab-{commit}"
    if not (folder / "server").exists():
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(machine.REPO), "archive", commit], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
        subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace"], cwd=folder, check=True, capture_output=True
        )
    return folder


@dataclass
class Run:
    output_tps: float  # every token over the whole run
    decode_tps: float  # each stream's tokens after its first over the time between them, summed
    ttft: float  # p50, seconds


async def run_once(target: str, requests: list[workloads.Request]) -> Run:
    """All requests sent at once."""
    async with AsyncClient(target) as client:

        async def one(request: workloads.Request) -> tuple[float, float, int]:
            sent, first, last, count = time.perf_counter(), 0.0, 0.0, 0
            async for message in client.stream(
                request.prompt, max_new_tokens=request.max_new_tokens, ignore_eos=True, cache_salt=uuid.uuid4().hex
            ):
                if message.token_ids:
                    last = time.perf_counter() - sent
                    first = first or last
                    count += len(message.token_ids)
            return first, last, count

        start = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in requests))
        elapsed = time.perf_counter() - start
        return Run(
            output_tps=sum(n for _, _, n in results) / elapsed,
            decode_tps=sum((n - 1) / (last - first) for first, last, n in results),
            ttft=statistics.median(first for first, _, _ in results),
        )


def model_folder(name: str) -> Path | None:
    """--model's folder: None for the embedded model."""
    if name == "embedded":
        return None
    if name in format_models.SMALL_MODELS:
        return format_models.small_folder(name, format_models.smollm_fp32_folder())
    return Path(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the earlier commit")
    parser.add_argument(
        "--starts", type=int, default=4, help="server starts per side and model (two timed runs per stream count each)"
    )
    parser.add_argument("--mode", default="continuous")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--model",
        nargs="+",
        default=["embedded"],
        help=f"embedded, {', '.join(format_models.SMALL_MODELS)} or a folder",
    )
    parser.add_argument("--streams", nargs="+", type=int, default=[16], help="requests at once, at most 16")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve(None, default_cache_dir())[1])
    requests = workloads.PromptMaker(tokenizer).batch(16, 30, 60)
    sides = {"before": {**os.environ, "PYTHONPATH": str(checkout(args.before) / "server")}, "after": None}
    table = []
    for model in args.model:
        folder = model_folder(model)
        flags = [] if folder is None else ["--model", str(folder)]
        runs: dict[tuple[str, int], list[Run]] = {(side, n): [] for side in sides for n in args.streams}
        for _ in range(args.starts):
            for side, env in sides.items():
                server = BraidProcess(
                    [
                        *flags,
                        "--mode",
                        args.mode,
                        "--max-batch-size",
                        "32",
                        "--threads",
                        str(args.threads),
                        "--log-level",
                        "warning",
                    ],
                    env=env,
                )
                try:
                    asyncio.run(run_once(server.target, requests[: max(args.streams)]))  # warm-up
                    for n in args.streams:
                        for _ in range(2):
                            runs[side, n].append(asyncio.run(run_once(server.target, requests[:n])))
                        print(
                            model,
                            side,
                            f"{n} at once:",
                            " ".join(
                                f"{r.output_tps:.1f} tok/s ({r.decode_tps:.1f} decoding), TTFT p50 {r.ttft:.3f} s;"
                                for r in runs[side, n][-2:]
                            ),
                            flush=True,
                        )
                finally:
                    server.stop()
        for n in args.streams:
            median = {
                side: Run(
                    *(
                        statistics.median(getattr(r, f) for r in runs[side, n])
                        for f in ("output_tps", "decode_tps", "ttft")
                    )
                )
                for side in sides
            }
            table.append((model, n, median["before"], median["after"]))
    count = 2 * args.starts
    print(f"\nbefore: {args.before}, after: this tree; medians of {count} runs each")
    print(
        "| model | streams | output tok/s before | after | after / before | decode tok/s before | after | "
        "after / before | TTFT p50 before | after |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model, n, before, after in table:
        print(
            f"| {model} | {n} | {before.output_tps:.1f} | {after.output_tps:.1f} | "
            f"{after.output_tps / before.output_tps:.3f} | {before.decode_tps:.1f} | {after.decode_tps:.1f} | "
            f"{after.decode_tps / before.decode_tps:.3f} | {before.ttft:.3f} s | {after.ttft:.3f} s |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
