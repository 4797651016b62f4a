"""The benchmark of issue 29: speculative decoding against none, one machine, one run, braid's
servers and llama.cpp's taking turns (A B C, C B A, ...) so that each round's ratios see the same
neighbours.

braid's systems: none; ngram (--speculative ngram); draft-random (--speculative draft with a tiny
random Llama of the same vocabulary: nearly every proposal rejected, the lower bound); draft-self (the
embedded model drafting for itself: nearly every proposal accepted, but a draft as costly as the
model, so no speed-up is possible; it shows the mechanics' cost, not a real pairing).

llama.cpp's (when a llama-server build is found, llamacpp.py; --no-llama-cpp to leave them out), on
the same GGUF file braid serves by default (the embedded model's), with the same requests over its
streamed /completion: none; ngram (--spec-type ngram-simple: the last --llama-cpp-ngram-n tokens
looked up in the context, --speculative-tokens proposed); draft-self (-md the same file).

1. Copy-heavy: "repeat / fix / rewrite this passage" chats whose answers reuse the input, one stream,
   greedy (the tokens are checked equal across each server's systems).
2. The chat workload of bench.py (prompts of 30-60 random words, 64 greedy tokens each) at 1 and 16
   streams.

For each: output tok/s (generated tokens over the wall time of the workload), the acceptance rate
(braid: ServerStatus over the run; llama.cpp: each request's final draft_n and draft_n_accepted) and
braid's tokens per forward pass. Prints its section (HEADING below) and writes it into
docs/benchmarks.md in place, leaving the page's other sections as they were.

    .venv/bin/python benchmarks/speculative.py                      # ~25 min on two cores
    .venv/bin/python benchmarks/speculative.py --quick --no-docs    # one round, fewer prompts
    .venv/bin/python benchmarks/speculative.py --quick --no-docs --requests 2 --max-new-tokens 24  # a smoke run
    .venv/bin/python benchmarks/speculative.py --systems ngram --speculative-tokens 8 --no-llama-cpp
    .venv/bin/python benchmarks/speculative.py --systems ngram --no-llama-cpp --no-docs  # the copy-heavy target
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import bench
import braid_server
from braid.server.config import EngineConfig
import llamacpp
import report
from workloads import PromptMaker

HEADING = "## Speculative decoding against llama.cpp's (make bench-speculative)"
LLAMA = "llama.cpp "  # the prefix of llama.cpp's systems' names
LLAMA_PARALLEL = 16  # llama-server's slots: at least the most streams of a workload
LONGEST = 512  # tokens a slot holds: the longest prompt (a copy-heavy chat, ~170) and its new tokens
PASSAGES = [
    "The river rises in the hills above the town and runs for forty miles to the sea. In spring the snow melts "
    "and the water comes down fast and brown, carrying branches and stones; in summer it is slow and clear, and "
    "children swim in the pools below the old mill. The mill has not turned since the war, but its wheel is "
    "still there, green with moss, and the miller's house is a small museum now.",
    "To reset the router, hold the button on its back for ten seconds until the light turns orange. Wait two "
    "minutes for it to restart, then connect to the network named on the sticker under the router, using the "
    "password printed beside it. Open a browser and go to the address shown on the same sticker to choose a "
    "new name and password for your network.",
    "Our company was founded in 1998 by three engineers who wanted to build better bicycles. We started in a "
    "garage with two machines and a borrowed van. Today we employ four hundred people in six countries, and "
    "every frame we sell is still designed, welded and tested in the town where we began.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / "
    "len(values)\n\n\ndef variance(values):\n    m = mean(values)\n    total = 0\n    for value in values:\n"
    "        total += (value - m) ** 2\n    return total / len(values)\n",
]
TYPOS = {
    "rises": "rizes",
    "water": "watter",
    "button": "buton",
    "network": "netwrok",
    "engineers": "enginers",
    "company": "compnay",
    "value": "valeu",
}
INSTRUCTIONS = [
    "Repeat the following passage exactly, word for word:\n\n{}",
    "Fix the spelling mistakes in this passage and write it out again in full:\n\n{}",
    "Rewrite this passage in the past tense, changing nothing else:\n\n{}",
]


def _typos(text: str) -> str:
    for right, wrong in TYPOS.items():
        text = text.replace(right, wrong, 1)
    return text


@dataclass
class Call:
    """One request of a workload: braid's Stream arguments, and the prompt's token ids when it is a
    prompt (llama.cpp gets those very ids; a chat goes through llama-server's own chat template)."""

    params: dict
    prompt_ids: list[int] | None = None


def copy_requests(quick: bool) -> list[Call]:
    chats = [
        INSTRUCTIONS[i % len(INSTRUCTIONS)].format(_typos(p) if i % 3 == 1 else p)
        for i, p in enumerate(PASSAGES * (1 if quick else 3))
    ]
    return [Call(dict(messages=[("user", c)], max_new_tokens=160, temperature=0)) for c in chats]


def _embedded() -> str:
    """The embedded model's folder (converted once into braid's cache)."""
    from braid.server.model.loader import default_cache_dir, resolve

    return str(resolve(None, default_cache_dir())[1])


def random_draft(path: Path) -> Path:
    """A tiny random Llama with the embedded model's tokenizer: a draft that is nearly always wrong,
    the lower bound of draft speculation (the tests' tiny model)."""
    from braid_testing.models import save_model, tiny_model  # tests/support: on the path braid_server sets

    model = tiny_model(max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=None)
    return save_model(path, model, Path(_embedded()))


def chat_requests(count: int) -> list[Call]:
    from transformers import AutoTokenizer

    maker = PromptMaker(AutoTokenizer.from_pretrained(_embedded()))
    return [
        Call(dict(prompt=r.prompt, max_new_tokens=64, ignore_eos=True, temperature=0), r.prompt_ids)
        for r in maker.batch(count, 30, 60)
    ]


@dataclass
class Run:
    """One workload on one server: its wall time, each request's generated tokens (ids) and prompt
    length as the server counted it, and the tokens generated in all."""

    seconds: float
    tokens: list[list[int]]
    prompt_tokens: list[int]
    generated: int


async def _closed_loop(one, calls: list[Call], streams: int) -> Run:
    """`calls` in a closed loop of `streams` streams; `one(call)` runs one: (tokens, prompt tokens, count)."""
    queue = list(enumerate(calls))
    done: list = [None] * len(calls)

    async def stream() -> None:
        while queue:
            i, call = queue.pop(0)
            done[i] = await one(call)

    start = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(streams)))
    seconds = time.perf_counter() - start
    return Run(seconds, [d[0] for d in done], [d[1] for d in done], sum(d[2] for d in done))


class BraidSystem:
    """A braid server over gRPC; counters from its ServerStatus."""

    def __init__(self, client) -> None:
        self.client = client

    async def prepare(self, calls: list[Call]) -> None:
        pass

    async def run(self, calls: list[Call], streams: int) -> Run:
        async def one(call: Call):
            tokens: list[int] = []
            async with self.client.stream(**call.params) as generation:
                async for message in generation:
                    tokens += message.token_ids
            return tokens, generation.final.usage.prompt_tokens, len(tokens)

        return await _closed_loop(one, calls, streams)

    async def counters(self) -> list:
        """tokens generated, forward passes, proposals, accepted proposals: so far."""
        status = await self.client.server_status()
        return [
            status.tokens_generated,
            status.forward_passes,
            status.speculative_proposed_tokens,
            status.speculative_accepted_tokens,
        ]


class LlamaCppSystem:
    """A llama-server over HTTP (llamacpp.py's streamed /completion), the requests made as braid's:
    greedy, the same prompt ids or the same chat through the GGUF's chat template, the same new
    tokens, EOS ignored where braid's request ignores it, the prompt cache on (braid's prefix cache is
    on and these requests carry no salt). Counters from each request's final timings (draft_n,
    draft_n_accepted); the server reports no forward passes."""

    def __init__(self, http, url: str) -> None:
        self.http, self.url = http, url
        self.bodies: dict[int, dict] = {}
        self.totals = [0, None, 0, 0]

    async def prepare(self, calls: list[Call]) -> None:
        for call in calls:
            p = call.params
            if "messages" in p:
                messages = [{"role": role, "content": content} for role, content in p["messages"]]
                prompt = await llamacpp.apply_template(self.http, self.url, messages)
            else:
                prompt = call.prompt_ids
            self.bodies[id(call)] = {
                "prompt": prompt,
                "n_predict": p["max_new_tokens"],
                "ignore_eos": p.get("ignore_eos", False),
                "temperature": 0,
                "stream": True,
                "cache_prompt": True,
                "return_tokens": True,
            }

    async def run(self, calls: list[Call], streams: int) -> Run:
        async def one(call: Call):
            tokens: list[int] = []
            final: dict = {}
            async for chunk in llamacpp.completion_chunks(self.http, self.url, self.bodies[id(call)]):
                tokens += chunk.get("tokens") or []
                if chunk.get("stop"):
                    final = chunk
            count = max(len(tokens), final.get("tokens_predicted", 0))
            timings = final.get("timings", {})
            self.totals[0] += count
            self.totals[2] += timings.get("draft_n", 0)
            self.totals[3] += timings.get("draft_n_accepted", 0)
            return tokens, final.get("tokens_evaluated", -1), count

        return await _closed_loop(one, calls, streams)

    async def counters(self) -> list:
        return list(self.totals)


def llama_cpp_flags(args, gguf: Path) -> dict[str, list[str]]:
    """llama-server's flags for each llama.cpp system: ngram-simple (the most recent match of the last
    --llama-cpp-ngram-n tokens in the context, the tokens after it proposed) drafting as many tokens
    as braid's --speculative-tokens; draft-self: the same file as its own draft model."""
    k = str(args.speculative_tokens)
    return {
        "none": [],
        "ngram": [
            "--spec-type",
            "ngram-simple",
            "--spec-ngram-simple-size-n",
            str(args.llama_cpp_ngram_n),
            "--spec-ngram-simple-size-m",
            k,
            "--spec-draft-n-max",
            k,
        ],
        "draft-self": ["--spec-type", "draft-simple", "-md", str(gguf), "--spec-draft-n-max", k],
    }


async def start_llama_cpp(stack, args, workloads: dict, log_dir: Path) -> dict:
    """The llama.cpp systems, started on braid's default model file (the embedded GGUF)."""
    import httpx

    from braid.server.model.loader import embedded_gguf

    llama = llamacpp.find()
    # A connection for each request (a fraction of a millisecond on loopback): a request sent on the
    # connection of the one before it, just ended, failed with "Server disconnected without sending a
    # response" (llama-server had closed it).
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    http = await stack.enter_async_context(httpx.AsyncClient(timeout=900, limits=limits))
    gguf = embedded_gguf()
    parallel = max(LLAMA_PARALLEL, *(streams for _, streams in workloads.values()))
    context = llamacpp.context_size(parallel, LONGEST)
    systems = {}
    for name, extra in llama_cpp_flags(args, gguf).items():
        if name in args.llama_cpp_systems:
            url, _ = await asyncio.to_thread(
                stack.enter_context,
                llamacpp.running_server(
                    llama,
                    gguf,
                    braid_server.free_port(),
                    parallel=parallel,
                    context=context,
                    threads=args.threads,
                    log_path=log_dir / f"llama-cpp-{name}.log",
                    extra_args=extra,
                ),
            )
            systems[LLAMA + name] = LlamaCppSystem(http, url)
    return systems


async def measure(args) -> dict:
    workloads = {
        "copy-1": (copy_requests(args.quick), 1),
        "chat-1": (chat_requests(4), 1),
        "chat-16": (chat_requests(16 if args.quick else 32), 16),
    }
    for name, (calls, streams) in workloads.items():  # the smoke run's limits
        for call in calls:
            call.params["max_new_tokens"] = min(call.params["max_new_tokens"], args.max_new_tokens or 10**9)
        workloads[name] = (calls[: args.requests or None], streams)
    log_dir = Path(tempfile.mkdtemp(prefix="braid-spec-bench-"))
    k = ["--speculative-tokens", str(args.speculative_tokens)]
    flags = {
        "none": [],
        "ngram": ["--speculative", "ngram", *k],
        "draft-random": ["--speculative", "draft", "--draft-model", str(random_draft(log_dir / "random")), *k],
        "draft-self": ["--speculative", "draft", "--draft-model", _embedded(), *k],
    }
    results: dict = {}
    counts: dict = {}  # tokens, passes (None: not reported), proposed, accepted
    seen: dict = {}  # (system, workload): the last round's Run
    async with contextlib.AsyncExitStack() as stack:
        systems: dict = {}
        for name in args.systems:
            client, _ = await stack.enter_async_context(
                braid_server.running(
                    "continuous",
                    threads=args.threads,
                    max_batch_size=32,
                    log_path=log_dir / f"{name}.log",
                    extra_args=["--kv-cache-memory", "512MiB", *flags[name]],
                )
            )
            systems[name] = BraidSystem(client)
        if args.llama_cpp_systems:
            systems |= await start_llama_cpp(stack, args, workloads, log_dir)
        for system in systems.values():
            await system.prepare([call for calls, _ in workloads.values() for call in calls])
        for name, (calls, streams) in workloads.items():  # a warm-up of each, then rounds
            for system in systems.values():
                await system.run(calls[:2], min(streams, 2))
        for name, (calls, streams) in workloads.items():
            for round_ in range(1 if args.quick else args.rounds):  # A B C, then C B A: paired under the same load
                order = list(systems.items()) if round_ % 2 == 0 else list(systems.items())[::-1]
                for system_name, system in order:
                    before = await system.counters()
                    run = await system.run(calls, streams)
                    after = await system.counters()
                    results.setdefault((system_name, name), []).append(run.generated / run.seconds)
                    c = counts.setdefault((system_name, name), [0, 0, 0, 0])
                    for j, (a, b) in enumerate(zip(after, before)):
                        c[j] = None if a is None else c[j] + a - b
                    seen[system_name, name] = run
    return dict(results=results, counts=counts, seen=seen, workloads=workloads, systems=list(systems))


def _median_ratio(m: dict, system: str, base: str, workload: str) -> float:
    return statistics.median(a / b for a, b in zip(m["results"][system, workload], m["results"][base, workload]))


def _same(m: dict, workload: str, systems: list[str], base: str) -> str:
    ok = all(m["seen"][s, workload].tokens == m["seen"][base, workload].tokens for s in systems)
    return "identical" if ok else "DIFFERENT"


def _checks(m: dict) -> list[str]:
    """Within each server, the tokens with and without speculation; across them, the prompts' lengths
    (the same chat template and prompt ids) and the comparisons of braid's rows to llama.cpp's."""
    braid = [s for s in m["systems"] if not s.startswith(LLAMA)]
    llama = [s for s in m["systems"] if s.startswith(LLAMA)]
    lines = [
        "Tokens with and without speculation, braid: "
        + ", ".join(f"{w}: {_same(m, w, braid, 'none')}" for w in m["workloads"])
        + "."
    ]
    if llama:
        base = LLAMA + "none"
        lines.append("llama.cpp: " + ", ".join(f"{w}: {_same(m, w, llama, base)}" for w in m["workloads"]) + ".")
        lines.append(
            "Prompt tokens, braid against llama.cpp: "
            + ", ".join(
                f"{w}: {'the same' if m['seen']['none', w].prompt_tokens == m['seen'][base, w].prompt_tokens else 'DIFFERENT'}"
                for w in m["workloads"]
            )
            + "; tokens generated in a round (copy-heavy ends at EOS), braid "
            + ", ".join(f"{w}: {m['seen']['none', w].generated}/{m['seen'][base, w].generated}" for w in m["workloads"])
            + " (braid/llama.cpp, without speculation)."
        )
        for system in ("none", "ngram", "draft-self"):
            if system in braid and LLAMA + system in llama:
                lines.append(
                    f"braid {system} against llama.cpp {system}, output tok/s (median of the rounds' "
                    "ratios): "
                    + ", ".join(f"{w} {_median_ratio(m, system, LLAMA + system, w):.2f}x" for w in m["workloads"])
                    + "."
                )
    return lines


def markdown(m: dict, args) -> str:
    rows = [
        "| workload | system | output tok/s (median) | tokens per pass | acceptance | ratio to its server's "
        "none (median of the rounds' ratios) |",
        "|---|---|---|---|---|---|",
    ]
    titles = {
        "copy-1": "copy-heavy (repeat/fix/rewrite a passage), 1 stream",
        "chat-1": "chat, 1 stream",
        "chat-16": "chat, 16 streams",
    }
    for name in m["workloads"]:
        for system in m["systems"]:
            base = LLAMA + "none" if system.startswith(LLAMA) else "none"
            tok_s = statistics.median(m["results"][system, name])
            tokens, passes, proposed, accepted = m["counts"][system, name]
            acceptance = f"{accepted / proposed:.0%} of {proposed}" if proposed else "-"
            per_pass = f"{tokens / max(1, passes):.2f}" if passes is not None else "-"
            label = system if system.startswith(LLAMA) else f"braid {system}"
            rows.append(
                f"| {titles[name]} | {label} | {tok_s:.1f} | {per_pass} | {acceptance} "
                f"| {_median_ratio(m, system, base, name):.2f}x |"
            )
    runs = max(len(v) for v in m["results"].values())
    llama = ""
    if args.llama_cpp_systems:
        flags = llama_cpp_flags(args, Path("<the same GGUF>"))
        parallel = max(LLAMA_PARALLEL, *(s for _, s in m["workloads"].values()))
        llama = (
            f" llama.cpp ({llamacpp.find().build_info}): `llama-server -m <the same GGUF> -t {args.threads} "
            f"-tb {args.threads} --parallel {parallel} -c {llamacpp.context_size(parallel, LONGEST)}` "
            "plus, per system, "
            + "; ".join(
                f"{name}: `{' '.join(f) or '(nothing)'}`" for name, f in flags.items() if name in args.llama_cpp_systems
            )
            + ". Its requests are braid's: the same prompt ids, or the same chat through the GGUF's chat "
            "template (`/apply-template`), greedy, the same new tokens, EOS ignored where braid ignores it, "
            "the prompt cache on as braid's prefix cache is. ngram-simple looks up one n-gram length only "
            "(the most recent match of the last n tokens), where braid tries --ngram-max 4 down to "
            "--ngram-min 2; llama.cpp reports no forward passes (tokens per pass: -)."
        )
    command = (
        f"benchmarks/speculative.py --threads {args.threads} --speculative-tokens {args.speculative_tokens} "
        f"--systems {','.join(args.systems)}"
    )
    if args.llama_cpp_systems:
        command += (
            f" --llama-cpp-systems {','.join(args.llama_cpp_systems)} --llama-cpp-ngram-n {args.llama_cpp_ngram_n}"
        )
    else:
        command += " --no-llama-cpp"
    for flag, value in (
        ("--quick", args.quick),
        ("--requests", args.requests),
        ("--max-new-tokens", args.max_new_tokens),
    ):
        command += f" {flag}" + ("" if value is True else f" {value}") if value else ""
    return "\n".join(
        [
            HEADING,
            "",
            f"`{command}` (`make bench-speculative`), the embedded SmolLM2-135M-Instruct (Q4_1, int8 rows), braid in "
            f"continuous mode, {runs} rounds of each workload, the servers taking turns (A B C, C B A, ...)."
            + llama
            + " The machine was shared with other work while this ran, so the absolute figures are noisy; the ratios "
            "are within one run.",
            "",
            *rows,
            "",
            *_checks(m),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, fewer prompts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for every server")
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        default=EngineConfig.speculative_tokens,
        help="K, for braid and llama.cpp alike (default: braid's own)",
    )
    parser.add_argument(
        "--systems",
        default="none,ngram,draft-random,draft-self",
        help="braid's, of: none (always run), ngram, draft-random (a tiny random draft), draft-self "
        "(the embedded model drafting for itself)",
    )
    parser.add_argument(
        "--llama-cpp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="llama.cpp's systems too (default: when a llama-server build is found)",
    )
    parser.add_argument(
        "--llama-cpp-systems",
        default="none,ngram,draft-self",
        help="llama.cpp's, of: none (always run), ngram (--spec-type ngram-simple), draft-self",
    )
    parser.add_argument(
        "--llama-cpp-ngram-n",
        type=int,
        default=4,
        help="llama.cpp ngram's lookup length (--spec-ngram-simple-size-n; braid's --ngram-max)",
    )
    parser.add_argument("--requests", type=int, help="at most this many requests a workload (a smoke run)")
    parser.add_argument("--max-new-tokens", type=int, help="at most this many new tokens a request (a smoke run)")
    parser.add_argument("--output", type=Path, default=bench.DOCS / "benchmarks.md", help="the page to write to")
    parser.add_argument("--no-docs", action="store_true", help="print the section only")
    args = parser.parse_args(argv)
    args.systems = ["none"] + [s for s in args.systems.split(",") if s and s != "none"]
    found = llamacpp.find() is not None
    if args.llama_cpp and not found:
        parser.error("--llama-cpp: no llama-server build found (benchmarks/bench.py builds one)")
    wanted = [s for s in args.llama_cpp_systems.split(",") if s and s != "none"]
    if unknown := set(wanted) - {"ngram", "draft-self"}:
        parser.error(f"unknown --llama-cpp-systems: {', '.join(sorted(unknown))}")
    args.llama_cpp_systems = ["none", *wanted] if (found if args.llama_cpp is None else args.llama_cpp) else []
    section = markdown(asyncio.run(measure(args)), args)
    print(section)
    if not args.no_docs:
        args.output.write_text(report.with_section(args.output.read_text(), HEADING, section))


if __name__ == "__main__":
    main()
