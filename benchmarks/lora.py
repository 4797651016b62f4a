"""What LoRA adapters cost (issue 30), braid against llama.cpp's --lora, one run on one machine, the
embedded model (SmolLM2-135M, Q4_1 GGUF) on the CPU:

1. 16 streams at once (30-60-token prompts, 64 new tokens each), 4 of them on each of 4 rank-16
   adapters (every projection: q, k, v, o, gate, up, down), against the same 16 with no adapter;
2. 1 stream with one of those adapters, against 1 with none.

Output tok/s, medians of --repeats runs; in each repeat the four kinds in turn, and each kind on
every system back to back, the systems' order reversed every other repeat (A B, B A: paired under
the same load). Every prompt is computed in full (braid: a fresh cache_salt; llama.cpp:
cache_prompt off). The adapters are random, made by PEFT (tests/lora_files.py), saved in float32 or
(--adapter-dtype bfloat16) in bf16, as an adapter trained in bf16 is (braid's C step reads those in
half the bytes), and written as GGUF LoRA files as llama.cpp's convert_lora_to_gguf.py writes them
(lora_files.write_gguf_adapter, in the same type): both systems load the same .gguf files.

braid: one server with the four adapters (--lora NAME=file.gguf), each request naming its own.
llama.cpp (llamacpp.py finds llama-server; --no-llama-cpp leaves it out): one llama-server with
`--lora-init-without-apply --lora a.gguf,b.gguf,...`, each request its adapter by
`"lora": [{"id": i, "scale": 1.0}]`, and one llama-server with none for the kinds without; 16
slots each.

    .venv/bin/python benchmarks/lora.py [--repeats 5] [--threads N] [--adapter-dtype bfloat16] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

import braid_server
import llamacpp
import workloads
from braid.client import AsyncClient
from braid.server.model.loader import default_cache_dir, embedded_gguf, resolve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from lora_files import make_adapter, write_gguf_adapter  # noqa: E402

NUM_ADAPTERS, RANK = 4, 16
# kind -> (streams, how many adapters they spread over: 0 none)
KINDS = {
    "16 streams, no adapter": (16, 0),
    "16 streams, 4 adapters": (16, NUM_ADAPTERS),
    "1 stream, no adapter": (1, 0),
    "1 stream, an adapter": (1, 1),
}
SLOTS = 16  # llama-server's --parallel: the most streams of a kind


class Braid:
    def __init__(self, client: AsyncClient, names: list[str]) -> None:
        self.client, self.names = client, names

    async def tokens_per_second(self, requests: list[workloads.Request], adapters: int) -> float:
        """All the requests at once, request i with adapter i % adapters (none where 0)."""

        async def one(i: int, request: workloads.Request) -> int:
            count = 0
            async for message in self.client.stream(
                request.prompt,
                max_new_tokens=request.max_new_tokens,
                ignore_eos=True,
                cache_salt=uuid.uuid4().hex,
                adapter=self.names[i % adapters] if adapters else "",
            ):
                count += len(message.token_ids)
            return count

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        return sum(counts) / (time.perf_counter() - start)


class LlamaCpp:
    def __init__(self, http, plain_url: str, lora_url: str) -> None:
        self.http, self.plain_url, self.lora_url = http, plain_url, lora_url
        self.plain = llamacpp.sender(http, plain_url)
        self.with_lora = [llamacpp.sender(http, lora_url, lora=[{"id": i, "scale": 1.0}]) for i in range(NUM_ADAPTERS)]

    async def tokens_per_second(self, requests: list[workloads.Request], adapters: int) -> float:
        """As Braid's: the server with the adapters for requests that use one, the other for those without."""
        sends = self.with_lora[:adapters] or [self.plain]
        start = time.perf_counter()
        timings = await asyncio.gather(*(sends[i % len(sends)](r) for i, r in enumerate(requests)))
        return sum(t.num_tokens for t in timings) / (time.perf_counter() - start)


async def start_llama_cpp(stack: contextlib.AsyncExitStack, ggufs: list[Path], threads: int, log_dir: Path) -> LlamaCpp:
    """The two llama-servers on the embedded GGUF: with the adapters (applied per request), and without."""
    import httpx

    llama = llamacpp.find()
    if llama is None:
        raise SystemExit("no llama-server found (benchmarks/llamacpp.py builds one); --no-llama-cpp leaves it out")
    # a connection per request: one reused just after llama-server closed it failed (speculative.py)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    http = await stack.enter_async_context(httpx.AsyncClient(timeout=900, limits=limits))
    urls = []
    for name, extra in (
        ("plain", []),
        ("lora", ["--lora-init-without-apply", "--lora", ",".join(str(g) for g in ggufs)]),
    ):
        url, _ = await asyncio.to_thread(
            stack.enter_context,
            llamacpp.running_server(
                llama,
                embedded_gguf(),
                braid_server.free_port(),
                parallel=SLOTS,
                context=llamacpp.context_size(SLOTS, 128),
                threads=threads,
                log_path=log_dir / f"llama-cpp-{name}.log",
                extra_args=extra,
            ),
        )
        urls.append(url)
    print(f"llama.cpp: {llama.build_info}", file=sys.stderr)
    return LlamaCpp(http, *urls)


async def check_llama_cpp_applies(system: LlamaCpp, request: workloads.Request) -> None:
    """An adapter's greedy tokens are not the base model's on llama-server: it did load and apply it.
    At scale 10: the random adapters (entries N(0, 0.02)) move few tokens at their own scale."""
    tokens = []
    for url, lora in ((system.plain_url, []), (system.lora_url, [{"id": 0, "scale": 10.0}])):
        body = {"prompt": request.prompt_ids, "n_predict": 16, "temperature": 0, "return_tokens": True, "lora": lora}
        response = await system.http.post(url + "/completion", json=body)
        response.raise_for_status()
        tokens.append(response.json()["tokens"])
    if tokens[0] == tokens[1]:
        raise RuntimeError("llama.cpp: the same greedy tokens with the adapter as without: it was not applied")


async def main(args: argparse.Namespace) -> None:
    base = Path(resolve(None, default_cache_dir())[1])
    tokenizer = AutoTokenizer.from_pretrained(base)
    requests = workloads.PromptMaker(tokenizer).batch(16, 30, 60)  # max_new_tokens: 64 (workloads.NEW_TOKENS)
    names = [f"tenant{i}" for i in range(NUM_ADAPTERS)]
    outtype = {"float32": "f32", "bfloat16": "bf16"}[args.adapter_dtype]
    # the adapters (about 40 MB each, as PEFT's folder and as GGUF) and the servers' logs: gone at the end
    work = tempfile.TemporaryDirectory(prefix="braid-lora-bench-")
    log_dir = Path(work.name)
    config = AutoConfig.from_pretrained(base)
    ggufs = [
        write_gguf_adapter(
            make_adapter(base, log_dir / name, rank=RANK, seed=i, spread=0.02, dtype=args.adapter_dtype),
            config,
            log_dir / f"{name}.gguf",
            outtype,
        )
        for i, name in enumerate(names)
    ]
    async with contextlib.AsyncExitStack() as stack:
        client, _ = await stack.enter_async_context(
            braid_server.running(
                "continuous",
                threads=args.threads,
                max_batch_size=16,
                log_path=log_dir / "braid.log",
                extra_args=[
                    "--max-loras",
                    str(NUM_ADAPTERS),
                    *(a for name, g in zip(names, ggufs) for a in ("--lora", f"{name}={g}")),
                ],
            )
        )
        systems: dict = {"braid": Braid(client, names)}
        if args.llama_cpp:
            systems["llama.cpp"] = await start_llama_cpp(stack, ggufs, args.threads, log_dir)
            await check_llama_cpp_applies(systems["llama.cpp"], requests[0])
        for system in systems.values():  # warm-up
            for streams, adapters in KINDS.values():
                await system.tokens_per_second(requests[: min(streams, 4)], adapters)
        runs: dict[tuple[str, str], list[float]] = {}
        for repeat in range(args.repeats):
            for kind, (streams, adapters) in KINDS.items():
                order = list(systems.items()) if repeat % 2 == 0 else list(systems.items())[::-1]
                for name, system in order:
                    tps = await system.tokens_per_second(requests[:streams], adapters)
                    runs.setdefault((name, kind), []).append(tps)
        info = await client.model_info()
    work.cleanup()
    report(args, info, systems, runs)


def report(args, info, systems: dict, runs: dict[tuple[str, str], list[float]]) -> None:
    medians = {key: statistics.median(values) for key, values in runs.items()}
    print(
        f"model {info.model_name} ({info.kernels}, {info.threads} threads), {NUM_ADAPTERS} GGUF adapters of "
        f"rank {RANK} in {args.adapter_dtype}; output tok/s, median of {args.repeats} (the runs):"
    )
    print(f"| system | {' | '.join(KINDS)} | 16 streams: 4 adapters / none | 1 stream: an adapter / none |")
    print(f"|---|{'---:|' * (len(KINDS) + 2)}")
    for name in systems:
        cells = [f"{medians[name, k]:.1f} ({', '.join(f'{v:.1f}' for v in runs[name, k])})" for k in KINDS]
        many = medians[name, "16 streams, 4 adapters"] / medians[name, "16 streams, no adapter"]
        one = medians[name, "1 stream, an adapter"] / medians[name, "1 stream, no adapter"]
        print(f"| {name} | {' | '.join(cells)} | {many:.3f} | {one:.3f} |")
    if len(systems) > 1:
        # each repeat's braid / llama.cpp, the two measured back to back
        paired = {
            k: statistics.median(ours / theirs for ours, theirs in zip(runs["braid", k], runs["llama.cpp", k]))
            for k in KINDS
        }
        print(
            "braid / llama.cpp, median of the paired repeats: " + "; ".join(f"{k}: {v:.2f}x" for k, v in paired.items())
        )


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
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false", help="braid only")
    asyncio.run(main(parser.parse_args()))
