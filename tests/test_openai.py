"""OpenAI's HTTP API (--http-port) called as its users call it: OpenAI's own SDK and LangChain's
ChatOpenAI, against one real `braid serve` of a tiny random Qwen3 whose chat template (given with
--chat-template) renders tools as Qwen's does. Mapping and parsing details: tests/unit/test_openai_*.py."""

from __future__ import annotations

import json
import signal

import httpx
import jsonschema
import pytest

from braid_testing.models import save_model, tiny_model
from conftest import SLOW, Server, free_port, tiny_server, wait_for
from braid.v1 import generate_pb2 as pb

KEY = "sk-test-key"
TEMPLATE = "tests/data/hermes_tools.jinja"
HI = [{"role": "user", "content": "Say hi."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}, "days": {"enum": [1, 2, 3]}},
            "required": ["unit", "days"],
            "additionalProperties": False,
        },
    },
}

ANSWER = {  # a JSON schema for structured output
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # llguidance's option: no whitespace for a random model
}


def logged(server: Server, *wanted: str) -> bool:
    """Whether a line of the server's log holds every one of `wanted`."""
    return any(all(w in line for w in wanted) for line in server.log_file.read_text().splitlines())


@pytest.fixture(scope="module")
def server(tmp_path_factory, smol_dir):
    """The tiny Qwen3, every pass 3 ms slower (SLOW: a long stream outlasts its cancel), with an
    API key on both ports."""
    path = tmp_path_factory.mktemp("tiny-qwen3")
    save_model(path, tiny_model("qwen3"), smol_dir)
    http_port = free_port()
    log = tmp_path_factory.mktemp("log") / "braid.log"
    started = Server(
        [
            "--model",
            str(path),
            "--threads",
            "1",
            "--max-batch-size",
            "16",
            "--max-wait-ms",
            "5",
            "--http-port",
            str(http_port),
            "--chat-template",
            TEMPLATE,
        ],
        env={**SLOW, "BRAID_API_KEY": KEY},
        log_path=log,
    )
    started.http = f"http://127.0.0.1:{http_port}"
    started.log_file = log
    yield started
    assert started.stop() == 0  # SIGTERM drains the HTTP front end with the gRPC server, and braid exits cleanly


@pytest.fixture(scope="module")
def client(server):
    import openai

    with openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


def test_chat_streamed_and_not_says_the_same_with_usage(client):
    whole = client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason in ("length", "stop") and choice.message.role == "assistant"
    assert (
        whole.usage.completion_tokens <= 8
        and whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_streamed_and_not_with_n_and_logprobs(client):
    whole = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, n=3, seed=5, logprobs=2)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2] and whole.usage.completion_tokens <= 18
    for choice in whole.choices:
        lp = choice.logprobs
        assert "".join(lp.tokens) == choice.text and len(lp.token_logprobs) == len(lp.tokens)
        assert all(len(top) <= 2 for top in lp.top_logprobs)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=6, n=3, seed=5, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in whole.choices}  # the seed makes it reproducible


def test_chat_logprobs_name_each_token(client):
    out = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content) == out.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-5 for t in content)


def test_a_seed_reproduces_a_sampled_chat(client):
    def sample(seed: int) -> list[str]:
        out = client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=1.0, seed=seed, n=2)
        return [c.message.content for c in out.choices]

    assert sample(11) == sample(11)


def test_json_schema_output_validates(client):
    schema = ANSWER
    out = client.chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=40,
        temperature=1.0,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_a_named_function_call_has_arguments_that_validate_streamed_or_not(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice=named,
        max_tokens=40,
    )
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    with client.chat.completions.stream(
        model="tiny",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        tool_choice=named,
        max_tokens=40,
    ) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = client.chat.completions.create(
        model="tiny", messages=HI, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=40
    )
    (call,) = required.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_conversation_with_tool_turns_renders_through_the_template(client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"unit": "c", "days": 1}'},
    }
    out = client.chat.completions.create(
        model="tiny",
        max_tokens=4,
        tools=[WEATHER],
        tool_choice="auto",
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    )
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert out.usage.prompt_tokens > 100  # the tools' block and the tool turns were rendered


def test_a_repeated_prompt_reports_cached_tokens(client):
    long = [{"role": "user", "content": "Remember this list: " + " ".join(f"item{i}" for i in range(60))}]
    client.chat.completions.create(model="tiny", messages=long, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=long, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_closing_the_sdks_stream_cancels_the_session(server, client):
    with server.client() as grpc_client:
        before = grpc_client.server_status().sessions_finished.cancelled
        stream = client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=900, stream=True, extra_body={"ignore_eos": True}
        )
        for _, _ in zip(range(4), stream):
            pass
        stream.close()
        wait_for(lambda: grpc_client.server_status().sessions_finished.cancelled == before + 1)
        assert grpc_client.server_status().sessions_active == 0


def test_a_client_that_hangs_up_on_a_whole_response_cancels_its_session(server):
    with server.client() as grpc_client:
        before = grpc_client.server_status().sessions_finished.cancelled
        body = {"model": "tiny", "messages": HI, "max_tokens": 900, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):  # SLOW: the 900 tokens take 2.7 s at least
            httpx.post(
                server.http + "/v1/chat/completions", json=body, timeout=0.5, headers={"Authorization": f"Bearer {KEY}"}
            )
        wait_for(lambda: grpc_client.server_status().sessions_finished.cancelled == before + 1)


BAD = [  # (body beside model and messages, the param OpenAI's error names): one per parameter family
    (dict(temperature=-1), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=99), "n"),
    (dict(stop=["x"] * 17), "stop"),
    (dict(seed="x"), "seed"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(logit_bias={"999999": 1}), "logit_bias[999999]"),
    (dict(logprobs=True, top_logprobs=99), "top_logprobs"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        "response_format.json_schema.schema",
    ),
    (
        dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice.function.name",
    ),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (dict(top_k=-1), "top_k"),
    (dict(min_p=2), "min_p"),
    (dict(typical_p=0), "typical_p"),
    (dict(repetition_penalty=-1), "repetition_penalty"),
    (dict(priority="urgent"), "priority"),
    (dict(min_tokens=-1), "min_tokens"),
]


def test_bad_input_is_400_naming_the_param_and_the_server_stays_up(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.http, headers=headers) as http:
        for body, param in BAD:
            response = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, **body})
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert (error["param"], error["type"]) == (param, "invalid_request_error"), body
        assert http.post("/v1/chat/completions", content=b"{not json").json()["error"]["param"] == "body"
        assert http.post("/v1/completions", json={"prompt": "hi", "echo": True}).json()["error"]["param"] == "echo"
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_the_api_key_guards_every_route_but_health(server):
    import openai

    with httpx.Client(base_url=server.http) as http:
        assert http.get("/health").json() == {"status": "ok"}
        for path in ("/v1/models", "/v1/chat/completions"):
            response = http.request(
                "GET" if path == "/v1/models" else "POST", path, json={}, headers={"Authorization": "Bearer wrong"}
            )
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.http + "/v1", api_key="wrong", max_retries=0).models.list()


def test_models_lists_the_served_model(server, client):
    with server.client() as grpc_client:
        name = grpc_client.model_info().model_name
    assert [m.id for m in client.models.list()] == [name]


def test_greedy_text_over_http_is_greedy_text_over_grpc(server, client):
    messages = [{"role": "user", "content": "Count with me: one, two,"}]
    http = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    with server.client() as grpc_client:
        grpc = grpc_client.generate(messages=[pb.Message(**m) for m in messages], max_new_tokens=12)
    assert http.choices[0].message.content == grpc.text and http.usage.completion_tokens == len(grpc.token_ids)
    text = client.completions.create(model="tiny", prompt="one, two,", max_tokens=12, temperature=0).choices[0].text
    with server.client() as grpc_client:
        assert text == grpc_client.generate("one, two,", max_new_tokens=12).text


def test_a_prompt_of_token_ids_completes_as_its_text_does(server, client):
    import openai

    text = "Once upon a time, the river"
    with server.client() as grpc_client:
        ids = list(grpc_client.tokenize(text).token_ids)
    by_text = client.completions.create(model="tiny", prompt=text, max_tokens=5, temperature=0, logprobs=1)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0, logprobs=1)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.choices[0].text
    assert by_ids.choices[0].logprobs.tokens == by_text.choices[0].logprobs.tokens
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=[*ids, 49152], max_tokens=5)
    assert caught.value.body["param"] == f"prompt[{len(ids)}]"


def test_langchain_chat_openai_calls_it(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=server.http + "/v1", api_key=KEY, model="tiny", temperature=0, max_tokens=6, max_retries=0
    )
    reply = chat.invoke("Say hi.")
    assert isinstance(reply.content, str) and reply.usage_metadata["output_tokens"] <= 6
    assert "".join(chunk.content for chunk in chat.stream("Say hi.")) == reply.content


def test_every_call_has_its_request_log_line(server, client):
    import openai

    client.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=HI, temperature=-1)

    wait_for(
        lambda: logged(server, " HTTP request_id=chatcmpl-", "route=POST /v1/chat/completions", "status=200", "finish=")
    )
    assert logged(server, " HTTP request_id=", "status=400", "error=invalid_request_error param=temperature")


def test_sigterm_lets_an_http_stream_finish_while_new_calls_get_503(tiny_dir):
    port = free_port()
    # The grace is no subject here (the server ends when its stream does, not at the grace): a long one,
    # so that a loaded machine's slower stream is never cut by it (900 tokens were, at 708, with 60 s).
    # 150 passes of 20 ms more each: the stream lasts 3 s at least on any machine, and costs a sixth of
    # the CPU of 900 SLOW ones (its time is the sleeps, not the tokens).
    server = tiny_server(
        tiny_dir, "--http-port", str(port), "--grace-period", "3600", env={"BRAID_INJECT_FAULT": "delay:20"}
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=60) as http:
            body = {"model": "tiny", "prompt": "Once", "max_tokens": 150, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as stream:
                events = stream.iter_lines()
                assert next(e for e in events if e.startswith("data: "))  # it runs (3 s at least)
                server.proc.send_signal(signal.SIGTERM)
                wait_for(lambda: http.get("/health").status_code == 503)
                refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
                rest = [e for e in events if e.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
