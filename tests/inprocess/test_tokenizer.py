"""The engine's tokenizer, shared by the tokenizer threads and the model thread: the same ids and
text as transformers', from many threads at once, with no per-thread copy of a fast tokenizer (a
copy took 0.3 s or more, paid by a request's first use of each thread: the first request after a
start took 0.6 to 2.4 s, where the next took 0.02 s)."""

from __future__ import annotations

import concurrent.futures
import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from braid.server.engine import tokenizer as tokenizer_module
from braid.server.engine.tokenizer import Tokenizer
from braid.server.engine.types import InvalidArgument, Message


@pytest.fixture(scope="module")
def hf(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


def _texts(count: int) -> list[str]:
    rng = random.Random(0)
    alphabet = "ab cdé\n\t<|>_🎉中" + "<|im_start|>"
    return ["", "The sea is", "<|im_start|>user\nhi<|im_end|>", "x" * 3000] + [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) for _ in range(count)
    ]


def test_a_fast_tokenizer_is_shared_by_every_thread_never_copied(hf, monkeypatch):
    def no_copy(_):
        raise AssertionError("a fast tokenizer was copied")

    monkeypatch.setattr(tokenizer_module.copy, "deepcopy", no_copy)
    tok = Tokenizer(hf, [2])
    texts = _texts(300)
    expected = [list(hf.encode(t, add_special_tokens=True)) for t in texts]

    def work(i: int) -> None:  # encode and decode, interleaved, on 8 threads at once
        for text, ids in zip(texts[i::8], expected[i::8]):
            assert tok.encode_prompt(text) == ids
            assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    chat = [Message(role="user", content="Hi")]
    assert tok.encode(None, chat) == list(
        hf.apply_chat_template(
            [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    assert tok.pieces(expected[1]) == [hf.decode([t]) for t in expected[1]]


def test_a_python_tokenizer_gets_a_copy_per_thread(hf):
    """A tokenizer with no Rust backend (here: the fast one with its backend hidden) is copied once
    per thread that uses it."""

    class Slow:
        def __init__(self, inner) -> None:
            self.inner, self.chat_template = inner, inner.chat_template

        def __len__(self) -> int:
            return len(self.inner)

        def encode(self, text, add_special_tokens):
            return self.inner.encode(text, add_special_tokens=add_special_tokens)

        def decode(self, ids, skip_special_tokens):
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

        def __deepcopy__(self, memo):
            copies.append(1)
            return Slow(self.inner)

    copies: list[int] = []
    tok = Tokenizer(Slow(hf), [2])
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(tok.encode_prompt, ["The sea is"] * 30))
    assert results == [list(hf.encode("The sea is"))] * 30
    assert 1 <= len(copies) <= 3


def test_a_template_that_drops_tools_is_told_from_one_that_renders_them(smol_dir):
    """SmolLM2's template renders the same prompt with tools or without (issue 39: 37 tokens
    either way); the HTTP front end then puts them into the system message."""
    smol = Tokenizer(AutoTokenizer.from_pretrained(smol_dir), [2])
    assert smol.has_chat_template and not smol.template_takes_tools
    hermes = AutoTokenizer.from_pretrained(smol_dir)
    hermes.chat_template = (Path(__file__).parents[1] / "data" / "hermes_tools.jinja").read_text()
    assert Tokenizer(hermes, [2]).template_takes_tools


def test_chat_template_kwargs_reach_the_template_but_not_its_own_arguments(smol_dir):
    hf = AutoTokenizer.from_pretrained(smol_dir)
    hf.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if think is defined %}/{{ think }}{% endif %}"
    )
    tok = Tokenizer(hf, [2])
    chat = [Message(role="user", content="hi")]
    assert tok.decode(tok.encode(None, chat, template_kwargs='{"think": "no"}')) == "hi/no"
    assert tok.decode(tok.encode(None, chat)) == "hi"
    for own in ("tokenize", "messages", "chat_template"):
        with pytest.raises(InvalidArgument) as caught:
            tok.encode(None, chat, template_kwargs=json.dumps({own: "x"}))
        assert caught.value.field == f"chat_template_kwargs.{own}"


def test_the_longest_token_is_read_on_the_first_prompt_that_needs_it_not_at_start(hf, monkeypatch):
    # Every start decoded all 49,152 tokens (0.1 s of CPU); only a prompt of at least twice the
    # context's length in bytes can be refused by its size, and the first such prompt reads it.
    from unit.engine_fakes import Harness

    calls = []
    longest = tokenizer_module._longest_token_bytes
    monkeypatch.setattr(tokenizer_module, "_longest_token_bytes", lambda hf: calls.append(hf) or longest(hf))
    tok = Tokenizer(hf, [2])
    harness = Harness(tokenizer=tok)  # a context of 512 tokens
    try:
        assert calls == []
        harness.admission.admit("x" * 1023, ())
        assert calls == []
        with pytest.raises(InvalidArgument) as err:
            harness.admission.admit("x" * 2 * 512 * tok.max_token_bytes, ())
        assert calls == [hf] and "is at least 512 tokens" in err.value.description
        assert tok.max_token_bytes == longest(hf) and len(calls) == 1
    finally:
        harness.close()
