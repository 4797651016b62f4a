"""Flood: big prompts and big Tokenize calls all at once, and one small call beside them.

Sends, at the same moment on one connection:

- `door_prompts` Stream calls whose prompt is `door_bytes` long (1 MiB): far past any context, the
  server should refuse them at once with INVALID_ARGUMENT, without tokenizing them;
- `big_prompts` Stream calls of `big_bytes` (300 KB) of words: small enough to be tokenized (the
  server cannot tell from their size alone that they do not fit), then refused with INVALID_ARGUMENT
  if they are past the context;
- `big_tokenize` Tokenize calls of `big_bytes`, which the server must tokenize in full.

A moment later (`small_delay_s`) it sends one small Stream call (a short prompt, 4 tokens) on a
connection of its own and times it: from the send of the attempt that the server admitted to its
last message. Past --max-queued, calls get RESOURCE_EXHAUSTED (with a retry delay), the small call
included; it is then retried after `small_retry_s`, as a client would, and `small_refusals` counts
those refusals. Every call's status code is counted; INTERNAL and UNKNOWN never should be.

    .venv/bin/python load/flood.py --target 127.0.0.1:50051
    .venv/bin/python load/flood.py --target 127.0.0.1:50051 --big-prompts 80 --big-tokenize 40

Importable: `await flood(target, ...)` returns a FloodResult.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import sys
import time
from dataclasses import dataclass, field

import grpc

from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc

DOOR_BYTES = 1 << 20  # the largest prompt braid accepts at all; far past any context
BIG_BYTES = 300_000  # under the size a 4,096-token context refuses untokenized, so it is tokenized
SMALL_PROMPT = "Hi"
SMALL_TOKENS = 4
# The channels send messages of any size and take Tokenize answers of any size (300 KB of words
# is some 170,000 token ids and pieces).
CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
# A channel of its own for the small call: grpc shares connections between channels with the same
# target and options unless told not to, and the small call should not queue behind megabytes of
# big requests on the same connection.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


@dataclass
class FloodResult:
    """What a flood did. `codes` maps each kind of call ("door", "prompt", "tokenize", "small") to a
    Counter of status code names ("OK", "INVALID_ARGUMENT", ...), the small call's refused attempts
    included."""

    small_wait_s: float  # send of the admitted attempt of the small call -> its last message
    small_total_s: float  # first send of the small call -> its last message, refusals included
    small_refusals: int  # RESOURCE_EXHAUSTED answers to the small call before it was admitted
    small_tokens: int  # tokens the small call generated
    flood_s: float  # first send -> the last big call's answer
    codes: dict[str, collections.Counter] = field(default_factory=dict)
    details: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # kind -> (code, details) per call

    def unexpected(self) -> dict[str, dict[str, int]]:
        """Status codes that a flood should never produce: anything but OK, INVALID_ARGUMENT and
        RESOURCE_EXHAUSTED (and for the small call, anything but OK in the end)."""
        bad = {}
        for kind, counter in self.codes.items():
            allowed = (
                {"OK", "RESOURCE_EXHAUSTED"} if kind == "small" else {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
            )
            extra = {code: n for code, n in counter.items() if code not in allowed}
            if extra:
                bad[kind] = extra
        return bad

    def summary(self) -> str:
        lines = [
            f"small call: {self.small_wait_s * 1000:.0f} ms once admitted, {self.small_total_s * 1000:.0f} ms "
            f"in all, {self.small_refusals} refusals, {self.small_tokens} tokens",
            f"flood: {self.flood_s:.2f} s",
        ]
        for kind, counter in self.codes.items():
            lines.append(f"  {kind:9s} " + ", ".join(f"{code} {n}" for code, n in sorted(counter.items())))
        return "\n".join(lines)


def words(num_bytes: int, rng: random.Random) -> str:
    """About num_bytes of ASCII pseudo-words (tokenizes slower than one word repeated)."""
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(2000)]
    out, size = [], 0
    while size < num_bytes:
        word = rng.choice(vocab)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:num_bytes]


async def _outcome(call) -> tuple[str, str]:
    """Runs a call to its end; returns its status code's name and details."""
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as err:
        return err.code().name, err.details() or ""
    return "OK", ""


async def _small_call(stub, delay_s: float, retry_s: float, max_attempts: int):
    await asyncio.sleep(delay_s)
    request = pb.GenerateRequest(prompt=SMALL_PROMPT, max_new_tokens=SMALL_TOKENS, ignore_eos=True)
    first = time.monotonic()
    codes: collections.Counter = collections.Counter()
    for _ in range(max_attempts):
        sent = time.monotonic()
        try:
            messages = [m async for m in stub.Stream(request)]
        except grpc.aio.AioRpcError as err:
            codes[err.code().name] += 1
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                return codes, time.monotonic() - sent, time.monotonic() - first, 0
            await asyncio.sleep(retry_s)
            continue
        codes["OK"] += 1
        end = time.monotonic()
        return codes, end - sent, end - first, messages[-1].usage.generated_tokens
    return codes, float("nan"), time.monotonic() - first, 0


async def flood(
    target: str,
    *,
    door_prompts: int = 20,
    big_prompts: int = 40,
    big_tokenize: int = 20,
    door_bytes: int = DOOR_BYTES,
    big_bytes: int = BIG_BYTES,
    small_delay_s: float = 0.05,
    small_retry_s: float = 0.05,
    small_max_attempts: int = 400,
    seed: int = 0,
) -> FloodResult:
    """Floods `target` (host:port, plaintext) and times one small call beside the flood."""
    rng = random.Random(seed)
    door_text, big_text = words(door_bytes, rng), words(big_bytes, rng)
    async with (
        grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel,
        grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS + OWN_CONNECTION) as small_channel,
    ):
        stub, small_stub = generate_pb2_grpc.GenerateStub(channel), generate_pb2_grpc.GenerateStub(small_channel)
        # Both connections up before the clock starts.
        await asyncio.gather(channel.channel_ready(), small_channel.channel_ready())
        kinds = ["door"] * door_prompts + ["prompt"] * big_prompts + ["tokenize"] * big_tokenize
        rng.shuffle(kinds)

        def call(kind: str):
            if kind == "tokenize":
                return stub.Tokenize(pb.TokenizeRequest(text=big_text))
            text = door_text if kind == "door" else big_text
            return stub.Stream(pb.GenerateRequest(prompt=text, max_new_tokens=1))

        start = time.monotonic()
        small = asyncio.create_task(_small_call(small_stub, small_delay_s, small_retry_s, small_max_attempts))
        outcomes = await asyncio.gather(*(_outcome(call(kind)) for kind in kinds))
        flood_s = time.monotonic() - start
        small_codes, small_wait, small_total, small_tokens = await small
    codes: dict[str, collections.Counter] = {kind: collections.Counter() for kind in ("door", "prompt", "tokenize")}
    details: dict[str, list[tuple[str, str]]] = {kind: [] for kind in codes}
    for kind, (code, detail) in zip(kinds, outcomes):
        codes[kind][code] += 1
        details[kind].append((code, detail))
    codes["small"] = small_codes
    return FloodResult(
        small_wait_s=small_wait,
        small_total_s=small_total,
        small_refusals=small_codes["RESOURCE_EXHAUSTED"],
        small_tokens=small_tokens,
        flood_s=flood_s,
        codes=codes,
        details=details,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="127.0.0.1:50051", help="host:port of a running server (plaintext)")
    parser.add_argument("--door-prompts", type=int, default=20, help="prompts of --door-bytes (default 20)")
    parser.add_argument("--big-prompts", type=int, default=40, help="prompts of --big-bytes (default 40)")
    parser.add_argument("--big-tokenize", type=int, default=20, help="Tokenize calls of --big-bytes (default 20)")
    parser.add_argument("--door-bytes", type=int, default=DOOR_BYTES)
    parser.add_argument("--big-bytes", type=int, default=BIG_BYTES)
    parser.add_argument("--small-delay", type=float, default=0.05, help="seconds after the flood (default 0.05)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = asyncio.run(
        flood(
            args.target,
            door_prompts=args.door_prompts,
            big_prompts=args.big_prompts,
            big_tokenize=args.big_tokenize,
            door_bytes=args.door_bytes,
            big_bytes=args.big_bytes,
            small_delay_s=args.small_delay,
            seed=args.seed,
        )
    )
    print(result.summary())
    unexpected = result.unexpected()
    if unexpected or result.codes["small"]["OK"] != 1:
        print(f"FAIL unexpected={unexpected}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sys.exit(main())
