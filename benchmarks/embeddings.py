"""Embeddings per second on the embedded model: `braid serve` (continuous mode) answering Embed calls
of 1 and of 16 texts of about 100 tokens, one call after another; and the cost to a running stream's
time per output token while embeddings run beside it. llama.cpp's server with --embeddings
(--pooling last, the same GGUF file) beside it when benchmarks/llamacpp.py finds it built.

    .venv/bin/python benchmarks/embeddings.py [--threads 2] [--texts 64] [--repeats 3]

Each text starts differently, so the prefix cache finds nothing to reuse. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import llamacpp
from braid_server import free_port, running, timed

WORDS = (
    "tide harbour lantern copper meadow signal river anchor thunder orchard ledger canvas falcon "
    "granite whisper compass ember lattice quarry velvet beacon cinder marble thistle"
).split()


def texts(count: int, words: int = 75) -> list[str]:
    """`count` distinct texts of about 100 tokens each (the embedded model's tokenizer)."""
    return [f"{i}. " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words)) for i in range(count)]


async def braid_rates(client, inputs: list[str], batch: int, repeats: int) -> float:
    """Median embeddings per second over `repeats` runs, each embedding every input in calls of `batch`."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, len(inputs), batch):
            await client.embed(inputs[i : i + batch])
        rates.append(len(inputs) / (time.perf_counter() - start))
    return statistics.median(rates)


async def tpot_beside(client, inputs: list[str] | None) -> float:
    """A 64-token stream's time per output token (ms), alone or while `inputs` are embedded 16 at a time."""

    async def embed_all() -> None:
        for i in range(0, len(inputs or []), 16):
            await client.embed(inputs[i : i + 16])

    stream = asyncio.create_task(timed(client, "Once upon a time", max_new_tokens=64, ignore_eos=True))
    if inputs:
        await asyncio.sleep(0.2)  # the stream decoding first
        await embed_all()
    timing, _ = await stream
    return 1000 * (timing.last - timing.first) / max(1, timing.num_tokens - 1)


def llama_rates(inputs: list[str], batch: int, repeats: int, threads: int, log: Path) -> float | None:
    llama = llamacpp.find()
    if llama is None:
        return None
    from braid.server.model.loader import embedded_gguf

    port = free_port()
    with llamacpp.running_server(
        llama,
        embedded_gguf(),
        port,
        parallel=batch,
        context=batch * 256,
        threads=threads,
        log_path=log,
        extra_args=["--embeddings", "--pooling", "last", "-ub", "2048", "-b", "2048"],
    ) as (url, _):
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            for i in range(0, len(inputs), batch):
                body = json.dumps({"input": inputs[i : i + batch], "model": "smol"}).encode()
                request = urllib.request.Request(url + "/v1/embeddings", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=300) as response:
                    assert len(json.load(response)["data"]) == len(inputs[i : i + batch])
            rates.append(len(inputs) / (time.perf_counter() - start))
        return statistics.median(rates)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    inputs = texts(args.texts)
    log = Path(tempfile.mkdtemp(prefix="braid-embed-bench-"))
    rows = []
    async with running("continuous", threads=args.threads, max_batch_size=16, log_path=log / "braid.log") as (
        client,
        _,
    ):
        tokens = (await client.embed(inputs[:1])).prompt_tokens
        await braid_rates(client, inputs[:16], 16, 1)  # warm up
        for batch in (1, 16):
            rows.append(
                (
                    f"braid, {batch} text{'s' * (batch > 1)} a call",
                    await braid_rates(client, inputs, batch, args.repeats),
                )
            )
        alone = statistics.median([await tpot_beside(client, None) for _ in range(args.repeats)])
        beside = statistics.median([await tpot_beside(client, inputs) for _ in range(args.repeats)])
    for batch in (1, 16):
        rate = llama_rates(inputs, batch, args.repeats, args.threads, log / f"llama-{batch}.log")
        rows.append((f"llama.cpp --embeddings, {batch} a call", rate))
    print(f"{args.texts} texts of {tokens} tokens, {args.threads} threads, median of {args.repeats}\n")
    print("| server, call | embeddings/s |\n|---|---|")
    for name, rate in rows:
        print(f"| {name} | {'not built' if rate is None else f'{rate:.1f}'} |")
    print(f"\nA 64-token stream's TPOT: {alone:.1f} ms alone, {beside:.1f} ms while the texts are embedded 16 a call")


if __name__ == "__main__":
    asyncio.run(main())
