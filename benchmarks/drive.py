"""Runs a workload against a server from the client side, with asyncio: a closed loop of N streams,
or arrivals at given times. The server is reached through `send`, one coroutine per request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from metrics import StreamTiming
from workloads import Request, Workload

Send = Callable[[Request], Awaitable[StreamTiming]]


async def run(workload: Workload, send: Send) -> tuple[list[StreamTiming], float]:
    """Every request's timing, in request order, and the wall time from the start to the last token."""
    start = time.perf_counter()
    if workload.arrival_offsets is None:
        timings = await _closed_loop(workload.requests, workload.concurrency, send)
    else:
        timings = await _arrivals(workload.requests, workload.arrival_offsets, start, send)
    return timings, max(t.last for t in timings) - start


async def _closed_loop(requests: list[Request], concurrency: int, send: Send) -> list[StreamTiming]:
    timings: list[StreamTiming | None] = [None] * len(requests)
    next_index = iter(range(len(requests)))

    async def stream_worker() -> None:
        for i in next_index:  # shared iterator: each worker takes the next request when it is free
            timings[i] = await send(requests[i])

    await asyncio.gather(*(stream_worker() for _ in range(concurrency)))
    return timings  # type: ignore[return-value]


async def _arrivals(requests: list[Request], offsets: list[float], start: float, send: Send) -> list[StreamTiming]:
    async def arrive(request: Request, offset: float) -> StreamTiming:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        return await send(request)

    return list(await asyncio.gather(*(arrive(r, o) for r, o in zip(requests, offsets))))


def check_counts(system: str, requests: list[Request], timings: list[StreamTiming]) -> None:
    """Every system must generate exactly max_new_tokens for every request, or the comparison is off."""
    for i, (request, timing) in enumerate(zip(requests, timings)):
        if timing.num_tokens != request.max_new_tokens:
            raise RuntimeError(
                f"{system}: request {i} got {timing.num_tokens} tokens, expected {request.max_new_tokens}"
            )
