"""The Python client as its README uses it: `mypy --strict` accepts this (tests/test_client_typing.py).

Never run, only type-checked; assert_type fails the check where a type is less precise than written.
"""

from __future__ import annotations

import asyncio

from typing_extensions import assert_type

from braid.client import (
    AsyncClient,
    AsyncGeneration,
    Client,
    Completion,
    GenerateParams,
    Generation,
    choice,
    json_schema,
)
from braid.v1 import generate_pb2 as pb


def run(target: str) -> list[Completion]:
    with Client(target, api_key="k") as client:
        with client.stream(
            "Once upon a time",
            max_new_tokens=32,
            temperature=0.7,
            top_p=0.9,
            seed=1,
            stop="\n",
            stop_token_ids=[2],
            logit_bias={42: -100.0},
            bad_words=["x"],
            priority=pb.PRIORITY_BATCH,
            logprobs=True,
            top_logprobs=None,
        ) as generation:
            assert_type(generation, Generation)
            for message in generation:
                assert_type(message, pb.GenerateResponse)
                print(message.text, end="", flush=True)
        final = generation.final
        assert_type(final, pb.GenerateResponse | None)
        completion = client.generate(
            messages=[("system", "Be brief."), ("user", "What is gRPC?")],
            top_k=40,
            constraint=json_schema({"type": "object"}),
        )
        assert_type(completion.token_ids, list[int])
        params: GenerateParams = {"n": 2, "cache_salt": "tenant-a", "ignore_eos": True}
        with client.stream("Hi", timeout=5.0, **params) as samples:
            for _ in samples:
                pass
        assert_type(client.tokenize("Hi"), pb.TokenizeResponse)
        assert_type(client.model_info().context_length, int)
        assert_type(client.abort(["req-1"]), list[str])
        return [completion, *samples.completions()]


async def run_async(target: str) -> str:
    async with AsyncClient(target) as client:
        async with client.stream(
            "Once upon a time", n=2, max_new_tokens=8, constraint=choice(["a", "b"])
        ) as generation:
            assert_type(generation, AsyncGeneration)
            async for message in generation:
                assert_type(message.index, int)
        texts = [c.text for c in generation.completions()]
        completion = await client.generate("2 + 2 =", max_new_tokens=4, stop=["\n", "."])
        status = await client.server_status()
        assert_type(status, pb.ServerStatusResponse)
        assert_type(await client.abort(("req-1", "req-2")), list[str])
        return completion.text + "".join(texts) + await client.health()


if __name__ == "__main__":
    print(run("localhost:50051"), asyncio.run(run_async("localhost:50051")))
