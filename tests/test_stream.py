"""Streaming generation over a real channel: what a client sees, in every mode."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from braid.v1 import generate_pb2 as pb
from conftest import MODES

PROMPT = "The quick brown fox"


@pytest.mark.parametrize("mode", MODES)
def test_stream_yields_tokens_then_one_final_message(servers, mode):
    with servers(mode).client() as client:
        messages = list(client.stream(PROMPT, max_new_tokens=12, ignore_eos=True))
        prompt_tokens = len(client.tokenize(PROMPT).token_ids)
    *body, final = messages
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in body)
    assert final.finish_reason == pb.FINISH_REASON_MAX_TOKENS
    assert final.usage.generated_tokens == 12
    assert sum(len(m.token_ids) for m in messages) == 12
    assert final.usage.prompt_tokens == prompt_tokens
    assert final.request_id and final.timings.total_ms > 0


def test_text_is_the_decoding_of_the_tokens_and_never_splits_a_character(servers, smol_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    with servers("continuous").client() as client:
        # Sampling hot from a random model visits many byte-level tokens: pieces of characters.
        for seed in range(6):
            messages = list(
                client.stream(
                    "h\u00e9llo w\u00f6rld \u65e5\u672c \U0001f642",
                    max_new_tokens=40,
                    ignore_eos=True,
                    temperature=1.5,
                    seed=seed,
                )
            )
            full = tok.decode([t for m in messages for t in m.token_ids])
            sent = ""
            for m in messages:
                sent += m.text
                assert full.startswith(sent), "a message split a character or sent text twice"
            assert sent.rstrip("\ufffd") == full.rstrip("\ufffd")


def test_greedy_is_deterministic_and_top_k_1_is_greedy(servers):
    with servers("continuous").client() as client:
        greedy = client.generate(PROMPT, max_new_tokens=16, ignore_eos=True)
        again = client.generate(PROMPT, max_new_tokens=16, ignore_eos=True)
        top1 = client.generate(PROMPT, max_new_tokens=16, ignore_eos=True, temperature=1.0, top_k=1, seed=5)
        tiny_p = client.generate(PROMPT, max_new_tokens=16, ignore_eos=True, temperature=1.0, top_p=1e-6, seed=5)
        min_p = client.generate(PROMPT, max_new_tokens=16, ignore_eos=True, temperature=1.0, min_p=1.0, seed=5)
    assert greedy.token_ids == again.token_ids == top1.token_ids == tiny_p.token_ids == min_p.token_ids


def test_typical_p_samples_reproducibly_and_a_tiny_one_keeps_one_token_whatever_the_seed(servers):
    kw = dict(max_new_tokens=16, ignore_eos=True, temperature=1.0)
    with servers("continuous").client() as client:
        a = client.generate(PROMPT, typical_p=0.5, seed=3, **kw)
        b = client.generate(PROMPT, typical_p=0.5, seed=3, **kw)
        tiny = [client.generate(PROMPT, typical_p=1e-6, seed=seed, **kw).token_ids for seed in (1, 2)]
        plain = [client.generate(PROMPT, seed=seed, **kw).token_ids for seed in (1, 2)]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    assert plain[0] != plain[1]
    assert tiny[0] == tiny[1]  # one token kept at each step: the seed draws nothing


def test_seeds_reproduce_and_differ(servers):
    kw = dict(max_new_tokens=24, ignore_eos=True, temperature=1.0)
    with servers("continuous").client() as client:
        a = client.generate(PROMPT, seed=1, **kw)
        b = client.generate(PROMPT, seed=1, **kw)
        c = client.generate(PROMPT, seed=2, **kw)
        unseeded = client.stream(PROMPT, **kw)
        list(unseeded)
        replay = client.generate(PROMPT, seed=unseeded.final.seed, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    assert a.final.seed == 1
    assert replay.token_ids == unseeded.token_ids  # the reported seed replays an unseeded call


def test_temperature_spreads_the_choices(servers):
    kw = dict(max_new_tokens=24, ignore_eos=True)
    with servers("continuous").client() as client:
        hot = [client.generate(PROMPT, temperature=2.0, seed=s, **kw).token_ids for s in range(3)]
    assert len({tuple(h) for h in hot}) == 3


@pytest.mark.parametrize("mode", MODES)
def test_logit_bias_forces_and_bans_tokens(servers, mode):
    """+100 on a token forces it at every step, sampled or greedy; -100 on the greedy tokens keeps
    them out."""
    with servers(mode).client() as client:
        forced = client.generate(
            "The sea is", max_new_tokens=6, ignore_eos=True, logit_bias={4242: 100.0}, temperature=1.0, seed=1
        )
        greedy = client.generate("The sea is", max_new_tokens=12, ignore_eos=True)
        banned = client.generate(
            "The sea is", max_new_tokens=12, ignore_eos=True, logit_bias={t: -100.0 for t in set(greedy.token_ids)}
        )
    assert forced.token_ids == [4242] * 6
    assert banned.token_ids and not set(banned.token_ids) & set(greedy.token_ids)


def test_bad_words_are_never_generated(servers, smol_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    with servers("continuous").client() as client:
        greedy = client.generate("The sea is", max_new_tokens=16, ignore_eos=True)
        words = [w for w in greedy.text.split() if w.isalpha()][:2]
        assert words, greedy.text
        avoided = client.generate("The sea is", max_new_tokens=16, ignore_eos=True, bad_words=words)
    ids = avoided.token_ids
    for word in words:
        for variant in (word, " " + word):
            seq = tokenizer.encode(variant, add_special_tokens=False)
            assert not any(ids[i : i + len(seq)] == seq for i in range(len(ids))), (word, avoided.text)
    assert avoided.token_ids != greedy.token_ids


def test_stop_sequence_ends_the_stream_and_never_leaks(servers):
    with servers("continuous").client() as client:
        full = client.generate(PROMPT, max_new_tokens=30, ignore_eos=True)
        stop = full.text[len(full.text) // 2 :][:4]
        assert stop.strip(), "need a visible stop string"
        stopped = client.stream(PROMPT, max_new_tokens=30, ignore_eos=True, stop=[stop])
        messages = list(stopped)
    expected = full.text[: full.text.find(stop)]
    sent = ""
    for m in messages:
        sent += m.text
        assert expected.startswith(sent), "text past the stop string's start was sent"
    assert stopped.final.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert sent == expected and stopped.final.stop_sequence == stop


def test_include_stop_sequence_sends_the_matched_string(servers):
    with servers("continuous").client() as client:
        full = client.generate(PROMPT, max_new_tokens=30, ignore_eos=True)
        stop = full.text[len(full.text) // 2 :][:4]
        other = "\u2603 never produced"
        included = client.generate(
            PROMPT, max_new_tokens=30, ignore_eos=True, stop=[other, stop], include_stop_sequence=True
        )
    assert included.text == full.text[: full.text.find(stop) + len(stop)]
    assert included.final.stop_sequence == stop


def test_stop_token_ids_and_min_new_tokens(servers):
    with servers("continuous").client() as client:
        first = client.generate(PROMPT, max_new_tokens=10, ignore_eos=True)
        target = first.token_ids[5]
        stopped = client.generate(PROMPT, max_new_tokens=10, ignore_eos=True, stop_token_ids=[target])
        held = client.generate(PROMPT, max_new_tokens=10, ignore_eos=True, stop_token_ids=[target], min_new_tokens=10)
    cut = first.token_ids.index(target)
    assert stopped.finish_reason == "STOP_TOKEN"
    assert stopped.token_ids == first.token_ids[: cut + 1]
    assert held.finish_reason == "MAX_TOKENS" and target not in held.token_ids


def test_chat_messages_use_the_chat_template(servers):
    with servers("continuous").client() as client:
        chat = [("system", "Be brief."), ("user", "Hi")]
        ids = client.tokenize(messages=chat).token_ids
        plain = client.tokenize("Hi").token_ids
        done = client.generate(messages=chat, max_new_tokens=4, ignore_eos=True)
    assert len(ids) > len(plain)
    assert done.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    "request_kwargs, field",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt="x", messages=[pb.Message(role="user", content="y")]), "prompt"),
        (dict(messages=[pb.Message(role="wizard", content="y")]), "messages[0].role"),
        (dict(prompt="x", max_new_tokens=-1), "max_new_tokens"),
        (dict(prompt="x", max_new_tokens=10_000_000), "max_new_tokens"),
        (dict(prompt="x", temperature=-0.5), "temperature"),
        (dict(prompt="x", top_p=1.5), "top_p"),
        (dict(prompt="x", top_k=-3), "top_k"),
        (dict(prompt="x", min_p=2.0), "min_p"),
        (dict(prompt="x", typical_p=0.0), "typical_p"),
        (dict(prompt="x", repetition_penalty=-1.0), "repetition_penalty"),
        (dict(prompt="x", stop=[""]), "stop[0]"),
        (dict(prompt="x", stop_token_ids=[10**9]), "stop_token_ids[0]"),
        (dict(prompt="x", min_new_tokens=9, max_new_tokens=3), "min_new_tokens"),
        (dict(prompt="word " * 5000), "prompt"),
        (dict(prompt="x", request_id="tab\there"), "request_id"),
        (dict(prompt="x", priority=7), "priority"),
    ],
)
def test_bad_requests_get_invalid_argument_naming_the_field(servers, request_kwargs, field):
    server = servers("continuous")
    with server.client() as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client._stub.Stream(pb.GenerateRequest(**request_kwargs)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
        details = dict(err.value.trailing_metadata())["grpc-status-details-bin"]
        status = status_pb2.Status.FromString(details)
        bad = error_details_pb2.BadRequest()
        status.details[0].Unpack(bad)
        assert bad.field_violations[0].field == field
        # and the server is still fine
        assert client.generate(PROMPT, max_new_tokens=2).usage.generated_tokens >= 1
