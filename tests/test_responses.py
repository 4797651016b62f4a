"""OpenAI's Responses API (--http-port's /v1/responses, stateless) called as its users call it: the
official `openai` SDK's client.responses, against the real `braid serve` of a tiny random Qwen3 that
tests/test_openai.py starts (its `server` fixture: Qwen's tools template, an API key, every pass
3 ms slower). Mapping, events, errors and hostile bodies: tests/unit/test_responses_app.py."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from conftest import wait_for
from test_openai import ANSWER, HI, KEY, logged, server  # noqa: F401  (server: the module's fixture)
from test_openai import WEATHER as CHAT_WEATHER

WEATHER = {
    "type": "function",
    **CHAT_WEATHER["function"],
    "strict": True,
}  # test_openai's tool, as Responses define one
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    import openai

    with openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


def test_a_response_is_the_chat_apis_greedy_text_with_usage(server, client):  # noqa: F811
    response = client.responses.create(model="tiny", input="Say hi.", max_output_tokens=8, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    body = {"model": "tiny", "messages": HI, "max_tokens": 8, "temperature": 0}
    chat = httpx.post(
        server.http + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ).json()
    assert response.output_text == chat["choices"][0]["message"]["content"]
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (
        chat["usage"]["prompt_tokens"],
        chat["usage"]["completion_tokens"],
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    cut = response.status == "incomplete"
    assert (response.incomplete_details is not None) == cut == (chat["choices"][0]["finish_reason"] == "length")
    if cut:
        assert response.incomplete_details.reason == "max_output_tokens"


def test_a_streamed_response_sends_the_events_in_order_and_the_same_text(client):
    whole = client.responses.create(
        model="tiny", input=HI, instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    events = list(
        client.responses.create(
            model="tiny", input=HI, instructions="Be brief.", max_output_tokens=8, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_function_call_has_arguments_that_validate_streamed_or_not(client):
    asked = "Weather in Oslo?"
    for choice, parallel in ((NAMED, None), ("required", False)):
        kw = {} if parallel is None else {"parallel_tool_calls": parallel}
        response = client.responses.create(
            model="tiny", input=asked, tools=[WEATHER], tool_choice=choice, max_output_tokens=40, **kw
        )
        (call,) = response.output
        assert response.status == "completed" and call.type == "function_call" and call.name == "get_weather"
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(
        model="tiny", input=asked, tools=[WEATHER], tool_choice=NAMED, max_output_tokens=40
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    (call,) = final.output
    assert call.arguments == deltas
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_a_function_call_output_turn_renders_through_the_template(client):
    turns = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"unit": "c", "days": 1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    response = client.responses.create(model="tiny", input=turns, tools=[WEATHER], max_output_tokens=4)
    assert response.status in ("completed", "incomplete")
    assert response.usage.input_tokens > 100  # the tools' block and the tool turns were rendered
    again = client.responses.create(model="tiny", input=turns + response.output, tools=[WEATHER], max_output_tokens=2)
    assert again.usage.input_tokens > response.usage.input_tokens  # its own output items, sent back as input


def test_a_json_schema_text_format_output_validates(client):
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    response = client.responses.create(
        model="tiny", input=HI, max_output_tokens=60, temperature=1.0, text={"format": fmt}
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), ANSWER)


def test_state_is_refused_naming_the_field(client):
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="Hi", previous_response_id="resp_123")
    assert refused.value.body["param"] == "previous_response_id"
    assert "no state" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="Hi", reasoning={"effort": "extreme"})
    assert refused.value.body["param"] == "reasoning.effort"
    raw = client.responses.with_raw_response.create(model="tiny", input="Hi", max_output_tokens=2, store=True)
    assert raw.headers["braid-ignored-fields"] == "store" and raw.parse().store is False


def test_closing_the_sdks_stream_cancels_the_session(server, client):  # noqa: F811
    with server.client() as grpc_client:
        before = grpc_client.server_status().sessions_finished.cancelled
        stream = client.responses.create(model="tiny", input=HI, max_output_tokens=900, temperature=0, stream=True)
        for _, _ in zip(range(6), stream):
            pass
        stream.close()
        wait_for(lambda: grpc_client.server_status().sessions_finished.cancelled == before + 1)
        assert grpc_client.server_status().sessions_active == 0


def test_every_call_has_its_request_log_line(server, client):  # noqa: F811
    import openai

    client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="Hi", temperature=-1)
    wait_for(lambda: logged(server, " HTTP request_id=resp_", "route=POST /v1/responses", "status=200", "finish="))
    assert logged(server, "route=POST /v1/responses", "status=400", "error=invalid_request_error param=temperature")
