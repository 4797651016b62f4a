"""Prefill of long prompts, in process over the runner: distinct prompts of each length, fed in
chunks of --chunk tokens as the engine feeds them, one prompt at a time; prompt tokens per second
(wall, and from the CPU time every thread took: on a shared machine, what the work cost) and where
the time goes. The embedded model on braid's C kernels, default flags (--kv-cache-dtype
to try another cache).

Attention's share: after each prompt, its chunks' attention over the cache it just filled is timed
alone (the kernel the pass runs, csrc/attention.c, on one layer's cache with random queries, times
the layers); the rest of the pass (the linear layers, norms, RoPE, the LM head) is the remainder.

    .venv/bin/python benchmarks/prefill.py [--lengths 512,2048,8000] [--repeats 3] [--threads 2]
    .venv/bin/python benchmarks/prefill.py --kernel   # the attention kernel alone
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from braid.server.config import EngineConfig
from braid.server.model.loader import default_cache_dir, load
from braid.server.runner.kernels.pick import kernels_isa
from braid.server.runner.kernels.step import decode_attention
from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import Row, Sampling

SAMPLING = Sampling()


def prefill(runner: ModelRunner, prompt: list[int], pages: list[int], chunk: int) -> tuple[float, float]:
    """Seconds to prefill the prompt into the pages, chunk by chunk (the last samples): wall, and
    CPU (every thread's: on a shared machine, what the work took whoever else ran)."""
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, len(prompt), chunk):
        ids = prompt[start : start + chunk]
        last = start + len(ids) == len(prompt)
        row = Row(pages=pages, start=start, token_ids=ids, sample=last, sampling=SAMPLING, rng=None, is_prompt=True)
        runner.run([row])
    return time.perf_counter() - wall, time.process_time() - cpu


def attention(
    runner: ModelRunner, length: int, pages: list[int], chunk: int, generator: torch.Generator
) -> tuple[float, float]:
    """Seconds (wall, CPU) the prompt's chunks spend in attention: each chunk's rows over layer 0's
    cache (filled by the prefill), random queries, times the layers."""
    decoder, cache = runner.decoder, runner.cache
    heads, kv_heads, d = decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
    table = torch.tensor(pages, dtype=torch.long)
    wall = cpu = 0.0
    for start in range(0, length, chunk):
        n = min(chunk, length - start)
        qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=generator)
        out = torch.empty(n, heads * d)
        tables, positions = table.expand(n, -1).contiguous(), torch.arange(start, start + n)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        decode_attention(
            qkv,
            heads,
            cache.k[0],
            cache.v[0],
            tables,
            positions,
            out,
            decoder.scale,
            decoder.attn_softcap,
            write=False,
        )
        wall, cpu = wall + time.perf_counter() - wall0, cpu + time.process_time() - cpu0
    return wall * decoder.num_layers, cpu * decoder.num_layers


def kernel_alone(lengths: list[int], chunk: int, repeats: int) -> None:
    """The attention of one chunk of rows ending at each length, alone: the embedded model's heads
    (9 over 3 KV heads of 64), one layer, random caches in fp32 and bf16, one thread; best CPU ms."""
    heads, kv_heads, d, page = 9, 3, 64, 16
    torch.set_num_threads(1)
    print(f"{kernels_isa()} build, one {chunk}-row chunk, one layer, one thread: best of {repeats}, CPU ms\n")
    print("| cache | chunk ending at | ms |")
    print("|---|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for n in lengths:
            pages = -(-n // page)
            k_cache, v_cache = (torch.randn(pages, kv_heads, page, d).to(dtype) for _ in range(2))
            tables, positions = torch.arange(pages).expand(chunk, -1).contiguous(), torch.arange(n - chunk, n)
            qkv, out = torch.randn(chunk, (heads + 2 * kv_heads) * d), torch.empty(chunk, heads * d)
            best = float("inf")
            for _ in range(repeats):
                cpu = time.process_time()
                decode_attention(qkv, heads, k_cache, v_cache, tables, positions, out, d**-0.5, write=False)
                best = min(best, time.process_time() - cpu)
            print(f"| {str(dtype).removeprefix('torch.')} | {n:,} | {best * 1e3:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048,8000", help="prompt lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=EngineConfig.prefill_chunk)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--kernel", action="store_true", help="time the attention kernel alone (kernel_alone)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.kernel:
        kernel_alone(lengths, args.chunk, args.repeats)
        return
    config = EngineConfig(
        threads=args.threads, max_seq_len=max(lengths), kv_cache_memory="2GiB", kv_cache_dtype=args.kv_cache_dtype
    )
    runner = ModelRunner.build(config, load(None, default_cache_dir()))
    runner.governor = None  # the threads stay --threads
    vocab = runner.decoder.vocab_size
    generator = torch.Generator().manual_seed(0)
    page = runner.page_size
    results: dict[int, list[tuple[float, float, float, float]]] = {n: [] for n in lengths}
    prefill(runner, list(range(100, 100 + args.chunk)), list(range(-(-args.chunk // page))), args.chunk)  # warm-up
    for _ in range(args.repeats):
        for n in lengths:
            prompt = torch.randint(100, vocab, (n,), generator=generator).tolist()  # distinct: no prefix shared
            pages = list(range(-(-n // page)))
            results[n].append(
                prefill(runner, prompt, pages, args.chunk) + attention(runner, n, pages, args.chunk, generator)
            )
    print(
        f"{args.threads} threads, chunks of {args.chunk}, {runner.cache.k[0].dtype} cache, medians of {args.repeats}\n"
    )
    print("| prompt tokens | prompt tok/s (wall) | (CPU) | attention, wall (s) | rest (s) | attention share (CPU) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in lengths:
        wall, cpu, attn_wall, attn_cpu = (statistics.median(r[i] for r in results[n]) for i in range(4))
        print(
            f"| {n:,} | {n / wall:.0f} | {n / cpu * args.threads:.0f} | {attn_wall:.2f} | {wall - attn_wall:.2f} "
            f"| {attn_cpu / cpu:.0%} |"
        )


if __name__ == "__main__":
    main()
