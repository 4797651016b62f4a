"""The checks every front end shares (frontend/checks.py), on the engine's request itself: each bad
field is named, in braid's spelling or in the one a front end passes, and a request at every edge
passes. The front ends' own tests (test_validation.py for gRPC, test_openai_mapping.py for HTTP)
check that they translate into these."""

from __future__ import annotations

import dataclasses
import json

import pytest

from braid.server.engine.types import RANGED, GenerationRequest, InvalidArgument, Message, SamplingParams
from braid.server.frontend import checks

VOCAB = 1000


def _request(n: int = 1, resume_token_ids: tuple[int, ...] = (), **params: object) -> GenerationRequest:
    return GenerationRequest(
        prompt="a",
        messages=(),
        params=SamplingParams(**params),
        request_id="r",
        n=n,
        resume_token_ids=resume_token_ids,
    )


def _field(req: GenerationRequest, spelling: checks.Spelling = checks.braids) -> str:
    with pytest.raises(InvalidArgument) as err:
        checks.check_request(req, VOCAB, spelling)
    return err.value.field


@pytest.mark.parametrize(
    "req, field",
    [
        (_request(max_new_tokens=-1), "max_new_tokens"),
        (_request(max_new_tokens=5, min_new_tokens=6), "min_new_tokens"),
        (_request(top_p=float("nan")), "top_p"),
        (_request(repetition_penalty=0.0), "repetition_penalty"),  # the engine's 1.0 is "none"; 0 is out
        (_request(logit_bias=((3, 1.0), (VOCAB, 1.0))), f"logit_bias[{VOCAB}]"),
        (_request(n=checks.MAX_SAMPLES + 1), "n"),
        (_request(n=2, resume_token_ids=(1,)), "resume_token_ids"),
        (_request(resume_token_ids=(1, VOCAB)), "resume_token_ids[1]"),
        (_request(stop_token_ids=(-1,)), "stop_token_ids[0]"),
        (dataclasses.replace(_request(), request_id="é"), "request_id"),
        (dataclasses.replace(_request(), cache_salt="é" * (checks.MAX_CACHE_SALT_BYTES // 2 + 1)), "cache_salt"),
        (dataclasses.replace(_request(), prompt=None, messages=(Message("", "hi"),)), "messages[0].role"),
    ],
)
def test_a_bad_field_is_named_in_braids_spelling(req, field):
    assert _field(req) == field


def test_a_bad_field_is_named_in_the_front_ends_spelling_with_the_same_description():
    renamed = {"max_new_tokens": "max_tokens", "stop[1]": "stop_strings[1]"}
    spelling = lambda field: renamed.get(field, field)  # noqa: E731
    with pytest.raises(InvalidArgument) as err:
        checks.check_request(_request(max_new_tokens=-3), VOCAB, spelling)
    assert (err.value.field, err.value.description) == ("max_tokens", "-3 is negative")
    assert _field(_request(stop=("x", "")), spelling) == "stop_strings[1]"
    assert _field(_request(temperature=-1.0), spelling) == "temperature"  # a name it keeps


def test_messages_over_the_text_limit_name_messages_and_a_text_names_its_own_field():
    half = "x" * (checks.MAX_TEXT_BYTES // 2)
    too_long = dataclasses.replace(_request(), prompt=None, messages=(Message("user", half), Message("user", half)))
    assert _field(too_long) == "messages"
    for text, messages in (("a", (Message("user", "b"),)), ("", ())):
        with pytest.raises(InvalidArgument) as err:
            checks.check_text(text, messages, "text")
        assert err.value.field == "text"


def test_a_request_at_every_edge_passes():
    edges = _request(
        n=checks.MAX_SAMPLES,
        max_new_tokens=0,
        temperature=checks.MAX_TEMPERATURE,
        top_k=VOCAB,
        repetition_penalty=checks.MAX_REPETITION_PENALTY,
        logit_bias=((0, -checks.MAX_LOGIT_BIAS), (VOCAB - 1, checks.MAX_LOGIT_BIAS)),
        top_logprobs=checks.MAX_TOP_LOGPROBS,
        stop=("x" * checks.MAX_STOP_BYTES,) * checks.MAX_STOP_STRINGS,
        stop_token_ids=(VOCAB - 1,) * checks.MAX_STOP_TOKEN_IDS,
    )
    checks.check_request(dataclasses.replace(edges, request_id="~" * checks.MAX_REQUEST_ID_BYTES), VOCAB)
    checks.check_request(_request(resume_token_ids=(0, VOCAB - 1)), VOCAB)


def test_a_constraints_text_is_checked_as_it_is_made_naming_the_front_ends_field():
    made = checks.constraint("regex", "[a-z]+", "response_format.regex")
    assert (made.kind, made.text, made.field) == ("regex", "[a-z]+", "response_format.regex")
    for text in ("", "x" * (checks.MAX_CONSTRAINT_BYTES + 1)):
        with pytest.raises(InvalidArgument) as err:
            checks.constraint("json_schema", text, "constraint.json_schema")
        assert err.value.field == "constraint.json_schema"


@pytest.mark.parametrize(
    "choices, field",
    [
        ([], "choices"),
        (["a"] * (checks.MAX_CHOICES + 1), "choices"),
        (["a", ""], "choices[1]"),
        (["a", "b" * (checks.MAX_CHOICE_BYTES + 1)], "choices[1]"),
    ],
)
def test_a_bad_choice_is_named(choices, field):
    with pytest.raises(InvalidArgument) as err:
        checks.choice(choices, "choices")
    assert err.value.field == field


def test_choices_become_a_json_list():
    made = checks.choice(["yes", "no"], "constraint.choice.choices")
    assert (made.kind, json.loads(made.text), made.field) == ("choice", ["yes", "no"], "constraint.choice.choices")


@pytest.mark.parametrize("param", RANGED, ids=[param.name for param in RANGED])
def test_each_sampling_parameter_is_checked_against_the_range_it_is_declared_with(param):
    """temperature, top_p, ..., typical_p: each declared once, with its limits (runner/rows.py's
    Sampling), and refused just outside them naming itself, in the front end's spelling too."""
    lo, hi, lo_open, _ = param.limits
    top = VOCAB if hi is None else hi
    bracket = "(" if lo_open else "["
    for value in (lo - 1, top + 1, float("nan")) + ((lo,) if lo_open else ()):
        with pytest.raises(InvalidArgument) as err:
            checks.check_request(_request(**{param.name: value}), VOCAB, lambda field: "the " + field)
        assert (err.value.field, err.value.description) == (
            "the " + param.name,
            f"{value} is outside {bracket}{lo}, {top}]",
        )
    for value in (top, param.default) + (() if lo_open else (lo,)):
        checks.check_request(_request(**{param.name: value}), VOCAB)


def test_typical_p_is_in_0_to_1_with_0_refused():
    for value in (0.0, -0.5, 1.5):
        with pytest.raises(InvalidArgument) as err:
            checks.check_request(_request(typical_p=value), VOCAB)
        assert (err.value.field, err.value.description) == ("typical_p", f"{value} is outside (0.0, 1.0]")
    for value in (1e-6, 0.5, 1.0):
        checks.check_request(_request(typical_p=value), VOCAB)


def test_sampling_values_are_copied_by_name_unset_taking_the_default():
    given = {"temperature": 0.7, "top_p": 0.0, "repetition_penalty": 0.0, "typical_p": 0.0, "min_p": None}
    values = checks.sampling_values(given.get)
    assert values == {param.name: param.default for param in RANGED} | {"temperature": 0.7, "typical_p": 0.0}
