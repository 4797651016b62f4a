"""What each API costs against gRPC: the same chats to one `braid serve --http-port`, through its gRPC
port (braid's AsyncClient: as messages, as the rendered prompt's text, as its token ids, and ids in
with ids out) and its HTTP port (OpenAI's /v1/completions with the rendered text, /v1/chat/completions,
Anthropic's /v1/messages and OpenAI's /v1/responses with the same messages; streamed as server-sent
events, read with httpx), at 1 and 16 streams; output tok/s, TTFT p50 (to the first text; to the first
token where no text is sent) and the server's CPU time per output token.

    .venv/bin/python benchmarks/http_vs_grpc.py [--repeats 5] [--threads 2] [--new-tokens 64] [--requests 2]
        [--apis grpc,chat,...]

Every way in gets the very same prompt tokens: one user message each, rendered by the model's chat
template on the chat-shaped routes, sent rendered (text or ids) on the others (checked with Tokenize
before the run). Greedy; Anthropic's and the Responses API have no ignore_eos, so the chats are
chosen, before the run, among those whose greedy answer runs past the token budget, and every stream
must end at it. The prefix cache is off (Anthropic and Responses have no cache_salt either), so every
prompt is computed in full. The APIs run in turn, the order rotated each round, so that drift of the
machine hits all; medians. The result is written to docs/benchmarks.md (section HEADING).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import braid_server  # noqa: E402
import drive  # noqa: E402
import report  # noqa: E402
import workloads  # noqa: E402
from metrics import StreamTiming, percentile  # noqa: E402

HEADING = "## Each API against gRPC (benchmarks/http_vs_grpc.py)"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
BASELINE = "grpc"
APIS = {  # name -> what the table calls it
    "grpc": "gRPC `Stream`, messages",
    "grpc-text": "gRPC, the rendered prompt as text",
    "grpc-ids": "gRPC, the prompt as token ids (`prompt_token_ids`)",
    "grpc-ids-out": "gRPC, ids in and ids out (`skip_detokenize`)",
    "completions": "OpenAI `/v1/completions`, the rendered prompt",
    "chat": "OpenAI `/v1/chat/completions`",
    "anthropic": "Anthropic `/v1/messages`",
    "responses": "OpenAI `/v1/responses`",
}
SUBJECTS = (
    "lighthouse keeper fox baker river clockmaker dragon garden pirate violin robot desert "
    "astronaut owl village painter glacier merchant forest kite"
).split()


@dataclass
class Chat(workloads.Request):
    """One user message; `prompt` and `prompt_ids` are what the chat template makes of it."""

    content: str = ""

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.content}]


def timed_stream(sent: float):
    """A stream's clock: `tick(has_text, tokens)` per event or message, `timing()` at its end."""
    state = {"first": 0.0, "last": 0.0, "tokens": 0}

    def tick(has_output: bool, tokens: int | None = None) -> None:
        if has_output:
            state["last"] = time.perf_counter()
            state["first"] = state["first"] or state["last"]
        if tokens is not None:
            state["tokens"] = tokens

    return tick, lambda: StreamTiming(sent, state["first"], state["last"], state["tokens"])


# ---------------------------------------------------------------- gRPC


def grpc_sender(client, new_tokens: int, how: str):
    """One Stream call, timed from its first message with text (a token whose text the detokenizer
    holds back, as it does a word's first piece, sends no event over HTTP either); ids out: from its
    first message with token ids."""

    def inputs(chat: Chat) -> tuple[str | None, dict]:
        if how == "grpc":
            return None, {"messages": chat.messages}
        if how == "grpc-text":
            return chat.prompt, {}
        return None, {"prompt_token_ids": chat.prompt_ids, "skip_detokenize": how == "grpc-ids-out"}

    async def send(chat: Chat) -> StreamTiming:
        prompt, params = inputs(chat)
        tick, timing = timed_stream(time.perf_counter())
        tokens = 0
        async with client.stream(prompt, max_new_tokens=new_tokens, temperature=0, **params) as generation:
            async for message in generation:
                tokens += len(message.token_ids)
                tick(bool(message.text) or (how == "grpc-ids-out" and bool(message.token_ids)), tokens)
        return timing()

    return send


# ---------------------------------------------------------------- HTTP: one server-sent-event reader, four APIs


@dataclass(frozen=True)
class Route:
    path: str
    body: Callable[[Chat, int], dict]  # the request's body, for a token budget
    text: Callable[[dict], str]  # an event's text ("" if none)
    tokens: Callable[[dict], int | None]  # the output tokens an event counts (its usage), if any


def _openai_text(event: dict) -> str:
    """A completions chunk's text, or a chat chunk's delta content."""
    choice = (event.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _openai_tokens(event: dict) -> int | None:
    return (event.get("usage") or {}).get("completion_tokens")


def _anthropic_text(event: dict) -> str:
    return event["delta"].get("text") or "" if event.get("type") == "content_block_delta" else ""


def _anthropic_tokens(event: dict) -> int | None:
    return event["usage"]["output_tokens"] if event.get("type") == "message_delta" else None


def _responses_text(event: dict) -> str:
    return event["delta"] if event.get("type") == "response.output_text.delta" else ""


def _responses_tokens(event: dict) -> int | None:
    # a response cut at max_output_tokens ends with response.incomplete
    done = event.get("type") in ("response.completed", "response.incomplete")
    return event["response"]["usage"]["output_tokens"] if done else None


_OPENAI_STREAM = {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0, "model": "braid"}
ROUTES = {
    "completions": Route(
        "/v1/completions",
        lambda c, n: {"prompt": c.prompt, "max_tokens": n, **_OPENAI_STREAM},
        _openai_text,
        _openai_tokens,
    ),
    "chat": Route(
        "/v1/chat/completions",
        lambda c, n: {"messages": c.messages, "max_tokens": n, **_OPENAI_STREAM},
        _openai_text,
        _openai_tokens,
    ),
    "anthropic": Route(
        "/v1/messages",
        lambda c, n: {"model": "braid", "messages": c.messages, "max_tokens": n, "temperature": 0, "stream": True},
        _anthropic_text,
        _anthropic_tokens,
    ),
    "responses": Route(
        "/v1/responses",
        lambda c, n: {"model": "braid", "input": c.content, "max_output_tokens": n, "temperature": 0, "stream": True},
        _responses_text,
        _responses_tokens,
    ),
}


def http_sender(http, new_tokens: int, route: Route):
    """One streamed call of `route`, timed per event; the tokens counted by its usage."""

    async def send(chat: Chat) -> StreamTiming:
        tick, timing = timed_stream(time.perf_counter())
        async with http.stream("POST", route.path, json=route.body(chat, new_tokens)) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    tick(bool(route.text(event)), route.tokens(event))
        return timing()

    return send


# ---------------------------------------------------------------- the run


async def chats(client, tokenizer, count: int, new_tokens: int) -> list[Chat]:
    """`count` distinct chats whose greedy answers run at least 8 tokens past `new_tokens` (so that
    every API ends each at the budget without ignore_eos), with the prompt the template makes of each,
    as text and ids; the server tokenizes the text to the very ids. Tried 16 at a time."""

    async def runs_past(chat: Chat) -> bool:
        chat.prompt_ids = list((await client.tokenize(messages=chat.messages)).token_ids)
        chat.prompt = tokenizer.decode(chat.prompt_ids, skip_special_tokens=False)
        if list((await client.tokenize(chat.prompt)).token_ids) != chat.prompt_ids:
            raise RuntimeError(f"the rendered prompt does not tokenize to the template's ids: {chat.prompt!r}")
        answer = await client.generate(messages=chat.messages, max_new_tokens=new_tokens + 8, temperature=0)
        return answer.usage.generated_tokens == new_tokens + 8

    pairs = [(a, b) for a in SUBJECTS for b in SUBJECTS if a != b]
    candidates = [
        Chat("", [], new_tokens, content=f"Write a long story about a {a} and a {b}. ({i})")
        for i, (a, b) in enumerate(pairs)
    ]
    found: list[Chat] = []
    for start in range(0, len(candidates), 16):
        batch = candidates[start : start + 16]
        found += [chat for chat, ok in zip(batch, await asyncio.gather(*map(runs_past, batch))) if ok]
        if len(found) >= count:
            return found[:count]
    raise RuntimeError(f"only {len(found)} chats run {new_tokens + 8} tokens; asked for {count}")


def cpu_seconds(pid: int) -> float:
    """The CPU time a process has used, all its threads (Linux: /proc/<pid>/stat utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(workload: workloads.Workload, send, pid: int, name: str) -> tuple[float, float, float]:
    """(output tok/s, TTFT p50 ms, the server's CPU ms per output token) of one run. The CPU time is
    the server's own, whatever else the machine runs: the front end's cost shows in it even where the
    wall-clock figures drift with the machine's load."""
    cpu = cpu_seconds(pid)
    timings, wall = await drive.run(workload, send)
    drive.check_counts(name, workload.requests, timings)
    tokens = sum(t.num_tokens for t in timings)
    return tokens / wall, percentile([t.ttft_s for t in timings], 50) * 1000, (cpu_seconds(pid) - cpu) * 1000 / tokens


async def main_async(args, tokenizer) -> dict:
    import httpx

    port = braid_server.free_port()
    results: dict = {streams: {name: [] for name in args.apis} for streams in (1, 16)}
    with tempfile.TemporaryDirectory() as tmp:
        async with braid_server.running(
            "continuous",
            threads=args.threads,
            max_batch_size=32,
            log_path=Path(tmp) / "server.log",
            extra_args=["--http-port", str(port), "--prefix-caching", "off"],
        ) as (client, pid):
            pool = await chats(client, tokenizer, 16 * args.requests, args.new_tokens)
            loads = {
                1: workloads.Workload("one", "1 stream", pool[: args.requests], concurrency=1),
                16: workloads.Workload("sixteen", "16 streams", pool, concurrency=16),
            }
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", timeout=600, limits=httpx.Limits(max_connections=64)
            ) as http:
                sends = {
                    name: http_sender(http, args.new_tokens, ROUTES[name])
                    if name in ROUTES
                    else grpc_sender(client, args.new_tokens, name)
                    for name in args.apis
                }
                for streams, workload in loads.items():
                    for name, send in sends.items():  # warm every way in
                        await measure(workload, send, pid, name)
                    for i in range(args.repeats):
                        order = args.apis[i % len(args.apis) :] + args.apis[: i % len(args.apis)]
                        for name in order:
                            results[streams][name].append(await measure(workload, sends[name], pid, name))
                        print(
                            f"{streams} streams, round {i + 1}: "
                            + ", ".join(
                                f"{n} {tok:.1f} tok/s ttft {ttft:.0f} ms cpu {cpu:.1f} ms/tok"
                                for n in args.apis
                                for tok, ttft, cpu in [results[streams][n][-1]]
                            ),
                            flush=True,
                        )
    return results


def table(results: dict, args) -> str:
    lines = [
        HEADING,
        "",
        f"`benchmarks/http_vs_grpc.py --repeats {args.repeats} --threads {args.threads} --new-tokens "
        f"{args.new_tokens} --requests {args.requests} --apis {','.join(args.apis)}` ({time.strftime('%Y-%m-%d')}, braid `{args.commit}`): one `braid serve "
        f"--http-port --prefix-caching off` (the embedded model, continuous mode), the same chats (one user "
        f"message, 40-50 prompt tokens after the template) through each way in, streamed, {args.requests} "
        f"request(s) per stream, one way in after another with the order rotated each round; medians of {args.repeats}. Greedy, {args.new_tokens} new tokens "
        f"(every stream checked to end at that count). ÷ gRPC is against the first row, measured in the same "
        f"rounds.",
        "",
        "| way in | streams | output tok/s | ÷ gRPC | TTFT p50 ms | ÷ gRPC | server CPU ms/token | ÷ gRPC |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for streams, by in results.items():
        base = [statistics.median(x[i] for x in by[BASELINE]) for i in (0, 1, 2)] if BASELINE in by else None
        for name, runs in by.items():
            tok, ttft, cpu = (statistics.median(x[i] for x in runs) for i in (0, 1, 2))
            ratios = [f"{v / b:.2f}" if base else "-" for v, b in zip((tok, ttft, cpu), base or (1, 1, 1))]
            lines.append(
                f"| {APIS[name]} | {streams} | {tok:.1f} | {ratios[0]} | {ttft:.0f} | {ratios[1]} | {cpu:.1f} "
                f"| {ratios[2]} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="requests each stream sends in a run")
    parser.add_argument("--apis", default=",".join(APIS), help=f"the ways in, in order (of {', '.join(APIS)})")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave docs/benchmarks.md")
    args = parser.parse_args()
    args.apis = args.apis.split(",")
    if unknown := set(args.apis) - set(APIS):
        parser.error(f"unknown --apis: {', '.join(sorted(unknown))}")
    args.commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=DOCS.parent, capture_output=True, text=True
    ).stdout.strip()
    from braid.server.config import EngineConfig
    from braid.server.model.loader import load

    text = table(asyncio.run(main_async(args, load(None, EngineConfig().cache_dir).hf_tokenizer)), args)
    print(text)
    if not args.no_write:
        report.write_section(DOCS, HEADING, text)


if __name__ == "__main__":
    main()
