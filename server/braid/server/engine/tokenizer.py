"""The model's tokenizer, as the engine uses it: prompts and chats in, token ids out, and back."""

from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
import threading
from typing import TYPE_CHECKING, Any, Sequence, TypeAlias

from braid.server.engine.reasoning import Markers, find_markers
from braid.server.engine.types import InvalidArgument, Message

if TYPE_CHECKING:
    import tokenizers

# A transformers tokenizer (PreTrainedTokenizerBase). The engine only calls it, and never imports
# transformers (which would bring torch in): to mypy it is Any.
HfTokenizer: TypeAlias = Any

_LOGGER = logging.getLogger(__name__)
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class Tokenizer:
    """Thread-safe, and no thread waits for another. Where the model has a fast (Rust) tokenizer,
    every thread encodes and decodes through it directly: its encode and decode only read it, and
    run side by side. transformers' own encode reconfigures it first (truncation, padding), and a
    Rust tokenizer reconfigured during another thread's call raises "Already borrowed"; so braid
    never calls that on it. (One lock around it made the model thread's per-token decode wait behind
    a worker's second-long encode of a 1 MiB prompt, which stalled every stream.) A model with only
    a Python tokenizer gets a copy per thread that tokenizes; so did every model before, and each
    copy took 0.3 s or more, made by a request's first use of a thread.

    The chat template is rendered by transformers' tokenizer, shared: rendering reads it only."""

    def __init__(self, hf_tokenizer: HfTokenizer, eos_token_ids: Sequence[int]) -> None:
        self._original = hf_tokenizer
        # the fast tokenizer's Rust backend, where there is one
        self._backend: tokenizers.Tokenizer | None = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._copy_lock = threading.Lock()
        self._local = threading.local()
        self.eos_token_ids = tuple(eos_token_ids)
        self.has_chat_template = bool(getattr(hf_tokenizer, "chat_template", None))
        self.template_takes_tools = not self.has_chat_template or _renders_tools(hf_tokenizer)
        if not self.template_takes_tools:
            _LOGGER.info("the chat template does not render tools: requests' tools go into their system message")
        # a reasoning model's <think> and </think> (or its kin), from its template or vocabulary
        self.reasoning_markers: Markers | None = find_markers(
            getattr(hf_tokenizer, "chat_template", None),
            _added_tokens(hf_tokenizer),
            lambda text: self._encode(text, add_special_tokens=False),
        )
        if self.reasoning_markers is not None:
            m = self.reasoning_markers
            _LOGGER.info("reasoning between %s and %s: sent apart from the answer", m.start, m.end)

    @property
    def hf_tokenizer(self) -> HfTokenizer:
        """The transformers tokenizer itself, for what reads the vocabulary once (engine/grammars.py)."""
        return self._original

    def _own(self) -> HfTokenizer:
        """This thread's copy of a Python tokenizer (one with no Rust backend)."""
        own = getattr(self._local, "tok", None)
        if own is None:
            with self._copy_lock:
                own = self._local.tok = copy.deepcopy(self._original)
        return own

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self._own().encode(text, add_special_tokens=add_special_tokens))

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token covers: read on the first prompt long enough to
        need it (decoding every token took 0.1 s of each start's CPU on a slow core, for the 49,152
        tokens of the embedded model's vocabulary)."""
        return _longest_token_bytes(self._original)

    def min_tokens(self, text_bytes: int) -> int:
        """A lower bound on the token count of a text of this many UTF-8 bytes, so a prompt far past
        the context is refused without the second or more it takes to tokenize: no token covers
        more than `max_token_bytes` bytes. Halved, because a normalizer (NFC, lowercasing) or a chat
        template (trimming) may shrink the text a little before it is split into tokens."""
        return text_bytes // (2 * self.max_token_bytes)

    def encode_prompt(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=True)

    def prompt_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """A prompt's tokens, as encode_prompt's, and each token's characters [start, end) in the
        text (a token the tokenizer added: (0, 0)). Only a fast (Rust) tokenizer knows them."""
        if self._backend is None:
            raise InvalidArgument("return_offsets", "this model's tokenizer has no offsets (it has no fast tokenizer)")
        encoding = self._backend.encode(text, add_special_tokens=True)
        return encoding.ids, [(start, end) for start, end in encoding.offsets]

    def encode_chat(
        self, messages: Sequence[Message], field_name: str = "messages", tools: str = "", template_kwargs: str = ""
    ) -> list[int]:
        """template_kwargs: a JSON object of more variables for the template (OpenAI's
        chat_template_kwargs, as vLLM takes them: {"enable_thinking": false}); none may be one of
        apply_chat_template's own arguments."""
        if not self.has_chat_template:
            raise InvalidArgument(field_name, "this model has no chat template; send a prompt instead")
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise InvalidArgument(
                    f"{field_name}[{i}].role", f"unknown role {m.role!r}; use one of {sorted(CHAT_ROLES)}"
                )
        chat = [_turn(m) for m in messages]
        extra = self._template_kwargs(template_kwargs) if template_kwargs else {}
        try:
            text = self._original.apply_chat_template(
                chat, tools=json.loads(tools) if tools else None, add_generation_prompt=True, tokenize=False, **extra
            )
        except Exception as exc:  # jinja templates raise their own errors for chats they reject
            raise InvalidArgument(field_name, f"the chat template rejected it: {exc}") from exc
        return self._encode(text, add_special_tokens=False)  # the template wrote its special tokens

    def encode_words(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's token sequences as it appears in text: alone, and after a space."""
        sequences = {tuple(self._encode(text, add_special_tokens=False)) for w in words for text in (w, " " + w)}
        return tuple(sorted(s for s in sequences if s))

    def _template_kwargs(self, text: str) -> dict[str, Any]:
        kwargs: dict[str, Any] = json.loads(text)
        own = set(inspect.signature(self._original.apply_chat_template).parameters) | {"messages"}
        for key in kwargs:
            if key in own:
                raise InvalidArgument(f"chat_template_kwargs.{key}", "is the chat template's own argument")
        return kwargs

    def encode(
        self, prompt: str | None, messages: Sequence[Message], tools: str = "", template_kwargs: str = ""
    ) -> list[int]:
        if messages:
            return self.encode_chat(messages, tools=tools, template_kwargs=template_kwargs)
        return self.encode_prompt(prompt or "")

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(token_ids), skip_special_tokens=False)
        text: str = self._own().decode(token_ids, skip_special_tokens=False)
        return text

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text, in one call to the Rust tokenizer where there is one."""
        if self._backend is not None:
            return self._backend.decode_batch([[t] for t in token_ids], skip_special_tokens=False)
        tok = self._own()
        return [tok.decode([t], skip_special_tokens=False) for t in token_ids]


_PROBE_CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "braid_probe_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _renders_tools(hf_tokenizer: HfTokenizer) -> bool:
    """Whether the chat template writes `tools` into the prompt: a chat rendered with a tool and
    without it differ (as minja's capability probe does for llama.cpp). A template that fails
    without tools is left to say why on a real request."""
    try:
        without = hf_tokenizer.apply_chat_template(_PROBE_CHAT, add_generation_prompt=True, tokenize=False)
    except Exception:
        return True
    try:
        rendered = hf_tokenizer.apply_chat_template(
            _PROBE_CHAT, tools=_PROBE_TOOLS, add_generation_prompt=True, tokenize=False
        )
    except Exception:  # one that refuses tools does not take them
        return False
    return bool(rendered != without)


def _turn(m: Message) -> dict[str, Any]:
    """A message as chat templates read it: tool calls with their arguments parsed, as
    transformers' templates (Qwen's, Llama 3's) expect them."""
    turn: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        turn["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _parsed(c["function"]["arguments"])}}
            for c in json.loads(m.tool_calls)
        ]
    if m.tool_call_id:
        turn["tool_call_id"] = m.tool_call_id
    return turn


def _parsed(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _added_tokens(hf_tokenizer: HfTokenizer) -> list[str]:
    """The texts of the tokens added to the tokenizer's vocabulary (special ones and others)."""
    try:
        return list(hf_tokenizer.get_added_vocab())
    except (AttributeError, NotImplementedError):
        return []


def _longest_token_bytes(hf_tokenizer: HfTokenizer) -> int:
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
