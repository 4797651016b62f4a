"""What the generation features cost (issue 14), one run on one machine:

1. logprobs: 16 streams at once (30-60-token prompts, 64 new tokens), without and with
   top_logprobs=5: output tok/s, medians of --repeats runs, interleaved.
2. n samples: one 500-token prompt with n=8 against n=1 (8 new tokens each): the time to the
   first token, medians of --repeats runs, each with a fresh cache_salt (nothing cached before).

    .venv/bin/python benchmarks/features.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid

from transformers import AutoTokenizer

from braid.client import AsyncClient
from braid.server.model.loader import default_cache_dir, resolve
from braid_server import BraidProcess

import workloads


async def tokens_per_second(client: AsyncClient, requests: list[workloads.Request], **extra) -> float:
    async def one(request: workloads.Request) -> int:
        count = 0
        async for message in client.stream(
            request.prompt, max_new_tokens=64, ignore_eos=True, cache_salt=uuid.uuid4().hex, **extra
        ):
            count += len(message.token_ids)
        return count

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(r) for r in requests))
    return sum(counts) / (time.perf_counter() - start)


async def first_tokens(client: AsyncClient, prompt: str, n: int) -> float:
    """Seconds from sending to the first token of the last of the n samples to get one."""
    start, firsts = time.perf_counter(), {}
    async for message in client.stream(
        prompt, n=n, max_new_tokens=8, ignore_eos=True, temperature=1.0, cache_salt=uuid.uuid4().hex
    ):
        if message.token_ids and message.index not in firsts:
            firsts[message.index] = time.perf_counter() - start
    return max(firsts.values())


async def main(args: argparse.Namespace) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve(None, default_cache_dir())[1])
    maker = workloads.PromptMaker(tokenizer)
    requests, long_prompt = maker.batch(16, 30, 60), maker.prompt(500).prompt
    server = BraidProcess(["--mode", "continuous", "--threads", str(args.threads), "--log-level", "warning"])
    try:
        async with AsyncClient(server.target) as client:
            await tokens_per_second(client, requests[:4])  # warm-up
            plain, with_logprobs, one, eight = [], [], [], []
            for _ in range(args.repeats):
                plain.append(await tokens_per_second(client, requests))
                with_logprobs.append(await tokens_per_second(client, requests, logprobs=True, top_logprobs=5))
                one.append(await first_tokens(client, long_prompt, 1))
                eight.append(await first_tokens(client, long_prompt, 8))
    finally:
        server.stop()
    a, b = statistics.median(plain), statistics.median(with_logprobs)
    c, d = statistics.median(one), statistics.median(eight)
    print(f"16 streams, output tok/s: {a:.1f} without logprobs, {b:.1f} with top_logprobs=5 ({b / a:.3f}x)")
    print(
        f"500-token prompt, time to the first token of every sample: n=1 {c * 1000:.0f} ms, "
        f"n=8 {d * 1000:.0f} ms ({d / c:.2f}x)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    asyncio.run(main(parser.parse_args()))
