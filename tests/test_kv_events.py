"""SubscribeKvEvents as a prefix-aware router meets it: a prompt's full pages stored under the hashes
the .proto describes, evicted under KV pressure, a stream resumed from a sequence number, a resync
when the events asked for are gone (older than --kv-events-buffer keeps, or another run's), the API
key guarding it, and a view that matches ServerStatus."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import subprocess
import sys
import threading
from array import array

import grpc
import pytest

from braid.client import AsyncClient, BraidError
from braid.v1 import generate_pb2 as pb
from conftest import tiny_server, wait_for

KEY = "kv-s3cret"
PAGE = 16
RING = 4


@pytest.fixture(scope="module")
def server(tiny_dir):
    # 256 KiB of keys and values in the default cache (float16 for the tiny model's head_dim 16, on a
    # CPU; bf16 on CUDA): 256 bytes a token, 1,024 tokens, 64 pages of 16
    started = tiny_server(
        tiny_dir,
        "--mode",
        "continuous",
        "--max-seq-len",
        "512",
        "--kv-cache-memory",
        "256KiB",
        env={"BRAID_API_KEY": KEY},
    )
    yield started
    started.stop()


@pytest.fixture(scope="module")
def small_ring(tiny_dir):
    """A server that keeps only the last RING events for subscribers that resume."""
    started = tiny_server(tiny_dir, "--mode", "continuous", "--kv-events-buffer", str(RING))
    yield started
    started.stop()


class Subscriber:
    """client.kv_events on a thread, every event kept, as a router's reader would."""

    def __init__(self, client, after_sequence: int = 0) -> None:
        self.events: list[pb.KvEvent] = []
        self._iterator = client.kv_events(after_sequence)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for event in self._iterator:  # ends when closed
            self.events.append(event)

    def close(self) -> None:
        self._iterator.close()  # cancels the call, from this thread: the reading one's loop ends
        self._thread.join(10)
        assert not self._thread.is_alive()

    @property
    def last(self) -> int:
        return self.events[-1].sequence if self.events else 0


def _hashes(token_ids: list[int], salt: str) -> list[bytes]:
    """A prompt's page hashes as the .proto's KvPageStored describes them: what a router computes."""
    parent = hashlib.blake2b(b"braid-kv:" + salt.encode(), digest_size=16).digest()
    keys = []
    for i in range(len(token_ids) // PAGE):
        parent = hashlib.blake2b(parent + array("q", token_ids[i * PAGE : (i + 1) * PAGE]).tobytes(), digest_size=16)
        parent = parent.digest()
        keys.append(parent)
    return keys


def _prompt(seed: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 40000 + 100 for i in range(10 * PAGE + 5)]  # ten full pages and 5 more


def _ask(client, token_ids: list[int], salt: str):
    return client.generate(prompt_token_ids=token_ids, max_new_tokens=2, ignore_eos=True, cache_salt=salt)


def test_the_stream_needs_the_api_key(server):
    with server.client(api_key=None) as client, pytest.raises(BraidError) as caught:
        next(iter(client.kv_events()))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED

    async def first(api_key: str | None) -> pb.KvEvent:
        async with AsyncClient(server.target, api_key=api_key) as client:
            async for event in client.kv_events(after_sequence=10**9):
                return event
        raise AssertionError("the stream ended")

    with pytest.raises(BraidError) as caught:
        asyncio.run(first(None))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(first(KEY)).HasField("resync")  # past the newest: another run's sequence


def test_a_subscriber_sees_pages_stored_and_evicted_resumes_and_matches_the_status(server):
    with server.client() as client:
        sub = Subscriber(client)
        first = _prompt(1)
        _ask(client, first, "tenant-a")
        wanted = _hashes(first, "tenant-a")
        wait_for(lambda: len([e for e in sub.events if e.HasField("stored")]) >= len(wanted))
        stored = {e.stored.hash: e.stored for e in sub.events if e.HasField("stored")}
        assert set(wanted) <= set(stored)
        page = stored[wanted[1]]
        assert page.parent_hash == wanted[0] and page.num_tokens == PAGE
        assert page.cache_salt == "tenant-a" and page.adapter_key == ""
        seen_before = sub.last

        for seed in range(2, 9):  # 7 x 11 pages through a cache of 64: the first prompt's are evicted
            _ask(client, _prompt(seed), f"tenant-{seed}")
        wait_for(lambda: client.server_status().kv_evictions > 0 and client.server_status().sessions_active == 0)
        status = client.server_status()
        # every event the counts imply has reached the reader (on a loaded machine it lags): a page
        # cached now was stored once, an evicted one stored and evicted
        wait_for(lambda: sub.last >= status.kv_pages_cached + 2 * status.kv_evictions)
        evicted = [e.evicted.hash for e in sub.events if e.HasField("evicted")]
        assert set(wanted) & set(evicted)
        num_stored = sum(e.HasField("stored") for e in sub.events)
        assert len(evicted) == status.kv_evictions
        assert num_stored - len(evicted) == status.kv_pages_cached  # no session holds a page now
        assert [e.sequence for e in sub.events] == list(range(1, sub.last + 1))
        assert not any(e.HasField("resync") for e in sub.events)
        sub.close()

        # a router that reconnects resumes where it was, and sees exactly what it missed
        again = Subscriber(client, after_sequence=seen_before)
        wait_for(lambda: again.last >= sub.last)
        assert again.events == sub.events[seen_before:]
        again.close()


def test_a_subscriber_asking_for_events_the_server_never_held_is_told_to_resync(server):
    """A sequence past the newest is another run's (the server restarted): resync, then every event
    held follows, from the oldest on."""
    with server.client() as client:
        _ask(client, _prompt(20), "resync")
        sub = Subscriber(client, after_sequence=10**9)
        wait_for(lambda: len(sub.events) > 1)
        sub.close()
    resync = sub.events[0]
    assert resync.HasField("resync") and resync.resync.oldest_sequence == resync.sequence + 1 == 1
    assert sub.events[1].sequence == 1 and sub.events[1].HasField("stored")


def test_a_subscriber_further_behind_than_the_ring_is_told_to_resync_then_reads_on(small_ring):
    """A prompt of ten full pages stores ten events; the ring keeps the last RING. A router that
    resumes after sequence 1 (it saw the first page, then lost its connection) has missed events that
    are gone: it is told to resync from the oldest held, gets those held, then reads on."""
    with small_ring.client() as client:
        first = _prompt(30)
        _ask(client, first, "ring")
        wanted = _hashes(first, "ring")
        sub = Subscriber(client, after_sequence=1)
        wait_for(lambda: len(sub.events) >= 1 + RING)
        resync, held = sub.events[0], sub.events[1:]
        assert resync.HasField("resync") and resync.resync.oldest_sequence == resync.sequence + 1
        oldest = resync.resync.oldest_sequence
        assert oldest > 2  # sequence 2, the first one asked for, is gone
        assert [e.sequence for e in held] == list(range(oldest, oldest + RING))
        assert [e.stored.hash for e in held] == wanted[-RING:]  # the prompt's last pages, stored

        second = _prompt(31)[: 2 * PAGE + 3]  # two pages: fewer events than the ring holds, so it keeps up
        _ask(client, second, "ring-2")
        wait_for(lambda: len(sub.events) >= 1 + RING + 2)
        sub.close()
    after = sub.events[1 + RING :]
    assert not any(e.HasField("resync") for e in after)  # it kept up from then on
    assert [e.sequence for e in sub.events[1:]] == list(range(oldest, sub.last + 1))
    assert [e.stored.hash for e in after] == _hashes(second, "ring-2")


def test_braid_client_kv_events_prints_the_events_as_json_lines(server):
    """The ring holds every event of this module's server (64 pages): the first three are the first
    prompt's first pages, whichever test ran first."""
    with server.client() as client:
        _ask(client, _prompt(40), "cli")
        first = next(iter(client.kv_events()))
    out = subprocess.run(
        [sys.executable, "-m", "braid.client.cli", "--target", server.target, "--api-key", KEY]
        + ["--kv-events", "--after-sequence", "1", "--max-events", "3", "--timeout", "60"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [int(e["sequence"]) for e in lines] == [2, 3, 4]
    assert base64.b64decode(lines[0]["stored"]["parent_hash"]) == first.stored.hash  # the chain from event 1
