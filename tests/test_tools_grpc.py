"""Tool calls over gRPC, called as a user calls them (braid's Python client), against the real
`braid serve` of a tiny random Qwen3 whose chat template renders tools as Qwen's does
(tests/test_openai.py's `server`: --chat-template tests/data/hermes_tools.jinja, an API key). A
forced call's arguments always validate against the tool's schema, and the same greedy request
over gRPC, OpenAI's chat and Anthropic's messages gives the same call: one plan serves all three
(frontend/tool_plan.py). Fixed outputs, checks and streaming: tests/unit/test_tool_calls_grpc.py."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from braid.client import BadRequestError, function_choice
from braid.v1 import generate_pb2 as pb
from test_openai import KEY, WEATHER, server  # noqa: F401  (server: the module's fixture)

HI = [{"role": "user", "content": "What is the weather in Oslo?"}]
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MAX = 40


@pytest.fixture(scope="module")
def grpc_client(server):  # noqa: F811
    with server.client() as client:
        yield client


def chat(server, **body):  # noqa: F811
    request = {"model": "tiny", "messages": HI, "max_tokens": MAX, "temperature": 0, **body}
    response = httpx.post(
        server.http + "/v1/chat/completions", json=request, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def valid(call) -> dict:  # a ToolCall's arguments, parsed and validated against its tool's schema
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.name])
    return arguments


def test_a_named_call_is_the_final_messages_and_its_arguments_validate(grpc_client):
    choice = function_choice("get_weather")
    with grpc_client.stream(messages=HI, tools=[WEATHER, TIME], tool_choice=choice, max_new_tokens=MAX) as generation:
        messages = list(generation)
    (call,) = messages[-1].tool_calls
    assert generation.finish_reason == "CONSTRAINT" and call.name == "get_weather" and call.id.startswith("call_")
    valid(call)
    assert generation.text == "" and generation.tool_calls == [call]  # the call is never text


def test_a_required_call_validates_and_a_list_streams_each_call_as_it_closes(grpc_client):
    one = pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED, disable_parallel_tool_calls=True)
    completion = grpc_client.generate(messages=HI, tools=[WEATHER, TIME], tool_choice=one, max_new_tokens=MAX)
    assert completion.finish_reason == "CONSTRAINT" and completion.text == "", completion
    (call,) = completion.tool_calls
    valid(call)
    # parallel calls: this random model goes on calling until max_new_tokens cuts the last call short
    several = pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)
    with grpc_client.stream(messages=HI, tools=[WEATHER, TIME], tool_choice=several, max_new_tokens=MAX) as generation:
        messages = list(generation)
    calls = generation.tool_calls
    whole = calls if generation.finish_reason == "CONSTRAINT" else calls[:-1]
    assert len(whole) >= 1 and len({c.id for c in calls}) == len(calls) and generation.text == ""
    for call in whole:
        valid(call)
    # each whole call came in the message where its JSON closed, before the stream's end
    assert messages.index(next(m for m in messages if m.tool_calls)) < len(messages) - 1


@pytest.mark.parametrize("forced", ["get_time", "required"])
def test_the_same_request_over_grpc_openais_chat_and_anthropics_messages_gives_the_same_call(
    server,  # noqa: F811
    grpc_client,
    forced,
):
    import anthropic

    named = forced != "required"
    grpc_choice = (
        function_choice(forced)
        if named
        else pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED, disable_parallel_tool_calls=True)
    )
    over_grpc = grpc_client.generate(messages=HI, tools=[WEATHER, TIME], tool_choice=grpc_choice, max_new_tokens=MAX)
    calls = [(c.name, valid(c)) for c in over_grpc.tool_calls]
    assert over_grpc.finish_reason == "CONSTRAINT" and len(calls) == 1

    openai_choice = {"type": "function", "function": {"name": forced}} if named else "required"
    over_chat = chat(server, tools=[WEATHER, TIME], tool_choice=openai_choice, parallel_tool_calls=False)
    assert over_chat["finish_reason"] == "tool_calls"
    sent = over_chat["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in sent] == [
        (c.name, c.arguments) for c in over_grpc.tool_calls
    ]

    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
    with anthropic.Anthropic(base_url=server.http, api_key=KEY, max_retries=0) as client:
        message = client.messages.create(
            model="tiny",
            max_tokens=MAX,
            messages=HI,
            tools=tools,
            tool_choice={"type": "tool", "name": forced}
            if named
            else {"type": "any", "disable_parallel_tool_use": True},
            extra_body={"temperature": 0},
        )
    assert message.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == calls


def test_tool_turns_render_through_the_template_as_over_openais_chat(server, grpc_client):  # noqa: F811
    """A conversation with an assistant's call and its result: the same prompt, token for token."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}
    turns = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    over_grpc = grpc_client.generate(messages=turns, tools=[WEATHER], max_new_tokens=4, temperature=0)
    body = {"model": "tiny", "messages": turns, "tools": [WEATHER], "max_tokens": 4, "temperature": 0}
    over_chat = httpx.post(server.http + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    prompt_tokens = over_chat.json()["usage"]["prompt_tokens"]
    plain = grpc_client.generate(messages=HI, max_new_tokens=1)
    assert over_grpc.usage.prompt_tokens == prompt_tokens > plain.usage.prompt_tokens + 100  # the tools and the turns


def test_a_required_list_streams_each_call_as_it_closes_over_openais_chat(server, grpc_client):  # noqa: F811
    """As over gRPC: each whole call's delta (its index, id, name and arguments) comes as its JSON
    closes, not all at the end; the calls are gRPC's (this random model calls until max_tokens cuts
    its last call short, which comes at the end, as far as it got)."""
    import openai

    several = pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)
    over_grpc = grpc_client.generate(messages=HI, tools=[WEATHER, TIME], tool_choice=several, max_new_tokens=MAX)
    with openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0) as sdk:
        stream = sdk.chat.completions.create(
            model="tiny",
            messages=HI,
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=MAX,
            temperature=0,
            stream=True,
        )
        chunks = [c for c in stream if c.choices]
    carrying = [i for i, c in enumerate(chunks) if c.choices[0].delta.tool_calls]
    (end,) = [i for i, c in enumerate(chunks) if c.choices[0].finish_reason]
    assert end == len(chunks) - 1 and carrying[0] < end - 1  # the first call, before the stream's end
    calls: dict[int, list[str]] = {}  # index: id, name, arguments, as OpenAI's stream accumulates them
    for i in carrying:
        for call in chunks[i].choices[0].delta.tool_calls:
            if call.index not in calls:
                calls[call.index] = [call.id, call.function.name, ""]
            calls[call.index][2] += call.function.arguments or ""
    assert sorted(calls) == list(range(len(calls))) and len({c[0] for c in calls.values()}) == len(calls)
    assert [(name, arguments) for _, name, arguments in calls.values()] == [
        (c.name, c.arguments) for c in over_grpc.tool_calls
    ]
    whole = over_grpc.tool_calls if over_grpc.finish_reason == "CONSTRAINT" else over_grpc.tool_calls[:-1]
    assert len(whole) >= 1
    for call in whole:
        valid(call)


def test_tokenize_and_count_tokens_of_a_chat_with_tools_count_its_generations_prompt(server, grpc_client):  # noqa: F811
    """Tokenize (gRPC) and Anthropic's count_tokens count a chat's tools as its generation renders
    them: through this template's tools, not in a system message of their own."""
    import anthropic

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}
    turns = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    for chat_turns in (HI, turns):
        tokenized = grpc_client.tokenize(messages=chat_turns, tools=[WEATHER, TIME])
        generated = grpc_client.generate(messages=chat_turns, tools=[WEATHER, TIME], max_new_tokens=1)
        assert len(tokenized.token_ids) == generated.usage.prompt_tokens
        assert "<tools>" in "".join(tokenized.pieces)  # the template's own rendering
    assert len(grpc_client.tokenize(messages=HI).token_ids) < generated.usage.prompt_tokens

    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
    with anthropic.Anthropic(base_url=server.http, api_key=KEY, max_retries=0) as client:
        counted = client.messages.count_tokens(model="tiny", messages=HI, tools=tools, system="Be brief.")
        message = client.messages.create(model="tiny", max_tokens=1, messages=HI, tools=tools, system="Be brief.")
    assert counted.input_tokens == message.usage.input_tokens


def test_tokenize_refuses_offsets_of_a_chat_with_tools(grpc_client):
    with pytest.raises(BadRequestError) as err:
        grpc_client.tokenize(messages=HI, tools=[WEATHER], return_offsets=True)
    assert err.value.field == "return_offsets"
