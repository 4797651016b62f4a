"""A generation request's prompt: tokenized (a chat rendered by its template), cut to
truncate_input_tokens (a chat's oldest turns first), and checked with the request's parameters
against the context. Admission (engine/admission.py) uses it on the tokenizer threads."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from braid.server.engine.tokenizer import Tokenizer
from braid.server.engine.types import GenerationRequest, InvalidArgument, Message, SamplingParams


class Prompts:
    def __init__(self, tokenizer: Tokenizer, max_seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len

    def encode(self, request: GenerationRequest) -> tuple[list[int], int]:
        """The prompt's tokens (prompt_token_ids as they are), cut to truncate_input_tokens, and how
        many were cut."""
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
        else:
            ids = self.tokenizer.encode(request.prompt, request.messages, request.tools, request.chat_template_kwargs)
        keep = request.params.truncate_input_tokens
        if not keep or len(ids) <= keep:
            return ids, 0
        if request.messages:
            kept = self._drop_oldest_turns(request.messages, keep, request.tools, request.chat_template_kwargs)
            if kept is not None:
                return kept, len(ids) - len(kept)
        return ids[-keep:], len(ids) - keep

    def _drop_oldest_turns(
        self, messages: Sequence[Message], keep: int, tools: str = "", template_kwargs: str = ""
    ) -> list[int] | None:
        """The chat without its oldest non-system messages, as few dropped as make it fit in
        `keep` tokens (a rendering the template rejects is passed over); None if only the last
        message left still does not fit."""
        others = [i for i, m in enumerate(messages) if m.role != "system"]
        for n in range(1, len(others)):
            dropped = set(others[:n])
            try:
                kept = [m for i, m in enumerate(messages) if i not in dropped]
                ids = self.tokenizer.encode_chat(kept, tools=tools, template_kwargs=template_kwargs)
            except InvalidArgument:
                continue
            if len(ids) <= keep:
                return ids
        return None

    def fit(self, request: GenerationRequest, prompt_ids: list[int]) -> SamplingParams:
        """The request's parameters checked against its tokenized prompt; a default max_new_tokens
        clipped to what fits."""
        params = request.params
        field = _prompt_field(request)
        n = len(prompt_ids)
        if not prompt_ids:
            raise InvalidArgument(field, "must not be empty")
        self.check_length(field, n)
        room = self.max_seq_len - n
        if params.max_new_tokens > room and params.clip_max_new_tokens:
            params = dataclasses.replace(params, max_new_tokens=room)
        if params.max_new_tokens > room:
            raise InvalidArgument(
                "max_new_tokens",
                f"{params.max_new_tokens} new tokens after a {n}-token prompt "
                f"exceed the context length {self.max_seq_len} (at most {room})",
            )
        if params.min_new_tokens > params.max_new_tokens:
            raise InvalidArgument(
                "min_new_tokens",
                f"{params.min_new_tokens} is more than the {room} new tokens "
                f"that fit after a {n}-token prompt "
                f"(context length {self.max_seq_len})",
            )
        return params

    def check_length(self, field: str, n: int) -> None:
        """A prompt of n tokens leaves room in the context for one more."""
        if n >= self.max_seq_len:
            raise InvalidArgument(field, f"is {n} tokens; the context length is {self.max_seq_len}")


def _prompt_field(request: GenerationRequest) -> str:
    """The field that holds the request's prompt, for errors."""
    if request.prompt_token_ids:
        return "prompt_token_ids"
    return "messages" if request.messages else "prompt"
