"""The HTTP front end in process (Starlette's TestClient) over the servicer's fake engine client:
status codes and OpenAI's error shape for what the engine says, the API key, draining."""

from __future__ import annotations

import dataclasses
import json

import pytest
from starlette.testclient import TestClient
from test_servicer import FakeEngine

from braid.server.config import ServerConfig
from braid.server.engine.types import FinishReason
from braid.server.http.app import OpenAIApi


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


def serve(engine: FakeEngine, **config) -> tuple[OpenAIApi, TestClient]:
    api = OpenAIApi(engine, ServerConfig(**config))
    return api, TestClient(api.app)


def test_a_chat_streams_its_tokens_then_done():
    _, http = serve(FakeEngine())
    with http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True, "n": 2}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert response.headers["content-type"].startswith("text/event-stream") and events[-1] == "data: [DONE]"
    whole = http.post("/v1/chat/completions", json=CHAT).json()
    assert whole["choices"][0]["message"]["content"] == " 5 6 7" and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def test_a_full_queue_is_429_with_retry_after():
    engine = FakeEngine(max_queued=1)
    engine.books.reserve()  # the one place is taken
    _, http = serve(engine)
    response = http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["type"] == "rate_limit_error"


def test_a_draining_server_is_503_and_says_so_on_health():
    api, http = serve(FakeEngine())
    assert http.get("/health").status_code == 200
    api.draining = True
    assert http.get("/health").status_code == 503
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 503


def test_an_engine_error_is_500_and_a_request_found_invalid_is_400_naming_the_param():
    engine = FakeEngine()
    engine.finish, engine.error = FinishReason.ERROR, "forward pass failed: boom"
    _, http = serve(engine)
    response = http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 500 and response.json()["error"]["message"] == "forward pass failed: boom"
    engine.finish, engine.error, engine.error_field = FinishReason.INVALID_REQUEST, "x" * 5000, "constraint.regex"
    error = http.post("/v1/chat/completions", json=CHAT).json()["error"]
    assert error["param"] == "response_format" and len(error["message"]) <= 1000


def test_the_api_key_is_one_bearer_header_and_health_stays_open():
    _, http = serve(FakeEngine(), api_key="k")
    assert http.get("/health").status_code == 200
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "bearer k"}).status_code == 200
    assert (
        http.get("/v1/models", headers={"Authorization": "Bearer x"}).json()["error"]["type"] == "authentication_error"
    )


def test_a_body_over_max_message_bytes_is_refused_unread():
    _, http = serve(FakeEngine(), max_message_bytes=1000)
    response = http.post("/v1/completions", json={"prompt": "x" * 2000})
    assert response.status_code == 413 and response.json()["error"]["param"] == "body"


def test_unknown_routes_and_methods_answer_in_openais_shape():
    _, http = serve(FakeEngine())
    assert http.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert http.get("/v1/chat/completions").status_code == 405


def test_a_call_is_one_span_child_of_its_traceparent_that_lasts_the_whole_stream():
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # once per process; the app's tracer is a proxy that follows it
    _, http = serve(FakeEngine())
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with http.stream(
        "POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"traceparent": parent}
    ) as response:
        assert list(response.iter_lines())
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/chat/completions"]
    assert format(span.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert span.attributes["http.response.status_code"] == 200 and span.attributes["braid.generated_tokens"] == 3


def named(engine: FakeEngine, *names: str, path: str = "/models/fake") -> FakeEngine:
    """The engine served under --served-model-name's names."""
    engine.info = dataclasses.replace(engine.info, model_name=names[0], served_model_names=names, model_path=path)
    return engine


def test_models_lists_every_served_name_and_each_answers_by_its_id():
    engine = named(FakeEngine(), "smol", "gpt-4o-mini")
    engine.load_lora("sql", "/adapters/sql")
    _, http = serve(engine)
    cards = http.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["smol", "gpt-4o-mini", "sql"]  # no path among them
    assert {c["root"] for c in cards} == {"smol"} and cards[2]["parent"] == "smol"  # never the model's path
    for card in cards:
        assert http.get(f"/v1/models/{card['id']}").json() == card
    assert http.get("/v1/models/HuggingFaceTB/SmolLM2-135M-Instruct").status_code == 404  # ids with a slash route


def test_an_unknown_model_id_is_404_in_openais_shape():
    _, http = serve(named(FakeEngine(), "smol"))
    response = http.get("/v1/models/nothing")
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "the model 'nothing' does not exist",
        "type": "not_found_error",
        "param": "model",
        "code": None,
    }


def test_a_slashed_served_name_is_found_by_its_id():
    _, http = serve(named(FakeEngine(), "HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert http.get("/v1/models/HuggingFaceTB/SmolLM2-135M-Instruct").json()["id"] == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )


@pytest.mark.parametrize("asked", ["smol", "gpt-4o-mini", "anything else", None])
def test_a_response_reports_the_first_served_name_whatever_name_the_request_gave(asked):
    _, http = serve(named(FakeEngine(), "smol", "gpt-4o-mini"))
    body = {k: v for k, v in {**CHAT, "model": asked}.items() if v is not None}
    assert http.post("/v1/chat/completions", json=body).json()["model"] == "smol"
    with http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True, "model": asked}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"smol"}


def test_a_request_naming_an_adapter_runs_it_and_is_answered_under_its_name():
    engine = named(FakeEngine(), "smol")
    engine.load_lora("sql", "/adapters/sql")
    adapters, submit = [], engine.submit
    engine.submit = lambda ticket, request, *rest, **kw: (
        adapters.append(request.adapter) or submit(ticket, request, *rest, **kw)
    )
    _, http = serve(engine)
    assert http.post("/v1/chat/completions", json={**CHAT, "model": "sql"}).json()["model"] == "sql"
    assert http.post("/v1/chat/completions", json={**CHAT, "model": "smol"}).json()["model"] == "smol"
    assert adapters == ["sql", ""]


def _requests_of(engine: FakeEngine) -> list:
    """The GenerationRequests the engine is given, from now on."""
    seen, submit = [], engine.submit
    engine.submit = lambda ticket, request, *rest, **kw: seen.append(request) or submit(ticket, request, *rest, **kw)
    return seen


def test_a_completion_prompt_of_token_ids_reaches_the_engine_as_ids_and_bad_ones_are_400_naming_them():
    engine = FakeEngine()
    seen, (_, http) = _requests_of(engine), serve(engine)
    response = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
    assert response.status_code == 200 and response.json()["choices"][0]["text"]
    assert [(r.prompt, r.prompt_token_ids) for r in seen] == [(None, (5, 6, 7))]
    for prompt, param in (
        ([5, 6, 7, 100], "prompt[3]"),
        ([], "prompt"),
        ([[1, 2], [3, 4]], "prompt"),
        ([1.5], "prompt"),
    ):
        response = http.post("/v1/completions", json={"prompt": prompt})
        assert (response.status_code, response.json()["error"]["param"]) == (400, param), prompt
    assert len(seen) == 1
    engine.finish, engine.error, engine.error_field = FinishReason.INVALID_REQUEST, "too long", "prompt_token_ids"
    assert http.post("/v1/completions", json={"prompt": [5, 6]}).json()["error"]["param"] == "prompt"


def test_a_stream_a_drain_cuts_ends_with_an_error_event_not_done_and_a_whole_response_is_503():
    """The drain's cancel (its grace, or --handover-grace, over) reaches the sessions after they
    began: a stream ends with OpenAI's error event, so that a client sees it was cut."""
    engine = FakeEngine()
    engine.finish = FinishReason.CANCELLED
    api, http = serve(engine)
    submit = engine.submit

    def submit_then_drain(*args, **kw):
        handles = submit(*args, **kw)
        api.draining = True  # the server drains while the sessions run: their tokens, then the cancel
        return handles

    engine.submit = submit_then_drain
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events and not any(c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"])
    assert "".join(c["delta"].get("content", "") for e in events[:-1] for c in json.loads(e)["choices"]) == " 5 6 7"
    error = json.loads(events[-1])["error"]
    assert error["type"] == "service_unavailable" and "draining" in error["message"]
    api.draining = False
    whole = http.post("/v1/chat/completions", json=CHAT)
    assert whole.status_code == 503 and whole.json()["error"]["type"] == "service_unavailable"
    engine.submit, api.draining = submit, False  # a cancel while not draining (Abort, say) stays a normal end
    assert http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["finish_reason"] == "stop"


def test_a_forced_call_cut_by_max_tokens_is_a_tool_call_with_finish_reason_length():
    """As OpenAI answers: the call as far as it got (its arguments unfinished JSON), never content,
    so that a client (LangChain's with_structured_output) fails to parse it instead of finding none."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    _, http = serve(FakeEngine())  # its " 5 6 7" then max_tokens: a call cut short
    body = {**CHAT, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}
    (choice,) = http.post("/v1/chat/completions", json=body).json()["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": "5 6 7"}


def test_tools_reach_a_template_that_does_not_render_them_through_the_system_message():
    engine = FakeEngine()
    engine.info = dataclasses.replace(engine.info, chat_template_takes_tools=False)
    seen = _requests_of(engine)
    _, http = serve(engine)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    http.post("/v1/chat/completions", json={**CHAT, "tools": [tool]})
    (request,) = seen
    assert request.messages[0].role == "system" and "get_weather" in request.messages[0].content
    assert request.tools == ""


def test_an_unknown_field_is_named_in_a_header_and_logged_once_and_strict_refuses_it(caplog):
    engine = FakeEngine()
    seen = _requests_of(engine)
    _, http = serve(engine)
    body = {**CHAT, "max_tokns": 3, "chat_template_kwargs": {"enable_thinking": False}}
    with caplog.at_level("WARNING", logger="braid.server.http.app"):
        first = http.post("/v1/chat/completions", json=body)
        again = http.post("/v1/chat/completions", json=body)
    assert first.status_code == 200 and first.headers["braid-ignored-fields"] == "max_tokns"
    assert again.headers["braid-ignored-fields"] == "max_tokns"
    assert [r.getMessage() for r in caplog.records if "max_tokns" in r.getMessage()] == [
        "HTTP POST /v1/chat/completions: ignoring fields braid does not know: max_tokns"
    ]
    assert json.loads(seen[0].chat_template_kwargs) == {"enable_thinking": False}
    with http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True, "echoo": 1}) as response:
        assert response.headers["braid-ignored-fields"] == "echoo"
    assert "braid-ignored-fields" not in http.post("/v1/chat/completions", json=CHAT).headers
    _, strict = serve(FakeEngine(), strict_request_fields=True)
    refused = strict.post("/v1/chat/completions", json={**CHAT, "messages": [{**CHAT["messages"][0], "nam": "x"}]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages[0].nam"
    assert strict.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {}}).status_code == 200


def test_metrics_are_served_on_the_http_port_behind_the_api_key_and_only_when_given():
    asked = []

    def page(accept: str) -> tuple[bytes, str]:
        asked.append(accept)
        return b"# TYPE braid_sessions gauge\nbraid_sessions 0.0\n", "text/plain; version=0.0.4; charset=utf-8"

    http = TestClient(OpenAIApi(FakeEngine(), ServerConfig(api_key="k"), metrics=page).app)
    assert http.get("/metrics").json()["error"]["type"] == "authentication_error"
    response = http.get("/metrics", headers={"Authorization": "Bearer k", "Accept": "application/openmetrics-text"})
    assert response.status_code == 200 and response.text.startswith("# TYPE braid_sessions gauge")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert asked == ["application/openmetrics-text"]  # the scraper's Accept chooses the format
    _, without = serve(FakeEngine())
    assert without.get("/metrics").status_code == 404


def test_a_calls_metric_is_labelled_by_its_route_never_by_the_path_a_client_wrote():
    """Every id a client asks /v1/models/{id} for is one series of the calls metric, not a new one."""
    calls: list[tuple[str, str]] = []

    class Calls:
        def on_call(self, method: str, status_code: str, seconds: float) -> None:
            calls.append((method, status_code))

    api = OpenAIApi(FakeEngine(), ServerConfig(), calls=Calls())
    http = TestClient(api.app)
    for wanted in ("a", "b/c", "x" * 300):
        assert http.get(f"/v1/models/{wanted}").status_code == 404
    http.post("/v1/chat/completions", json=CHAT)
    assert calls == [("http GET /v1/models/{id}", "404")] * 3 + [("http POST /v1/chat/completions", "200")]
