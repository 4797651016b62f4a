"""The real braid gRPC server for the benchmark: started as `braid serve` on a free port, driven with
braid's AsyncClient, stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from braid.client import AsyncClient, AsyncGeneration

# braid_testing (tests/support): `braid serve` as a child process, shared with the tests and kept out of
# the production package. The other benchmarks take it from here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from braid_testing.process import BRAID, START_TIMEOUT_S, BraidProcess  # noqa: E402, F401  (BRAID: formats.py's)
from braid_testing.process import free_port  # noqa: E402, F401  (llama.cpp's port too)

from metrics import StreamTiming
from workloads import Request


@contextlib.asynccontextmanager
async def running(
    mode: str,
    *,
    threads: int,
    max_batch_size: int,
    log_path: Path,
    extra_args: Sequence[str] = (),
    start_timeout: float = START_TIMEOUT_S,
    env: dict[str, str] | None = None,
):
    """A healthy braid server in `mode`, with `extra_args` (--model, --dtype, ...) on its command
    line and `env` in its environment; yields (AsyncClient, server pid)."""
    server = await asyncio.to_thread(
        BraidProcess,
        [
            "--mode",
            mode,
            "--max-batch-size",
            str(max_batch_size),
            "--threads",
            str(threads),
            "--log-level",
            "warning",
            *extra_args,
        ],
        env=env,
        log_path=log_path,
        start_timeout=start_timeout,
    )
    try:
        async with AsyncClient(server.target) as client:
            yield client, server.pid
    finally:
        await asyncio.to_thread(server.stop)


async def timed(client: AsyncClient, prompt: str | None = None, **params) -> tuple[StreamTiming, AsyncGeneration]:
    """One Stream call (a prompt, or messages=...), timed per message; the generation it returns
    holds the text and the final message."""
    sent = time.perf_counter()
    first = last = 0.0
    num_tokens = 0
    async with client.stream(prompt, **params) as generation:
        async for message in generation:
            if message.token_ids:
                last = time.perf_counter()
                first = first or last
                num_tokens += len(message.token_ids)
    return StreamTiming(sent, first, last, num_tokens), generation


def sender(client: AsyncClient):
    """The `send` coroutine for drive.run: one Stream call, greedy, ignore_eos, timed per message."""

    async def send(request: Request) -> StreamTiming:
        # A salt of its own unless the workload shares one: the standard workloads repeat their
        # prompts, and every system (llama.cpp: cache_prompt false) computes each one in full.
        salt = {"cache_salt": request.cache_salt or uuid.uuid4().hex}
        timing, generation = await timed(
            client, request.prompt, max_new_tokens=request.max_new_tokens, ignore_eos=True, temperature=0, **salt
        )
        if generation.final is not None and generation.final.usage.prompt_tokens != len(request.prompt_ids):
            raise RuntimeError(
                f"braid saw {generation.final.usage.prompt_tokens} prompt tokens, "
                f"the benchmark counted {len(request.prompt_ids)}"
            )
        return timing

    return send


async def warm_up(send, warm_requests: list[Request]) -> None:
    """A few requests at once, so that first-call costs (allocation, kernels) are not measured."""
    await asyncio.gather(*(send(r) for r in warm_requests))
