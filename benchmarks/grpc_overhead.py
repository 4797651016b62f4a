"""What braid loses to gRPC: the same workload through the in-process engine and through the server.

    .venv/bin/python benchmarks/grpc_overhead.py [--mode continuous] [--repeats 3] [--threads 2]

The in-process side submits straight to braid's Engine from an event loop on another thread, while
the engine's model loop runs on this process's main thread, exactly as in `braid serve` (torch's
CPU kernels run ~40% slower on a spawned thread); the gRPC side is `braid serve` in a subprocess
driven by the Python client. Runs alternate, so drift of the machine hits both; medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import braid_server  # noqa: E402
import drive  # noqa: E402
import workloads  # noqa: E402
from metrics import StreamTiming  # noqa: E402


def engine_sender(engine):
    from braid.server.engine.types import Delta, GenerationRequest, SamplingParams

    async def send(request: workloads.Request) -> StreamTiming:
        loop = asyncio.get_running_loop()
        sent = time.perf_counter()
        params = SamplingParams(max_new_tokens=request.max_new_tokens, ignore_eos=True)
        req = GenerationRequest(
            prompt=request.prompt, messages=(), params=params, request_id="bench", cache_salt=uuid.uuid4().hex
        )  # as braid_server.sender: no prefix cache hits
        ticket = engine.client.admit(req.prompt, req.messages)
        [handle] = await loop.run_in_executor(None, engine.client.submit, ticket, req, loop)
        first = last = 0.0
        num_tokens = 0
        async for batch in handle.batches():
            n = sum(len(e.token_ids) for e in batch if isinstance(e, Delta))
            if n:
                last = time.perf_counter()
                first = first or last
                num_tokens += n
        return StreamTiming(sent, first, last, num_tokens)

    return send


async def throughput(workload: workloads.Workload, send) -> float:
    timings, wall = await drive.run(workload, send)
    return sum(t.num_tokens for t in timings) / wall


async def main_async(args, engine, workload: workloads.Workload) -> None:
    in_process, over_grpc = [], []
    with tempfile.TemporaryDirectory() as tmp:
        async with braid_server.running(
            args.mode, threads=args.threads, max_batch_size=32, log_path=Path(tmp) / "server.log"
        ) as (client, _pid):
            grpc_send = braid_server.sender(client)
            local_send = engine_sender(engine)
            await throughput(workload, local_send)  # warm both
            await throughput(workload, grpc_send)
            for i in range(args.repeats):
                in_process.append(await throughput(workload, local_send))
                over_grpc.append(await throughput(workload, grpc_send))
                print(
                    f"repeat {i + 1}: in-process {in_process[-1]:.1f} tok/s, gRPC {over_grpc[-1]:.1f} tok/s", flush=True
                )
    local, remote = statistics.median(in_process), statistics.median(over_grpc)
    print(
        f"{workload.title}, {args.mode} mode: in-process {local:.1f} tok/s, over gRPC {remote:.1f} tok/s "
        f"(median of {args.repeats}); gRPC costs {1 - remote / local:+.1%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="continuous")
    parser.add_argument("--workload", default="targets", help="a workload name from workloads.build")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from braid.server.config import EngineConfig
    from braid.server.cli import build_engine
    from braid.server.model.loader import load

    model = load(None, EngineConfig().cache_dir)
    workload = workloads.build(model.hf_tokenizer, repeats=1)[args.workload]
    engine = build_engine(EngineConfig(mode=args.mode, threads=args.threads, max_batch_size=32), model)

    def drive_then_stop() -> None:
        try:
            asyncio.run(main_async(args, engine, workload))
        finally:
            engine.client.stop()

    client = threading.Thread(target=drive_then_stop, name="bench-client")
    client.start()
    engine.run()  # the model loop on the main thread, as in `braid serve`, until drive_then_stop ends
    client.join()


if __name__ == "__main__":
    main()
