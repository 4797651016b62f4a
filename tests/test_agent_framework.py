"""An agent framework against braid, run as its users run it: pydantic-ai's Agent (pydantic-ai-slim,
its OpenAI models over the `openai` SDK) with a weather tool (and a second tool, never called), against
the real `braid serve` of the tiny random Qwen3 that tests/test_openai.py starts (its `server` fixture:
Qwen's tools template, an API key). braid forces the first call (a named `tool_choice` from the run's
model settings), the framework runs the tool and sends its result back in a second request
(`tool_choice` auto), and the run ends with the model's answer: over OpenAI's chat API and over the
Responses API, whole and streamed. The random model's words are gibberish, so the checks are on the
structure: the call's arguments validate, the tool ran once with them, the second request carried its
result under the call's id, braid ignored no field the framework sent, and braid finished two sessions
(the call, the answer), none cancelled or failed. No connection leaves this machine."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from typing import TYPE_CHECKING, Literal

import jsonschema
import pytest

from conftest import wait_for
from test_openai import KEY, WEATHER, server  # noqa: F401  (server: the module's fixture)

if TYPE_CHECKING:  # imported where used, as the SDKs are (tests/conftest.py: SDKS_WHERE_USED)
    from pydantic_ai import Agent, RunContext

SCHEMA = WEATHER["function"]["parameters"]  # {"unit": "c"|"f", "days": 1|2|3}, both required
RESULT = "Sunny, 21 degrees, in Oslo."  # what the tool returns, to be found in the second request
MODELS = {"chat": "OpenAIChatModel", "responses": "OpenAIResponsesModel"}  # pydantic_ai.models.openai's
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}


class Recorder:
    """The framework's HTTP traffic to braid: each request's path and JSON body, each response's status
    and `braid-ignored-fields` header."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.responses: list[tuple[int, str | None]] = []

    async def request(self, request) -> None:
        self.requests.append((request.url.path, json.loads(request.content)))

    async def response(self, response) -> None:
        self.responses.append((response.status_code, response.headers.get("braid-ignored-fields")))


def agent_for(server, api: str, recorder: Recorder) -> tuple[Agent, list[dict]]:  # noqa: F811
    import openai
    import pydantic_ai.models.openai
    from pydantic_ai import Agent
    from pydantic_ai.providers.openai import OpenAIProvider

    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [recorder.request], "response": [recorder.response]})
    client = openai.AsyncOpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0, http_client=http)
    model = getattr(pydantic_ai.models.openai, MODELS[api])("tiny", provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, instructions="Answer with the weather tool's help.")
    calls: list[dict] = []

    @agent.tool_plain
    def get_weather(unit: Literal["c", "f"], days: Literal[1, 2, 3]) -> str:
        """The weather in a city."""
        calls.append({"unit": unit, "days": days})
        return RESULT

    @agent.tool_plain
    def get_time(zone: Literal["utc", "cet"]) -> str:
        """The time now: never called, here so that forcing get_weather takes its name."""
        raise AssertionError("get_time was called")

    return agent, calls


def settings(ctx: RunContext) -> dict:
    """Per step, as pydantic-ai wants a forcing tool_choice: the weather tool named until its result is
    in the history, then auto (the random model's free output is the answer)."""
    from pydantic_ai.messages import ToolReturnPart

    returned = any(isinstance(p, ToolReturnPart) for m in ctx.messages for p in getattr(m, "parts", ()))
    return {
        "tool_choice": "auto" if returned else ["get_weather"],
        "max_tokens": 40,
        "temperature": 0.0,
        "parallel_tool_calls": False,
    }


def check(api: str, recorder: Recorder, calls: list[dict], messages: list) -> None:
    from pydantic_ai.messages import ModelResponse, ToolCallPart, ToolReturnPart

    # the model called the tool once, with arguments that validate, and the framework ran it with them
    (call,) = [p for m in messages if isinstance(m, ModelResponse) for p in m.parts if isinstance(p, ToolCallPart)]
    assert call.tool_name == "get_weather"
    arguments = call.args_as_dict()
    jsonschema.validate(arguments, SCHEMA)
    assert calls == [arguments]
    (returned,) = [p for m in messages for p in getattr(m, "parts", ()) if isinstance(p, ToolReturnPart)]
    assert returned.tool_call_id == call.tool_call_id and returned.content == RESULT
    # two requests to braid: the forced call, then the result under the call's id, with auto
    assert [path for path, _ in recorder.requests] == [PATHS[api]] * 2, recorder.requests
    (_, first), (_, second) = recorder.requests
    if api == "chat":
        assert first["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
        assert second.get("tool_choice", "auto") == "auto"
        (tool_message,) = [m for m in second["messages"] if m["role"] == "tool"]
        assert tool_message["tool_call_id"] == call.tool_call_id and RESULT in str(tool_message["content"])
    else:
        assert first["tool_choice"] == {"type": "function", "name": "get_weather"}
        assert second.get("tool_choice", "auto") == "auto"
        (output,) = [i for i in second["input"] if i.get("type") == "function_call_output"]
        assert output["call_id"] == call.tool_call_id and RESULT in str(output["output"])
    # braid took every field the framework sent, and answered both
    assert recorder.responses == [(200, None)] * 2, recorder.responses


def finished(grpc_client) -> dict[str, int]:
    """braid's finished sessions by finish reason (ServerStatus)."""
    counts = grpc_client.server_status().sessions_finished
    return {field.name: value for field, value in counts.ListFields()}


def two_sessions(before: dict[str, int], after: dict[str, int]) -> None:
    """The run was two sessions on braid: the forced call (ended by its constraint), then the answer, and
    none cancelled, failed or refused."""
    grown = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    assert grown.get("constraint", 0) >= 1 and sum(grown.values()) == 2, grown
    assert not {"cancelled", "error", "invalid_request", "deadline"} & set(grown), grown


@pytest.fixture(autouse=True)
def localhost_only(monkeypatch):
    """No connection beyond this machine: pydantic-ai's instrumentation is off unless asked for (and has
    no exporter of its own), and its price tables are bundled; a connection elsewhere fails the test."""
    connect = socket.socket.connect

    def checked(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            assert ipaddress.ip_address(address[0]).is_loopback, f"a connection to {address}"
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", checked)


@pytest.fixture
def grpc_client(server):  # noqa: F811
    with server.client() as client:
        yield client


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_agent_calls_the_forced_tool_and_answers_with_its_result(server, grpc_client, api):  # noqa: F811
    recorder = Recorder()
    agent, calls = agent_for(server, api, recorder)
    before = finished(grpc_client)
    result = agent.run_sync("What is the weather in Oslo?", model_settings=settings)
    assert isinstance(result.output, str)
    check(api, recorder, calls, result.all_messages())
    wait_for(lambda: sum(finished(grpc_client).values()) == sum(before.values()) + 2)
    two_sessions(before, finished(grpc_client))


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_streamed_agent_run_calls_the_tool_and_streams_the_answer(server, grpc_client, api):  # noqa: F811
    recorder = Recorder()
    agent, calls = agent_for(server, api, recorder)
    before = finished(grpc_client)

    async def run():
        async with agent.run_stream("What is the weather in Oslo?", model_settings=settings) as streamed:
            chunks = [chunk async for chunk in streamed.stream_text(delta=True)]
            return chunks, await streamed.get_output(), streamed.all_messages()

    chunks, output, messages = asyncio.run(run())
    assert len(chunks) > 1 and "".join(chunks) == output  # the answer came in pieces
    assert all(body.get("stream") for _, body in recorder.requests)
    check(api, recorder, calls, messages)
    wait_for(lambda: sum(finished(grpc_client).values()) == sum(before.values()) + 2)
    two_sessions(before, finished(grpc_client))
