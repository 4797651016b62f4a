"""The benchmark of issue 29: speculative decoding against none, one machine, one run, the servers
taking turns (A B C, C B A, ...) so that each round's ratios see the same neighbours.

Systems: none; ngram (--speculative ngram); draft-random (--speculative draft with a tiny random
Llama of the same vocabulary: nearly every proposal rejected, the lower bound); draft-self (the
embedded model drafting for itself: nearly every proposal accepted, but a draft as costly as the
model, so no speed-up is possible; it shows the mechanics' cost, not a real pairing).

1. Copy-heavy: "repeat / fix / rewrite this passage" chats whose answers reuse the input, one stream,
   greedy (the tokens are checked equal across systems).
2. The chat workload of bench.py (prompts of 30-60 random words, 64 greedy tokens each) at 1 and 16
   streams.

For each: output tok/s (generated tokens over the wall time of the workload), the acceptance rate and
tokens per forward pass (ServerStatus, over the run). Prints the section "Speculative decoding
(issue 29)" and writes it into docs/benchmarks.md (bench.py keeps it when it rewrites the page).

    .venv/bin/python benchmarks/speculative.py                      # ~15 min on two cores
    .venv/bin/python benchmarks/speculative.py --quick --no-docs    # one round, fewer prompts
    .venv/bin/python benchmarks/speculative.py --systems ngram --speculative-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import bench
import braid_server
import report
from workloads import PromptMaker

HEADING = "## Speculative decoding (issue 29)"
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
TYPOS = {"rises": "rizes", "water": "watter", "button": "buton", "network": "netwrok", "engineers": "enginers",
         "company": "compnay", "value": "valeu"}
INSTRUCTIONS = [
    "Repeat the following passage exactly, word for word:\n\n{}",
    "Fix the spelling mistakes in this passage and write it out again in full:\n\n{}",
    "Rewrite this passage in the past tense, changing nothing else:\n\n{}",
]


def _typos(text: str) -> str:
    for right, wrong in TYPOS.items():
        text = text.replace(right, wrong, 1)
    return text


def copy_requests(quick: bool) -> list[dict]:
    chats = [INSTRUCTIONS[i % len(INSTRUCTIONS)].format(_typos(p) if i % 3 == 1 else p)
             for i, p in enumerate(PASSAGES * (1 if quick else 3))]
    return [dict(messages=[("user", c)], max_new_tokens=160, temperature=0) for c in chats]


def _embedded() -> str:
    """The embedded model's folder (converted once into braid's cache)."""
    from braid.server.model.loader import default_cache_dir, resolve

    return str(resolve(None, default_cache_dir())[1])


def random_draft(path: Path) -> Path:
    """A tiny random Llama with the embedded model's tokenizer: a draft that is nearly always wrong,
    the lower bound of draft speculation (the tests' tiny model)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                 tie_word_embeddings=True, initializer_range=0.3)).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(_embedded()) / name, path / name)
    return path


def chat_requests(count: int) -> list[dict]:
    from transformers import AutoTokenizer

    maker = PromptMaker(AutoTokenizer.from_pretrained(_embedded()))
    return [dict(prompt=r.prompt, max_new_tokens=64, ignore_eos=True, temperature=0)
            for r in maker.batch(count, 30, 60)]


async def _workload(client, requests: list[dict], streams: int) -> tuple[float, list[list[int]]]:
    """Runs the requests in a closed loop of `streams` streams; (seconds, each request's tokens)."""
    queue = list(enumerate(requests))
    tokens: list[list[int]] = [[] for _ in requests]

    async def stream() -> None:
        while queue:
            i, request = queue.pop(0)
            async for message in client.stream(**request):
                tokens[i] += message.token_ids

    start = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(streams)))
    return time.perf_counter() - start, tokens


async def measure(args) -> dict:
    workloads = {"copy-1": (copy_requests(args.quick), 1), "chat-1": (chat_requests(4), 1),
                 "chat-16": (chat_requests(16 if args.quick else 32), 16)}
    log_dir = Path(tempfile.mkdtemp(prefix="braid-spec-bench-"))
    k = ["--speculative-tokens", str(args.speculative_tokens)]
    flags = {"none": [], "ngram": ["--speculative", "ngram", *k],
             "draft-random": ["--speculative", "draft", "--draft-model", str(random_draft(log_dir / "random")), *k],
             "draft-self": ["--speculative", "draft", "--draft-model", _embedded(), *k]}
    systems = {name: flags[name] for name in args.systems}
    results: dict = {(s, w): [] for s in systems for w in workloads}
    counts: dict = {(s, w): [0, 0, 0, 0] for s in systems for w in workloads}  # tokens, passes, proposed, accepted
    tokens_seen: dict = {}
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for name, extra in systems.items():
            clients[name], _ = await stack.enter_async_context(braid_server.running(
                "continuous", threads=args.threads, max_batch_size=32, log_path=log_dir / f"{name}.log",
                extra_args=["--kv-cache-memory", "512MiB", *extra]))
        for name, (requests, streams) in workloads.items():  # a warm-up of each, then rounds
            for client in clients.values():
                await _workload(client, requests[:2], min(streams, 2))
        for name, (requests, streams) in workloads.items():
            for round_ in range(1 if args.quick else args.rounds):  # A B C, then C B A: paired under the same load
                order = list(clients.items()) if round_ % 2 == 0 else list(clients.items())[::-1]
                for system, client in order:
                    before = await client.server_status()
                    seconds, tokens = await _workload(client, requests, streams)
                    after = await client.server_status()
                    results[system, name].append(sum(map(len, tokens)) / seconds)
                    c = counts[system, name]
                    for j, field in enumerate(("tokens_generated", "forward_passes", "speculative_proposed_tokens",
                                               "speculative_accepted_tokens")):
                        c[j] += getattr(after, field) - getattr(before, field)
                    tokens_seen.setdefault(name, {})[system] = tokens
    same = {name: all(tokens == seen["none"] for tokens in seen.values()) for name, seen in tokens_seen.items()}
    return dict(results=results, counts=counts, same=same, workloads=workloads, systems=list(systems))


def markdown(m: dict, args) -> str:
    rows = ["| workload | system | output tok/s (median) | tokens per pass | acceptance | ratio to none "
            "(median of the rounds' ratios) |", "|---|---|---|---|---|---|"]
    titles = {"copy-1": "copy-heavy (repeat/fix/rewrite a passage), 1 stream", "chat-1": "chat, 1 stream",
              "chat-16": "chat, 16 streams"}
    for name in m["workloads"]:
        base = m["results"]["none", name]
        for system in m["systems"]:
            tok_s = statistics.median(m["results"][system, name])
            ratio = statistics.median(a / b for a, b in zip(m["results"][system, name], base))
            tokens, passes, proposed, accepted = m["counts"][system, name]
            acceptance = f"{accepted / proposed:.0%} of {proposed}" if proposed else "-"
            rows.append(f"| {titles[name]} | {system} | {tok_s:.1f} | {tokens / max(1, passes):.2f} | {acceptance} "
                        f"| {ratio:.2f}x |")
    same = ", ".join(f"{name}: {'identical' if ok else 'DIFFERENT'}" for name, ok in m["same"].items())
    runs = {name: len(v) for name, v in m["results"].items()}
    return "\n".join([
        HEADING, "",
        f"`benchmarks/speculative.py --threads {args.threads} --speculative-tokens {args.speculative_tokens} "
        f"--systems {','.join(args.systems)}` "
        f"(`make bench-speculative`), the embedded SmolLM2-135M-Instruct (Q4_1, int8 rows), continuous mode, "
        f"{max(runs.values())} rounds of each workload, the two servers taking turns (A B, B A, ...). The machine "
        "was shared with other work while this ran, so the absolute figures are noisy; the ratios are within "
        "one run. Tokens with and without speculation: " + same + ".", "",
        *rows, "",
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, fewer prompts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for both servers")
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument("--systems", default="none,ngram,draft-random,draft-self",
                        help="of: none (always run), ngram, draft-random (a tiny random draft), draft-self (the "
                             "embedded model drafting for itself)")
    parser.add_argument("--output", type=Path, default=bench.DOCS / "benchmarks.md", help="the page to write to")
    parser.add_argument("--no-docs", action="store_true", help="print the section only")
    args = parser.parse_args(argv)
    args.systems = ["none"] + [s for s in args.systems.split(",") if s and s != "none"]
    section = markdown(asyncio.run(measure(args)), args)
    print(section)
    if not args.no_docs:
        args.output.write_text(report.with_section(args.output.read_text(), HEADING, section))


if __name__ == "__main__":
    main()
