"""What OpenAI's HTTP API costs against gRPC: the same requests to one `braid serve --http-port`,
through its gRPC port (braid's AsyncClient) and its HTTP port (/v1/completions streamed as
server-sent events, read with httpx), at 1 and 16 streams; output tok/s, TTFT p50 (to the first
text, on both) and the server's CPU time per output token.

    .venv/bin/python benchmarks/http_vs_grpc.py [--repeats 5] [--threads 2] [--new-tokens 64]

Greedy, ignore_eos, a cache salt per request (no prefix-cache hits), the embedded model. Runs
alternate between the two ports, so drift of the machine hits both; medians. The result is appended
to docs/benchmarks.md (section "HTTP against gRPC"), or replaces that section.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import braid_server  # noqa: E402
import drive  # noqa: E402
import report  # noqa: E402
import workloads  # noqa: E402
from metrics import StreamTiming, percentile  # noqa: E402

HEADING = "## HTTP against gRPC"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def http_sender(http, new_tokens: int):
    """One streamed /v1/completions call, timed per event; the tokens counted by its usage."""

    async def send(request: workloads.Request) -> StreamTiming:
        body = {
            "model": "braid",
            "prompt": request.prompt,
            "max_tokens": new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "cache_salt": uuid.uuid4().hex,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = time.perf_counter()
        first = last = 0.0
        num_tokens = 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    last = time.perf_counter()
                    first = first or last
                if chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
        return StreamTiming(sent, first, last, num_tokens)

    return send


def grpc_sender(client, new_tokens: int):
    """One Stream call, timed as the HTTP side is: from the first message with text (a token whose
    text the detokenizer holds back, as it does a word's first piece, sends no event over HTTP)."""

    async def send(request: workloads.Request) -> StreamTiming:
        sent = time.perf_counter()
        first = last = 0.0
        num_tokens = 0
        async with client.stream(
            request.prompt, max_new_tokens=new_tokens, ignore_eos=True, temperature=0, cache_salt=uuid.uuid4().hex
        ) as generation:
            async for message in generation:
                num_tokens += len(message.token_ids)
                if message.text:
                    last = time.perf_counter()
                    first = first or last
        return StreamTiming(sent, first, last, num_tokens)

    return send


def cpu_seconds(pid: int) -> float:
    """The CPU time a process has used, all its threads (Linux: /proc/<pid>/stat utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(workload: workloads.Workload, send, pid: int) -> tuple[float, float, float]:
    """(output tok/s, TTFT p50 ms, the server's CPU ms per output token) of one run. The CPU time is
    the server's own, whatever else the machine runs: the front end's cost shows in it even where the
    wall-clock figures drift with the machine's load."""
    cpu = cpu_seconds(pid)
    timings, wall = await drive.run(workload, send)
    tokens = sum(t.num_tokens for t in timings)
    return tokens / wall, percentile([t.ttft_s for t in timings], 50) * 1000, (cpu_seconds(pid) - cpu) * 1000 / tokens


async def main_async(args, loads: dict[int, workloads.Workload]) -> dict:
    import httpx

    port = braid_server.free_port()
    results: dict = {streams: {"grpc": [], "http": []} for streams in loads}
    with tempfile.TemporaryDirectory() as tmp:
        async with braid_server.running(
            "continuous",
            threads=args.threads,
            max_batch_size=32,
            log_path=Path(tmp) / "server.log",
            extra_args=["--http-port", str(port)],
        ) as (client, pid):
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", timeout=600, limits=httpx.Limits(max_connections=64)
            ) as http:
                sends = {"grpc": grpc_sender(client, args.new_tokens), "http": http_sender(http, args.new_tokens)}
                for streams, workload in loads.items():
                    for send in sends.values():  # warm both
                        await measure(workload, send, pid)
                    for i in range(args.repeats):
                        order = ("grpc", "http") if i % 2 == 0 else ("http", "grpc")
                        for name in order:
                            results[streams][name].append(await measure(workload, sends[name], pid))
                        print(
                            f"{streams} streams, repeat {i + 1}: "
                            + ", ".join(
                                f"{n} {results[streams][n][-1][0]:.1f} tok/s ttft {results[streams][n][-1][1]:.0f} ms "
                                f"cpu {results[streams][n][-1][2]:.1f} ms/tok"
                                for n in ("grpc", "http")
                            ),
                            flush=True,
                        )
    return results


def table(results: dict, args) -> str:
    lines = [
        HEADING,
        "",
        f"`benchmarks/http_vs_grpc.py --repeats {args.repeats} --threads {args.threads} --new-tokens "
        f"{args.new_tokens}`: one `braid serve --http-port` (the embedded model, continuous mode), the same "
        f"requests through its gRPC port (braid's AsyncClient) and its HTTP port (`/v1/completions`, "
        f"streamed, read with httpx), alternated; medians of {args.repeats}. Greedy, ignore_eos, "
        f"{args.new_tokens} new tokens, prompts of 30-60 tokens, a cache salt per request.",
        "",
        "| streams | gRPC tok/s | HTTP tok/s | HTTP costs | gRPC TTFT p50 ms | HTTP TTFT p50 ms "
        "| server CPU ms/token, gRPC | HTTP |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for streams, by in results.items():
        g_tok, g_ttft, g_cpu = (statistics.median(x[i] for x in by["grpc"]) for i in (0, 1, 2))
        h_tok, h_ttft, h_cpu = (statistics.median(x[i] for x in by["http"]) for i in (0, 1, 2))
        lines.append(
            f"| {streams} | {g_tok:.1f} | {h_tok:.1f} | {1 - h_tok / g_tok:+.1%} | {g_ttft:.0f} | "
            f"{h_ttft:.0f} | {g_cpu:.1f} | {h_cpu:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-write", action="store_true", help="print the table, leave docs/benchmarks.md")
    args = parser.parse_args()
    from braid.server.config import EngineConfig
    from braid.server.model.loader import load

    maker = workloads.PromptMaker(load(None, EngineConfig().cache_dir).hf_tokenizer)
    loads = {
        1: workloads.Workload("one", "1 stream", maker.batch(4, 30, 60), concurrency=1),
        16: workloads.Workload("sixteen", "16 streams", maker.batch(32, 30, 60), concurrency=16),
    }
    text = table(asyncio.run(main_async(args, loads)), args)
    print(text)
    if not args.no_write:
        DOCS.write_text(report.with_section(DOCS.read_text(), HEADING, text))


if __name__ == "__main__":
    main()
