"""Embeddings as their users call them, against one real `braid serve` of the tiny random Llama with
an API key on both ports: braid's Python client over gRPC (sync and async), the official `openai`
SDK's embeddings.create over HTTP, braid-client --embed; bad input named, the key enforced, and a
call that gives up leaving the engine's books balanced. The numbers themselves are checked against
transformers in tests/inprocess/test_embed_pooling.py; the mapping in tests/unit/test_embeddings_api.py."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from braid.client import AsyncClient, BadRequestError
from conftest import free_port, tiny_server

KEY = "sk-embed-key"
TEXTS = ["The tide comes in", "The tide goes out, and the sea is calm again"]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """The tiny model with its HTTP API; its forward passes wait while the file `server.hold` exists
    (BRAID_INJECT_FAULT's hold: test_a_call_that_gives_up_frees_its_inputs_and_the_books_balance)."""
    http_port, hold = free_port(), tmp_path_factory.mktemp("embed-hold") / "held"
    env = {"BRAID_API_KEY": KEY, "BRAID_INJECT_FAULT": f"hold:{hold}"}
    started = tiny_server(tiny_dir, "--mode", "continuous", "--http-port", str(http_port), env=env)
    started.http, started.hold = f"http://127.0.0.1:{http_port}", hold
    yield started
    assert started.stop() == 0


def _norm(values) -> float:
    return math.sqrt(math.fsum(v * v for v in values))


def test_grpc_and_the_openai_sdk_give_the_same_unit_vectors_in_order(server):
    import openai

    with server.client() as client:
        info = client.model_info()
        assert info.embedding_dimensions == 64 and info.embedding_pooling_source == "default"
        response = client.embed(TEXTS)
        mean = client.embed(TEXTS[1], pooling="mean", dimensions=16, normalize=False)
    vectors = [list(e.values) for e in response.embeddings]
    assert [len(v) for v in vectors] == [64, 64] and all(abs(_norm(v) - 1) < 1e-6 for v in vectors)
    assert response.prompt_tokens == sum(e.prompt_tokens for e in response.embeddings) > 0
    assert len(mean.embeddings[0].values) == 16 and mean.pooling == 2
    with openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0) as sdk:
        created = sdk.embeddings.create(input=TEXTS, model="tiny")  # the SDK asks for base64 and decodes it
        floats = sdk.embeddings.create(input=TEXTS, model="tiny", encoding_format="float")
    assert created.usage.prompt_tokens == created.usage.total_tokens == response.prompt_tokens
    for grpc_vector, d, f in zip(vectors, created.data, floats.data):
        assert max(abs(a - b) for a, b in zip(d.embedding, grpc_vector)) < 1e-6
        assert max(abs(a - b) for a, b in zip(f.embedding, grpc_vector)) < 1e-6


def test_the_async_client_embeds_token_ids(server):
    async def go():
        async with AsyncClient(server.target, api_key=KEY) as client:
            ids = list((await client.tokenize(TEXTS[0])).token_ids)
            return ids, await client.embed([ids, ids[:2]], truncate_input_tokens=3)

    ids, response = asyncio.run(go())
    assert [e.prompt_tokens for e in response.embeddings] == [3, 2]
    assert response.embeddings[0].truncated_tokens == len(ids) - 3


def test_bad_input_is_named_over_both_apis_and_the_key_is_enforced(server):
    import openai

    with server.client() as client, pytest.raises(BadRequestError) as error:
        client.embed(["fine", ""])
    assert error.value.field == "texts[1]"
    with openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0) as sdk:
        with pytest.raises(openai.BadRequestError) as bad:
            sdk.embeddings.create(input=["fine", ""], model="tiny")
        assert bad.value.body["param"] == "input[1]"
        with pytest.raises(openai.BadRequestError) as too_long:
            sdk.embeddings.create(input=[list(range(5, 2000))], model="tiny")
        assert too_long.value.body["param"] == "input[0]" and "context length" in too_long.value.body["message"]
    with openai.OpenAI(base_url=server.http + "/v1", api_key="wrong", max_retries=0) as sdk:
        with pytest.raises(openai.AuthenticationError):
            sdk.embeddings.create(input="hi", model="tiny")
    with server.client(api_key="wrong") as client, pytest.raises(grpc.RpcError) as denied:
        client.embed("hi")
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_call_that_gives_up_frees_its_inputs_and_the_books_balance(server):
    """A gRPC call cancelled, and an HTTP client that hangs up, once all 64 of the call's inputs are
    sessions in the engine: the sessions the held pass had not taken are counted cancelled, and no
    session or KV page is left. The model
    is held meanwhile (server.hold), so the call cannot finish first. (The call gave up after a fixed
    0.3 s before, which raced its own admission: on a loaded machine the deadline passed while the 64
    texts were still being tokenized, nothing was submitted, and nothing was there to cancel.)"""

    async def give_up(call) -> None:
        async with AsyncClient(server.target, api_key=KEY) as client:
            before = await client.server_status()
            server.hold.touch()
            try:
                task = asyncio.create_task(call())
                await _until(client, lambda s: s.sessions_submitted - before.sessions_submitted == 64)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                server.hold.unlink()
            # the pass held when the call gave up still finishes its sessions: the rest are cancelled
            status = await _until(
                client,
                lambda s: s.sessions_active + s.sessions_queued == 0 and _finished(s) == _finished(before) + 64,
            )
            assert status.sessions_finished.cancelled > before.sessions_finished.cancelled
            assert status.kv_pages_used == 0
            assert len((await client.embed("still serving")).embeddings) == 1

    async def grpc_call() -> None:
        async with AsyncClient(server.target, api_key=KEY) as client:
            await client.embed(_long_texts("grpc"), pooling="mean")

    async def http_call() -> None:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as http:
            await http.post(server.http + "/v1/embeddings", json={"input": _long_texts("http"), "pooling": "mean"})

    asyncio.run(give_up(grpc_call))
    asyncio.run(give_up(http_call))


def _finished(status) -> int:
    """Sessions finished, for any reason."""
    return sum(count for _, count in status.sessions_finished.ListFields())


async def _until(client: AsyncClient, holds, timeout: float = 20.0):
    """Polls the server's status until holds(status); returns that status (wait_for, awaited)."""
    deadline = time.monotonic() + timeout
    while not holds(status := await client.server_status()):
        assert time.monotonic() < deadline, f"condition not met in time: {status}"
        await asyncio.sleep(0.05)
    return status


def _long_texts(tag: str) -> list[str]:
    """64 texts of about 300 tokens, each its own from the first token (mean pooling, which reads
    nothing from the prefix cache, computes every one whole)."""
    return [f"{tag} {i}: " + " ".join(["tide"] * 300) for i in range(64)]


def test_braid_client_embed_prints_the_response(server):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "braid.client.cli",
            "--target",
            server.target,
            "--api-key",
            KEY,
            "--embed",
            TEXTS[0],
            "--embed",
            TEXTS[1],
            "--pooling",
            "mean",
            "--dimensions",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    response = json.loads(out)
    assert [len(e["values"]) for e in response["embeddings"]] == [4, 4] and response["pooling"] == "POOLING_MEAN"
