"""Admission: a call's place in the queue, its constraint compiled, its prompt tokenized and
checked, its session made.

Runs on the event loop (`admit`, cheap), on the constraint lane (`compile`: a compile can take
seconds, so it never holds up the tokenizer threads) and on tokenizer threads (`submit`,
`tokenize`); hands sessions to the model thread through the `enqueue` callable it is given.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import Callable, Sequence

from braid.server.engine.adapters import Adapters
from braid.server.engine.books import Books, Ticket
from braid.server.engine.constraints import check_resumed
from braid.server.engine.detokenizer import IdsOnly, IncrementalDetokenizer, detokenize
from braid.server.engine.embedding import Embedding
from braid.server.engine.grammars import Grammars, Matcher
from braid.server.engine.handle import SessionHandle
from braid.server.engine.prompts import Prompts
from braid.server.engine.session import NO_FEATURES, Features, Session
from braid.server.engine.reasoning import Reasoning
from braid.server.engine.tokenizer import Tokenizer
from braid.server.engine.types import (
    EmbeddingRequest,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    InvalidArgument,
    Message,
    NotFound,
    Pooling,
    SamplingParams,
    text_bytes,
)
from braid.server.runner.rows import Sampling

TOKEN_BYTES = 4  # a token id weighs as much as a text's token does (books.BIG_TEXT_BYTES: about 4 bytes)


class Admission:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_seq_len: int,
        books: Books,
        random_state: Callable[[Sampling, int], object],
        grammars: Grammars,
        enqueue: Callable[[Session, Features], None],
        abort: Callable[[int, FinishReason], None],
        wake: Callable[[], None],
        is_open: Callable[[], str | None],
        adapters: Adapters | None = None,
    ) -> None:
        """random_state: the runner's, for a session's Row.rng (advanced by a number of draws);
        enqueue: hands a session and its features' state to the model thread; is_open: None while
        sessions may be admitted, else why not; adapters: the LoRA adapters a request may name
        (none without)."""
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.prompts = Prompts(tokenizer, max_seq_len)
        self.books = books
        self._random_state = random_state
        self.grammars = grammars
        self._enqueue, self._abort, self._wake, self._is_open = enqueue, abort, wake, is_open
        self._ids = itertools.count(1)
        self.adapters = adapters

    def admit(
        self,
        prompt: str | None,
        messages: Sequence[Message],
        for_session: bool = True,
        truncated: bool = False,
        token_ids: Sequence[int] = (),
    ) -> Ticket:
        """Takes a place for a call before its text is tokenized: cheap, so the event loop calls it
        the moment a call arrives. A Stream prompt that cannot fit in the context even at the most
        bytes per token is refused here, without tokenizing it (unless it is to be truncated).
        token_ids: a prompt already tokenized (prompt_token_ids), or Detokenize's ids."""
        closed = self._is_open()
        if closed is not None:
            raise EngineUnavailable(closed)
        size = text_bytes(prompt, messages) + len(token_ids) * TOKEN_BYTES
        if token_ids and for_session and not truncated:
            self.prompts.check_length("prompt_token_ids", len(token_ids))
        elif for_session and not truncated and size >= 2 * self.max_seq_len:
            # (the bound is at most half the bytes: a shorter text never reaches the context, and the
            # tokenizer's longest token, read on first need, is not needed)
            at_least = self.tokenizer.min_tokens(size)
            if at_least >= self.max_seq_len:
                raise InvalidArgument(
                    "messages" if messages else "prompt",
                    f"is at least {at_least} tokens; the context length is {self.max_seq_len}",
                )
        return Ticket(self.books, size)

    def compile(self, request: GenerationRequest) -> Matcher | None:
        """The request's constraint compiled into a matcher for its first session (None without
        one). Raises InvalidArgument naming the field. Blocking: call it off the event loop, and
        off the tokenizer threads."""
        if request.constraint is None:
            return None
        return self.grammars.matcher(request.constraint)

    def submit(
        self,
        ticket: Ticket,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        matcher: Matcher | None = None,
    ) -> list[SessionHandle]:
        """Tokenizes, checks and queues the request's `n` sessions (sample i seeded seed + i); gives
        the ticket back whatever happens. matcher: compile(request)'s, for a request with a
        constraint. Blocking (tokenization): call it off the event loop."""
        if (matcher is None) != (request.constraint is None):
            raise ValueError("a request with a constraint is submitted with its compiled matcher")
        try:
            first = self._session(request, loop, matcher)
            sessions = [first] + [self._fork(*first, i, loop) for i in range(1, request.n)]
            ticket.release(submitted=len(sessions))  # counted before the model thread can finish them
        finally:
            ticket.release()
        for session, features in sessions:
            self._enqueue(session, features)
        return [s.handle for s, _ in sessions]

    def admit_embedding(self, request: EmbeddingRequest) -> Ticket:
        """An Embed call's place in the queue (cheap: on the event loop); its inputs' lengths are
        checked once tokenized (embed)."""
        closed = self._is_open()
        if closed is not None:
            raise EngineUnavailable(closed)
        size = sum(len(t.encode()) for t in request.texts) + sum(map(len, request.token_ids)) * TOKEN_BYTES
        return Ticket(self.books, size)

    def embed(
        self, ticket: Ticket, request: EmbeddingRequest, loop: asyncio.AbstractEventLoop, pooling: Pooling
    ) -> list[SessionHandle]:
        """Tokenizes, checks and queues one prompt-only session per input, pooled with the request's
        pooling or else `pooling` (the model's); gives the ticket back whatever happens. An input
        longer than the context (after truncate_input_tokens) is InvalidArgument naming it.
        Blocking (tokenization): call it off the event loop."""
        field = "texts" if request.texts else "token_ids"
        try:
            inputs = [self._embedding_input(request, i, field) for i in range(len(request.inputs))]
            sessions = [self._embedding_session(request, ids, cut, loop, pooling) for ids, cut in inputs]
            ticket.release(submitted=len(sessions))
        finally:
            ticket.release()
        for session in sessions:
            self._enqueue(session, NO_FEATURES)
        return [s.handle for s in sessions]

    def _embedding_input(self, request: EmbeddingRequest, i: int, field: str) -> tuple[list[int], int]:
        """Input i's tokens (a text's with the tokenizer's special tokens, as sentence-transformers
        encodes it), its last truncate_input_tokens kept, and how many were cut."""
        ids = list(request.token_ids[i]) if request.token_ids else self.tokenizer.encode(request.texts[i], ())
        keep = request.truncate_input_tokens
        cut = len(ids) - keep if keep and len(ids) > keep else 0
        ids = ids[cut:]
        if not ids:
            raise InvalidArgument(f"{field}[{i}]", "has no tokens")
        if len(ids) > self.max_seq_len:  # no room needed after it: nothing is generated
            raise InvalidArgument(
                f"{field}[{i}]",
                f"is {len(ids)} tokens; the context length is {self.max_seq_len} (truncate_input_tokens cuts it)",
            )
        return ids, cut

    def _embedding_session(
        self,
        request: EmbeddingRequest,
        ids: list[int],
        truncated: int,
        loop: asyncio.AbstractEventLoop,
        pooling: Pooling,
    ) -> Session:
        session_id = next(self._ids)
        handle = SessionHandle(session_id, request.request_id, 0, len(ids), loop, self._abort, self._wake)
        params = SamplingParams(max_new_tokens=0, skip_detokenize=True)
        return Session(
            id=session_id,
            prompt_ids=ids,
            params=params,
            rng=None,
            handle=handle,
            detokenizer=IdsOnly(),
            deadline=request.deadline,
            priority=request.priority,
            arrived=handle.arrived,
            truncated_tokens=truncated,
            embedding=Embedding(request.pooling or pooling, request.normalize, request.dimensions),
        )

    def _fork(
        self, first: Session, features: Features, index: int, loop: asyncio.AbstractEventLoop
    ) -> tuple[Session, Features]:
        """Sample `index` of first's request: the same prompt and parameters, seed + index, and
        features of its own. It is held until first has computed the prompt, then finds its pages
        in the prefix cache."""
        params = dataclasses.replace(first.params, seed=(first.params.seed + index) % 2**64)
        if self.adapters is not None:
            self.adapters.retain(first.adapter)
        session_id = next(self._ids)
        handle = SessionHandle(
            session_id, first.handle.request_id, params.seed, first.num_prompt, loop, self._abort, self._wake
        )
        session = dataclasses.replace(
            first,
            id=session_id,
            params=params,
            rng=self._random_state(params, 0),
            handle=handle,
            detokenizer=self._detokenizer(first.prompt_ids, params),
            parent=first,
            arrived=handle.arrived,
            token_ids=[],
            pages=[],
            page_keys=[],
            prompt_scores=None,
        )
        matcher, reasoning = features.matcher, features.reasoning
        return session, dataclasses.replace(
            features,
            matcher=matcher.deep_copy() if matcher is not None else None,
            reasoning=None
            if reasoning is None
            else Reasoning(reasoning.markers, first.prompt_ids, reasoning.budget, reasoning.constrained),
        )

    def tokenize(
        self,
        ticket: Ticket,
        prompt: str | None,
        messages: Sequence[Message],
        offsets: bool = False,
        tools: str = "",
        template_kwargs: str = "",
    ) -> tuple[list[int], list[str], list[tuple[int, int]]]:
        """A Tokenize call's work: ids, pieces, and with `offsets` each token's characters in the
        prompt ([] without); gives the ticket back. A chat is rendered with `tools` and
        `template_kwargs` as a generation's (GenerationRequest.tools, .chat_template_kwargs): its
        ids are those the generation's prompt would have. Blocking: call it off the event loop."""
        try:
            if offsets:
                if messages:
                    raise InvalidArgument("return_offsets", "offsets are of a text: send text, not messages")
                ids, spans = self.tokenizer.prompt_offsets(prompt or "")
            else:
                ids, spans = self.tokenizer.encode(prompt, messages, tools, template_kwargs), []
            return ids, self.tokenizer.pieces(ids), spans
        finally:
            ticket.release()

    def detokenize(self, ticket: Ticket, token_ids: Sequence[int]) -> tuple[str, int]:
        """A Detokenize call's work: the ids' text and how many of the last ids it leaves out (they
        end in part of a character); gives the ticket back. Blocking: call it off the event loop."""
        try:
            return detokenize(self.tokenizer.decode, token_ids)
        finally:
            ticket.release()

    def _detokenizer(self, prompt_ids: Sequence[int], params: SamplingParams) -> IncrementalDetokenizer:
        if params.skip_detokenize:
            return IdsOnly()
        return IncrementalDetokenizer(self.tokenizer.decode, prompt_ids, params.stop, params.include_stop_sequence)

    def _session(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, matcher: Matcher | None
    ) -> tuple[Session, Features]:
        prompt_ids, truncated = self.prompts.encode(request)
        params = self.prompts.fit(request, prompt_ids)
        resumed = request.resume_token_ids
        if len(resumed) >= params.max_new_tokens:
            raise InvalidArgument(
                "resume_token_ids",
                f"{len(resumed)} tokens leave none of max_new_tokens ({params.max_new_tokens}) to generate",
            )
        if matcher is not None:  # walked past a reasoning's tokens as the model thread will replay them
            check_resumed(
                request, matcher, self._reasoning(request, prompt_ids, params, True), self.tokenizer.eos_token_ids
            )
        adapter, adapter_key = self._adapter(request.adapter)  # the last check: it holds the adapter
        session_id = next(self._ids)
        handle = SessionHandle(
            session_id, request.request_id, params.seed, len(prompt_ids), loop, self._abort, self._wake
        )
        session = Session(
            adapter=adapter,
            adapter_key=adapter_key,
            id=session_id,
            prompt_ids=prompt_ids,
            params=params,
            rng=self._random_state(params, len(resumed)),
            handle=handle,
            detokenizer=self._detokenizer(prompt_ids, params),
            deadline=request.deadline,
            priority=request.priority,
            arrived=handle.arrived,
            cache_salt=request.cache_salt,
            truncated_tokens=truncated,
            bad_words=self.tokenizer.encode_words(params.bad_words) if params.bad_words else (),
            prompt_scores=[] if params.prompt_logprobs else None,
        )
        return session, Features(
            matcher=matcher,
            constraint_field=request.constraint.field if request.constraint else "",
            reasoning=self._reasoning(request, prompt_ids, params, matcher is not None),
            resumed=tuple(resumed),
        )

    def _reasoning(
        self, request: GenerationRequest, prompt_ids: Sequence[int], params: SamplingParams, constrained: bool
    ) -> Reasoning | None:
        """A reasoning model's chat's reasoning (None for any other model's, or a plain prompt's:
        its output is the model's text as it is, as vLLM's completions send it); constrained: the
        request has a constraint, which waits for a reasoning the model opens."""
        markers = self.tokenizer.reasoning_markers
        if markers is None or not request.messages:
            return None
        return Reasoning(markers, prompt_ids, params.max_reasoning_tokens, constrained)

    def _adapter(self, name: str) -> tuple[int, str]:
        """The LoRA adapter `name` held for a new session: its id and prefix-cache key; raises
        NotFound naming it."""
        if not name:
            return 0, ""
        if self.adapters is None:
            raise NotFound(f"adapter {name!r} is not loaded (this server has none)")
        return self.adapters.acquire(name)
