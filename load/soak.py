"""Soak test: drive a braid server for a while with streams, random cancellations, random deadlines
and a share of bad requests; then report outcomes, server RSS and leaked sessions.

    .venv/bin/python load/soak.py                      # spawns `braid serve`, 10 minutes
    .venv/bin/python load/soak.py --duration 120 --concurrency 24
    .venv/bin/python load/soak.py --target host:port --pid PID   # an already running server

Run on demand, not in CI. Targets: RSS grows < 10% after the first minute, no session leaked, no
unexpected status code.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import sys
import time

import grpc

from braid.client import AsyncClient
from braid.v1 import generate_pb2 as pb

# braid_testing (tests/support): `braid serve` as a child process, shared with the tests and the
# benchmarks, kept out of the production package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support"))
from braid_testing.process import BraidProcess  # noqa: E402

EXPECTED_CODES = {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
BAD_REQUESTS = [
    dict(prompt=""),
    dict(prompt="x", top_p=3.0),
    dict(prompt="x", max_new_tokens=-4),
    dict(messages=[pb.Message(role="wizard", content="hi")]),
    dict(prompt="x", stop=[""]),
    dict(prompt="x", stop_token_ids=[10**9]),
    dict(prompt="word " * 6000),
]
PROMPTS = [
    "Tell me about the sea.",
    "Write a list of fruits:",
    "Once upon a time",
    "Explain gRPC in one paragraph.",
    "1, 2, 3, 4,",
]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def one_call(client: AsyncClient, rng: random.Random, outcomes: collections.Counter) -> None:
    roll = rng.random()
    if roll < 0.1:
        kwargs, timeout, cancel_after = dict(rng.choice(BAD_REQUESTS)), None, None
    else:
        kwargs = dict(
            prompt=rng.choice(PROMPTS),
            max_new_tokens=rng.randint(8, 96),
            ignore_eos=True,
            temperature=rng.choice([0.0, 0.8]),
            seed=rng.randint(0, 1000),
        )
        timeout = rng.uniform(0.2, 5.0) if roll < 0.3 else None
        cancel_after = rng.randint(0, 20) if 0.3 <= roll < 0.55 else None
    stream = client.stream(timeout=timeout, **kwargs)
    received = 0
    try:
        async for message in stream:
            received += len(message.token_ids)
            if cancel_after is not None and received >= cancel_after:
                stream.cancel()
                outcomes["CANCELLED (by client)"] += 1
                return
            if message.finish_reason:
                outcomes["OK " + pb.FinishReason.Name(message.finish_reason)] += 1
    except grpc.aio.AioRpcError as err:
        outcomes[err.code().name] += 1


async def drive(target: str, duration: float, concurrency: int, pid: int, seed: int) -> dict:
    rng = random.Random(seed)
    outcomes: collections.Counter = collections.Counter()
    samples: list[tuple[float, int]] = []
    start = time.monotonic()
    async with AsyncClient(target) as client:

        async def worker() -> None:
            while time.monotonic() - start < duration:
                await one_call(client, rng, outcomes)

        async def sample_rss() -> None:
            while time.monotonic() - start < duration:
                samples.append((time.monotonic() - start, rss_bytes(pid)))
                await asyncio.sleep(5)

        await asyncio.gather(sample_rss(), *(worker() for _ in range(concurrency)))
        status = await settled(client)
    samples.append((time.monotonic() - start, rss_bytes(pid)))
    return {"outcomes": outcomes, "samples": samples, "status": status}


async def settled(client: AsyncClient, timeout: float = 30.0):
    """ServerStatus once the last cancellations have landed and the books balance, or after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        status = await client.server_status()
        if books_balance(status) or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.2)


def books_balance(status) -> bool:
    """Nothing running or queued, every session the server accepted finished exactly once, and no
    KV-cache page held (only cached ones)."""
    finished = sum(getattr(status.sessions_finished, f.name) for f in status.sessions_finished.DESCRIPTOR.fields)
    return (
        status.sessions_active == 0
        and status.sessions_queued == 0
        and status.sessions_submitted == finished
        and status.kv_pages_used == 0
    )


def spawn(args: argparse.Namespace) -> BraidProcess:
    # A KV cache of 512 MiB: cached prefixes keep their pages until the memory is needed, so the
    # cache's memory grows to its budget; a small one fills in the first minute, before the RSS
    # growth is measured.
    return BraidProcess(["--mode", args.mode, "--max-queued", str(args.concurrency), "--kv-cache-memory", "512MiB"])


def report(result: dict, duration: float) -> int:
    outcomes, samples, status = result["outcomes"], result["samples"], result["status"]
    total = sum(outcomes.values())
    print(f"requests: {total} in {duration:.0f} s")
    for name, count in sorted(outcomes.items()):
        print(f"  {name:34s} {count:6d}")
    after_minute = next((rss for t, rss in samples if t >= min(60.0, duration / 2)), samples[0][1])
    start_rss, end_rss = samples[0][1], samples[-1][1]
    growth = (end_rss - after_minute) / after_minute
    print(
        f"server RSS: start {start_rss / 2**20:.0f} MiB, after the first minute {after_minute / 2**20:.0f} MiB, "
        f"end {end_rss / 2**20:.0f} MiB ({growth:+.1%} after the first minute)"
    )
    print(
        f"at the end: {status.sessions_active} active, {status.sessions_queued} queued; "
        f"server counted {status.sessions_finished.cancelled} cancelled, "
        f"{status.sessions_finished.deadline} deadline, {status.sessions_finished.error} errors"
    )
    print(
        f"KV cache at the end: {status.kv_pages_used} pages in use, {status.kv_pages_cached} cached, "
        f"{status.kv_pages_total} in all; {status.preemptions} preemptions, {status.kv_evictions} evictions, "
        f"{status.prompt_tokens_cached} prompt tokens from the cache, {status.prompt_tokens_computed} computed"
    )
    balanced = books_balance(status)
    print(
        f"books: {'balanced' if balanced else 'DO NOT BALANCE'} ({status.sessions_submitted} sessions submitted, "
        f"{status.sessions_active} active, {status.sessions_queued} queued, the rest finished once each)"
    )
    unexpected = {k: v for k, v in outcomes.items() if k.split(" ")[0] not in EXPECTED_CODES}
    ok = growth < 0.10 and balanced and not unexpected
    print("PASS" if ok else f"FAIL unexpected={unexpected}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--mode", default="continuous", help="mode of the spawned server")
    parser.add_argument("--target", help="an already running server (with --pid)")
    parser.add_argument("--pid", type=int, help="its process id, for RSS")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    server = None
    if args.target:
        if not args.pid:
            parser.error("--target needs --pid")
        target, pid = args.target, args.pid
    else:
        server = spawn(args)
        target, pid = server.target, server.pid
    try:
        result = asyncio.run(drive(target, args.duration, args.concurrency, pid, args.seed))
        return report(result, args.duration)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sys.exit(main())
