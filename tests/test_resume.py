"""Resuming a broken stream from the tokens it delivered (resume_token_ids), as a client library
does when a replica dies mid-stream: the rest of the stream equals the unbroken one's, token for
token and character for character, greedy and sampled, with stop strings and penalties in play."""

from __future__ import annotations

import functools

import grpc
import pytest

from braid.client import Client
from braid.v1 import generate_pb2 as pb
from conftest import MODES, start_together, tiny_server

PROMPT = "The lighthouse keeper wrote in his log"
CASES = {
    "greedy": dict(max_new_tokens=40, ignore_eos=True),
    "sampled": dict(
        max_new_tokens=40,
        ignore_eos=True,
        temperature=1.0,
        top_k=50,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.3,
    ),
    "stop string": dict(max_new_tokens=60, temperature=0.8, seed=3, stop=["e t", "ing "]),
}


def _stream(client, **params) -> list:
    return list(client.stream(PROMPT, **params))


@pytest.mark.parametrize("mode", ["continuous", "sequential"])
@pytest.mark.parametrize("case", CASES)
def test_a_stream_resumed_at_any_message_ends_as_the_unbroken_one(servers, mode, case):
    params = CASES[case]
    with servers(mode).client() as client:
        messages = _stream(client, **params)
        final = messages[-1]
        ids = [t for m in messages for t in m.token_ids]
        text = "".join(m.text for m in messages)
        seed = final.seed
        boundaries, delivered_ids, delivered_text = [], [], ""  # what a client had after each message
        for message in messages[:-1]:
            delivered_ids = delivered_ids + list(message.token_ids)
            delivered_text += message.text
            boundaries.append((delivered_ids, delivered_text))
        for got_ids, got_text in boundaries[:: max(1, len(boundaries) // 5)]:  # break after some
            rest = _stream(client, **{**params, "seed": seed}, resume_token_ids=got_ids)
            assert got_ids + [t for m in rest for t in m.token_ids] == ids
            assert got_text + "".join(m.text for m in rest) == text
            end = rest[-1]
            assert end.finish_reason == final.finish_reason and end.stop_sequence == final.stop_sequence
            assert end.usage.generated_tokens == final.usage.generated_tokens


def test_the_seed_comes_in_the_headers(servers):
    with servers("continuous").client() as client:
        generation = client.stream(PROMPT, max_new_tokens=3, temperature=1.0)
        messages = list(generation)
        headers = dict(generation._call.initial_metadata())
    assert headers["braid-seed"] == str(messages[-1].seed)


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(resume_token_ids=[49152]), "resume_token_ids[0]"),
        (dict(resume_token_ids=[5, 6], n=2), "resume_token_ids"),
        (dict(resume_token_ids=[5] * 8, max_new_tokens=8), "resume_token_ids"),
    ],
)
def test_bad_resume_token_ids_are_invalid_argument(servers, fields, field):
    with servers("continuous").client() as client, pytest.raises(grpc.RpcError) as err:
        _stream(client, **fields)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field + ":")


@pytest.mark.parametrize("mode", MODES)
def test_resumed_tokens_that_already_end_it_end_it_at_once(servers, mode):
    """A client that broke just after the last token, before the final message."""
    with servers(mode).client() as client:
        messages = _stream(client, max_new_tokens=30, temperature=0.9, seed=5, stop=["a"])
        ids = [t for m in messages for t in m.token_ids]
        if messages[-1].finish_reason != 3:  # no stop string matched: nothing to check here
            pytest.fail("the seed should have produced an 'a'")
        rest = _stream(client, max_new_tokens=30, temperature=0.9, seed=5, stop=["a"], resume_token_ids=ids)
    assert [m.token_ids for m in rest] == [[]] and rest[-1].finish_reason == 3 and rest[-1].text == ""


STREAM_SLOW = {"BRAID_INJECT_FAULT": "delay:10"}  # each pass 10 ms longer: a 150-token stream lasts 1.5 s


def test_the_client_resumes_on_another_replica_when_one_is_killed_mid_stream(tiny_dir):
    """Replicas behind one client that balances over them. The replica serving a stream is killed
    with SIGKILL at its first message; the caller's one iteration goes on, on another replica, and
    ends with exactly the text of an unbroken run; greedy, then sampled (a third replica spare)."""
    replicas = start_together(*[functools.partial(tiny_server, tiny_dir, "--mode", "continuous", env=STREAM_SLOW)] * 3)
    try:
        for sampling in ({}, {"temperature": 1.0, "top_k": 40}):
            alive = [r for r in replicas if r.proc.poll() is None]
            params = dict(max_new_tokens=150, ignore_eos=True, **sampling)
            with Client([r.target for r in alive]) as client:
                generation = client.stream(PROMPT, **params)
                for i, _ in enumerate(generation):
                    if i == 0:
                        # Killed as soon as it is found, at the first message: a server runs ahead
                        # of the client's reading (the tokens wait in the HTTP/2 window), so one
                        # killed only after the client had read 10 messages had often sent all 150
                        # already, and nothing was resumed. Its passes take 10 ms longer (STREAM_SLOW),
                        # so the 150 tokens take 1.5 s at least, and the status calls that find it
                        # take a small part of that.
                        (serving,) = [r for r in alive if _status(r).sessions_active == 1]
                        serving.proc.kill()
                unbroken = client.generate(PROMPT, **params, seed=generation.final.seed)
            assert generation.resumes == 1 and generation.final.finish_reason == pb.FINISH_REASON_MAX_TOKENS
            assert generation.token_ids == unbroken.token_ids and generation.text == unbroken.text
            assert generation.final.usage.generated_tokens == 150
    finally:
        for r in replicas:
            r.stop()


def _status(server) -> pb.ServerStatusResponse:
    with server.client(resume=False) as client:
        return client.server_status(timeout=10)
