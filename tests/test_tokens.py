"""Tokens in and out (issue 43): prompt_token_ids as a third kind of input, skip_detokenize, the
Detokenize RPC and Tokenize's offsets.

In process (tests/in_process.py), the engine in every mode: a prompt sent as ids gives the tokens
its text gives, with the prefix cache, speculation and an adapter. Through a real tiny server: the
stream of ids is the text's in every request feature that reads the prompt, bad ids are refused
naming the field, Detokenize gives back the text (a character split across tokens included), and
Tokenize's offsets point at each token's text."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from braid.client import AsyncClient, regex
from braid.client.errors import BraidError
from braid.server.engine.types import Message
from braid.v1 import generate_pb2 as pb
from conftest import MODES
from in_process import Model, generate
from lora_files import make_adapter

PROMPTS = [
    "The sea is",
    "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7",
    "The river rises in the hills above the town and runs for forty miles to the sea. In spring the snow "
    "melts and the water comes down fast and brown, carrying branches and stones.",  # past two 16-token pages
]
CHAT = [("system", "Be brief."), ("user", "Repeat: the river rises in the hills")]
_NGRAM = dict(speculative="ngram", speculative_tokens=6, ngram_min=1)


@pytest.fixture(scope="module")
def tiny(tiny_dir, in_process) -> Model:
    return in_process(tiny_dir)


def _as_ids(model: Model, request: dict) -> dict:
    """The request with its prompt or chat tokenized as the engine would, sent as prompt_token_ids."""
    request = dict(request)
    if "messages" in request:
        ids = model.tokenizer.encode_chat([Message(role, text) for role, text in request.pop("messages")])
    else:
        ids = model.tokenizer.encode_prompt(request.pop("prompt"))
    return dict(request, prompt_token_ids=ids)


def _texts(max_new_tokens: int = 12, **params) -> list[dict]:
    return [dict(prompt=p, max_new_tokens=max_new_tokens, ignore_eos=True, **params) for p in PROMPTS] + [
        dict(messages=CHAT, max_new_tokens=max_new_tokens, ignore_eos=True, **params)
    ]


def _same_as_text(model: Model, texts: list[dict], **config) -> list:
    """Every text request, then each as ids, in one engine: the ids' outcomes, after checking that
    each gave its text's tokens and prompt length."""
    outcomes = generate(model, texts + [_as_ids(model, r) for r in texts], **config)
    by_text, by_ids = outcomes[: len(texts)], outcomes[len(texts) :]
    for text, ids in zip(by_text, by_ids):
        assert ids.token_ids == text.token_ids and len(ids.token_ids) == ids.final.generated_tokens > 0
        assert ids.final.prompt_tokens == text.final.prompt_tokens
    return by_ids


@pytest.mark.parametrize("mode", MODES)
def test_ids_give_the_texts_tokens_in_every_mode(tiny, mode):
    _same_as_text(tiny, _texts(top_logprobs=2, seed=5, temperature=0.7), mode=mode, max_batch_size=16)


def test_ids_read_the_texts_pages_from_the_prefix_cache_within_a_salt(tiny):
    """Sequential: each session runs after the last, so the ids find their text's pages cached, and
    under another cache_salt do not."""
    by_ids = _same_as_text(tiny, _texts(), mode="sequential")
    assert by_ids[2].final.cached_tokens >= 32
    (salted,) = generate(tiny, [dict(_as_ids(tiny, _texts()[2]), cache_salt="other")], mode="sequential")
    assert salted.final.cached_tokens == 0


@pytest.mark.parametrize("mode", ["continuous", "sequential"])
def test_ids_give_the_texts_tokens_with_speculation(tiny, mode):
    """Texts and ids in engines of their own: a pass's proposals are budgeted, so ids submitted
    after their texts would get fewer (their tokens are the same either way)."""
    texts = _texts(40)  # a random model seldom repeats itself: 40 tokens to propose some
    by_text = generate(tiny, texts, mode=mode, max_batch_size=16, **_NGRAM)
    by_ids = generate(tiny, [_as_ids(tiny, r) for r in texts], mode=mode, max_batch_size=16, **_NGRAM)
    assert [o.token_ids for o in by_ids] == [o.token_ids for o in by_text]
    proposed = [o.final.proposed_tokens for o in by_ids]
    assert proposed == [o.final.proposed_tokens for o in by_text] and sum(proposed) > 0


def test_ids_give_the_texts_tokens_with_an_adapter(tiny, tiny_dir, tmp_path):
    folder = make_adapter(tiny_dir, tmp_path / "r8", rank=8)
    texts = _texts(adapter="r8")
    by_ids = _same_as_text(tiny, texts, adapters=[("r8", folder)], mode="continuous", max_batch_size=16)
    base = generate(tiny, [_as_ids(tiny, r) for r in _texts()], mode="continuous", max_batch_size=16)
    assert any(a.token_ids != b.token_ids for a, b in zip(by_ids, base))  # the adapter is in force


# ---- through a real server ----------------------------------------------------------------------


async def _stream(target: str, **request) -> tuple[list[int], str, pb.GenerateResponse]:
    async with AsyncClient(target) as client:
        ids, text, final = [], "", None
        async for m in client.stream(**request):
            ids += m.token_ids
            text += m.text
            if m.finish_reason:
                final = m
        return ids, text, final


@pytest.mark.parametrize(
    "params",
    [
        dict(max_new_tokens=10, ignore_eos=True, logprobs=True),
        dict(max_new_tokens=10, temperature=0.9, seed=7, stop=[" the"], bad_words=["sea"]),
        dict(max_new_tokens=10, constraint=regex("[a-z ]{1,20}")),
        dict(max_new_tokens=10, seed=3, temperature=0.8, resume_token_ids=[]),  # filled in below
    ],
)
def test_a_prompt_sent_as_ids_streams_what_its_text_does(servers, params):
    target = servers("continuous").target
    prompt = "Once upon a time, the river"
    with servers("continuous").client() as client:
        ids = list(client.tokenize(prompt).token_ids)
    if "resume_token_ids" in params:  # resume a stream of ids from its first 3 tokens
        full, _, _ = asyncio.run(_stream(target, prompt=prompt, **{**params, "resume_token_ids": None}))
        params = dict(params, resume_token_ids=full[:3])
    by_text = asyncio.run(_stream(target, prompt=prompt, **params))
    by_ids = asyncio.run(_stream(target, prompt_token_ids=ids, **params))
    assert by_ids[:2] == by_text[:2] and by_ids[0]
    assert by_ids[2].usage.prompt_tokens == len(ids) == by_text[2].usage.prompt_tokens
    assert by_ids[2].finish_reason == by_text[2].finish_reason
    if not params.get("stop"):  # stop strings need text: refused with skip_detokenize (below)
        skipped = asyncio.run(_stream(target, prompt_token_ids=ids, skip_detokenize=True, **params))
        assert skipped[0] == by_text[0] and skipped[1] == ""


def _refusal(client, **request) -> BraidError:
    with pytest.raises(BraidError) as err:
        client.generate(**request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return err.value


def test_bad_token_input_is_invalid_argument_naming_the_field(servers):
    with servers("continuous").client() as client:
        assert _refusal(client, prompt_token_ids=[1, 49152, 3]).field == "prompt_token_ids[1]"
        assert _refusal(client, prompt_token_ids=[-5]).field == "prompt_token_ids[0]"
        too_long = _refusal(client, prompt_token_ids=[1] * 1024)
        assert too_long.field == "prompt_token_ids" and "1024" in too_long.description
        both = client._stub.Stream(pb.GenerateRequest(prompt="a", prompt_token_ids=[1]))
        with pytest.raises(grpc.RpcError) as err:
            list(both)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in err.value.details()
        assert _refusal(client, prompt_token_ids=[1, 2], stop="x", skip_detokenize=True).field == "stop"
        with pytest.raises(BraidError) as err:
            client.detokenize([5, 49152])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.field == "token_ids[1]"
        # cut to the context by truncate_input_tokens: the last ids kept
        final = client.generate(prompt_token_ids=[1] * 2000, truncate_input_tokens=100, max_new_tokens=1).final
        assert final.usage.prompt_tokens == 100 and final.usage.truncated_tokens == 1900


TEXT = "Hello, wörld  日本語 🌊!"


def test_detokenize_gives_back_the_text_and_holds_back_a_split_character(servers):
    with servers("continuous").client() as client:
        ids = list(client.tokenize(TEXT).token_ids)
        whole = client.detokenize(ids)
        assert (whole.text, whole.held_back_tokens) == (TEXT, 0)
        # the first token that ends inside a character (a byte-level piece of 日)
        pieces = client.tokenize(TEXT).pieces
        cut = next(i for i, p in enumerate(pieces) if p.endswith("\ufffd")) + 1
        head = client.detokenize(ids[:cut])
        assert head.held_back_tokens >= 1 and TEXT.startswith(head.text) and "\ufffd" not in head.text
        tail = client.detokenize(ids[cut - head.held_back_tokens :])
        assert head.text + tail.text == TEXT and tail.held_back_tokens == 0
        assert client.detokenize([]).text == ""


def test_tokenize_offsets_point_at_each_tokens_text(servers):
    with servers("continuous").client() as client:
        out = client.tokenize(TEXT, return_offsets=True)
        assert not client.tokenize(TEXT).offsets
        with pytest.raises(BraidError) as err:
            client.tokenize(messages=[("user", "hi")], return_offsets=True)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.field == "return_offsets"
    spans = [(o.start, o.end) for o in out.offsets]
    assert len(spans) == len(out.token_ids) and spans[-1][1] == len(TEXT)
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in zip(spans, spans[1:]))
    for (start, end), piece in zip(spans, out.pieces):
        if "\ufffd" not in piece:
            assert TEXT[start:end] == piece
        else:  # a piece of a character: its span is the character's (with a space before it)
            assert TEXT[start:end].strip() and len(TEXT[start:end].strip()) == 1
