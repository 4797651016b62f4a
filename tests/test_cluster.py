"""The local cluster of `make cluster`: braid replicas behind a real HAProxy, scraped by a real
Prometheus (deploy/cluster.py, deploy/haproxy.cfg). The set-up installs both with
deploy/install-tools.sh when they are missing, as `make cluster` does; where it cannot, the tests
fail with the command that would.

One cluster of three tiny-model replicas serves the module. Calls with a routing key
(braid-route-key, which braid's clients send) go to the replica their key hashes to, with bounded
load; the rolling restart hands streams over (--handover-grace) and comes last: it restarts every
replica. Figures (cached-token ratios, restart times) are printed and recorded as properties, never
asserted on as timings.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import threading
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from braid.client import Client
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc as pb_grpc
from braid_testing import zygote
from conftest import REPO, SLOW, free_port, tiny_server, wait_for

GRPCURL = Path(sys.executable).parent / "grpcurl"

# deploy/cluster.py as `make cluster` runs it; deploy/roll.py's clients, with braid-client's retry policy.
sys.path.insert(0, str(REPO / "deploy"))
from cluster import BRAID, Cluster, Replica
from roll import Load

MAX_TOKENS = pb.FINISH_REASON_MAX_TOKENS
HANDOVER_GRACE_S = 0.5
# Every forward pass 5 ms longer: a 256-token stream lasts at least 1.3 s, past the hand-over grace.
SLOWER = {"BRAID_INJECT_FAULT": "delay:5"}


class ForkedCluster(Cluster):
    """deploy/cluster.py's cluster, each replica (and each restart of one) `braid serve` forked from
    the tests' zygote (braid_testing.zygote) instead of a Python that imports torch again: six starts
    in this module. That also runs BRAID_INJECT_FAULT's delay, which a plain `braid serve` ignores."""

    def _run(self, args: list[str], log_name: str, env: dict[str, str] | None = None):
        if args[0] != str(BRAID):
            return super()._run(args, log_name, env)
        with open(self.run_dir / log_name, "a") as log:
            return zygote.spawn(args[1:], env or dict(os.environ), log.fileno()) or super()._run(args, log_name, env)


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    install = subprocess.run(
        [str(REPO / "deploy" / "install-tools.sh"), "haproxy", "prometheus"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert install.returncode == 0, (
        f"the cluster tests need HAProxy and Prometheus: `deploy/install-tools.sh haproxy prometheus` (as root: "
        f"apt-get install -y haproxy prometheus) failed: {install.stderr.strip()}"
    )
    replicas = [Replica(f"replica-{n}", free_port(), free_port()) for n in (1, 2, 3)]
    cluster = ForkedCluster(
        replicas,
        tmp_path_factory.mktemp("cluster"),
        port=free_port(),
        stats_port=free_port(),
        prometheus_port=free_port(),
        scrape_interval="1s",
        env=SLOWER,
        quiet=True,
        braid_args=[
            "--model",
            str(tiny_dir),
            "--threads",
            "1",
            "--kv-cache-memory",
            "64MiB",
            "--grace-period",
            "30",
            "--handover-grace",
            str(HANDOVER_GRACE_S),
            # HAProxy's connections to a replica are replaced every 5 s or so (GOAWAY)
            "--max-connection-age-ms",
            "5000",
        ],
    )
    cluster.start()
    yield cluster
    cluster.stop()


def status(cluster: Cluster, replica: Replica) -> pb.ServerStatusResponse:
    """The replica's own books, asked directly, not through the proxy."""
    with grpc.insecure_channel(f"{cluster.host}:{replica.port}") as channel:
        return pb_grpc.GenerateStub(channel).ServerStatus(pb.ServerStatusRequest(), timeout=10)


def request(max_new_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="The sea is", max_new_tokens=max_new_tokens, ignore_eos=True)


def prometheus_query(cluster: Cluster, promql: str) -> list[dict]:
    url = f"{cluster.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        answer = json.load(response)
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def test_the_haproxy_health_check_is_a_grpc_health_call_a_replica_answers(cluster):
    """deploy/haproxy.cfg's raw HTTP/2 frames, sent to a replica as HAProxy sends them, get back a
    HealthCheckResponse SERVING: the frame HAProxy's expect rules look for."""
    config = (REPO / "deploy" / "haproxy.cfg").read_text()
    sent = b"".join(bytes.fromhex(h) for h in re.findall(r"^\s*tcp-check send-binary (\w+)", config, re.MULTILINE))
    (serving,) = re.findall(r"^\s*tcp-check expect min-recv 1 binary (\w+)", config, re.MULTILINE)
    replica = cluster.replicas[0]
    received = b""
    with socket.create_connection((cluster.host, replica.port), timeout=5) as sock:
        sock.sendall(sent)
        while bytes.fromhex(serving) not in received:
            chunk = sock.recv(65536)
            assert chunk, f"the replica closed the connection; it sent {received.hex()}"
            received += chunk


def test_one_channels_concurrent_streams_spread_over_the_replicas(cluster):
    before = {r.name: status(cluster, r).sessions_submitted for r in cluster.replicas}
    with grpc.insecure_channel(cluster.target) as channel:  # one channel: one HTTP/2 connection to HAProxy
        stub = pb_grpc.GenerateStub(channel)
        calls = [stub.Stream(request(64), timeout=60) for _ in range(8)]  # each call starts at once
        finals = [list(call)[-1] for call in calls]
    assert [final.finish_reason for final in finals] == [MAX_TOKENS] * 8
    served = {r.name: status(cluster, r).sessions_submitted - before[r.name] for r in cluster.replicas}
    assert sum(served.values()) == 8 and all(served.values()), served


def test_trailers_come_through_the_proxy(cluster):
    """The ORCA load report a weighted balancer reads is a trailer (gRPC's own clients hand it to
    their balancer, not the caller: grpcurl shows it)."""
    out = subprocess.run(
        [
            str(GRPCURL),
            "-plaintext",
            "-v",
            "-d",
            '{"prompt": "The sea is", "max_new_tokens": 4}',
            cluster.target,
            "braid.v1.Generate/Stream",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    trailers = out[out.index("Response trailers received:") :]
    assert "endpoint-load-metrics-bin: " in trailers and "braid-total-ms: " in trailers


def test_prometheus_scrapes_each_replicas_generated_tokens(cluster):
    with grpc.insecure_channel(cluster.target) as channel:
        stub = pb_grpc.GenerateStub(channel)
        for call in [stub.Stream(request(24), timeout=60) for _ in range(4)]:
            list(call)
    books = {r.name: float(status(cluster, r).tokens_generated) for r in cluster.replicas}
    assert all(books.values()), books

    def query(promql: str) -> list[dict]:
        return prometheus_query(cluster, promql)

    def scraped_tokens() -> dict[str, float]:
        result = query('braid_tokens_total{job="braid", braid_token_type="generated"}')
        return {series["metric"]["replica"]: float(series["value"][1]) for series in result}

    # Each replica's series is its own (label replica=replica-N): equal to its ServerStatus count once
    # a scrape (every second) has come after the calls.
    wait_for(lambda: scraped_tokens() == books, timeout=30)
    (total,) = query('sum(braid_tokens_total{job="braid", braid_token_type="generated"})')
    assert float(total["value"][1]) == sum(books.values())
    # HAProxy's own metrics too, as compose's Prometheus scrapes Envoy's: both replicas UP.
    up = wait_for(lambda: query('sum(haproxy_server_status{proxy="braid", state="UP"})'), timeout=15)
    assert float(up[0]["value"][1]) == len(cluster.replicas)


WORDS = (
    "sea river stone light garden window letter market winter summer music paper forest table "
    "mountain bridge village morning evening silver orange yellow animal answer number story"
).split()


def system_prompt(name: str) -> str:
    """A system prompt of about 900 tokens (the tiny model's context is 1,024), its own for each name."""
    rng = random.Random(name)
    return f"Rules of {name}: " + " ".join(rng.choice(WORDS) for _ in range(880))


def cached_share(cluster: Cluster, run: str, route_keys: bool) -> tuple[float, int]:
    """6 system prompts, 8 questions each, in a shuffled order, one call at a time: the share of
    prompt tokens found in a prefix cache (each final message's usage), and the prompt tokens."""
    systems = [system_prompt(f"{run}-{i}") for i in range(6)]
    calls = [(system, question) for system in systems for question in range(8)]
    random.Random(run).shuffle(calls)
    cached = total = 0
    with Client(cluster.target, route_keys=route_keys) as client:
        for system, question in calls:
            usage = client.generate(
                f"{system}\nQuestion {question}:", max_new_tokens=1, ignore_eos=True, timeout=60
            ).usage
            cached, total = cached + usage.cached_tokens, total + usage.prompt_tokens
    return cached / total, total // len(calls)


def test_calls_with_a_route_key_find_their_prefix_cached(cluster, record_property):
    """Issue 31: with the client's routing key, calls that share a system prompt go to the replica
    that has it cached, which computes it once; without it, to any, and each replica computes each
    prompt once (here, where each replica's cache holds all six: 18 prefills against 6; where a
    cache cannot hold them all, about 1 call in 3 finds its prefix)."""
    with_key, prompt_tokens = cached_share(cluster, "keyed", route_keys=True)
    without_key, _ = cached_share(cluster, "unkeyed", route_keys=False)
    record_property("cached_share_with_key", round(with_key, 3))
    record_property("cached_share_without_key", round(without_key, 3))
    print(
        f"prefix cache, 48 calls of {prompt_tokens} prompt tokens over 3 replicas: {with_key:.0%} of prompt "
        f"tokens cached with the routing key, {without_key:.0%} without"
    )
    assert with_key >= 0.8
    assert without_key < with_key
    # Each replica's own ratio: in its ServerStatus, and in Prometheus with its replica label.
    books = {r.name: status(cluster, r) for r in cluster.replicas}
    ratios = {name: s.prefix_hit_ratio for name, s in books.items()}
    assert all(
        ratio == pytest.approx(s.prompt_tokens_cached / (s.prompt_tokens_cached + s.prompt_tokens_computed))
        for ratio, s in zip(ratios.values(), books.values())
    )
    print(f"prefix hit ratio per replica: {', '.join(f'{name} {ratio:.2f}' for name, ratio in ratios.items())}")

    def scraped() -> dict[str, float]:
        result = prometheus_query(cluster, 'braid_prefix_cache_hit_ratio{job="braid"}')
        return {series["metric"]["replica"]: float(series["value"][1]) for series in result}

    wait_for(
        lambda: (
            scraped().keys() == ratios.keys()
            and all(v == pytest.approx(ratios[k], abs=1e-6) for k, v in scraped().items())
        ),
        timeout=30,
    )


@dataclass
class Call:
    prompt: int  # which system prompt
    early: bool  # started before any call of its system prompt had ended
    usage: pb.Usage


def keyed_workload(cluster: Cluster, run: str, in_flight: int, max_new_tokens: int) -> dict:
    """6 system prompts of about 900 tokens, 8 questions each, in a shuffled order, `in_flight`
    calls at a time through braid's client (which sends the routing key). Counted from each call's
    usage and each replica's ServerStatus:
    - share: the prompt tokens found in a prefix cache, over all prompt tokens;
    - ideal: the share if each system prompt missed once, every other call finding what the
      prompt's best call found cached (`shared`);
    - allowed: the same, but every early call missing: a replica shares a prefix once a prefill
      has cached it, so a call that starts before any call of its prompt has ended may compute the
      prompt again wherever it goes;
    - one_miss: the share of one call's miss (the most a call finds cached);
    - served: each replica's sessions."""
    systems, questions = [system_prompt(f"{run}-{i}") for i in range(6)], 8
    order = [(prompt, question) for prompt in range(len(systems)) for question in range(questions)]
    random.Random(run).shuffle(order)
    lock = threading.Lock()
    ended: set[int] = set()  # system prompts a call of which has ended: cached where it ran
    calls: list[Call] = []

    def one(client: Client, prompt: int, question: int) -> None:
        with lock:
            early = prompt not in ended
        usage = client.generate(
            f"{systems[prompt]}\nQuestion {question}:", max_new_tokens=max_new_tokens, ignore_eos=True, timeout=120
        ).usage
        with lock:
            ended.add(prompt)
            calls.append(Call(prompt, early, usage))

    before = {r.name: status(cluster, r).sessions_submitted for r in cluster.replicas}
    with Client(cluster.target) as client, concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        list(pool.map(lambda call: one(client, *call), order))
    total = sum(call.usage.prompt_tokens for call in calls)
    shared = {p: max(call.usage.cached_tokens for call in calls if call.prompt == p) for p in range(len(systems))}
    return {
        "share": sum(call.usage.cached_tokens for call in calls) / total,
        "ideal": sum((questions - 1) * cached for cached in shared.values()) / total,
        "allowed": sum(shared[call.prompt] for call in calls if not call.early) / total,
        "one_miss": max(shared.values()) / total,
        "misses": sum(call.usage.cached_tokens < shared[call.prompt] for call in calls),
        "early": sum(call.early for call in calls),
        "shared": shared,
        "served": {r.name: status(cluster, r).sessions_submitted - before[r.name] for r in cluster.replicas},
        "prompt_tokens": total // len(calls),
    }


def test_route_keys_find_their_prefix_cached_at_low_and_high_concurrency(cluster, record_property):
    """Issue 39, item 22: with 4 calls in flight over 3 replicas, HAProxy's bound
    (hash-balance-factor 125: at most 125% of the mean streams in flight, under 2 here) sent calls
    to replicas that had to compute their system prompt again: 70% of prompt tokens cached, where
    one miss per system prompt gives 86%. At 4 in flight every call but the early ones must find
    its prompt cached (one call of slack); with all 48 in flight at once the load still spreads
    over every replica. The shares are printed and recorded (docs/deployment.md)."""
    low = keyed_workload(cluster, "low", in_flight=4, max_new_tokens=1)
    high = keyed_workload(cluster, "high", in_flight=48, max_new_tokens=64)
    for name, run in (("low", low), ("high", high)):
        record_property(f"cached_share_{name}", round(run["share"], 3))
        print(
            f"{name} concurrency: {run['share']:.1%} of prompt tokens cached (one miss per system prompt: "
            f"{run['ideal']:.1%}; every early call missing too: {run['allowed']:.1%}); {run['misses']} calls "
            f"missed, {run['early']} started early; sessions per replica {run['served']}"
        )
    assert low["early"] < 48 and all(low["shared"].values()), low  # the bound below is not empty
    assert low["share"] >= low["allowed"] - low["one_miss"], low
    mean = 48 / len(cluster.replicas)
    assert all(high["served"].values()) and max(high["served"].values()) <= 1.5 * mean, high


def test_a_hot_prefix_spills_over_to_other_replicas(cluster):
    """One prefix 10 times as frequent as each of 5 others, all in flight at once: bounded load
    (deploy/haproxy.lua: to the least-loaded replica once the busiest has more than 4 streams over
    it and 125% of its streams) keeps every replica within 1.5 times the mean number of sessions,
    where the hash alone gave one replica 26 of the 30."""
    prompts = ["Hot topic: the sea is"] * 20
    prompts += [f"Cold topic {i}: the sea is" for i in range(5) for _ in range(2)]
    random.Random(7).shuffle(prompts)
    before = {r.name: status(cluster, r).sessions_submitted for r in cluster.replicas}
    with Client(cluster.target) as client:
        streams = [
            client.stream(prompt, max_new_tokens=256, ignore_eos=True, temperature=0, timeout=120) for prompt in prompts
        ]  # each call starts at once
        finals = [list(stream)[-1] for stream in streams]
    assert [final.finish_reason for final in finals] == [MAX_TOKENS] * len(prompts)
    served = {r.name: status(cluster, r).sessions_submitted - before[r.name] for r in cluster.replicas}
    print(f"bounded load, 20 calls of one prefix and 2 of each of 5 others: sessions per replica {served}")
    mean = len(prompts) / len(cluster.replicas)
    assert sum(served.values()) == len(prompts) and max(served.values()) <= 1.5 * mean, served


def restart(cluster: Cluster, replica: Replica) -> tuple[float, float]:
    """SIGTERM to the replica: it exits 0 (its streams handed over after --handover-grace), the
    cluster starts it again and HAProxy puts it back. Returns the seconds to its exit and to UP."""
    old, began = replica.proc, time.monotonic()
    old.send_signal(signal.SIGTERM)
    assert old.wait(40) == 0
    exited = time.monotonic() - began
    wait_for(lambda: replica.proc is not old, timeout=10)
    wait_for(lambda: cluster.proxy_states()[replica.name] == "UP", timeout=180)
    return exited, time.monotonic() - began


# 16 a wave: where each lands is HAProxy's hash of its route key with bounded load, so with 8 a wave a
# run once had none on the replica being restarted in any wave (0 of 24 resumed; 3 to 8 in other runs)
STORIES = [f"Story {i}: the sea is" for i in range(16)]


def stream_tokens(client: Client, prompt: str, generations: list, mine: list | None = None) -> list[int]:
    """The tokens of a long greedy stream; its Generation is appended to `generations` (and `mine`)
    as it starts."""
    generation = client.stream(prompt, max_new_tokens=256, ignore_eos=True, temperature=0, timeout=120)
    generations.append(generation)
    if mine is not None:
        mine.append(generation)
    messages = list(generation)
    assert messages[-1].finish_reason == MAX_TOKENS
    return [token for message in messages for token in message.token_ids]


def test_a_rolling_restart_hands_streams_over_and_fails_no_call(cluster, record_property):
    """8 clients stream through HAProxy in a loop while the replicas are restarted one at a time;
    before each restart, 16 long greedy streams (256 tokens) start, 48 in all. Those still running
    when their replica's hand-over grace ends are resumed on another replica by the client: every
    one ends token for token as an undisturbed run, no call fails, and each replica exits within
    its hand-over grace and a few seconds (recorded, not asserted)."""
    with Client(cluster.target) as client, concurrent.futures.ThreadPoolExecutor(len(STORIES)) as pool:
        undisturbed = dict(zip(STORIES, pool.map(lambda prompt: stream_tokens(client, prompt, []), STORIES)))
    load = Load(cluster.target, clients=8, max_new_tokens=48)
    began, times, outcomes, generations = time.monotonic(), [], [], []
    try:
        wait_for(lambda: load.completed["ok"] >= 8, timeout=60)  # the load flows before the first restart
        with Client(cluster.target) as client:
            for replica in cluster.replicas:
                wave: list = [None] * len(STORIES)

                def run(i: int) -> None:
                    mine: list = []
                    tokens = stream_tokens(client, STORIES[i], generations, mine)
                    wave[i] = (tokens, mine[0].resumes)

                threads = [threading.Thread(target=run, args=(i,)) for i in range(len(STORIES))]
                for thread in threads:
                    thread.start()
                # SIGTERM once every story streams, or as soon as one is a quarter through: a story
                # slow to start (its first try refused by a replica HAProxy has not yet seen go) must
                # not let the others near their end, or those on this replica would end within the
                # hand-over grace and none would be handed over (0 resumed, in loaded full runs)
                wait_for(
                    lambda: (
                        len(generations) == len(outcomes) + len(STORIES)
                        and (
                            all(g.token_ids for g in generations[-len(STORIES) :])
                            or any(len(g.token_ids) >= 64 for g in generations[-len(STORIES) :])
                        )
                    ),
                    timeout=30,
                )
                times.append(restart(cluster, replica))
                for thread in threads:
                    thread.join(120)
                outcomes += [(STORIES[i], *outcome) for i, outcome in enumerate(wave)]
        done = load.completed["ok"]
        wait_for(lambda: load.completed["ok"] >= done + 8, timeout=60)  # and goes on after the last
    finally:
        load.stop()
    resumed = sum(g.resumes for g in generations)
    record_property("restart_s", [[round(t, 1) for t in pair] for pair in times])
    print(
        f"rolling restart with hand-over ({HANDOVER_GRACE_S} s): SIGTERM to exit "
        f"{', '.join(f'{e:.1f}' for e, _ in times)} s, to UP again {', '.join(f'{u:.1f}' for _, u in times)} s; "
        f"{resumed} of {len(outcomes)} long streams resumed; {load.completed['ok']} other calls ({load.resumed} "
        f"resumed) in "
        f"{time.monotonic() - began:.0f} s"
    )
    assert len(outcomes) == 3 * len(STORIES)
    # where a stream is not its undisturbed run's, say where it parted from it and if it was resumed
    differ = [
        f"{prompt!r} (resumed {resumes}x): {len(tokens)} tokens, the first "
        f"{next((k for k, (a, b) in enumerate(zip(tokens, undisturbed[prompt])) if a != b), min(len(tokens), 256))} "
        "as undisturbed"
        for prompt, tokens, resumes in outcomes
        if tokens != undisturbed[prompt]
    ]
    assert not differ, "\n".join(differ)
    assert resumed >= 1  # some streams were handed over, not only waited for
    assert load.failures == []
    # The restarted replicas take calls again.
    before = {r.name: status(cluster, r).sessions_submitted for r in cluster.replicas}
    with grpc.insecure_channel(cluster.target) as channel:
        stub = pb_grpc.GenerateStub(channel)
        for call in [stub.Stream(request(16), timeout=60) for _ in range(6)]:
            list(call)
    assert all(status(cluster, r).sessions_submitted > before[r.name] for r in cluster.replicas)


def test_max_connection_age_closes_a_connection_its_calls_done(tiny_dir):
    """--max-connection-age-ms: the server sends GOAWAY, the channel goes IDLE, and its next call
    connects again; a call in flight at that moment runs to its end (grace 0: no limit)."""
    server = tiny_server(tiny_dir, "--max-connection-age-ms", "1000", env=SLOW)
    try:
        with grpc.insecure_channel(server.target) as channel:
            states: list[grpc.ChannelConnectivity] = []
            channel.subscribe(states.append, try_to_connect=True)
            stub = pb_grpc.GenerateStub(channel)
            # 500 tokens of SLOW passes last 1.5 s at least, on any machine: past the age and the
            # 10% jitter gRPC adds to it (1.1 s at most), so the GOAWAY comes while the call runs
            final = list(stub.Stream(request(500), timeout=60))[-1]
            assert final.finish_reason == MAX_TOKENS
            wait_for(lambda: states[-1] == grpc.ChannelConnectivity.IDLE, timeout=10)
            assert stub.ServerStatus(pb.ServerStatusRequest(), timeout=10).sessions_submitted == 1
    finally:
        server.stop()
