"""The request checks at the edge: every field and bound gets INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import pytest

from braid.server.grpc import convert
from braid.server.engine.types import RANGED, InvalidArgument, Priority
from braid.server.frontend import checks
from braid.v1 import generate_pb2 as pb


VOCAB = 1000


def _check(**fields):
    return convert.request_from_pb(
        pb.GenerateRequest(**fields), default_max_new_tokens=256, vocab_size=VOCAB, time_remaining=None
    )


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(), "prompt"),
        (dict(prompt="a", messages=[pb.Message(role="user", content="b")]), "prompt"),
        (dict(prompt="x" * (checks.MAX_TEXT_BYTES + 1)), "prompt"),
        (dict(messages=[pb.Message(role="", content="b")]), "messages[0].role"),
        (dict(prompt="a", max_new_tokens=-1), "max_new_tokens"),
        (dict(prompt="a", min_new_tokens=-1), "min_new_tokens"),
        (dict(prompt="a", max_new_tokens=5, min_new_tokens=6), "min_new_tokens"),
        (dict(prompt="a", min_new_tokens=257), "min_new_tokens"),  # past the default max
        (dict(prompt="a", temperature=-0.1), "temperature"),
        (dict(prompt="a", temperature=checks.MAX_TEMPERATURE + 1), "temperature"),
        (dict(prompt="a", temperature=float("nan")), "temperature"),
        (dict(prompt="a", top_p=1.5), "top_p"),
        (dict(prompt="a", top_p=-0.5), "top_p"),
        (dict(prompt="a", top_k=-1), "top_k"),
        (dict(prompt="a", top_k=VOCAB + 1), "top_k"),
        (dict(prompt="a", min_p=2.0), "min_p"),
        (dict(prompt="a", typical_p=0.0), "typical_p"),  # optional: set to 0 is 0, not the default
        (dict(prompt="a", typical_p=1.5), "typical_p"),
        (dict(prompt="a", repetition_penalty=-1.0), "repetition_penalty"),
        (dict(prompt="a", repetition_penalty=checks.MAX_REPETITION_PENALTY + 1), "repetition_penalty"),
        (dict(prompt="a", stop=["x"] * (checks.MAX_STOP_STRINGS + 1)), "stop"),
        (dict(prompt="a", stop=["ok", ""]), "stop[1]"),
        (dict(prompt="a", stop=["x" * (checks.MAX_STOP_BYTES + 1)]), "stop[0]"),
        (dict(prompt="a", stop_token_ids=[1] * (checks.MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
        (dict(prompt="a", stop_token_ids=[3, VOCAB]), "stop_token_ids[1]"),
        (dict(prompt="a", request_id="x" * (checks.MAX_REQUEST_ID_BYTES + 1)), "request_id"),
        (dict(prompt="a", request_id="tab\there"), "request_id"),
        (dict(prompt="a", priority=7), "priority"),
        (dict(prompt="a", cache_salt="x" * (checks.MAX_CACHE_SALT_BYTES + 1)), "cache_salt"),
        (dict(prompt="a", presence_penalty=2.5), "presence_penalty"),
        (dict(prompt="a", frequency_penalty=-2.5), "frequency_penalty"),
        (dict(prompt="a", frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(prompt="a", logit_bias={5: 101.0}), "logit_bias[5]"),
        (dict(prompt="a", logit_bias={VOCAB: 1.0}), f"logit_bias[{VOCAB}]"),
        (dict(prompt="a", logit_bias={-1: 1.0}), "logit_bias[-1]"),
        (dict(prompt="a", logit_bias={i: 1.0 for i in range(checks.MAX_LOGIT_BIAS_ENTRIES + 1)}), "logit_bias"),
        (dict(prompt="a", top_logprobs=checks.MAX_TOP_LOGPROBS + 1), "top_logprobs"),
        (dict(prompt="a", bad_words=["ok", ""]), "bad_words[1]"),
        (dict(prompt="a", bad_words=["x" * (checks.MAX_STOP_BYTES + 1)]), "bad_words[0]"),
        (dict(prompt="a", bad_words=["x"] * (checks.MAX_BAD_WORDS + 1)), "bad_words"),
    ],
)
def test_a_bad_field_is_named(fields, field):
    with pytest.raises(InvalidArgument) as err:
        _check(**fields)
    assert err.value.field == field


def test_defaults_and_edges_pass():
    req = _check(
        prompt="a",
        top_k=VOCAB,
        top_p=1.0,
        temperature=checks.MAX_TEMPERATURE,
        min_p=1.0,
        stop=["x" * checks.MAX_STOP_BYTES],
        priority=pb.PRIORITY_BATCH,
    )
    p = req.params
    assert p.max_new_tokens == 256 and p.clip_max_new_tokens  # left at 0: the default, clipped to fit
    assert req.priority is Priority.BATCH and req.request_id and req.deadline is None
    explicit = _check(prompt="a", max_new_tokens=7, seed=0).params
    assert explicit.max_new_tokens == 7 and not explicit.clip_max_new_tokens and explicit.seed == 0
    assert _check(prompt="a", top_p=0.0, repetition_penalty=0.0).params.top_p == 1.0
    edges = _check(prompt="a", presence_penalty=-2.0, frequency_penalty=2.0, logit_bias={9: -100.0, 3: 100.0}).params
    assert edges.presence_penalty == -2.0 and edges.logit_bias == ((3, 100.0), (9, -100.0))


def test_the_earlier_of_the_grpc_deadline_and_timeout_ms_bounds_the_session():
    import time

    before = time.monotonic()
    req = convert.request_from_pb(pb.GenerateRequest(prompt="a", timeout_ms=5000), 256, VOCAB, time_remaining=2.0)
    assert 1.5 < req.deadline - before < 2.5


def test_typical_p_left_out_is_off_and_set_is_read():
    assert _check(prompt="a").params.typical_p == 1.0
    assert _check(prompt="a", typical_p=0.25).params.typical_p == 0.25


def test_each_sampling_parameter_is_a_generate_request_field_whose_unset_is_its_default():
    """The .proto holds every numeric sampling parameter by Sampling's name; where its field is plain
    proto3 (0 read as unset) and the default is not 0, Sampling says so (zero_unset), and an
    `optional` field never is: its 0 is 0."""
    fields = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    for param in RANGED:
        assert param.name in fields, f"generate.proto's GenerateRequest has no {param.name}"
        if fields[param.name].has_presence:
            assert not param.limits.zero_unset, param.name
        elif param.default != 0:
            assert param.limits.zero_unset, param.name
        assert getattr(_check(prompt="a").params, param.name) == param.default
