"""Embeddings per second on the embedded model: `braid serve` (continuous mode) answering Embed calls
of 1 and of 16 texts of about 100 tokens, one call after another; and the cost to a running stream's
time per output token while embeddings run beside it. llama.cpp's server with --embeddings
(--pooling last, the same GGUF file) beside it when benchmarks/llamacpp.py finds it built: both
servers run at once, and each repeat measures one then the other, the order swapped every repeat,
so that a shared machine's drift hits both; medians.

    .venv/bin/python benchmarks/embeddings.py [--threads 2] [--texts 64] [--repeats 3] [--calls 1,16]

Each text starts differently, so the prefix cache finds nothing to reuse. The table is printed and
written to docs/benchmarks.md (section "Embeddings against llama.cpp"; --no-write leaves the file).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import contextlib
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import llamacpp
import report
from braid_server import free_port, running, timed

HEADING = "## Embeddings against llama.cpp (benchmarks/embeddings.py)"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"

WORDS = (
    "tide harbour lantern copper meadow signal river anchor thunder orchard ledger canvas falcon "
    "granite whisper compass ember lattice quarry velvet beacon cinder marble thistle"
).split()


def texts(count: int, start: int = 0, words: int = 75) -> list[str]:
    """`count` distinct texts of about 100 tokens each (the embedded model's tokenizer), numbered from
    `start`: each measurement takes its own, since braid's prefix cache would serve a text embedded
    before (last-token pooling reads it) and the figure would be the cache's, not the model's."""
    return [
        f"{i}. " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words))
        for i in range(start, start + count)
    ]


async def braid_rate(client, inputs: list[str], batch: int) -> float:
    """Embeddings per second, every input embedded in calls of `batch`, one call after another."""
    start = time.perf_counter()
    for i in range(0, len(inputs), batch):
        await client.embed(inputs[i : i + batch])
    return len(inputs) / (time.perf_counter() - start)


def llama_rate(url: str, inputs: list[str], batch: int) -> float:
    """As braid_rate, through llama-server's /v1/embeddings."""
    start = time.perf_counter()
    for i in range(0, len(inputs), batch):
        body = json.dumps({"input": inputs[i : i + batch], "model": "smol"}).encode()
        request = urllib.request.Request(url + "/v1/embeddings", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            assert len(json.load(response)["data"]) == len(inputs[i : i + batch])
    return len(inputs) / (time.perf_counter() - start)


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


@contextlib.contextmanager
def llama_server(threads: int, log: Path):
    """llama-server --embeddings on the embedded GGUF, 16 slots; yields its URL, or None if not built."""
    llama = llamacpp.find()
    if llama is None:
        yield None
        return
    from braid.server.model.loader import embedded_gguf

    with llamacpp.running_server(
        llama,
        embedded_gguf(),
        free_port(),
        parallel=16,
        context=16 * 256,
        threads=threads,
        log_path=log,
        extra_args=["--embeddings", "--pooling", "last", "-ub", "2048", "-b", "2048"],
    ) as (url, _):
        yield url


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", default="1,16", help="texts per call, each size measured")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave docs/benchmarks.md")
    args = parser.parse_args()
    inputs = texts(args.texts)
    fresh = itertools.count(1)  # each measurement's own texts: texts(args.texts, next(fresh) * args.texts)
    calls = [int(n) for n in args.calls.split(",")]
    log = Path(tempfile.mkdtemp(prefix="braid-embed-bench-"))
    rates: dict[str, list[float]] = {}
    async with running("continuous", threads=args.threads, max_batch_size=16, log_path=log / "braid.log") as (
        client,
        _,
    ):
        tokens = (await client.embed(inputs[:1])).prompt_tokens
        await braid_rate(client, inputs[:16], 16)  # warm up
        with llama_server(args.threads, log / "llama.log") as url:
            if url is not None:
                await asyncio.to_thread(llama_rate, url, inputs[:16], 16)
            for repeat in range(args.repeats):
                for batch in calls:
                    servers = ["braid", "llama.cpp"] if url is not None else ["braid"]
                    for server in servers[:: 1 if repeat % 2 == 0 else -1]:
                        new = texts(args.texts, next(fresh) * args.texts)
                        rate = (
                            await braid_rate(client, new, batch)
                            if server == "braid"
                            else await asyncio.to_thread(llama_rate, url, new, batch)
                        )
                        rates.setdefault(f"{server}, {batch} text{'s' * (batch > 1)} a call", []).append(rate)
                        print(f"repeat {repeat + 1}: {server}, {batch} a call: {rate:.2f}/s", flush=True)
        alone = statistics.median([await tpot_beside(client, None) for _ in range(args.repeats)])
        beside = statistics.median(
            [await tpot_beside(client, texts(args.texts, next(fresh) * args.texts)) for _ in range(args.repeats)]
        )
    rows = sorted(rates.items(), key=lambda item: (int(item[0].split(", ")[1].split()[0]), item[0]))
    lines = [
        HEADING,
        "",
        f"`benchmarks/embeddings.py --threads {args.threads} --texts {args.texts} --repeats {args.repeats} "
        f"--calls {args.calls}` ({time.strftime('%Y-%m-%d')}): the embedded model, {args.texts} distinct texts "
        f"of {tokens} tokens (new ones for every measurement: no prefix-cache hits), {args.threads} threads each; braid in continuous mode over gRPC `Embed`, "
        f"llama.cpp's `llama-server --embeddings --pooling last` on the same GGUF over `/v1/embeddings` (both "
        f"last-token pooling, L2-normalised), both servers up at once and measured in turn, the order swapped "
        f"each repeat; calls one after another; medians of {args.repeats} (range in brackets).",
        "",
        "| server, call | embeddings/s |",
        "|---|---:|",
        *(f"| {name} | {statistics.median(r):.2f} [{min(r):.2f}-{max(r):.2f}] |" for name, r in rows),
        "",
        f"A 64-token stream's TPOT: {alone:.1f} ms alone, {beside:.1f} ms while the texts are embedded 16 a call.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        report.write_section(DOCS, HEADING, text)


if __name__ == "__main__":
    asyncio.run(main())
