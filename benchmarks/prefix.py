"""The benchmark of issue 13: braid's paged KV cache and prefix sharing, one machine, one run.

1. Capacity: how many 200-token sessions are admitted at once under --kv-cache-memory 512MiB
   --max-seq-len 4096, braid now against braid at SLOT_COMMIT (a whole --max-seq-len slot per
   session): the peak of ServerStatus's sessions_active while 128 of them are sent at once.
2. A shared prefix: 16 requests at once, each a 1,000-token prefix and its own 20-50-token question;
   cold (a cache salt per request) against warm (one salt, the prefix cached), and llama.cpp's
   server beside it with cache_prompt false and true.
3. A 4-turn chat through the chat template: the 4th turn's TTFT with the chat's salt (warm) and
   with a fresh one (cold).

Prints its section (report.PREFIX_HEADING) and writes it into docs/benchmarks.md in place,
leaving the page's other sections as they were.

    .venv/bin/python benchmarks/prefix.py                 # everything (make bench-prefix; ~15 min)
    .venv/bin/python benchmarks/prefix.py --quick         # 8 requests, 16 new tokens, one run each
    .venv/bin/python benchmarks/prefix.py --parts capacity --no-docs
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import math
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import bench
import braid_server
import drive
import llamacpp
import machine
import report
from metrics import Row
from prefix_report import BRAID_COLD, BRAID_WARM, LLAMA_COLD, LLAMA_WARM, PREFIX, PrefixResults, markdown, targets
from workloads import SEED, PromptMaker, Request, Workload

PARTS = ("capacity", "prefix", "chat")
SLOT_COMMIT = "82e61da"  # the last braid with one KV-cache slot of --max-seq-len per session
KV_MEMORY, MAX_SEQ_LEN, MAX_SESSIONS = 512 * 2**20, 4096, 128
CAPACITY_FLAGS = [
    "--kv-cache-memory",
    "512MiB",
    "--max-seq-len",
    str(MAX_SEQ_LEN),
    "--max-sessions",
    str(MAX_SESSIONS),
    "--max-concurrent-streams",
    "256",
]  # all 128 streams on one connection
SESSION_PROMPT, SESSION_NEW = 184, 16  # a 200-token session
POLL_S, PLATEAU_S = 0.02, 2.0
PREFIX_TOKENS, QUESTION_TOKENS = 1000, (20, 50)
CHAT_SYSTEM_TOKENS, CHAT_TURNS = 100, 4
RUN_COUNTS = ("prompt_tokens_cached", "prompt_tokens_computed", "preemptions", "kv_evictions")  # per run
STATE = ("kv_pages_used", "kv_pages_cached", "kv_pages_total", "kv_page_tokens")  # as the run left it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 requests, 16 new tokens, one run of each")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of: {', '.join(PARTS)}")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the median is quoted")
    parser.add_argument("--skip-llama-cpp", action="store_true", help="no llama.cpp in the shared-prefix part")
    parser.add_argument("--build-llama-cpp", action="store_true", help="rebuild llama.cpp even if a build is found")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for every server")
    parser.add_argument("--output", type=Path, default=bench.DOCS / "benchmarks.md", help="the page to write to")
    parser.add_argument("--no-docs", action="store_true", help="print the section only")
    parser.add_argument(
        "--report-from",
        type=Path,
        metavar="JSON",
        help="write the section from a run's saved results (~/.cache/braid/bench/prefix-*.json)",
    )
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    return args


# ---------------------------------------------------------------- ServerStatus


async def counters(client) -> dict[str, int]:
    status = await client.server_status()
    return {name: getattr(status, name) for name in RUN_COUNTS + STATE}


def one_run(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counts a run added, and the cache's state after it."""
    return after | {name: after[name] - before[name] for name in RUN_COUNTS}


def _finished(status) -> int:
    return sum(count for _, count in status.sessions_finished.ListFields())


async def settled(client, timeout_s: float = 30.0) -> None:
    """Waits until no session is queued or running (cancelled ones take a step to leave)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = await client.server_status()
        if not status.sessions_active and not status.sessions_queued:
            return
        await asyncio.sleep(POLL_S)


# ---------------------------------------------------------------- 1. capacity


def slot_server() -> Path:
    """braid's server/ at SLOT_COMMIT, extracted once with git archive; first on PYTHONPATH, it is the
    server `braid serve` runs (with the stubs and client of this tree, which only add fields)."""
    root = bench.RESULTS_DIR / f"braid-{SLOT_COMMIT}"
    if not (root / "server").is_dir():
        archive = subprocess.run(
            ["git", "archive", SLOT_COMMIT, "server"], cwd=machine.REPO, capture_output=True, check=True
        ).stdout
        staging = Path(tempfile.mkdtemp(prefix="braid-slot-", dir=bench.RESULTS_DIR))
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(staging, filter="data")
        root.mkdir(parents=True, exist_ok=True)
        (staging / "server").rename(root / "server")
    return root / "server"


def slot_formula(model_path: str) -> int:
    """Slots by SLOT_COMMIT's fit_slots: min(--max-sessions, budget // (max_seq_len * bytes per token))
    with a float32 KV cache, as on the CPU."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    max_seq_len = min(MAX_SEQ_LEN, config.max_position_embeddings)
    return min(MAX_SESSIONS, KV_MEMORY // (max_seq_len * bytes_per_token))


async def peak_admitted(client, requests: list[Request]) -> dict[str, int]:
    """Sends every request at once and polls ServerStatus until sessions_active has not risen for
    PLATEAU_S after a session ended (or all ended), then cancels the rest: the peak, and the pages
    in use then."""
    send = braid_server.sender(client)
    started = await client.server_status()
    tasks = [asyncio.create_task(send(r)) for r in requests]
    peak, risen = {"admitted": 0, "kv_pages_used": 0}, time.monotonic()
    try:
        while not all(t.done() for t in tasks):
            status = await client.server_status()
            if status.sessions_active > peak["admitted"]:
                peak = {"admitted": status.sessions_active, "kv_pages_used": status.kv_pages_used}
                risen = time.monotonic()
            if _finished(status) > _finished(started) and time.monotonic() - risen > PLATEAU_S:
                break
            await asyncio.sleep(POLL_S)
    finally:
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    if failed := [o for o in outcomes if isinstance(o, Exception)]:
        raise failed[0]
    return peak


async def bench_capacity(maker: PromptMaker, model_path: str, args, results: PrefixResults) -> None:
    requests = [
        replace(maker.prompt(SESSION_PROMPT), max_new_tokens=SESSION_NEW, cache_salt=f"capacity-{i}")
        for i in range(MAX_SESSIONS)
    ]
    for key, env in (("paged", None), ("slot", {"PYTHONPATH": str(slot_server())})):
        bench.log(f"capacity, {key}: {len(requests)} sessions of {SESSION_PROMPT}+{SESSION_NEW} tokens at once")
        async with braid_server.running(
            "continuous",
            threads=args.threads,
            max_batch_size=bench.MAX_BATCH_SIZE,
            log_path=Path(tempfile.gettempdir()) / f"braid-prefix-{key}.log",
            extra_args=CAPACITY_FLAGS,
            env=env,
        ) as (client, _):
            before = await counters(client)
            if bool(before["kv_page_tokens"]) != (key == "paged"):  # 0 from a server before issue 13
                raise RuntimeError(
                    f"the {key} server is not the one asked for (kv_page_tokens {before['kv_page_tokens']})"
                )
            if key == "paged":
                results.settings["kv_cache_dtype"] = (await client.model_info()).kv_cache_dtype
            peak = await peak_admitted(client, requests)
            await settled(client)
            after = one_run(before, await counters(client))
        how = "peak `sessions_active`, measured"
        if key == "slot":
            how += f"; {SLOT_COMMIT}'s fit_slots gives {slot_formula(model_path)}"
        results.capacity[key] = {**after, **peak, "how": how}
        if key == "paged":  # the slot server has none of these counters
            results.counters["capacity, paged"] = after
        bench.log(f"  {key}: {peak['admitted']} admitted at once")


# ---------------------------------------------------------------- 2. a shared prefix


def with_prefix(maker: PromptMaker, prefix: Request, question: Request, new_tokens: int) -> Request:
    text = f"{prefix.prompt}\n{question.prompt}"
    ids = maker.encode(text)
    if ids[: len(prefix.prompt_ids)] != prefix.prompt_ids:
        raise RuntimeError("the question changed the tokens of the prefix")
    return Request(text, ids, new_tokens)


async def measure(
    system: str,
    workload: Workload,
    send,
    pid: int,
    requests_for: Callable[[int], list[Request]],
    client=None,
    results: PrefixResults | None = None,
) -> Row:
    """bench.measure, run k sending requests_for(k); with `client`, ServerStatus's counters after each run."""
    runs = itertools.count()

    async def run_once():
        before = client and await counters(client)
        outcome = await drive.run(replace(workload, requests=requests_for(next(runs))), send)
        if client:
            results.counters[system] = one_run(before, await counters(client))
        return outcome

    return await bench.measure(system, workload, run_once, [pid], budget_s=math.inf)


def prefix_runs(maker: PromptMaker, s: dict) -> tuple[list[Request], list[list[Request]], Workload]:
    """The warm-up's requests, one set of requests per run (a retried run included), and the workload:
    every set shares one prefix and has its own questions, so a warm run finds the prefix cached,
    never its questions."""
    prefix = maker.prompt(PREFIX_TOKENS)
    warm_up, *sets = [
        [
            with_prefix(maker, prefix, question, s["new_tokens"])
            for question in maker.batch(s["count"], *QUESTION_TOKENS)
        ]
        for _ in range(s["repeats"] + bench.RETRIES + 2)
    ]
    return warm_up, sets, Workload(PREFIX, "shared prefix", sets[0], s["count"], repeats=s["repeats"])


async def bench_prefix(
    client, pid: int, warm_up: list[Request], sets: list[list[Request]], workload: Workload, results: PrefixResults
) -> None:
    def salted(salt: Callable[[int, int], str]) -> Callable[[int], list[Request]]:
        return lambda run: [replace(r, cache_salt=salt(run, i)) for i, r in enumerate(sets[run])]

    send = braid_server.sender(client)
    await braid_server.warm_up(send, [replace(r, cache_salt="warm") for r in warm_up])
    results.add(await measure(BRAID_WARM, workload, send, pid, salted(lambda run, i: "warm"), client, results))
    results.add(
        await measure(BRAID_COLD, workload, send, pid, salted(lambda run, i: f"cold-{run}-{i}"), client, results)
    )


async def bench_llama_cpp(
    warm_up: list[Request], sets: list[list[Request]], workload: Workload, args, results: PrefixResults
) -> None:
    import httpx

    from braid.server.model.loader import embedded_gguf

    if (llama := bench.prepare_llama_cpp(args, results)) is None:
        return
    longest = max(len(r.prompt_ids) + r.max_new_tokens for run in sets for r in run)
    count = workload.concurrency
    with llamacpp.running_server(
        llama,
        embedded_gguf(),
        braid_server.free_port(),
        parallel=count,
        context=llamacpp.context_size(count, longest),
        threads=args.threads,
        log_path=Path(tempfile.gettempdir()) / "braid-prefix-llama-server.log",
    ) as (url, pid):
        async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=64)) as http:
            warm, cold = llamacpp.sender(http, url, cache_prompt=True), llamacpp.sender(http, url)
            await braid_server.warm_up(warm, warm_up)
            results.add(await measure(LLAMA_WARM, workload, warm, pid, lambda run: sets[run]))
            results.add(await measure(LLAMA_COLD, workload, cold, pid, lambda run: sets[run]))


# ---------------------------------------------------------------- 3. a multi-turn chat


async def bench_chat(client, maker: PromptMaker, results: PrefixResults) -> None:
    """Each run a fresh chat of CHAT_TURNS turns, then its last turn again under a fresh salt."""
    s = results.settings
    system = maker.prompt(CHAT_SYSTEM_TOKENS).prompt
    questions = [q.prompt for q in maker.batch(CHAT_TURNS, *QUESTION_TOKENS)]
    params = {"max_new_tokens": s["chat_answer_tokens"], "temperature": 0}
    results.chat = {"warm": [], "cold": []}
    before = await counters(client)
    for run in range(s["repeats"]):
        machine.wait_until_quiet([], threshold=bench.DISTURBED_ABOVE, max_wait_s=bench.QUIET_WAIT_S)
        messages = [("system", system)]
        for question in questions:
            messages.append(("user", question))
            warm, generation = await braid_server.timed(client, messages=messages, cache_salt=f"chat-{run}", **params)
            messages.append(("assistant", generation.text))
        cold, cold_generation = await braid_server.timed(
            client, messages=messages[:-1], cache_salt=f"chat-cold-{run}", **params
        )
        for key, timing, final in (("warm", warm, generation.final), ("cold", cold, cold_generation.final)):
            results.chat[key].append(
                {
                    "ttft_ms": timing.ttft_s * 1000,
                    "prompt_tokens": final.usage.prompt_tokens,
                    "cached_tokens": final.usage.cached_tokens,
                }
            )
        bench.log(f"  chat {run}: 4th turn TTFT warm {warm.ttft_s * 1000:.0f} ms, cold {cold.ttft_s * 1000:.0f} ms")
    results.counters["chat (all runs)"] = one_run(before, await counters(client))


# ---------------------------------------------------------------- the run


def settings(args, command: str) -> dict:
    return {
        "command": command,
        "quick": args.quick,
        "repeats": 1 if args.quick else args.repeats,
        "slot_commit": SLOT_COMMIT,
        "capacity_flags": CAPACITY_FLAGS,
        "capacity_sessions": MAX_SESSIONS,
        "session_prompt": SESSION_PROMPT,
        "session_new": SESSION_NEW,
        "poll_ms": POLL_S * 1000,
        "plateau_s": PLATEAU_S,
        "count": 8 if args.quick else 16,
        "prefix_tokens": PREFIX_TOKENS,
        "question_tokens": QUESTION_TOKENS,
        "new_tokens": 16 if args.quick else 64,
        "chat_turns": CHAT_TURNS,
        "chat_system_tokens": CHAT_SYSTEM_TOKENS,
        "chat_answer_tokens": 32 if args.quick else 128,
        "braid_max_batch_size": bench.MAX_BATCH_SIZE,
        "disturbed_above": bench.DISTURBED_ABOVE,
    }


async def run_all(args, command: str) -> PrefixResults:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    from braid.server.model.loader import default_cache_dir, resolve

    _, model_path, _ = resolve(None, default_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    # Each part draws its prompts from its own seed: the same prompts whichever parts run.
    capacity_maker, prefix_maker, chat_maker = (PromptMaker(tokenizer, SEED + i) for i in range(len(PARTS)))
    results = PrefixResults(machine.describe(args.threads).as_dict(), settings(args, command))
    json_path = bench.RESULTS_DIR / f"prefix-{time.strftime('%Y%m%d-%H%M%S')}.json"
    bench.log(f"results are saved to {json_path}")
    if "capacity" in args.parts:
        await bench_capacity(capacity_maker, model_path, args, results)
        results.save(json_path)
    warm_up, sets, workload = prefix_runs(prefix_maker, results.settings)
    if {"prefix", "chat"} & set(args.parts):
        async with braid_server.running(
            "continuous",
            threads=args.threads,
            max_batch_size=bench.MAX_BATCH_SIZE,
            log_path=Path(tempfile.gettempdir()) / "braid-prefix.log",
        ) as (client, pid):
            results.settings["kv_cache_dtype"] = (await client.model_info()).kv_cache_dtype
            if "prefix" in args.parts:
                await bench_prefix(client, pid, warm_up, sets, workload, results)
                results.save(json_path)
            if "chat" in args.parts:
                await bench_chat(client, chat_maker, results)
    if "prefix" in args.parts and not args.skip_llama_cpp:
        await bench_llama_cpp(warm_up, sets, workload, args, results)
    if results.machine["braid_commit"] != machine.braid_commit():
        results.notes.append(f"braid's server/ changed during the run (now {machine.braid_commit()}).")
    results.save(json_path)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = ".venv/bin/python benchmarks/prefix.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    results = PrefixResults.load(args.report_from) if args.report_from else asyncio.run(run_all(args, command.strip()))
    section = markdown(results)
    if args.no_docs:
        print("\n" + section)
        return 0
    print("\n" + report.ratio_table(targets(results), issue=13) + "\n")
    report.write_section(args.output, report.PREFIX_HEADING, section)
    bench.log(f"wrote the section {report.PREFIX_HEADING!r} of {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
