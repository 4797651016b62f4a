"""Token input and token-only output (issue 43), torch-free: the request checks of prompt_token_ids and
skip_detokenize, admission taking the ids where it would have tokenized a text, sessions that send
ids without text, and Detokenize's text by the rules of a stream's."""

from __future__ import annotations

import pytest

from braid.server.engine.detokenizer import IncrementalDetokenizer, detokenize
from braid.server.engine.types import Delta, FinishReason, GenerationRequest, InvalidArgument, Message, SamplingParams
from braid.server.frontend import checks
from engine_fakes import Harness

VOCAB = 1000


def _request(prompt: str = "", ids: tuple[int, ...] = (), messages=(), **params: object) -> GenerationRequest:
    return GenerationRequest(
        prompt=prompt or None,
        messages=tuple(messages),
        params=SamplingParams(**params),
        request_id="r",
        prompt_token_ids=ids,
    )


def _error(req: GenerationRequest) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as err:
        checks.check_request(req, VOCAB)
    return err.value


@pytest.mark.parametrize(
    "req, field",
    [
        (_request("a", ids=(1,)), "prompt_token_ids"),
        (_request(ids=(1,), messages=[Message("user", "hi")]), "prompt_token_ids"),
        (_request(), "prompt"),
        (_request(ids=(1, 2, VOCAB, -1)), "prompt_token_ids[2]"),
        (_request(ids=(5, -1)), "prompt_token_ids[1]"),
        (_request(ids=(1,) * (checks.MAX_TOKEN_IDS + 1)), "prompt_token_ids"),
        (_request(ids=(1,), stop=("x",), skip_detokenize=True), "stop"),
        (_request("a", stop=("x",), skip_detokenize=True), "stop"),
    ],
)
def test_each_bad_token_input_names_its_field(req, field):
    assert _error(req).field == field


def test_no_prompt_names_all_three_kinds_of_input():
    assert "prompt_token_ids" in _error(_request()).description


@pytest.mark.parametrize(
    "req",
    [
        _request(ids=(0, VOCAB - 1)),
        _request(ids=(1,) * checks.MAX_TOKEN_IDS),
        _request(ids=(3, 4), stop=("x",)),  # stop strings match the generated text, whatever the input
        _request(ids=(3, 4), skip_detokenize=True, stop_token_ids=(7,), bad_words=("x",)),
    ],
)
def test_token_input_at_its_limits_passes(req):
    checks.check_request(req, VOCAB)


def test_ids_give_the_session_the_text_prompts_tokens_and_usage():
    with Harness() as h:
        by_text = h.submit("10 11 12", max_new_tokens=4)[0]
        by_ids = h.submit("", prompt_token_ids=(10, 11, 12), max_new_tokens=4)[0]
        h.run()
        assert h.tokens(by_ids) == h.tokens(by_text) == [13, 14, 15, 16]
        assert h.text(by_ids) == h.text(by_text) == " 13 14 15 16"
        assert h.finished(by_ids).prompt_tokens == 3


def test_ids_share_the_prefix_cache_with_the_same_text_within_a_salt():
    with Harness(mode="continuous") as h:
        prompt = list(range(100, 140))  # 40 tokens: two whole pages of 16
        first = h.submit(" ".join(map(str, prompt)), max_new_tokens=2)[0]
        h.run()
        again = h.submit("", prompt_token_ids=prompt, max_new_tokens=2)[0]
        h.run()
        assert h.finished(first).cached_tokens == 0 and h.finished(again).cached_tokens == 32
        assert h.tokens(again) == h.tokens(first)


def test_ids_past_the_context_are_refused_at_the_door_and_truncation_keeps_the_last():
    with Harness() as h:
        too_long = tuple(range(10, 10 + h.runner.max_seq_len))
        with pytest.raises(InvalidArgument) as err:
            h.submit("", prompt_token_ids=too_long, max_new_tokens=1)
        assert err.value.field == "prompt_token_ids" and str(h.runner.max_seq_len) in err.value.description
        cut = h.submit("", prompt_token_ids=(7, 8, 9, 10), truncate_input_tokens=2, max_new_tokens=1)[0]
        h.run()
        assert h.finished(cut).prompt_tokens == 2 and h.finished(cut).truncated_tokens == 2
        assert h.runner.passes[0][0].token_ids == [9, 10]


def test_max_new_tokens_past_the_context_names_it_for_ids():
    with Harness() as h:
        ids = tuple(range(10, 10 + h.runner.max_seq_len - 4))
        with pytest.raises(InvalidArgument) as err:
            h.submit("", prompt_token_ids=ids, max_new_tokens=10)
        assert err.value.field == "max_new_tokens"


class _CountingDecode:
    def __init__(self, decode) -> None:
        self.decode, self.calls = decode, 0

    def __call__(self, ids):
        self.calls += 1
        return self.decode(ids)


def test_skip_detokenize_sends_ids_without_text_and_never_decodes():
    with Harness() as h:
        decode = _CountingDecode(h.admission.tokenizer.decode)
        h.admission.tokenizer.decode = decode
        handle = h.submit("", prompt_token_ids=(10, 11), max_new_tokens=5, skip_detokenize=True, stop_token_ids=(14,))[
            0
        ]
        h.run()
        deltas = [e for e in h.events[handle.session_id] if isinstance(e, Delta)]
        assert h.tokens(handle) == [12, 13, 14] and all(d.text == "" for d in deltas)
        assert h.finished(handle).reason is FinishReason.STOP_TOKEN
        assert decode.calls == 0


def test_n_samples_of_ids_skip_detokenizing_each():
    with Harness(mode="continuous") as h:
        samples = h.submit("", prompt_token_ids=(10, 11), n=2, max_new_tokens=2, skip_detokenize=True)
        h.run()
        assert [h.tokens(s) for s in samples] == [[12, 13]] * 2 and h.text(samples[1]) == ""


# A byte-level toy vocabulary: token i decodes to BYTES[i]; a sequence decodes to its bytes as UTF-8.
BYTES = [b"Hel", b"lo", b" w", "é".encode()[:1], "é".encode()[1:], b"!", "€".encode()[:1], "€".encode()[1:2]]


def _decode(ids) -> str:
    return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def _streamed(ids) -> str:
    d = IncrementalDetokenizer(_decode, (), ())
    for t in ids:
        d.add(t)
    return d.take(final=True)


@pytest.mark.parametrize(
    "ids, text, held_back",
    [
        ([0, 1, 2], "Hello w", 0),
        ([0, 3, 4, 5], "Helé!", 0),
        ([0, 3], "Hel", 1),  # half of é: left out, as a stream holds it back
        ([0, 6, 7], "Hel", 2),  # two of €'s three bytes
        ([3], "", 1),
        ([], "", 0),
    ],
)
def test_detokenize_ends_on_a_whole_character_as_a_stream_does(ids, text, held_back):
    assert detokenize(_decode, ids) == (text, held_back)
    assert _streamed(ids) == text


def test_detokenize_then_the_held_back_ids_again_gives_the_whole_text():
    text, held_back = detokenize(_decode, [0, 3])
    rest, _ = detokenize(_decode, [0, 3][len([0, 3]) - held_back :] + [4, 5])
    assert text + rest == "Helé!"
