"""The model's tokenizer, as the engine uses it: prompts and chats in, token ids out, and back."""

from __future__ import annotations

import copy
import threading
from typing import Sequence

from braid.server.engine.types import InvalidArgument, Message

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class Tokenizer:
    """Thread-safe, and no thread waits for another: each thread that encodes or decodes gets its
    own copy of the tokenizer. A Rust tokenizer shared across threads raises "Already borrowed" if
    one call reconfigures it during another, and one lock around a shared one made the model
    thread's per-token decode wait behind a worker's second-long encode of a 1 MiB prompt, which
    stalled every stream. Copies cost a few MB each, for the handful of threads that tokenize."""

    def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int]) -> None:
        self._original = hf_tokenizer
        self._copy_lock = threading.Lock()
        self._local = threading.local()
        self.eos_token_ids = tuple(eos_token_ids)
        self.has_chat_template = bool(getattr(hf_tokenizer, "chat_template", None))
        self.max_token_bytes = _longest_token_bytes(hf_tokenizer)

    @property
    def hf_tokenizer(self):
        """The transformers tokenizer itself, for what reads the vocabulary once (engine/grammars.py)."""
        return self._original

    def _own(self):
        """This thread's tokenizer: (the transformers wrapper, its Rust backend or None)."""
        own = getattr(self._local, "tok", None)
        if own is None:
            with self._copy_lock:
                tok = copy.deepcopy(self._original)
            # The Rust tokenizer itself, where there is one: decoding through it skips the Python
            # wrapper, which matters at one decode per token per session.
            own = self._local.tok = (tok, getattr(tok, "backend_tokenizer", None))
        return own

    def min_tokens(self, text_bytes: int) -> int:
        """A lower bound on the token count of a text of this many UTF-8 bytes, so a prompt far past
        the context is refused without the second or more it takes to tokenize: no token covers
        more than `max_token_bytes` bytes. Halved, because a normalizer (NFC, lowercasing) or a chat
        template (trimming) may shrink the text a little before it is split into tokens."""
        return text_bytes // (2 * self.max_token_bytes)

    def encode_prompt(self, text: str) -> list[int]:
        tok, _ = self._own()
        return list(tok.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: Sequence[Message], field_name: str = "messages") -> list[int]:
        if not self.has_chat_template:
            raise InvalidArgument(field_name, "this model has no chat template; send a prompt instead")
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise InvalidArgument(f"{field_name}[{i}].role",
                                      f"unknown role {m.role!r}; use one of {sorted(CHAT_ROLES)}")
        chat = [{"role": m.role, "content": m.content} for m in messages]
        tok, _ = self._own()
        try:
            text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja templates raise their own errors for chats they reject
            raise InvalidArgument(field_name, f"the chat template rejected it: {exc}") from exc
        return list(tok.encode(text, add_special_tokens=False))  # the template wrote its special tokens

    def encode_words(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's token sequences as it appears in text: alone, and after a space."""
        tok, _ = self._own()
        sequences = {tuple(tok.encode(text, add_special_tokens=False)) for w in words for text in (w, " " + w)}
        return tuple(sorted(s for s in sequences if s))

    def encode(self, prompt: str | None, messages: Sequence[Message]) -> list[int]:
        return self.encode_chat(messages) if messages else self.encode_prompt(prompt or "")

    def decode(self, token_ids: Sequence[int]) -> str:
        tok, backend = self._own()
        if backend is not None:
            return backend.decode(list(token_ids), skip_special_tokens=False)
        return tok.decode(token_ids, skip_special_tokens=False)

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text, in one call to the Rust tokenizer where there is one."""
        tok, backend = self._own()
        if backend is not None:
            return backend.decode_batch([[t] for t in token_ids], skip_special_tokens=False)
        return [tok.decode([t], skip_special_tokens=False) for t in token_ids]


def _longest_token_bytes(hf_tokenizer) -> int:
    """A bound on the UTF-8 bytes of text any one token covers (special tokens included)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    size = len(hf_tokenizer)
    ids = [[i] for i in range(size)]
    if backend is not None:
        texts = backend.decode_batch(ids, skip_special_tokens=False)
    else:
        texts = [hf_tokenizer.decode(i, skip_special_tokens=False) for i in ids]
    # +1: a decoder may drop a leading space the token stands for (SentencePiece's "\u2581")
    return 1 + max([0, *(len(t.encode()) for t in texts)])
