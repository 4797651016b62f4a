"""The paged KV cache as users meet it: a shared prompt prefix computed once, a chat's earlier turns
found in the cache, a cancelled stream that shared pages, and the cache's flags. Preemption, admission
by the pages in use and cancels under memory pressure are decided by the engine and the runner alone:
tests/inprocess/test_paging.py has them."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from braid.client import AsyncClient
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc as pb_grpc
from conftest import MODES, tiny_server, wait_for

SYSTEM = (
    "You are a careful assistant who answers questions about the sea, ships and the weather "
    "in plain words, briefly, and never makes anything up. "
) * 4  # about 100 tokens


def _ask(client, question: str, salt: str, n: int = 12):
    return client.generate(SYSTEM + question, max_new_tokens=n, ignore_eos=True, cache_salt=salt)


@pytest.mark.parametrize("mode", MODES)
def test_a_cache_hit_gives_the_tokens_of_a_cold_run(servers, mode):
    """The shared prefix is found in the cache (Usage.cached_tokens), and greedy decoding gives the
    very tokens a cold run gives, in every mode."""
    server = servers(mode)
    salt = uuid.uuid4().hex  # a prefix no earlier test has cached
    with server.client() as client:
        cold = _ask(client, "What is a tide?", salt)
        before = client.server_status()
        warm = _ask(client, "What is a tide?", salt)
        other = _ask(client, "Why is the sea salty?", salt)
        other_cold = _ask(client, "Why is the sea salty?", uuid.uuid4().hex)
        after = client.server_status()
    assert cold.usage.cached_tokens == 0 and cold.usage.prompt_tokens > 64
    # the last page holding a prompt token is always computed
    assert cold.usage.prompt_tokens - 16 <= warm.usage.cached_tokens < cold.usage.prompt_tokens
    assert warm.token_ids == cold.token_ids
    assert other.usage.cached_tokens >= 64 and other.token_ids == other_cold.token_ids
    assert other_cold.usage.cached_tokens == 0
    assert (
        after.prompt_tokens_cached - before.prompt_tokens_cached == warm.usage.cached_tokens + other.usage.cached_tokens
    )
    assert after.prompt_tokens_computed == after.prompt_tokens


def test_cached_tokens_travel_in_the_trailing_metadata(servers):
    request = pb.GenerateRequest(prompt=SYSTEM + "Hi", max_new_tokens=2, cache_salt="trailers")
    with grpc.insecure_channel(servers("continuous").target) as channel:
        stub = pb_grpc.GenerateStub(channel)
        for _ in range(2):
            call = stub.Stream(request, timeout=60)
            final = list(call)[-1]
            trailers = dict(call.trailing_metadata())
    assert final.usage.cached_tokens > 0
    assert trailers["braid-cached-tokens"] == str(final.usage.cached_tokens)


def test_a_chats_next_turn_finds_the_earlier_turns_in_the_cache(servers):
    chat = [{"role": "system", "content": SYSTEM}]
    with servers("continuous").client() as client:
        previous = None
        for question in ("What is a tide?", "And a wave?", "Which is bigger?", "Thanks!"):
            chat.append({"role": "user", "content": question})
            reply = client.generate(messages=chat, max_new_tokens=12, cache_salt="chat-turns")
            chat.append({"role": "assistant", "content": reply.text})
            if previous is not None:  # everything up to the last turn's answer, but a page or two
                assert reply.usage.cached_tokens >= previous.usage.prompt_tokens - 16
            previous = reply


def test_a_salt_that_is_too_long_is_invalid_argument(servers):
    with servers("continuous").client() as client, pytest.raises(grpc.RpcError) as err:
        client.generate("Hi", max_new_tokens=1, cache_salt="x" * 257)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in err.value.details()


def test_cancelling_a_session_that_shares_pages_frees_only_its_own(slow):
    """Two sessions share a prefix; one is cancelled mid-stream: the other goes on to the very tokens
    it gives alone, and afterwards no page is held, only cached. (On the session's SLOW server: its
    counts are taken before and after.)"""
    server = slow
    with server.client() as client:
        before = client.server_status().sessions_finished.cancelled
        alone = _ask(client, "Tell me about ships.", "alone", n=200).token_ids

    async def run():
        async with AsyncClient(server.target) as client:

            def _ask_async(question: str, n: int):
                return client.stream(SYSTEM + question, max_new_tokens=n, ignore_eos=True, cache_salt="shared")

            await client.generate(SYSTEM + "Warm up.", max_new_tokens=1, cache_salt="shared")
            kept = asyncio.create_task(_collect(_ask_async("Tell me about ships.", 200)))
            cancelled = _ask_async("Tell me about the weather.", 900)
            async for message in cancelled:
                if message.token_ids:
                    break
            await asyncio.sleep(0.05)
            cancelled.cancel()
            return await kept

    final, ids = asyncio.run(run())
    assert final.usage.cached_tokens > 0 and ids == alone
    with server.client() as client:
        status = wait_for(lambda: (s := client.server_status()).sessions_active == 0 and s)
    assert status.kv_pages_used == 0 and status.kv_pages_cached > 0
    assert status.sessions_finished.cancelled == before + 1


async def _collect(generation):
    ids = []
    final = None
    async for message in generation:
        ids += message.token_ids
        final = message
    return final, ids


@pytest.mark.parametrize("flags", [["--prefix-caching", "off"], ["--kv-cache-dtype", "bfloat16"]])
def test_the_cache_flags(tiny_dir, flags):
    """--prefix-caching off computes every prompt; a bfloat16 cache (half the pages' bytes) still
    gives a warm run the tokens of a cold one (both read the same rounded keys)."""
    server = tiny_server(tiny_dir, "--mode", "continuous", "--kv-cache-memory", "8MiB", *flags)
    try:
        with server.client() as client:
            cold = _ask(client, "What is a tide?", "flags")
            warm = _ask(client, "What is a tide?", "flags")
            status, info = client.server_status(), client.model_info()
        assert warm.token_ids == cold.token_ids
        if "off" in flags:
            assert warm.usage.cached_tokens == 0 and status.prompt_tokens_cached == 0 and not info.prefix_caching
        else:  # bfloat16: 256 bytes a token, so 8 MiB is 2,048 pages of 16
            assert warm.usage.cached_tokens > 0 and status.kv_pages_total == 2048
            assert info.kv_cache_dtype == "bfloat16" and info.prefix_caching
    finally:
        server.stop()
