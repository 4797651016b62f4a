"""The model's tokenizer, as the engine uses it: prompts and chats in, token ids out, and back."""

from __future__ import annotations

import threading
from typing import Sequence

from braid.server.engine.types import InvalidArgument, Message

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class Tokenizer:
    """Thread-safe: worker threads encode while the model thread decodes. A Rust tokenizer shared
    across threads raises "Already borrowed" if one call reconfigures it during another, so every
    call holds one lock (uncontended, it costs well under a microsecond)."""

    def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int]) -> None:
        self._tok = hf_tokenizer
        # The Rust tokenizer itself, where there is one: decoding through it skips the Python
        # wrapper, which matters at one decode per token per session.
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._lock = threading.Lock()
        self.eos_token_ids = tuple(eos_token_ids)
        self.has_chat_template = bool(getattr(hf_tokenizer, "chat_template", None))

    def encode_prompt(self, text: str) -> list[int]:
        with self._lock:
            return list(self._tok.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: Sequence[Message], field_name: str = "messages") -> list[int]:
        if not self.has_chat_template:
            raise InvalidArgument(field_name, "this model has no chat template; send a prompt instead")
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise InvalidArgument(f"{field_name}[{i}].role",
                                      f"unknown role {m.role!r}; use one of {sorted(CHAT_ROLES)}")
        chat = [{"role": m.role, "content": m.content} for m in messages]
        try:
            text = self._tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja templates raise their own errors for chats they reject
            raise InvalidArgument(field_name, f"the chat template rejected it: {exc}") from exc
        with self._lock:  # the template already wrote the special tokens it wants
            return list(self._tok.encode(text, add_special_tokens=False))

    def encode(self, prompt: str | None, messages: Sequence[Message]) -> list[int]:
        return self.encode_chat(messages) if messages else self.encode_prompt(prompt or "")

    def decode(self, token_ids: Sequence[int]) -> str:
        with self._lock:
            if self._backend is not None:
                return self._backend.decode(list(token_ids), skip_special_tokens=False)
            return self._tok.decode(token_ids, skip_special_tokens=False)

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        return [self.decode([t]) for t in token_ids]
