"""The Python client and CLI against a fake in-process Generate server (no model, no torch)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import io
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from braid.client import (
    AsyncClient,
    AsyncGeneration,
    BadRequestError,
    BraidError,
    CallCancelledError,
    Client,
    DeadlineExceededError,
    GenerateParams,
    InternalError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
    cli,
    describe,
    finish_reason_name,
    function_choice,
    tool,
)
from braid.client.generation import MAX_RESUMES, RESUME_BACKOFF_S
from braid.client.request import PARAMS, build_embed_request, build_request, build_tokenize_request
from braid.client.routing import ROUTE_KEY_HEADER, route_key
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc

Context = grpc.ServicerContext
REQUEST_ID = "req-42"
FINAL = pb.GenerateResponse(
    token_ids=[3],
    finish_reason=pb.FINISH_REASON_MAX_TOKENS,
    usage=pb.Usage(prompt_tokens=2, generated_tokens=3, cached_tokens=1),
    request_id=REQUEST_ID,
    seed=7,
    timings=pb.Timings(queue_ms=1, time_to_first_token_ms=2, total_ms=3, tokens_per_second=4),
)


def _status(code: int, message: str, detail: object) -> grpc.Status:
    packed = any_pb2.Any()
    packed.Pack(detail)
    return rpc_status.to_status(status_pb2.Status(code=code, message=message, details=[packed]))


def _samples(n: int) -> list[pb.GenerateResponse]:
    """n samples interleaved, the last index first: sample i is "s{i}" then "!", tokens [i, 9], and its
    own final message (seed 7 + i)."""
    indexes = range(n - 1, -1, -1)
    return [
        *(pb.GenerateResponse(index=i, text=f"s{i}", token_ids=[i]) for i in indexes),
        *(pb.GenerateResponse(index=i, text="!", token_ids=[9]) for i in indexes),
        *(
            pb.GenerateResponse(
                index=i,
                finish_reason=pb.FINISH_REASON_EOS + i % 2,
                seed=7 + i,
                usage=pb.Usage(prompt_tokens=2, generated_tokens=2),
                request_id=REQUEST_ID,
            )
            for i in indexes
        ),
    ]


class FakeGenerate(generate_pb2_grpc.GenerateServicer):
    """Streams "Hel", "lo" and a final message, or with n > 1 the n samples of _samples; the prompt
    "endless" streams until cancelled, "invalid" and "full" fail with rich status details,
    "mismatched" with the details of another status than its own, "fail CODE" with that status
    code, "fail mid-stream" with INTERNAL after "Hel". Every call with the API key "deny" fails
    UNAUTHENTICATED. Records what it was sent."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.tokenized: list[pb.TokenizeRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.ended_while_active: list[bool] = []  # per endless stream, is_active() when it ended
        self.endless_ended = threading.Event()
        self.target = ""  # host:port, once serving

    def Stream(self, request: pb.GenerateRequest, context: Context) -> Iterator[pb.GenerateResponse]:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        _check_api_key(context)
        context.send_initial_metadata((("braid-request-id", REQUEST_ID),))
        if request.prompt == "fail mid-stream":
            yield pb.GenerateResponse(text="Hel", token_ids=[1])
            context.abort(grpc.StatusCode.INTERNAL, "forward pass failed")
        if request.prompt.startswith("fail "):
            code = grpc.StatusCode[request.prompt.removeprefix("fail ")]
            context.abort(code, f"failed with {code.name}\nsee the log")
        if request.prompt == "invalid":
            violation = {"field": "temperature", "description": "must be in [0, 100]"}
            detail = error_details_pb2.BadRequest(field_violations=[violation])
            context.abort_with_status(_status(code_pb2.INVALID_ARGUMENT, "temperature: out of range", detail))
        if request.prompt == "full":
            detail = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=2))
            context.abort_with_status(_status(code_pb2.RESOURCE_EXHAUSTED, "server is full", detail))
        if request.prompt == "mismatched":
            other = _status(code_pb2.RESOURCE_EXHAUSTED, "server is full", error_details_pb2.RetryInfo())
            context.set_trailing_metadata(other.trailing_metadata)
            context.abort(grpc.StatusCode.INTERNAL, "something else")
        if request.prompt == "endless":
            context.add_callback(self._on_endless_end(context))
            while context.is_active():
                yield pb.GenerateResponse(text="x", token_ids=[1])
                time.sleep(0.01)
            return
        if request.n > 1:
            yield from _samples(request.n)
            return
        if request.tools:  # a call of the first tool as it completes, another in the final message
            name = request.tools[0].name
            yield pb.GenerateResponse(token_ids=[1], tool_calls=[pb.ToolCall(id="call_1", name=name, arguments="{}")])
            calls = [pb.ToolCall(id="call_2", name=name, arguments='{"a": 1}')]
            yield pb.GenerateResponse(
                finish_reason=pb.FINISH_REASON_CONSTRAINT, request_id=REQUEST_ID, tool_calls=calls
            )
            return
        scored = [pb.TokenLogprob(logprob=-1, rank=1), pb.TokenLogprob(logprob=-3, rank=2)]
        yield pb.GenerateResponse(text="Hel", token_ids=[1], prompt_logprobs=scored if request.prompt_logprobs else [])
        yield pb.GenerateResponse(text="lo", token_ids=[2])
        yield FINAL

    def _on_endless_end(self, context: Context) -> Callable[[], None]:
        def callback() -> None:
            self.ended_while_active.append(context.is_active())
            self.endless_ended.set()

        return callback

    def Tokenize(self, request: pb.TokenizeRequest, context: Context) -> pb.TokenizeResponse:
        self.tokenized.append(request)
        _check_api_key(context)
        if request.text == "invalid":
            violations = [{"field": "text", "description": "too long"}, {"field": "messages", "description": "x"}]
            detail = error_details_pb2.BadRequest(field_violations=violations)
            context.abort_with_status(_status(code_pb2.INVALID_ARGUMENT, "text: too long", detail))
        text = request.text or "".join(m.content for m in request.messages)
        offsets = [pb.TokenOffset(start=i, end=i + 1) for i in range(len(text))] if request.return_offsets else []
        return pb.TokenizeResponse(token_ids=[ord(c) for c in text], pieces=list(text), offsets=offsets)

    def Detokenize(self, request: pb.DetokenizeRequest, context: Context) -> pb.DetokenizeResponse:
        return pb.DetokenizeResponse(text="".join(chr(t) for t in request.token_ids), held_back_tokens=1)

    def ModelInfo(self, request: pb.ModelInfoRequest, context: Context) -> pb.ModelInfoResponse:
        _check_api_key(context)
        return pb.ModelInfoResponse(model_name="fake", context_length=64, mode=pb.SCHEDULING_MODE_CONTINUOUS)

    def ServerStatus(self, request: pb.ServerStatusRequest, context: Context) -> pb.ServerStatusResponse:
        _check_api_key(context)
        return pb.ServerStatusResponse(sessions_active=1, tokens_generated=5)

    def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        _check_api_key(context)
        return pb.AbortResponse(aborted=[i for i in request.request_ids if i.startswith("running")])


def _check_api_key(context: Context) -> None:
    if dict(context.invocation_metadata()).get("authorization") == "Bearer deny":
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong API key")


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeGenerate]:
    servicer = FakeGenerate()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generate_pb2_grpc.add_GenerateServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("braid.v1.Generate", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.target = f"127.0.0.1:{port}"
    yield servicer
    server.stop(0)


@pytest.fixture
def target(fake: FakeGenerate) -> str:
    fake.endless_ended.clear()
    return fake.target


def test_build_request_maps_params_to_fields() -> None:
    chat = [("system", "s"), {"role": "user", "content": "u"}, pb.Message(role="assistant", content="a")]
    request = build_request(
        messages=chat,
        max_new_tokens=8,
        temperature=0.5,
        seed=0,
        stop="\n",
        stop_token_ids=[5, 6],
        ignore_eos=True,
        top_k=None,
    )
    assert [m.role for m in request.messages] == ["system", "user", "assistant"]
    assert [m.content for m in request.messages] == ["s", "u", "a"]
    assert (request.max_new_tokens, request.temperature, request.ignore_eos) == (8, 0.5, True)
    assert request.HasField("seed") and request.seed == 0
    assert list(request.stop) == ["\n"] and list(request.stop_token_ids) == [5, 6]
    assert request.top_k == 0 and request.prompt == ""
    assert not build_request("hi").HasField("seed")


def test_build_request_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="max_tokens, temp"):
        build_request("hi", temp=1.0, max_tokens=3)
    with pytest.raises(ValueError):
        build_request("hi", messages=[("user", "hi")])
    with pytest.raises(ValueError):
        build_request()
    with pytest.raises(ValueError):
        build_tokenize_request()


def test_build_tokenize_request_takes_a_chats_tools_and_thinking_switch() -> None:
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    request = build_tokenize_request(messages=[("user", "hi")], tools=[weather], enable_thinking=False)
    assert [(t.name, json.loads(t.parameters)) for t in request.tools] == [("get_weather", {"type": "object"})]
    assert request.HasField("enable_thinking") and not request.enable_thinking
    assert not build_tokenize_request("hi").HasField("enable_thinking")  # unset: the template's default


def test_build_embed_request_takes_a_text_texts_or_token_id_lists() -> None:
    assert list(build_embed_request("hi").texts) == ["hi"]
    request = build_embed_request([[1, 2], [3]], pooling="mean", normalize=False, dimensions=8)
    assert [list(t.ids) for t in request.token_ids] == [[1, 2], [3]] and not request.texts
    assert request.pooling == pb.POOLING_MEAN and request.HasField("normalize") and not request.normalize
    assert not build_embed_request(["a"]).HasField("normalize")  # unset: the server's default, unit length
    with pytest.raises(ValueError, match="not a mix"):
        build_embed_request(["a", [1]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="pooling"):
        build_embed_request("a", pooling="cls")


def test_generate_params_has_a_key_per_generate_request_field() -> None:
    fields = {f.name for f in pb.GenerateRequest.DESCRIPTOR.fields} - {"prompt", "messages"}
    keys = set(GenerateParams.__annotations__)
    assert keys == fields, (
        f"GenerateParams in clients/python/src/braid/client/request.py has one key per GenerateRequest field "
        f"(with its type, or None): add {sorted(fields - keys)}, remove {sorted(keys - fields)}"
    )
    assert not GenerateParams.__required_keys__ and set(PARAMS) == fields


def test_build_request_takes_tools_tool_choice_and_tool_turns_as_openais_or_braids() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    openai = {"type": "function", "function": {"name": "weather", "description": "d", "parameters": schema}}
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    request = build_request(messages=turns, tools=[openai, {"name": "time"}], tool_choice="required")
    weather = pb.Tool(name="weather", description="d", parameters=json.dumps(schema))
    assert list(request.tools) == [weather, pb.Tool(name="time")] == [tool("weather", "d", schema), tool("time")]
    assert request.tool_choice == pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)
    assert list(request.messages[1].tool_calls) == [pb.ToolCall(id="c1", name="weather", arguments="{}")]
    assert (request.messages[1].content, request.messages[2].tool_call_id) == ("", "c1")
    named = {"type": "function", "function": {"name": "weather"}}
    assert build_request("hi", tools=[weather], tool_choice=named).tool_choice == function_choice("weather")
    assert build_request("hi", tool_choice="none").tool_choice.mode == pb.TOOL_CHOICE_MODE_NONE
    with pytest.raises(ValueError, match="function_choice"):
        build_request("hi", tools=[weather], tool_choice="weather")


def test_tool_calls_accumulate_on_the_generation_and_its_completion(fake: FakeGenerate, target: str) -> None:
    with Client(target) as client, client.stream(messages=[("user", "hi")], tools=[tool("weather")]) as generation:
        for _ in generation:
            pass
        assert [c.id for c in generation.tool_calls] == ["call_1", "call_2"]
        completion = client.generate(messages=[("user", "hi")], tools=[tool("weather")], tool_choice="required")
    assert completion.finish_reason == "CONSTRAINT" and completion.tool_calls == list(generation.tool_calls)
    assert json.loads(completion.tool_calls[1].arguments) == {"a": 1} and completion.text == ""
    assert fake.requests[-1].tool_choice.mode == pb.TOOL_CHOICE_MODE_REQUIRED


def test_stream_yields_messages_and_final(fake: FakeGenerate, target: str) -> None:
    with Client(target) as client, client.stream("hello", max_new_tokens=3, seed=7) as generation:
        texts = [message.text for message in generation]
        assert generation.request_id == REQUEST_ID
    assert texts == ["Hel", "lo", ""]
    assert generation.text == "Hello" and generation.token_ids == [1, 2, 3]
    assert generation.final == FINAL
    assert fake.requests[-1] == pb.GenerateRequest(prompt="hello", max_new_tokens=3, seed=7)


def test_generate_returns_completion(target: str) -> None:
    with Client(target) as client:
        completion = client.generate(messages=[("user", "hello")])
    assert completion.text == "Hello" and completion.token_ids == [1, 2, 3]
    assert completion.finish_reason == "MAX_TOKENS"
    assert completion.usage.generated_tokens == 3 and completion.final.seed == 7


def test_n_samples_accumulate_per_index(fake: FakeGenerate, target: str) -> None:
    with Client(target) as client:
        generation = client.stream("hello", n=3)
        next(generation)
        with pytest.raises(RuntimeError, match="not ended"):
            generation.completions()
        messages = [next(generation), *generation]
        with pytest.raises(ValueError, match="completions"):
            client.generate("hello", n=3)  # refused before a call is made
    assert fake.requests[-1].n == 3
    assert generation.final == messages[-1] and generation.final.index == 0
    completions = generation.completions()
    assert [c.final.index for c in completions] == [0, 1, 2]
    assert [(c.text, c.token_ids, c.finish_reason) for c in completions] == [
        ("s0!", [0, 9], "EOS"),
        ("s1!", [1, 9], "STOP_SEQUENCE"),
        ("s2!", [2, 9], "EOS"),
    ]
    assert [c.final.seed for c in completions] == [7, 8, 9] and completions[1].usage.generated_tokens == 2
    assert (generation.text, generation.token_ids) == ("s0!", [0, 9])  # sample 0's
    with pytest.raises(RuntimeError, match="3 samples: use completions"):
        generation.completion()


def test_one_sample_is_both_completion_and_completions(target: str) -> None:
    with Client(target) as client, client.stream("hello", n=1) as generation:
        with pytest.raises(RuntimeError, match="not ended"):
            generation.completion()
        list(generation)
    assert generation.completions() == [generation.completion()]
    assert generation.completion().text == "Hello"


def test_async_n_samples(target: str) -> None:
    async def main() -> list[tuple[str, list[int]]]:
        async with AsyncClient(target) as client:
            with pytest.raises(ValueError, match="completions"):
                await client.generate("hello", n=2)
            async with client.stream("hello", n=2) as generation:
                async for _ in generation:
                    pass
            return [(c.text, c.token_ids) for c in generation.completions()]

    assert asyncio.run(main()) == [("s0!", [0, 9]), ("s1!", [1, 9])]


def test_api_key_is_sent_as_bearer_metadata(fake: FakeGenerate, target: str) -> None:
    with Client(target, api_key="sekret") as client:
        client.generate("hello")
    assert fake.metadata[-1]["authorization"] == "Bearer sekret"


# The same vectors as clients/node/test/routing.test.js: both clients compute the same key.
ROUTE_KEY_VECTORS = [
    (dict(prompt="The sea is"), "4d5efeb7493816fd"),
    (dict(prompt="The sea is", cache_salt="tenant-a"), "6e1419c97a310cb1"),
    (dict(prompt="é" * 600 + " and more"), "d6552e76fec2954d"),  # cut at 1,024 bytes, mid-character
    (
        dict(messages=[("system", "You are terse."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Again")]),
        "c27234034c1a4c49",
    ),
    (dict(messages=[("user", "日本語 🌊")]), "9311b7a87686bfd7"),
    (dict(prompt=""), "6e340b9cffb37a98"),
    (dict(prompt_token_ids=[1, 400, 49151]), "e7b52d33f5ae94b9"),
    (dict(prompt_token_ids=list(range(300)), cache_salt="tenant-a"), "bf95a4d8e7a45eb1"),  # the first 256 ids
]


@pytest.mark.parametrize(("request_kw", "key"), ROUTE_KEY_VECTORS)
def test_the_route_key_is_the_node_clients(request_kw: dict, key: str) -> None:
    assert route_key(build_request(**request_kw)) == key


def test_a_conversation_keeps_its_route_key_and_a_salt_changes_it() -> None:
    first = [("system", "S"), ("user", "Q1")]
    later = [*first, ("assistant", "A1"), ("user", "Q2")]
    assert route_key(build_request(messages=first)) == route_key(build_request(messages=later))
    assert route_key(build_request(messages=first)) != route_key(build_request(messages=first, cache_salt="x"))
    long = "x" * 2000
    assert route_key(build_request(prompt=long + "a")) == route_key(build_request(prompt=long + "b"))


def test_stream_calls_carry_the_route_key_given_or_their_own(fake: FakeGenerate, target: str) -> None:
    with Client(target) as client:
        client.generate("hello")
        client.generate("hello", route_key="conversation-7")
    with Client(target, route_keys=False) as client:
        client.generate("hello")
    keys = [m.get(ROUTE_KEY_HEADER) for m in fake.metadata[-3:]]
    assert keys == [route_key(build_request("hello")), "conversation-7", None]


RING_HASH_CHECK = """
import json, sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from braid.client.client import RING_HASH_SERVICE_CONFIG
seen = []
class Health(health.HealthServicer):
    def __init__(self, n): super().__init__(); self.n = n
    def Check(self, request, context):
        seen.append((dict(context.invocation_metadata())["braid-route-key"], self.n))
        return health_pb2.HealthCheckResponse(status=1)
ports = []
for n in range(3):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(Health(n), server)
    ports.append(server.add_insecure_port("127.0.0.1:0"))
    server.start()
channel = grpc.insecure_channel("ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports),
                                options=[("grpc.service_config", json.dumps(RING_HASH_SERVICE_CONFIG))])
check = health_pb2_grpc.HealthStub(channel).Check
try:
    for i in range(60):  # the first round connects the replicas (a key whose replica is not ready yet goes on)
        check(health_pb2.HealthCheckRequest(), metadata=(("braid-route-key", f"key-{i % 12}"),), timeout=10)
except grpc.RpcError as error:
    print(json.dumps({"error": f"{error.code().name}: {error.details()}"}))
    sys.exit()
later = {}
for key, n in seen[24:]:
    later.setdefault(key, set()).add(n)
print(json.dumps({"replicas_per_key": sorted({len(v) for v in later.values()}), "used": len({n for _, n in seen})}))
"""


@pytest.mark.parametrize("opt_in", [True, False])
def test_grpcio_ring_hash_routes_by_the_route_key_only_when_opted_in(opt_in: bool) -> None:
    """What docs/deployment.md says of the client's own balancing: grpcio's ring hash keeps each key on
    one replica with GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY=true, and fails every call without."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"}
    if opt_in:
        env["GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"] = "true"
    out = subprocess.run(
        [sys.executable, "-c", RING_HASH_CHECK], env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    result = json.loads(out)
    if opt_in:
        assert result == {"replicas_per_key": [1], "used": 3}, result
    else:
        assert result == {"error": "INTERNAL: hash attribute not present"}, result


def test_unary_methods(target: str) -> None:
    with Client(target) as client:
        assert list(client.tokenize("ab").pieces) == ["a", "b"]
        assert list(client.tokenize(messages=[("user", "c")]).token_ids) == [ord("c")]
        assert client.model_info().model_name == "fake"
        assert client.server_status().tokens_generated == 5
        assert client.health() == "SERVING"
        assert client.health("braid.v1.Generate") == "NOT_SERVING"


def test_cancel_cancels_the_call_on_the_server(fake: FakeGenerate, target: str) -> None:
    with Client(target) as client:
        generation = client.stream("endless")
        assert next(generation).text == "x"
        generation.cancel()
        assert list(generation) == []
        assert fake.endless_ended.wait(5)
    assert fake.ended_while_active[-1] is False
    assert generation.final is None


def test_leaving_the_with_block_early_cancels(fake: FakeGenerate, target: str) -> None:
    with Client(target) as client:
        with client.stream("endless") as generation:
            next(generation)
        assert fake.endless_ended.wait(5)
    assert fake.ended_while_active[-1] is False


def test_async_stream_generate_and_unary(fake: FakeGenerate, target: str) -> None:
    async def main() -> None:
        async with AsyncClient(target, api_key="k") as client:
            async with client.stream("hello") as generation:
                texts = [message.text async for message in generation]
            assert texts == ["Hel", "lo", ""] and generation.final == FINAL
            assert generation.request_id == REQUEST_ID
            completion = await client.generate("hello")
            assert (completion.text, completion.finish_reason) == ("Hello", "MAX_TOKENS")
            assert list((await client.tokenize("ab")).pieces) == ["a", "b"]
            assert (await client.model_info()).model_name == "fake"
            assert (await client.server_status()).sessions_active == 1
            assert await client.health() == "SERVING"

    asyncio.run(main())
    assert fake.metadata[-1]["authorization"] == "Bearer k"


def test_async_cancel_and_early_exit_cancel_on_the_server(fake: FakeGenerate, target: str) -> None:
    async def main() -> None:
        async with AsyncClient(target) as client:
            generation = client.stream("endless")
            async for _ in generation:
                generation.cancel()
            assert fake.endless_ended.wait(5)
            fake.endless_ended.clear()
            async with client.stream("endless") as generation:
                async for _ in generation:
                    break
            assert fake.endless_ended.wait(5)
            fake.endless_ended.clear()
            generation = client.stream("endless")
            reader = asyncio.create_task(_drain(generation))
            await asyncio.sleep(0.05)
            generation.cancel()  # while the reader awaits a message: it just stops
            assert await reader > 0 and fake.endless_ended.wait(5)

    asyncio.run(main())
    assert fake.ended_while_active[-3:] == [False, False, False]


async def _drain(generation: AsyncGeneration) -> int:
    return len([message async for message in generation])


def test_describe_shows_field_violations_and_retry_info(target: str) -> None:
    with Client(target) as client:
        with pytest.raises(grpc.RpcError) as invalid:
            client.generate("invalid")
        with pytest.raises(grpc.RpcError) as full:
            client.generate("full")
    assert describe(invalid.value) == (
        "INVALID_ARGUMENT: temperature: out of range\n  temperature: must be in [0, 100]"
    )
    assert describe(full.value) == "RESOURCE_EXHAUSTED: server is full\n  retry after 2 s"


def test_describe_reads_asyncio_errors_alike(target: str) -> None:
    async def main() -> list[str]:
        async with AsyncClient(target) as client:
            descriptions = []
            for prompt in ("invalid", "full"):
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await client.generate(prompt)
                descriptions.append(describe(error.value))
            return descriptions

    assert asyncio.run(main()) == [
        "INVALID_ARGUMENT: temperature: out of range\n  temperature: must be in [0, 100]",
        "RESOURCE_EXHAUSTED: server is full\n  retry after 2 s",
    ]


def test_describe_leaves_out_details_of_another_status(target: str) -> None:
    with Client(target) as client, pytest.raises(grpc.RpcError) as error:
        client.generate("mismatched")
    assert describe(error.value) == "INTERNAL: something else"


TYPED = [
    ("INVALID_ARGUMENT", BadRequestError),
    ("RESOURCE_EXHAUSTED", OverloadedError),
    ("UNAVAILABLE", UnavailableError),
    ("DEADLINE_EXCEEDED", DeadlineExceededError),
    ("CANCELLED", CallCancelledError),
    ("NOT_FOUND", NotFoundError),
    ("PERMISSION_DENIED", PermissionDeniedError),
    ("UNAUTHENTICATED", UnauthenticatedError),
    ("INTERNAL", InternalError),
    ("UNIMPLEMENTED", BraidError),
    ("UNKNOWN", BraidError),
]


@pytest.mark.parametrize(("code", "kind"), TYPED)
def test_a_failed_stream_raises_the_error_of_its_status(target: str, code: str, kind: type[BraidError]) -> None:
    with Client(target) as client, pytest.raises(BraidError) as error:
        client.generate(f"fail {code}")
    assert type(error.value) is kind
    assert isinstance(error.value, grpc.RpcError) and isinstance(error.value, grpc.aio.AioRpcError)  # as before
    assert error.value.code() == grpc.StatusCode[code]
    assert error.value.details() == f"failed with {code}\nsee the log"
    words = code.lower().replace("_", " ")
    assert str(error.value) == f"{words}: failed with {code} see the log"  # one line
    assert isinstance(error.value.__cause__, grpc.RpcError) and error.value.status is None


@pytest.mark.parametrize(("code", "kind"), TYPED[:3])
def test_asyncio_streams_raise_the_error_of_their_status(target: str, code: str, kind: type[BraidError]) -> None:
    async def main() -> BraidError:
        async with AsyncClient(target) as client:
            with pytest.raises(BraidError) as error:
                await client.generate(f"fail {code}")
            return error.value

    error = asyncio.run(main())
    assert type(error) is kind and isinstance(error, grpc.aio.AioRpcError)  # `except AioRpcError` still catches it
    assert error.code() == grpc.StatusCode[code] and error.details() == f"failed with {code}\nsee the log"


def test_a_bad_request_names_its_field(target: str) -> None:
    with Client(target) as client:
        with pytest.raises(BadRequestError) as stream:
            client.generate("invalid")
        with pytest.raises(BadRequestError) as tokenize:
            client.tokenize("invalid")
    assert (stream.value.field, stream.value.description) == ("temperature", "must be in [0, 100]")
    assert str(stream.value) == "invalid argument: temperature: out of range"
    assert tokenize.value.violations == [("text", "too long"), ("messages", "x")]
    assert tokenize.value.field == "text" and tokenize.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    trailers = dict(stream.value.trailing_metadata())  # the raw details are still there
    assert isinstance(stream.value.trailing_metadata(), tuple)  # as grpc's error had them: `(key, value) in` works
    assert status_pb2.Status.FromString(trailers["grpc-status-details-bin"]).code == code_pb2.INVALID_ARGUMENT
    assert describe(stream.value) == "INVALID_ARGUMENT: temperature: out of range\n  temperature: must be in [0, 100]"
    no_details = BadRequestError(grpc.StatusCode.INVALID_ARGUMENT, details="prompt: is empty")
    assert (no_details.field, no_details.description, no_details.violations) == (None, "prompt: is empty", [])


def test_an_overloaded_server_says_when_to_retry(target: str) -> None:
    with Client(target) as client, pytest.raises(OverloadedError) as error:
        client.generate("full")
    assert error.value.retry_after == 2.0
    assert str(error.value) == "resource exhausted: server is full (retry after 2 s)"
    pushback = grpc.aio.Metadata(("grpc-retry-pushback-ms", "1500"))  # no RetryInfo: gRPC's pushback trailer
    assert OverloadedError(grpc.StatusCode.RESOURCE_EXHAUSTED, None, pushback).retry_after == 1.5
    assert OverloadedError(grpc.StatusCode.RESOURCE_EXHAUSTED).retry_after is None


def test_details_of_another_status_are_left_out(target: str) -> None:
    with Client(target) as client, pytest.raises(InternalError) as error:
        client.generate("mismatched")
    assert error.value.status is None and str(error.value) == "internal: something else"


def test_a_stream_that_fails_mid_way_raises_its_error_after_the_messages_it_sent(target: str) -> None:
    with Client(target) as client, client.stream("fail mid-stream") as generation:
        with pytest.raises(InternalError, match="^internal: forward pass failed$"):
            for _ in generation:
                pass
    assert generation.text == "Hel" and generation.finish_reason is None

    async def main() -> str:
        async with AsyncClient(target) as client, client.stream("fail mid-stream") as generation:
            with pytest.raises(InternalError):
                async for _ in generation:
                    pass
        return generation.text

    assert asyncio.run(main()) == "Hel"


def test_a_deadline_or_a_closed_channel_raises_its_error(fake: FakeGenerate, target: str) -> None:
    with Client(target) as client, pytest.raises(DeadlineExceededError):
        client.generate("endless", timeout=0.2)
    client = Client(target)
    generation = client.stream("endless")
    next(generation)
    client.close()  # not the generation's own cancel(): that ends iteration quietly
    with pytest.raises(CallCancelledError):
        list(generation)


def test_every_method_raises_typed_errors(target: str) -> None:
    with Client(target, api_key="deny") as client:
        calls: list[Callable[[], object]] = [
            lambda: client.generate("hello"),
            lambda: client.tokenize("ab"),
            client.model_info,
            client.server_status,
            lambda: client.abort(["running-1"]),
        ]
        for call in calls:
            with pytest.raises(UnauthenticatedError, match="^unauthenticated: wrong API key$"):
                call()
    with Client(target) as client, pytest.raises(NotFoundError):
        client.health("no.such.Service")

    async def main() -> int:
        raised = 0
        async with AsyncClient(target, api_key="deny") as client:
            for call in (
                client.generate("hello"),
                client.tokenize("ab"),
                client.model_info(),
                client.server_status(),
                client.abort(["running-1"]),
            ):
                with pytest.raises(UnauthenticatedError):
                    await call
                raised += 1
        async with AsyncClient(target) as client:
            with pytest.raises(NotFoundError):
                await client.health("no.such.Service")
            assert await client.abort(["running-1", "done-2"]) == ["running-1"]
        return raised + 1

    assert asyncio.run(main()) == 6


def test_typed_errors_pickle_as_themselves(target: str) -> None:
    with Client(target) as client, pytest.raises(BadRequestError) as error:
        client.generate("invalid")
    copy = pickle.loads(pickle.dumps(error.value))
    assert type(copy) is BadRequestError and copy.field == "temperature" and str(copy) == str(error.value)


def test_the_finish_reason_is_a_name(target: str) -> None:
    with Client(target) as client, client.stream("hello") as generation:
        assert generation.finish_reason is None
        list(generation)
    assert generation.finish_reason == "MAX_TOKENS" == generation.completion().finish_reason
    assert finish_reason_name(pb.FINISH_REASON_EOS) == "EOS" and finish_reason_name(99) == "99"  # unknown: its number

    async def main() -> str | None:
        async with AsyncClient(target) as client, client.stream("hello", n=2) as generation:
            async for _ in generation:
                pass
        return generation.finish_reason

    assert asyncio.run(main()) == "EOS"  # the message that ended the stream: sample 0's


def test_cli_prints_a_failed_call_as_one_line_and_exits_1(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--target", target, "invalid"]) == 1
    assert capsys.readouterr() == ("", "braid-client: invalid argument: temperature: out of range\n")
    assert cli.main(["--target", target, "fail mid-stream"]) == 1
    assert capsys.readouterr() == ("Hel\n", "braid-client: internal: forward pass failed\n")  # after the text's line
    assert cli.main(["--target", target, "--api-key", "deny", "--status"]) == 1
    assert capsys.readouterr().err == "braid-client: unauthenticated: wrong API key\n"


def test_cli_stats_start_on_a_line_of_their_own(target: str) -> None:
    """stdout and stderr into one pipe, as `braid-client --stats ... 2>&1 | less` has them: stdout
    buffered (as it is unless PYTHONUNBUFFERED is set), stderr not."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    for args in (["--stats"], ["--stats", "-n", "2"]):
        result = subprocess.run(
            [sys.executable, "-m", "braid.client.cli", "--target", target, *args, "hello"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=60,
            check=True,
            env=env,
        )
        first = "Hello\nfinish_reason: MAX_TOKENS" if "-n" not in args else "--- sample 0 ---\ns0!\n[sample 0] finish"
        assert result.stdout.startswith(first), result.stdout


def test_cli_streams_text_and_stats(fake: FakeGenerate, target: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--target",
        target,
        "--chat",
        "--system",
        "sys",
        "--max-new-tokens",
        "3",
        "--temperature",
        "0.5",
        "--stop",
        "a",
        "--stop",
        "b",
        "--stop-token-id",
        "9",
        "--stats",
        "hello",
    ]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == "Hello\n"
    assert "finish_reason: MAX_TOKENS" in err and "3 generated tokens" in err
    assert fake.requests[-1] == pb.GenerateRequest(
        messages=[pb.Message(role="system", content="sys"), pb.Message(role="user", content="hello")],
        max_new_tokens=3,
        stop=["a", "b"],
        stop_token_ids=[9],
        temperature=0.5,
    )


def test_cli_sends_the_cache_salt_and_shows_cached_tokens(
    fake: FakeGenerate, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--target", target, "--cache-salt", "tenant-a", "--stats", "hello"]) == 0
    assert fake.requests[-1].cache_salt == "tenant-a"
    assert "2 prompt tokens (1 from the cache, 0 cut)" in capsys.readouterr().err
    assert build_request("hi", cache_salt="tenant-a").cache_salt == "tenant-a"


def test_cli_sends_tools_and_prints_the_calls_as_json_lines(
    fake: FakeGenerate, target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": "weather", "parameters": {"type": "object"}}]))
    assert cli.main(["--target", target, "--chat", "--tools", str(tools), "--tool-choice", "weather", "hi"]) == 0
    sent = fake.requests[-1]
    assert sent.tools[0].name == "weather" and sent.tool_choice == function_choice("weather")
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["id"] for line in lines if line] == ["call_1", "call_2"]


def test_cli_tokenizes_a_chat_with_its_tools_and_thinking_switch(
    fake: FakeGenerate, target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": "weather", "parameters": {"type": "object"}}]))
    argv = ["--target", target, "--tokenize", "--chat", "--tools", str(tools), "--enable-thinking", "false", "hi"]
    assert cli.main(argv) == 0
    sent = fake.tokenized[-1]
    assert [t.name for t in sent.tools] == ["weather"] and sent.HasField("enable_thinking") and not sent.enable_thinking
    assert json.loads(capsys.readouterr().out)["pieces"] == ["h", "i"]


def test_cli_sends_penalties_bias_and_include_stop_sequence(fake: FakeGenerate, target: str) -> None:
    argv = [
        "--target",
        target,
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "-1",
        "--logit-bias",
        "42=-100",
        "--logit-bias",
        "7=2.5",
        "--include-stop-sequence",
        "hello",
    ]
    assert cli.main(argv) == 0
    assert fake.requests[-1] == pb.GenerateRequest(
        prompt="hello",
        presence_penalty=0.5,
        frequency_penalty=-1,
        logit_bias={42: -100.0, 7: 2.5},
        include_stop_sequence=True,
    )
    assert build_request("hi", logit_bias={3: 1.0}).logit_bias == {3: 1.0}
    with pytest.raises(SystemExit):
        cli.main(["--target", target, "--logit-bias", "forty-two", "hello"])


def test_cli_sends_resume_token_ids(fake: FakeGenerate, target: str) -> None:
    argv = ["--target", target, "--seed", "3", "--resume-token-id", "5", "--resume-token-id", "6", "hello"]
    assert cli.main(argv) == 0
    assert fake.requests[-1] == pb.GenerateRequest(prompt="hello", seed=3, resume_token_ids=[5, 6])
    assert list(build_request("hi", resume_token_ids=7).resume_token_ids) == [7]


def test_cli_sends_token_ids_and_prints_ids_without_text(
    fake: FakeGenerate, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--target", target, "--ids", "--skip-detokenize", "[5, 6,7]"]) == 0
    assert fake.requests[-1] == pb.GenerateRequest(prompt_token_ids=[5, 6, 7], skip_detokenize=True)
    assert capsys.readouterr().out == "1 2 3 \n"  # the fake's token ids
    for argv in (["--ids", "five"], ["--ids", "--chat", "5"], ["--detokenize", "--tokenize", "5"]):
        with pytest.raises(SystemExit):
            cli.main(["--target", target, *argv])


def test_token_ids_are_a_third_kind_of_input(fake: FakeGenerate, target: str) -> None:
    assert list(build_request(prompt_token_ids=[1, 2]).prompt_token_ids) == [1, 2]
    for kw in (dict(prompt="a", prompt_token_ids=[1]), dict(messages=[("user", "a")], prompt_token_ids=[1]), {}):
        with pytest.raises(ValueError, match="prompt_token_ids" if kw else "prompt and messages"):
            build_request(**kw)
    with Client(target) as client:
        assert client.generate(prompt_token_ids=[3], skip_detokenize=True).token_ids == [1, 2, 3]
        assert client.detokenize([104, 105]) == pb.DetokenizeResponse(text="hi", held_back_tokens=1)
        assert [o.end for o in client.tokenize("ab", return_offsets=True).offsets] == [1, 2]
    assert fake.requests[-1].prompt_token_ids == [3] and fake.requests[-1].skip_detokenize


def test_cli_prints_each_sample(fake: FakeGenerate, target: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--target", target, "-n", "2", "--stats", "hello"]) == 0
    out, err = capsys.readouterr()
    assert out == "--- sample 0 ---\ns0!\n--- sample 1 ---\ns1!\n"
    assert "[sample 0] finish_reason: EOS" in err and "[sample 1] finish_reason: STOP_SEQUENCE" in err
    assert "seed: 8" in err and fake.requests[-1].n == 2


def test_cli_shows_the_prompt_logprobs(fake: FakeGenerate, target: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--target", target, "--prompt-logprobs", "--stats", "hello"]) == 0
    assert fake.requests[-1].prompt_logprobs
    out, err = capsys.readouterr()
    assert out == "Hello\n" and "prompt logprobs: 2 tokens, mean -2.000, lowest -3.000" in err


def test_cli_prints_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"braid-client {importlib.metadata.version('braid-llm-client')}\n"


def test_cli_has_a_flag_for_every_param() -> None:
    args = cli._parser().parse_args([])
    assert not set(PARAMS) - set(vars(args)), "a GenerateRequest field without a braid-client flag"


def test_cli_reads_the_prompt_from_stdin(
    fake: FakeGenerate, target: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for argv in (["--target", target, "-"], ["--target", target]):
        monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))  # not a tty
        assert cli.main(argv) == 0
        assert fake.requests[-1].prompt == "from stdin"
        assert capsys.readouterr().out == "Hello\n"


def test_cli_json_actions(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--target", target, "--info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model_name"] == "fake" and info["vocab_size"] == 0
    assert info["mode"] == "SCHEDULING_MODE_CONTINUOUS"
    assert cli.main(["--target", target, "--status"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens_generated"] == "5"  # proto3 JSON: uint64 as a string
    assert cli.main(["--target", target, "--tokenize", "ab"]) == 0
    assert json.loads(capsys.readouterr().out) == {"token_ids": [97, 98], "pieces": ["a", "b"], "offsets": []}
    assert cli.main(["--target", target, "--offsets", "ab"]) == 0
    assert json.loads(capsys.readouterr().out)["offsets"] == [{"start": 0, "end": 1}, {"start": 1, "end": 2}]
    assert cli.main(["--target", target, "--detokenize", "104, 105"]) == 0
    assert json.loads(capsys.readouterr().out) == {"text": "hi", "held_back_tokens": 1}
    assert cli.main(["--target", target, "--health"]) == 0
    assert capsys.readouterr().out == "SERVING\n"


def test_cli_bad_arguments_exit_2(target: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--target", target, "--info", "--status"])
    assert exit_info.value.code == 2


def test_cli_ctrl_c_cancels_and_exits_130(
    fake: FakeGenerate, target: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupt(text: str) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.stdout, "write", interrupt)
    assert cli.main(["--target", target, "endless"]) == 130
    monkeypatch.undo()
    assert capsys.readouterr().err == "\n[cancelled]\n"
    assert fake.endless_ended.wait(5) and fake.ended_while_active[-1] is False


def test_client_imports_no_torch() -> None:
    code = "import sys, braid.client.cli; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout == "[]\n"


def test_several_targets_become_one_balanced_channel_target() -> None:
    from braid.client.client import DEFAULT_OPTIONS, SERVICE_CONFIG, channel_target

    assert channel_target("example.com:50051") == "example.com:50051"
    assert channel_target("dns:///braid.internal:50051") == "dns:///braid.internal:50051"
    assert channel_target(["localhost:1", "10.0.0.2:2"]) == "ipv4:127.0.0.1:1,10.0.0.2:2"
    assert channel_target(["[::1]:1", "[::2]:2"]) == "ipv6:[::1]:1,[::2]:2"
    assert channel_target(["10.0.0.2:2"]) == "10.0.0.2:2"
    assert SERVICE_CONFIG["loadBalancingConfig"] == [{"round_robin": {}}]
    retry = SERVICE_CONFIG["methodConfig"][0]["retryPolicy"]
    assert set(retry["retryableStatusCodes"]) == {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}
    assert dict(DEFAULT_OPTIONS)["grpc.enable_retries"] == 1


def test_a_stream_cut_by_the_network_or_a_proxy_counts_as_broken_and_a_server_error_does_not() -> None:
    """The rolling-restart test saw HAProxy end a stream with END_STREAM and no status (grpc:
    UNKNOWN "Stream removed"): the client resumes that, as it resumes UNAVAILABLE and RST_STREAM."""
    from braid.client.generation import is_broken

    class Failed(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode, details: str) -> None:
            self._code, self._details = code, details

        def code(self) -> grpc.StatusCode:
            return self._code

        def details(self) -> str:
            return self._details

    assert is_broken(Failed(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    assert is_broken(Failed(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"))
    assert is_broken(Failed(grpc.StatusCode.UNKNOWN, "Stream removed (Data frame with END_STREAM flag received)"))
    assert is_broken(Failed(grpc.StatusCode.CANCELLED, "CANCELLED"))  # gRPC's, for a call its server shut down on
    assert not is_broken(Failed(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
    assert not is_broken(Failed(grpc.StatusCode.INTERNAL, "forward pass failed: boom"))
    assert not is_broken(Failed(grpc.StatusCode.INVALID_ARGUMENT, "prompt: set prompt or messages"))


STORY = [11, 12, 13, 14, 15, 16]  # the token ids of the one generation the fake replica knows
CUTS = [  # how its first calls break, as HAProxy ends a stream whose replica died
    (grpc.StatusCode.UNKNOWN, "Stream removed (Data frame with END_STREAM flag received)"),
    (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"),
]


class Story(generate_pb2_grpc.GenerateServicer):
    """Serves STORY as braid does, from the request's resume_token_ids on, its seed in the headers;
    the first len(CUTS) calls break two messages in."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    def Stream(self, request: pb.GenerateRequest, context: Context) -> Iterator[pb.GenerateResponse]:
        self.requests.append(request)
        context.send_initial_metadata((("braid-seed", "42"),))
        rest = STORY[len(request.resume_token_ids) :]
        for i, token in enumerate(rest):
            if i == 2 and len(self.requests) <= len(CUTS):
                context.abort(*CUTS[len(self.requests) - 1])
            reason = pb.FINISH_REASON_MAX_TOKENS if i == len(rest) - 1 else pb.FINISH_REASON_UNSPECIFIED
            yield pb.GenerateResponse(text=f"t{token} ", token_ids=[token], seed=42, finish_reason=reason)


@pytest.fixture
def story() -> Iterator[tuple[Story, str]]:
    servicer = Story()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    generate_pb2_grpc.add_GenerateServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def _raw_client_section() -> str:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "deployment.md").read_text()
    return docs[docs.index("### A raw gRPC client") : docs.index("**Load reports.**")]


def test_the_deployment_docs_retry_policy_for_raw_clients_is_the_clients_own() -> None:
    from braid.client.client import SERVICE_CONFIG

    (config,) = re.findall(r"```json\n(.*?)```", _raw_client_section(), re.S)
    assert json.loads(config) == SERVICE_CONFIG


def test_a_raw_stub_sees_a_proxys_cut_and_the_deployment_docs_recipe_resumes_it(story: tuple[Story, str]) -> None:
    """docs/deployment.md's raw-client recipe, run as written: a plain stub fails with the status a
    proxy gives a stream whose replica died; the recipe, and braid's Client, read one unbroken story."""
    servicer, target = story
    section = _raw_client_section()
    (recipe,) = re.findall(r"```python\n(.*?)```", section, re.S)
    namespace: dict[str, object] = {}
    exec(compile(textwrap.dedent(recipe), "docs/deployment.md", "exec"), namespace)
    with grpc.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        with pytest.raises(grpc.RpcError) as raw:
            list(stub.Stream(pb.GenerateRequest(prompt="hi", resume_token_ids=[11])))
        assert (raw.value.code(), raw.value.details()) == CUTS[0]
        servicer.requests.clear()
        stream = namespace["stream"]
        assert callable(stream)
        messages = list(stream(stub, pb.GenerateRequest(prompt="hi", resume_token_ids=[11])))
    assert [t for m in messages for t in m.token_ids] == STORY[1:]
    assert [(list(r.resume_token_ids), r.seed) for r in servicer.requests] == [
        ([11], 0),
        ([11, 12, 13], 42),
        ([11, 12, 13, 14, 15], 42),  # each after the request's own
    ]
    servicer.requests.clear()
    with Client(target) as client, client.stream("hi") as generation:
        assert [t for m in generation for t in m.token_ids] == STORY and generation.resumes == 2


class CutBeforeHeaders(Story):
    """Cuts its first `cuts` calls before their headers, as HAProxy ends a stream whose replica exited
    as the call reached it (the rolling-restart test's UNKNOWN "Stream removed"), then serves STORY."""

    def __init__(self, cuts: int, code: grpc.StatusCode = CUTS[0][0], details: str = CUTS[0][1]) -> None:
        super().__init__()
        self.cuts, self.code, self.details = cuts, code, details

    def Stream(self, request: pb.GenerateRequest, context: Context) -> Iterator[pb.GenerateResponse]:
        self.requests.append(request)
        if len(self.requests) <= self.cuts:
            context.abort(self.code, self.details)
        context.send_initial_metadata((("braid-seed", "42"),))
        for i, token in enumerate(STORY):
            reason = pb.FINISH_REASON_MAX_TOKENS if i == len(STORY) - 1 else pb.FINISH_REASON_UNSPECIFIED
            yield pb.GenerateResponse(text=f"t{token} ", token_ids=[token], seed=42, finish_reason=reason)


def _serve(servicer: generate_pb2_grpc.GenerateServicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    generate_pb2_grpc.add_GenerateServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


class CutAfterFinal(Story):
    """Serves STORY, its final message included, then ends the stream with no status, as HAProxy
    does when the replica exits just after its last message (the rolling-restart test's load)."""

    def Stream(self, request: pb.GenerateRequest, context: Context) -> Iterator[pb.GenerateResponse]:
        self.requests.append(request)
        context.send_initial_metadata((("braid-seed", "42"),))
        for i, token in enumerate(STORY):
            reason = pb.FINISH_REASON_MAX_TOKENS if i == len(STORY) - 1 else pb.FINISH_REASON_UNSPECIFIED
            yield pb.GenerateResponse(text=f"t{token} ", token_ids=[token], seed=42, finish_reason=reason)
        context.abort(*CUTS[0])


def test_a_stream_cut_after_its_final_message_has_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every token and the final message arrived: the cut lost only the status, so the stream ends
    as it would have, with no error and no resume; sync and async alike. A stream cut before its
    final message still resumes."""
    servicer = CutAfterFinal()
    server, target = _serve(servicer)
    try:
        with Client(target) as client, client.stream("hi") as generation:
            assert [t for m in generation for t in m.token_ids] == STORY
        assert (generation.finish_reason, generation.resumes, len(servicer.requests)) == ("MAX_TOKENS", 0, 1)

        async def read() -> tuple[list[int], str | None]:
            async with AsyncClient(target) as client:
                streamed = client.stream("hi")
                return [t async for m in streamed for t in m.token_ids], streamed.finish_reason

        assert asyncio.run(read()) == (STORY, "MAX_TOKENS")
    finally:
        server.stop(0)


def test_a_stream_cut_before_its_headers_is_sent_again_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """It delivered nothing, so the same request goes again (no resume_token_ids, the request's own
    seed); it failed the rolling restart's load before. A server error before the headers is not
    sent again, nor is a stream cut more often than the client resumes one; each resume waits
    longer than the one before."""
    import braid.client.generation as generation_module

    waits: list[float] = []
    monkeypatch.setattr(generation_module.time, "sleep", waits.append)
    servicer = CutBeforeHeaders(cuts=1)
    server, target = _serve(servicer)
    try:
        with Client(target) as client, client.stream("hi", seed=7) as generation:
            assert [t for m in generation for t in m.token_ids] == STORY and generation.resumes == 1
        assert [(r.prompt, list(r.resume_token_ids), r.seed) for r in servicer.requests] == [("hi", [], 7)] * 2
        servicer.requests.clear()
        servicer.cuts = 10**6
        with Client(target) as client, pytest.raises(grpc.RpcError) as cut:
            list(client.stream("hi"))
        assert cut.value.details() == CUTS[0][1] and len(servicer.requests) == 1 + MAX_RESUMES
        assert waits == [
            RESUME_BACKOFF_S * f for f in (1, 1, 2, 4)
        ]  # the first stream's one resume, then the second's three
    finally:
        server.stop(0)
    servicer = CutBeforeHeaders(cuts=1, code=grpc.StatusCode.INTERNAL, details="forward pass failed: boom")
    server, target = _serve(servicer)
    try:
        with Client(target) as client, pytest.raises(grpc.RpcError):
            list(client.stream("hi"))
        assert len(servicer.requests) == 1
    finally:
        server.stop(0)


def test_a_call_its_server_shut_down_on_before_taking_it_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC ends a call that reached a server as it shut down, before any handler took it, with
    CANCELLED "CANCELLED" (grpc/grpc#41785), and HAProxy passes that on: the rolling-restart test's
    load failed so, once. The call never ran, so it goes again as it was; the client's own cancel()
    still just ends the stream."""
    import braid.client.generation as generation_module

    monkeypatch.setattr(generation_module.time, "sleep", lambda s: None)
    servicer = CutBeforeHeaders(cuts=1, code=grpc.StatusCode.CANCELLED, details="CANCELLED")
    server, target = _serve(servicer)
    try:
        with Client(target) as client, client.stream("hi", seed=7) as generation:
            assert [t for m in generation for t in m.token_ids] == STORY and generation.resumes == 1
        assert [(r.prompt, list(r.resume_token_ids), r.seed) for r in servicer.requests] == [("hi", [], 7)] * 2
        with Client(target) as client, client.stream("hi") as generation:
            next(generation)
            generation.cancel()
            assert list(generation) == [] and generation.resumes == 0
    finally:
        server.stop(0)
