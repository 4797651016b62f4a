"""Prefill of long prompts, in process over the runner: distinct prompts of each length, fed in
chunks of --chunk tokens as the engine feeds them, one prompt at a time; prompt tokens per second
(wall, and from the CPU time every thread took: on a shared machine, what the work cost) and where
the time goes. The embedded model on braid's C kernels, default flags (--kv-cache-dtype
to try another cache), or --model: any model braid serves, as `braid serve --model` takes it (a
random model of a real shape: make_shape_gguf below).

Attention's share: after each prompt, its chunks' attention over the cache it just filled is timed
alone (the kernel the pass runs, csrc/attention.c, on one layer's cache with random queries, times
the layers); the rest of the pass (the linear layers, norms, RoPE, the LM head) is the remainder.

    .venv/bin/python benchmarks/prefill.py [--lengths 512,2048,8000] [--repeats 3] [--threads 2]
    .venv/bin/python benchmarks/prefill.py --model "$(.venv/bin/python benchmarks/prefill.py --make-shape 1b)"
    .venv/bin/python benchmarks/prefill.py --kernel [--shape 9,3,64] [--before OLD.so]   # the kernel alone
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import urllib.request
from pathlib import Path

import torch

from braid.server.config import EngineConfig
from braid.server.model.loader import default_cache_dir, load
from braid.server.runner.kernels.pick import kernels_isa
from braid.server.runner import kv_cache
from braid.server.runner.kernels import step
from braid.server.runner.kernels.step import decode_attention
from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import Row, Sampling

import braid_server
import format_models
import llamacpp
from kernels_ab import load_build

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


@contextlib.contextmanager
def build_in(build):
    """step.decode_attention calling `build` (an _cpu_kernels module) meanwhile: its argument
    marshalling is the server's, whichever build runs."""
    kept, step._cpu_kernels = step._cpu_kernels, build
    try:
        yield
    finally:
        step._cpu_kernels = kept


def kernel_alone(lengths: list[int], chunk: int, repeats: int, shape: list[int], before: str | None) -> None:
    """The attention kernel alone at each length, one layer, one thread, over random caches in fp32,
    bf16 and q8_0 (a CPU's default): a prompt chunk of `chunk` rows ending there (its tiles), and a
    decode step of 32 sequences each that long (its own pages each, as distinct requests are). CPU
    ms, medians of `repeats`. With `before` (another build's .so), that build too, the two taken in
    turns, and each output compared bit for bit (the kernel contract: a change that only moves loops
    keeps every bit)."""
    heads, kv_heads, d = shape
    page, decode_rows = 16, 32
    torch.set_num_threads(1)
    isa = kernels_isa()
    builds = {"this": step._cpu_kernels}
    if before:
        builds = {"before": load_build("before", before), **builds}
        builds["before"].select_isa(isa)
    print(
        f"{isa} build, {heads} query heads over {kv_heads} KV heads of {d}, one layer, one thread: CPU ms, medians of {repeats}\n"
    )
    names = list(builds)
    print(f"| cache | rows | ending at | {' | '.join(names)} |" + (" this / before | bits |" if before else ""))
    print("|---|---|---:|" + "---:|" * len(names) + ("---:|---|" if before else ""))
    for dtype in (torch.float32, torch.bfloat16, kv_cache.Q8_0):
        for n in lengths:
            for rows, sequences in ((min(chunk, n), 1), (decode_rows, decode_rows)):
                pages = -(-n // page)
                k_cache, v_cache = (
                    kv_cache.encode(torch.randn(pages * sequences, kv_heads, page, d), dtype) for _ in range(2)
                )
                if sequences == 1:  # a chunk's rows: consecutive positions of one sequence, keys written
                    tables, positions = torch.arange(pages).expand(rows, -1).contiguous(), torch.arange(n - rows, n)
                else:  # each row its sequence's new token, at position n - 1
                    tables, positions = torch.arange(pages * rows).view(rows, pages), torch.full((rows,), n - 1)
                qkv = torch.randn(rows, (heads + 2 * kv_heads) * d)
                times: dict[str, list[float]] = {name: [] for name in names}
                outs = {name: torch.empty(rows, heads * d) for name in names}
                for _ in range(repeats):
                    for name, build in builds.items():
                        with build_in(build):
                            cpu = time.thread_time()
                            decode_attention(
                                qkv,
                                heads,
                                k_cache,
                                v_cache,
                                tables,
                                positions,
                                outs[name],
                                d**-0.5,
                                write=sequences > 1,
                            )
                            times[name].append(time.thread_time() - cpu)
                ms = [statistics.median(times[name]) * 1e3 for name in names]
                line = f"| {kv_cache.kv_dtype_name(dtype)} | {'prompt chunk' if sequences == 1 else 'decode'} {rows} | {n:,} | "
                line += " | ".join(f"{m:.1f}" for m in ms) + " |"
                if before:
                    same = torch.equal(outs["before"], outs["this"])
                    line += f" {ms[1] / ms[0]:.2f}x | {'same' if same else '**differ**'} |"
                print(line, flush=True)


def make_shape_gguf(key: str) -> Path:
    """The Q4_0 GGUF of a random model of shape `key` (format_models.SHAPES), the files sizes.py makes
    (a bf16 folder, then llama.cpp's convert_hf_to_gguf.py and llama-quantize; made once, in
    ~/.cache/braid/bench). Random weights: right for speed, not for text."""
    shape = format_models.SHAPES[key]
    folder = format_models.shape_folder(shape, format_models.smollm_fp32_folder())
    llama = llamacpp.find() or RuntimeError("llama.cpp is not built: make bench-formats builds it")
    return format_models.shape_ggufs(llama, shape, folder, ("Q4_0",))["Q4_0"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048,8000", help="prompt lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=EngineConfig.prefill_chunk)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--model", help="a model braid serves (default: the embedded one)")
    parser.add_argument(
        "--make-shape",
        metavar="SHAPE",
        help="make a random model of a real shape (format_models.SHAPES: 1b, 3b, 8b) as a Q4_0 GGUF by "
        "llama.cpp's converter and quantizer (sizes.py's files), print its path and stop",
    )
    parser.add_argument("--kernel", action="store_true", help="time the attention kernel alone (kernel_alone)")
    parser.add_argument("--shape", default="9,3,64", help="--kernel: query heads, KV heads, head size")
    parser.add_argument("--before", help="--kernel: another build's _cpu_kernels .so, timed beside this one")
    parser.add_argument(
        "--llama-cpp",
        action="store_true",
        help="--model a GGUF file: llama.cpp's server on the same file too, the same prompts, its own timings",
    )
    args = parser.parse_args()
    if args.llama_cpp and not (args.model or "").endswith(".gguf"):
        parser.error("--llama-cpp needs --model, a GGUF file (llama.cpp runs the same file)")
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.make_shape:
        print(make_shape_gguf(args.make_shape))
        return
    if args.kernel:
        kernel_alone(lengths, args.chunk, args.repeats, [int(v) for v in args.shape.split(",")], args.before)
        return
    config = EngineConfig(
        threads=args.threads, max_seq_len=max(lengths), kv_cache_memory="2GiB", kv_cache_dtype=args.kv_cache_dtype
    )
    model = load(args.model, default_cache_dir())
    runner = ModelRunner.build(config, model)
    runner.governor = None  # the threads stay --threads
    # token ids both the model and its tokenizer have (a random model of a real shape has a bigger
    # embedding than the tokenizer it borrows, and llama.cpp refuses ids past the tokenizer's)
    vocab = min(runner.decoder.vocab_size, len(model.hf_tokenizer))
    generator = torch.Generator().manual_seed(0)
    page = runner.page_size
    results: dict[int, list[tuple[float, float, float, float]]] = {n: [] for n in lengths}
    prompts: dict[int, list[list[int]]] = {n: [] for n in lengths}
    prefill(runner, list(range(100, 100 + args.chunk)), list(range(-(-args.chunk // page))), args.chunk)  # warm-up
    for _ in range(args.repeats):
        for n in lengths:
            prompt = torch.randint(100, vocab, (n,), generator=generator).tolist()  # distinct: no prefix shared
            prompts[n].append(prompt)
            pages = list(range(-(-n // page)))
            results[n].append(
                prefill(runner, prompt, pages, args.chunk) + attention(runner, n, pages, args.chunk, generator)
            )
    llama = llama_cpp_rates(Path(args.model), prompts, args.threads) if args.llama_cpp else None
    print(
        f"{args.model or 'the embedded model'}: {args.threads} threads, chunks of {args.chunk}, "
        f"{runner.kv_dtype_name} KV cache, medians of {args.repeats}\n"
    )
    extra = (" llama.cpp: prompt tok/s |", " braid / llama.cpp |") if llama else ("", "")
    print(
        "| prompt tokens | prompt tok/s (wall) | (CPU) | attention, wall (s) | rest (s) | attention share (CPU) |"
        + "".join(extra)
    )
    print("|---:|---:|---:|---:|---:|---:|" + "---:|" * (2 if llama else 0))
    for n in lengths:
        wall, cpu, attn_wall, attn_cpu = (statistics.median(r[i] for r in results[n]) for i in range(4))
        line = (
            f"| {n:,} | {n / wall:.0f} | {n / cpu * args.threads:.0f} | {attn_wall:.2f} | {wall - attn_wall:.2f} "
            f"| {attn_cpu / cpu:.0%} |"
        )
        if llama:
            line += f" {llama[n]:.1f} | {n / wall / llama[n]:.2f}x |"
        print(line)


def llama_cpp_rates(gguf: Path, prompts: dict[int, list[list[int]]], threads: int) -> dict[int, float]:
    """llama.cpp's server (built by make bench-formats) on the same GGUF file and the same prompts,
    one at a time, with no prompt cache: the median of its own prompt tok/s for each length."""
    llama = llamacpp.find()
    if llama is None:
        raise SystemExit("prefill.py: llama.cpp is not built (make bench-formats builds it)")
    longest = max(prompts)
    context = llamacpp.context_size(1, longest)
    log = Path(llamacpp.cache_dir()) / "prefill-server.log"
    port = braid_server.free_port()
    with llamacpp.running_server(llama, gguf, port, parallel=1, context=context, threads=threads, log_path=log) as (
        url,
        _,
    ):
        _llama_prompt(url, list(range(100, 164)))  # warm-up
        return {n: statistics.median(_llama_prompt(url, p) for p in ps) for n, ps in prompts.items()}


def _llama_prompt(url: str, prompt: list[int]) -> float:
    """llama.cpp's prompt tok/s (its timings) for one prompt of token ids, one token generated."""
    body = json.dumps({"prompt": prompt, "n_predict": 1, "cache_prompt": False}).encode()
    request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        timings = json.load(response)["timings"]
    assert timings["prompt_n"] == len(prompt), timings  # every token prefilled, none from a cache
    return timings["prompt_per_second"]


if __name__ == "__main__":
    main()
