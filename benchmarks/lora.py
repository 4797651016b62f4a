"""What LoRA adapters cost (issue 30), one run on one machine, the embedded model (SmolLM2-135M,
Q4_1) on the CPU:

1. 16 streams at once (30-60-token prompts, 64 new tokens each), 4 of them on each of 4 rank-16
   adapters (every projection: q, k, v, o, gate, up, down), against the same 16 with no adapter;
2. 1 stream with one of those adapters, against 1 with none.

Output tok/s, medians of --repeats runs, the four kinds interleaved; every prompt with a fresh
cache_salt (nothing cached). The adapters are random, made by PEFT (tests/lora_files.py), saved in
float32 or (--adapter-dtype bfloat16) in bf16, as an adapter trained in bf16 is: braid's C step reads
those in half the bytes.

    .venv/bin/python benchmarks/lora.py [--repeats 5] [--threads N] [--adapter-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from transformers import AutoTokenizer

from braid.client import AsyncClient
from braid.server.model.loader import default_cache_dir, resolve
from braid_server import BraidProcess

import workloads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from lora_files import make_adapter  # noqa: E402

NUM_ADAPTERS, RANK = 4, 16


async def tokens_per_second(client: AsyncClient, requests: list[workloads.Request], adapters: list[str]) -> float:
    """All the requests at once, request i with adapters[i % len(adapters)] ("": none)."""

    async def one(i: int, request: workloads.Request) -> int:
        count = 0
        async for message in client.stream(
            request.prompt,
            max_new_tokens=64,
            ignore_eos=True,
            cache_salt=uuid.uuid4().hex,
            adapter=adapters[i % len(adapters)],
        ):
            count += len(message.token_ids)
        return count

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return sum(counts) / (time.perf_counter() - start)


async def main(args: argparse.Namespace) -> None:
    base = Path(resolve(None, default_cache_dir())[1])
    tokenizer = AutoTokenizer.from_pretrained(base)
    requests = workloads.PromptMaker(tokenizer).batch(16, 30, 60)
    names = [f"tenant{i}" for i in range(NUM_ADAPTERS)]
    with tempfile.TemporaryDirectory(prefix="braid-lora-bench-") as root:
        folders = [
            make_adapter(base, Path(root) / name, rank=RANK, seed=i, spread=0.02, dtype=args.adapter_dtype)
            for i, name in enumerate(names)
        ]
        loras = [arg for name, folder in zip(names, folders) for arg in ("--lora", f"{name}={folder}")]
        server = BraidProcess(
            [
                "--mode",
                "continuous",
                "--max-batch-size",
                "16",
                "--threads",
                str(args.threads),
                "--log-level",
                "warning",
                "--max-loras",
                str(NUM_ADAPTERS),
                *loras,
            ]
        )
        try:
            async with AsyncClient(server.target) as client:
                kinds = {
                    "16 streams, no adapter": (requests, [""]),
                    "16 streams, 4 adapters": (requests, names),
                    "1 stream, no adapter": (requests[:1], [""]),
                    "1 stream, an adapter": (requests[:1], names),
                }
                for batch, adapters in kinds.values():  # warm-up
                    await tokens_per_second(client, batch[:4], adapters)
                runs: dict[str, list[float]] = {kind: [] for kind in kinds}
                for _ in range(args.repeats):
                    for kind, (batch, adapters) in kinds.items():
                        runs[kind].append(await tokens_per_second(client, batch, adapters))
                info = await client.model_info()
        finally:
            server.stop()
    medians = {kind: statistics.median(values) for kind, values in runs.items()}
    print(
        f"model {info.model_name} ({info.kernels}, {info.threads} threads), {len(info.adapters)} adapters of "
        f"rank {RANK} in {args.adapter_dtype}; output tok/s, median of {args.repeats}:"
    )
    for kind, value in medians.items():
        print(f"  {kind}: {value:.1f}  (runs: {', '.join(f'{v:.1f}' for v in runs[kind])})")
    many = medians["16 streams, 4 adapters"] / medians["16 streams, no adapter"]
    one = medians["1 stream, an adapter"] / medians["1 stream, no adapter"]
    print(f"16 streams over 4 adapters: {many:.3f}x no adapter (target 0.8x); 1 stream: {one:.3f}x (target 0.85x)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--adapter-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the dtype the adapters are saved in (bfloat16: the C step reads them in half the bytes)",
    )
    asyncio.run(main(parser.parse_args()))
