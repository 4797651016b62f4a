"""Anthropic's Messages API (--http-port's /v1/messages) called as its users call it: Anthropic's
own Python SDK, against the real `braid serve` of a tiny random Qwen3 that tests/test_openai.py
starts (its `server` fixture: Qwen's tools template, an API key, every pass 3 ms slower). Mapping,
errors and hostile bodies: tests/unit/test_anthropic_app.py."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from conftest import wait_for
from test_openai import ANSWER, KEY, logged, server  # noqa: F401  (server: the module's fixture)
from test_openai import WEATHER as OPENAI_WEATHER

HI = [{"role": "user", "content": "Say hi."}]
# Greedy: Anthropic's newer SDKs no longer have a temperature argument; braid takes the field all the same
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {  # test_openai's function, as Anthropic defines a tool
    "name": OPENAI_WEATHER["function"]["name"],
    "description": OPENAI_WEATHER["function"]["description"],
    "input_schema": OPENAI_WEATHER["function"]["parameters"],
}


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    import anthropic

    with anthropic.Anthropic(base_url=server.http, api_key=KEY, max_retries=0) as c:
        yield c


def test_a_message_is_the_chat_apis_greedy_text_with_usage(server, client):  # noqa: F811
    message = client.messages.create(model="tiny", max_tokens=8, messages=HI, **GREEDY)
    assert (
        message.id.startswith("msg_")
        and message.role == "assistant"
        and message.stop_reason in ("max_tokens", "end_turn")
    )
    (block,) = message.content
    assert block.type == "text" and 0 < message.usage.output_tokens <= 8
    body = {"model": "tiny", "messages": HI, "max_tokens": 8, "temperature": 0}
    chat = httpx.post(
        server.http + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ).json()
    assert block.text == chat["choices"][0]["message"]["content"]
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_a_streamed_message_sends_anthropics_events_in_order_and_the_same_text(client):
    whole = client.messages.create(model="tiny", max_tokens=8, messages=HI, **GREEDY)
    events = list(client.messages.create(model="tiny", max_tokens=8, messages=HI, **GREEDY, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert (
        events[-2].delta.stop_reason == whole.stop_reason
        and events[-2].usage.output_tokens == whole.usage.output_tokens
    )
    with client.messages.stream(model="tiny", max_tokens=8, messages=HI, **GREEDY) as stream:
        assert stream.get_final_message().content[0].text == whole.content[0].text


def test_a_forced_tool_call_has_input_that_validates_streamed_or_not(client):
    asked = [{"role": "user", "content": "Weather in Oslo?"}]
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}):
        message = client.messages.create(
            model="tiny", max_tokens=40, messages=asked, tools=[WEATHER], tool_choice=choice
        )
        (use,) = message.content
        assert message.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
        assert use.id.startswith("toolu_")
        jsonschema.validate(use.input, WEATHER["input_schema"])
    with client.messages.stream(
        model="tiny",
        max_tokens=40,
        messages=asked,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        final = stream.get_final_message()
    (use,) = final.content
    jsonschema.validate(use.input, WEATHER["input_schema"])


def test_output_config_json_schema_output_validates(client):
    schema = ANSWER
    message = client.messages.create(
        model="tiny",
        max_tokens=60,
        messages=HI,
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_a_conversation_with_a_tool_result_renders_through_the_template(client):
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"unit": "c", "days": 1}}
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    message = client.messages.create(model="tiny", max_tokens=4, messages=messages, tools=[WEATHER], system="Be brief.")
    assert message.stop_reason in ("max_tokens", "end_turn", "tool_use")
    assert message.usage.input_tokens > 100  # the tools' block and the tool turns were rendered
    counted = client.messages.count_tokens(model="tiny", messages=messages, system="Be brief.")
    assert counted.input_tokens > 30


def test_count_tokens_is_the_prompt_a_message_is_charged_for(client):
    counted = client.messages.count_tokens(model="tiny", messages=HI, system="Be brief.")
    message = client.messages.create(model="tiny", max_tokens=1, messages=HI, system="Be brief.")
    assert counted.input_tokens == message.usage.input_tokens
    with_tools = client.messages.count_tokens(model="tiny", messages=HI, system="Be brief.", tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens + 20


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    text = client.messages.create(model="tiny", max_tokens=12, messages=HI, **GREEDY).content[0].text
    stop = text.strip()[-3:]  # a piece of the greedy answer, late in it
    message = client.messages.create(model="tiny", max_tokens=12, messages=HI, **GREEDY, stop_sequences=[stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == text[: text.index(stop)]


def test_a_wrong_x_api_key_is_an_authentication_error(server):  # noqa: F811
    import anthropic

    with anthropic.Anthropic(base_url=server.http, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            wrong.messages.create(model="tiny", max_tokens=2, messages=HI)
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_bad_input_is_a_bad_request_naming_the_parameter(client):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model="tiny", max_tokens=2, messages=HI, thinking={"type": "enabled", "budget_tokens": 1024}
        )
    assert refused.value.body["error"]["message"].startswith("thinking.budget_tokens: ")  # not under max_tokens
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="tiny", max_tokens=2, messages=HI, extra_body={"top_k": -1})
    assert refused.value.body["error"]["message"].startswith("top_k: ")


def test_closing_the_sdks_stream_cancels_the_session(server, client):  # noqa: F811
    with server.client() as grpc_client:
        before = grpc_client.server_status().sessions_finished.cancelled
        stream = client.messages.create(model="tiny", max_tokens=900, messages=HI, **GREEDY, stream=True)
        for _, _ in zip(range(4), stream):
            pass
        stream.close()
        wait_for(lambda: grpc_client.server_status().sessions_finished.cancelled == before + 1)
        assert grpc_client.server_status().sessions_active == 0


def test_every_call_has_its_request_log_line(server, client):  # noqa: F811
    import anthropic

    client.messages.create(model="tiny", max_tokens=2, messages=HI)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=2, messages=HI, extra_body={"temperature": -1})
    wait_for(lambda: logged(server, " HTTP request_id=msg_", "route=POST /v1/messages", "status=200", "finish="))
    assert logged(server, "route=POST /v1/messages", "status=400", "error=invalid_request_error param=temperature")
