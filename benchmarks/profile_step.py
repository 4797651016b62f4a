"""Where a decode step's time goes at N streams, end to end: a `braid serve` (continuous mode) kept
busy by N streams at once, sampled by py-spy with native frames, each sample put in one bucket.

    .venv/bin/python benchmarks/profile_step.py [--streams 16 32] [--seconds 20] [--flags "--activations int8"]

py-spy (`pip install py-spy`, or --py-spy PATH) samples every thread of the server at --rate Hz. The
model thread's samples are split by the innermost frame that says what it is: the matmuls (braid's
tiles and panels, the LM head, the rows' quantization), OpenMP (libgomp: the barriers and waits of the
step's parallel region), attention, the row-wise kernels (norms, SwiGLU, RoPE), the forward pass's
Python (embedding, logits), sampling (runner/sampler.py), the runner's batch building, and the engine's
Python (scheduling, sessions, detokenizing, handing out tokens). The other threads' samples are the
gRPC edge (the asyncio loop: protobuf, grpc) and the rest. The shares are turned into milliseconds per
step and per token with the step rate measured in the same window: N streams of long answers, so
nearly every step is a decode step of N rows (a finished stream is sent again at once, and its
prompt's prefill joins a pass, in the same one C call as the decode rows since every pass is one).

The shares are samples, on a machine that may be shared: compare runs taken side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import shutil
import subprocess
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

# Where the model thread's samples go, at Python level (the server, sampled without pausing it):
# (bucket, frame fragments); a sample's bucket is the first here that one of its frames matches.
SERVER_BUCKETS = [
    ("layers (C: decode_step's matmuls, attention, norms; prompt chunks' rows too)", ("DecodeStep.__call__",)),
    ("LM head and final norm", ("_logits",)),
    ("embedding lookup", ("_embed",)),
    ("the pass's Python around the call", ("_one_call",)),
    ("passes per op (torch's ops: no one C call)", ("Decoder.forward",)),
    ("sampling", ("sampler.py",)),
    ("batch building (runner)", ("runner/batch.py", "rows.py")),
    ("runner, other", ("server/runner/",)),
    ("engine (Python: scheduler, sessions, outputs)", ("server/engine/",)),
]
# Inside decode_step (sampled in process with native frames): the bucket of its innermost frame
# that matches one.
STEP_BUCKETS = [
    ("OpenMP barriers and waits", ("libgomp",)),
    ("attention", ("attention",)),
    ("matmuls", ("gemm", "tile", "_panel", "quantize_rows", "round_rows", "block_sums", "widen")),
    ("norms, SwiGLU, RoPE", ("rms_norm", "silu_mul", "gelu_tanh", "rope")),
]


def first_bucket(stack: list[str], buckets) -> str:
    for name, fragments in buckets:
        if any(fragment in frame for frame in stack for fragment in fragments):
            return name
    return "other"


def innermost_bucket(stack: list[str], buckets) -> str:
    for frame in reversed(stack):
        for name, fragments in buckets:
            if any(fragment in frame for fragment in fragments):
                return name
    return "other"


def thread_of(stack: list[str]) -> str:
    """model (the main thread: the engine's loop), edge (the gRPC thread and grpc's poller), or rest."""
    head = stack[0]
    if "MainThread" in head:
        return "model"
    return "edge" if "grpc" in head or "_poll_wrapper" in head else "rest"


async def keep_busy(
    target: str, requests: list[workloads.Request], stop: asyncio.Event, counts: list[tuple[float, int]]
) -> None:
    """Each request's stream, sent again as soon as it ends, until stop; counts: (time, tokens) per message."""
    async with AsyncClient(target) as client:

        async def worker(request: workloads.Request) -> None:
            while not stop.is_set():
                async for message in client.stream(
                    request.prompt, max_new_tokens=request.max_new_tokens, ignore_eos=True, cache_salt=uuid.uuid4().hex
                ):
                    counts.append((time.perf_counter(), len(message.token_ids)))
                    if stop.is_set():
                        break

        await asyncio.gather(*(worker(r) for r in requests))


async def spy(py_spy: str, pid: int, seconds: float, rate: int, out: Path, native: bool) -> None:
    """py-spy's raw (collapsed) stacks of every thread of pid: without pausing it, or (native) with
    the C frames, pausing it for each sample."""
    mode = ["--native"] if native else ["--nonblocking"]
    process = await asyncio.create_subprocess_exec(
        py_spy,
        "record",
        "--pid",
        str(pid),
        *mode,
        "--threads",
        "--rate",
        str(rate),
        "--duration",
        str(int(seconds)),
        "--format",
        "raw",
        "--output",
        str(out),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, err = await process.communicate()
    if process.returncode:
        raise RuntimeError(f"py-spy failed: {err.decode()[-500:]}")


async def profile_server(
    server: BraidProcess, py_spy: str, requests: list[workloads.Request], seconds: float, rate: int, out: Path
) -> float:
    """Tokens per second over py-spy's window; the stacks in out."""
    stop, counts = asyncio.Event(), []
    load = asyncio.create_task(keep_busy(server.target, requests, stop, counts))
    await asyncio.sleep(4)  # every stream past its prompt
    start = time.perf_counter()
    await spy(py_spy, server.pid, seconds, rate, out, native=False)
    end = time.perf_counter()
    stop.set()
    await load
    return sum(n for t, n in counts if start <= t <= end) / (end - start)


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    """(stack, samples) of py-spy's raw output; its first frame names the thread."""
    samples = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            samples.append((stack.split(";"), int(count)))
    return samples


def server_table(streams: int, tokens_per_second: float, samples, rate: int, seconds: float) -> dict[str, float]:
    """Prints the model thread's buckets per step and per token; returns ms per step by bucket."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for stack, count in samples:
        thread = thread_of(stack)
        counts[thread][first_bucket(stack, SERVER_BUCKETS) if thread == "model" else thread] += count
    step_ms = 1e3 * streams / tokens_per_second
    wall = rate * seconds  # samples of a thread busy all the time
    model = counts["model"]
    print(
        f"\n{streams} streams, end to end: {tokens_per_second:.0f} tok/s, {step_ms:.1f} ms a step "
        f"({tokens_per_second / streams:.1f} steps/s); the model thread busy {sum(model.values()) / wall:.0%} "
        "of the time"
    )
    print("| where (the model thread) | share of wall time | ms per step | us per token |")
    print("|---|---:|---:|---:|")
    ms = {}
    for name in [name for name, _ in SERVER_BUCKETS] + ["other"]:
        share = model[name] / wall
        ms[name] = share * step_ms
        print(f"| {name} | {share:.1%} | {ms[name]:.2f} | {ms[name] * 1e3 / streams:.0f} |")
    idle = 1 - sum(model.values()) / wall
    print(
        f"| not running (waiting: for the GIL, the inbox; or not sampled) | {idle:.1%} | {idle * step_ms:.2f} | "
        f"{idle * step_ms * 1e3 / streams:.0f} |"
    )
    for thread, title in (
        ("edge", "gRPC edge and grpc's poller threads (CPU, beside the step)"),
        ("rest", "other threads (detokenizer pool, ...)"),
    ):
        cores = sum(counts[thread].values()) / wall
        print(
            f"| {title} | {cores:.1%} of a core | {cores * step_ms:.2f} CPU-ms | "
            f"{cores * step_ms * 1e3 / streams:.0f} CPU-us |"
        )
    return ms


def step_table(rows: int, layers_ms: float, samples) -> None:
    """Splits decode_step's time (layers_ms a step, from the server's table) by the native samples
    of the in-process passes."""
    counts = collections.Counter()
    for stack, count in samples:
        if "MainThread" in stack[0] and any("decode_step" in frame for frame in stack):
            counts[innermost_bucket(stack, STEP_BUCKETS)] += count
    total = sum(counts.values()) or 1
    print(f"\ninside decode_step at {rows} rows (in process, native frames, the model thread):")
    print("| where | share | ms per step | us per token |")
    print("|---|---:|---:|---:|")
    for name in [name for name, _ in STEP_BUCKETS] + ["other"]:
        share = counts[name] / total
        print(f"| {name} | {share:.1%} | {share * layers_ms:.2f} | {share * layers_ms * 1e3 / rows:.0f} |")


def native_step(rows: int, flags: dict, py_spy: str, seconds: float, rate: int, out: Path) -> None:
    """Decode passes of `rows` rows in this process under py-spy --native, for step_table."""
    import threading

    import torch
    from decode_rows import PAGES, pass_times
    from braid.server.model.loader import load
    from braid.server.runner.model_runner import ModelRunner

    runner = ModelRunner(
        load(None, default_cache_dir()),
        torch.device("cpu"),
        torch.float32,
        num_pages=PAGES * rows,
        max_seq_len=2048,
        **flags,
    )
    pass_times(runner, rows, 3)  # prompts in, warm
    done = threading.Event()

    def passes() -> None:
        while not done.is_set():
            pass_times(runner, rows, 20)

    worker = threading.Thread(target=passes, name="MainThread-passes")
    worker.start()
    try:
        asyncio.run(spy(py_spy, os.getpid(), seconds, rate, out, native=True))
    finally:
        done.set()
        worker.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", nargs="+", type=int, default=[16, 32])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rate", type=int, default=200, help="py-spy's samples per second")
    parser.add_argument("--new-tokens", type=int, default=400, help="each stream's answer before it is sent again")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--flags", default="", help="braid serve flags (e.g. --activations float32)")
    parser.add_argument(
        "--native-flags",
        default="",
        help="ModelRunner settings for the in-process passes, as name=value (e.g. activations=float32); match --flags",
    )
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--keep", type=Path, help="a folder to keep py-spy's raw stacks in")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve(None, default_cache_dir())[1])
    maker = workloads.PromptMaker(tokenizer)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="braid-profile-"))
    folder.mkdir(parents=True, exist_ok=True)
    native_flags = dict(flag.split("=", 1) for flag in args.native_flags.split())
    for streams in args.streams:
        requests = [dataclasses.replace(r, max_new_tokens=args.new_tokens) for r in maker.batch(streams, 30, 60)]
        server = BraidProcess(
            [
                *args.flags.split(),
                "--mode",
                "continuous",
                "--max-batch-size",
                str(max(32, streams)),
                "--threads",
                str(args.threads),
                "--log-level",
                "warning",
            ]
        )
        try:
            tps = asyncio.run(
                profile_server(server, args.py_spy, requests, args.seconds, args.rate, folder / f"server-{streams}.txt")
            )
        finally:
            server.stop()
        ms = server_table(streams, tps, read_raw(folder / f"server-{streams}.txt"), args.rate, args.seconds)
        native_step(streams, native_flags, args.py_spy, args.seconds, args.rate, folder / f"step-{streams}.txt")
        step_table(streams, ms[SERVER_BUCKETS[0][0]], read_raw(folder / f"step-{streams}.txt"))
    print(f"\nraw stacks: {folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
