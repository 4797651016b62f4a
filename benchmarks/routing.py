"""Prefix-affinity routing and stream hand-over on a local cluster (deploy/cluster.py: HAProxy and
3 replicas on this machine), one run; the figures of docs/deployment.md, "Prefix-affinity routing".

1. 6 system prompts of about 1,000 tokens, 8 questions each, in a shuffled order, 4 calls in
   flight at a time: TTFT p50/p95 (measured by the client, to the first token), generated tokens
   per second, and the share of prompt tokens found in a prefix cache, with braid's routing key
   (HAProxy's consistent hash with bounded load) against without it (leastconn). Each run has its
   own prompts, so neither finds the other's cached.
2. A rolling restart of the 3 replicas while 8 long greedy streams run through HAProxy, started
   again before each replica's restart: the seconds from SIGTERM to the replica's exit and to its
   return, without hand-over (--handover-grace 0: it waits for its streams) and with it.

    .venv/bin/python benchmarks/routing.py                       # the embedded model (~10 min on 2 cores)
    .venv/bin/python benchmarks/routing.py --model ./tiny --stream-tokens 256
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "deploy"))
from braid.client import Client  # noqa: E402
from braid_server import free_port  # noqa: E402
from cluster import Cluster, Replica, wait_until  # noqa: E402

WORDS = (
    "sea river stone light garden window letter market winter summer music paper forest table "
    "mountain bridge village morning evening silver orange yellow animal answer number story"
).split()


def system_prompt(name: str, words: int) -> str:
    rng = random.Random(name)
    return f"Rules of {name}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def workload(cluster: Cluster, run: str, route_keys: bool, args) -> dict:
    """The 48 calls, `args.concurrency` at a time: TTFT p50/p95 (ms), tokens/s, cached share."""
    calls = [(system_prompt(f"{run}-{i}", args.prompt_words), q) for i in range(6) for q in range(8)]
    random.Random(run).shuffle(calls)
    ttfts, cached, prompt, generated = [], 0, 0, 0
    lock = threading.Lock()

    def one(client: Client, system: str, question: int) -> None:
        nonlocal cached, prompt, generated
        began = time.monotonic()
        with client.stream(
            f"{system}\nQuestion {question}:", max_new_tokens=args.new_tokens, ignore_eos=True, timeout=600
        ) as generation:
            first = None
            for message in generation:
                if first is None and message.token_ids:
                    first = time.monotonic() - began
        usage = generation.final.usage
        with lock:
            ttfts.append(first * 1000)
            cached, prompt, generated = (
                cached + usage.cached_tokens,
                prompt + usage.prompt_tokens,
                generated + usage.generated_tokens,
            )

    with Client(cluster.target, route_keys=route_keys) as client:
        began = time.monotonic()
        with futures.ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda call: one(client, *call), calls))
        wall = time.monotonic() - began
    return {
        "p50": statistics.median(ttfts),
        "p95": percentile(ttfts, 0.95),
        "tok_s": generated / wall,
        "cached": cached / prompt,
        "prompt_tokens": prompt // len(calls),
        "wall": wall,
    }


def rolling_restart(cluster: Cluster, args) -> list[tuple[float, float]]:
    """Each replica in turn: 8 long streams start, then SIGTERM; (seconds to exit, to UP again)."""
    times = []
    with Client(cluster.target) as client:
        for replica in cluster.replicas:
            generations = [
                client.stream(
                    f"Story {i}: the sea is",
                    max_new_tokens=args.stream_tokens,
                    ignore_eos=True,
                    temperature=0,
                    timeout=600,
                )
                for i in range(8)
            ]
            readers = [threading.Thread(target=lambda g=g: list(g)) for g in generations]
            for reader in readers:
                reader.start()
            wait_until(lambda: all(g.token_ids for g in generations), 120, "the streams' first tokens")
            old, began = replica.proc, time.monotonic()
            old.send_signal(signal.SIGTERM)
            old.wait(600)
            exited = time.monotonic() - began
            wait_until(
                lambda: replica.proc is not old and cluster.proxy_states()[replica.name] == "UP",
                300,
                f"{replica.name} back UP",
            )
            times.append((exited, time.monotonic() - began))
            for reader in readers:
                reader.join(600)
            assert all(g.finish_reason == "MAX_TOKENS" for g in generations), "a stream did not complete"
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="braid serve --model (default: the embedded model)")
    parser.add_argument("--prompt-words", type=int, default=950, help="words per system prompt (~1 token each)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=256, help="tokens of each restart-time stream")
    parser.add_argument("--handover-grace", type=float, default=2.0)
    args = parser.parse_args(argv)
    model = ["--model", args.model] if args.model else []
    threads = str(max(1, (os.cpu_count() or 1) // 3))
    base = [*model, "--threads", threads, "--kv-cache-memory", "1GiB", "--grace-period", "600"]
    replicas = [Replica(f"replica-{n}", free_port(), free_port()) for n in (1, 2, 3)]
    cluster = Cluster(
        replicas,
        Path(tempfile.mkdtemp(prefix="braid-routing-")),
        port=free_port(),
        stats_port=free_port(),
        quiet=True,
        braid_args=[*base, "--handover-grace", "0"],
    )
    cluster.start()
    try:
        keyed = workload(cluster, "keyed", True, args)
        plain = workload(cluster, "plain", False, args)
        # The replicas run --handover-grace 0; each one comes back from the first roll with hand-over.
        cluster.braid_args = [*base, "--handover-grace", str(args.handover_grace)]
        without = rolling_restart(cluster, args)
        with_handover = rolling_restart(cluster, args)
    finally:
        cluster.stop()
    print(
        f"workload: 48 calls, {keyed['prompt_tokens']} prompt tokens, {args.new_tokens} new tokens, "
        f"{args.concurrency} at a time, 3 replicas ({threads} threads each) behind HAProxy"
    )
    print("| routing | TTFT p50 | TTFT p95 | generated tok/s | prompt tokens cached |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in (("braid-route-key (consistent hash, bounded load)", keyed), ("leastconn (no key)", plain)):
        print(f"| {name} | {r['p50']:.0f} ms | {r['p95']:.0f} ms | {r['tok_s']:.1f} | {r['cached']:.0%} |")
    print(f"\nrolling restart, 8 greedy streams of {args.stream_tokens} tokens started before each replica's SIGTERM:")
    print("| drain | SIGTERM to exit, per replica | SIGTERM to UP again | whole roll |")
    print("| --- | --- | --- | --- |")
    for name, times in (
        ("wait for the streams (--handover-grace 0)", without),
        (f"hand-over (--handover-grace {args.handover_grace:g})", with_handover),
    ):
        print(
            f"| {name} | {', '.join(f'{e:.1f}' for e, _ in times)} s | {', '.join(f'{u:.1f}' for _, u in times)} s "
            f"| {sum(u for _, u in times):.0f} s |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
