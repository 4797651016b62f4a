"""The API key check: one `authorization` header, the Bearer scheme in any case."""

from __future__ import annotations

import pytest

from braid.server.grpc.auth import ApiKeyInterceptor


AUTH = ApiKeyInterceptor("s3cret")


@pytest.mark.parametrize("value", ["Bearer s3cret", "bearer s3cret", "BEARER s3cret", "Bearer  s3cret"])
def test_the_scheme_is_case_insensitive(value):
    assert AUTH._accepts([("authorization", value)])


@pytest.mark.parametrize(
    "metadata",
    [
        [],
        [("authorization", "Bearer wrong")],
        [("authorization", "Basic s3cret")],
        [("authorization", "s3cret")],
        [("authorization", "Bearers3cret")],
        [("x-api-key", "s3cret")],
        # two headers: refused, not "the last one wins" (a proxy must not choose which key counts)
        [("authorization", "Bearer wrong"), ("authorization", "Bearer s3cret")],
        [("authorization", "Bearer s3cret"), ("authorization", "Bearer s3cret")],
    ],
)
def test_anything_else_is_refused(metadata):
    assert not AUTH._accepts(metadata)
