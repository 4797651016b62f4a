"""Thousands of random and malformed requests: every one gets a response or a defined status, and the
server stays healthy."""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from braid.v1 import generate_pb2 as pb

EXPECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
ROLES = st.sampled_from(["user", "system", "assistant", "tool", "", "wizard", "USER"])
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.floats(0, 2, width=32))
INTS = st.one_of(st.integers(-5, 40), st.integers(-(2**31), 2**31 - 1))
# constraints that compile, beside the random text that mostly does not
SCHEMAS = ['{"type": "integer", "minimum": 3}', '{"enum": ["a", "b"]}', "true", "false", '{"type": "array"}']
PATTERNS = ["a*", "", "[^\\s\\S]", "(yes|no)", "\\d{2,4}"]

requests = st.builds(
    pb.GenerateRequest,
    prompt=st.one_of(st.just(""), st.text(max_size=120)),
    messages=st.lists(st.builds(pb.Message, role=ROLES, content=st.text(max_size=60)), max_size=3),
    max_new_tokens=st.one_of(st.integers(-5, 12), st.integers(-(2**31), 2**31 - 1)),
    min_new_tokens=INTS,
    temperature=FLOATS,
    top_p=FLOATS,
    top_k=INTS,
    min_p=FLOATS,
    typical_p=FLOATS,
    repetition_penalty=FLOATS,
    seed=st.integers(0, 2**64 - 1),
    stop=st.lists(st.text(max_size=300), max_size=20),
    stop_token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=70),
    ignore_eos=st.booleans(),
    request_id=st.text(max_size=140),
    priority=st.integers(0, 5),
    timeout_ms=st.integers(0, 2000),
    cache_salt=st.text(max_size=300),
    presence_penalty=FLOATS,
    frequency_penalty=FLOATS,
    logit_bias=st.dictionaries(st.one_of(st.integers(-3, 60000), st.integers(-(2**31), 2**31 - 1)), FLOATS, max_size=4),
    logprobs=st.booleans(),
    top_logprobs=st.integers(0, 40),
    include_stop_sequence=st.booleans(),
    truncate_input_tokens=st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)),
    bad_words=st.lists(st.text(max_size=300), max_size=70),
    report_queue=st.booleans(),
    n=st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1)),
    prompt_logprobs=st.booleans(),
    constraint=st.one_of(
        st.none(),
        st.builds(pb.Constraint),
        st.builds(pb.Constraint, json_object=st.booleans()),
        st.builds(pb.Constraint, json_schema=st.one_of(st.text(max_size=80), st.sampled_from(SCHEMAS))),
        st.builds(pb.Constraint, regex=st.one_of(st.text(max_size=30), st.sampled_from(PATTERNS))),
        st.builds(pb.Constraint, choice=st.builds(pb.Choice, choices=st.lists(st.text(max_size=12), max_size=4))),
        st.builds(pb.Constraint, grammar=st.builds(pb.Grammar, syntax=st.integers(0, 3), text=st.text(max_size=60))),
    ),
)


@settings(max_examples=1200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(request=st.one_of(requests.map(pb.GenerateRequest.SerializeToString), st.binary(max_size=200)))
def _send(channel, request: bytes) -> None:
    call = channel.unary_stream(
        "/braid.v1.Generate/Stream", request_serializer=None, response_deserializer=pb.GenerateResponse.FromString
    )
    try:
        messages = list(call(request, timeout=60))
    except grpc.RpcError as err:
        assert err.code() in EXPECTED, (err.code(), err.details())
        return
    assert messages and messages[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert messages[-1].finish_reason not in (pb.FINISH_REASON_ERROR, pb.FINISH_REASON_CANCELLED)


def test_random_requests_get_a_response_or_a_defined_status(servers):
    server = servers("continuous")
    with grpc.insecure_channel(server.target) as channel:
        _send(channel)
    with server.client() as client:
        assert client.health() == "SERVING"
        assert client.generate("still fine", max_new_tokens=3, ignore_eos=True).usage.generated_tokens == 3
        status = client.server_status()
    assert status.sessions_active == 0 and status.sessions_finished.error == 0
