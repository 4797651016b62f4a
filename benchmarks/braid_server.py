"""The real braid gRPC server for the benchmark: started as `braid serve` on a free port, driven with
braid's AsyncClient, stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

from braid.client import AsyncClient

from metrics import StreamTiming
from processes import logged_process
from workloads import Request

BRAID = Path(sys.executable).with_name("braid")
_START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def running(mode: str, *, threads: int, max_batch_size: int, log_path: Path):
    """A healthy braid server in `mode`; yields (AsyncClient, server pid)."""
    port = free_port()
    command = [str(BRAID), "serve", "--host", "127.0.0.1", "--port", str(port), "--mode", mode,
               "--max-batch-size", str(max_batch_size), "--threads", str(threads), "--log-level", "warning"]
    with logged_process(command, log_path, grace_s=30) as process:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            await _wait_healthy(client, process)
            yield client, process.pid


async def _wait_healthy(client: AsyncClient, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"braid serve exited with {process.returncode}; see its log")
        with contextlib.suppress(Exception):
            if await client.health(timeout=2) == "SERVING":
                return
        await asyncio.sleep(0.3)
    raise TimeoutError(f"braid serve not healthy after {_START_TIMEOUT_S:.0f} s")


def sender(client: AsyncClient):
    """The `send` coroutine for drive.run: one Stream call, greedy, ignore_eos, timed per message."""
    async def send(request: Request) -> StreamTiming:
        sent = time.perf_counter()
        first = last = 0.0
        num_tokens = 0
        async with client.stream(request.prompt, max_new_tokens=request.max_new_tokens, ignore_eos=True,
                                 temperature=0) as generation:
            async for message in generation:
                if message.token_ids:
                    last = time.perf_counter()
                    first = first or last
                    num_tokens += len(message.token_ids)
        if generation.final is not None and generation.final.usage.prompt_tokens != len(request.prompt_ids):
            raise RuntimeError(f"braid saw {generation.final.usage.prompt_tokens} prompt tokens, "
                               f"the benchmark counted {len(request.prompt_ids)}")
        return StreamTiming(sent, first, last, num_tokens)

    return send


async def warm_up(send, warm_requests: list[Request]) -> None:
    """A few requests at once, so that first-call costs (allocation, kernels) are not measured."""
    await asyncio.gather(*(send(r) for r in warm_requests))
