"""The port every front end uses to reach the engine: calls admitted, constraints compiled,
prompts tokenized and queued as sessions, statistics, and the futures a drain waits on. The gRPC
servicer depends on this and nothing else of the engine's; so will the next front end. Engine
(engine/engine.py) implements it; the servicer's tests use a fake one."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import TYPE_CHECKING, Protocol, Sequence

from braid.server.engine.books import Ticket
from braid.server.engine.handle import SessionHandle
from braid.server.engine.kv_events import KvEventLog
from braid.server.engine.types import EmbeddingRequest, EngineStats, GenerationRequest, Message, ModelInfo
from braid.server.runner.rows import AdapterInfo

if TYPE_CHECKING:
    from braid.server.engine.grammars import Matcher


class EngineClient(Protocol):
    info: ModelInfo
    started_at: float  # time.monotonic() when the engine was made
    kv_events: KvEventLog  # the prefix cache's pages stored and evicted, read on the event loop

    @property
    def max_sessions(self) -> int:
        """Most sessions running at once (--max-sessions), for load reports."""

    def admit(
        self,
        prompt: str | None,
        messages: Sequence[Message],
        for_session: bool = True,
        truncated: bool = False,
        token_ids: Sequence[int] = (),
    ) -> Ticket:
        """A call's place in the queue, taken the moment it arrives (cheap: on the event loop).
        token_ids: a prompt already tokenized, or Detokenize's ids. Raises Overloaded,
        EngineUnavailable, or InvalidArgument for a prompt too big to fit."""

    def compile(self, request: GenerationRequest) -> Matcher | None:
        """The request's constraint compiled (None without one). Blocking: off the event loop."""

    def submit(
        self,
        ticket: Ticket,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        matcher: Matcher | None = None,
    ) -> list[SessionHandle]:
        """Tokenizes and queues the request's sessions, their events delivered on `loop`; gives the
        ticket back. Blocking: off the event loop."""

    def admit_embedding(self, request: EmbeddingRequest) -> Ticket:
        """An Embed call's place in the queue, taken the moment it arrives (cheap: on the event
        loop). Raises Overloaded, EngineUnavailable."""

    def embed(self, ticket: Ticket, request: EmbeddingRequest, loop: asyncio.AbstractEventLoop) -> list[SessionHandle]:
        """Tokenizes and queues one prompt-only session per input, in order; each ends with its
        vector (Finished.embedding). Gives the ticket back. Raises InvalidArgument naming an input
        too long. Blocking: off the event loop."""

    def tokenize(
        self, ticket: Ticket, prompt: str | None, messages: Sequence[Message], offsets: bool = False
    ) -> tuple[list[int], list[str], list[tuple[int, int]]]:
        """A Tokenize call's token ids, pieces and (with `offsets`, of a prompt) each token's
        characters [start, end); gives the ticket back. Blocking: off the event loop."""

    def detokenize(self, ticket: Ticket, token_ids: Sequence[int]) -> tuple[str, int]:
        """The ids' text, ending on a whole character, and how many of the last ids it leaves out;
        gives the ticket back. Blocking: off the event loop."""

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text (for logprobs over HTTP, which name tokens by text). Thread-safe;
        off the event loop, as a Python tokenizer's first use on a thread copies it."""

    def stats(self) -> EngineStats: ...

    def load_lora(self, name: str, path: str) -> AdapterInfo:
        """Loads a LoRA adapter under `name` (engine/adapters.py). Raises InvalidArgument,
        AlreadyExists, LimitReached. Blocking: off the event loop."""

    def unload_lora(self, name: str) -> concurrent.futures.Future[None]:
        """Begins unloading it: new requests for it get NotFound now; the future is done once the
        sessions using it have finished and it is freed. Raises NotFound. Never blocks: await the
        future (asyncio.wrap_future), holding no thread; keep_lora calls the unload off."""

    def keep_lora(self, name: str, waited: float) -> None:
        """Calls off an unload whose caller has waited `waited` seconds: Busy (it stays loaded),
        or nothing where it has been freed meanwhile."""

    def loras(self) -> list[AdapterInfo]:
        """The LoRA adapters loaded now."""

    @property
    def is_idle(self) -> bool:
        """Nothing queued, running or being tokenized."""

    def stop_accepting(self) -> None:
        """New calls get UNAVAILABLE from now on (a drain has begun)."""

    def cancel_all(self) -> None:
        """Ends every session with a final CANCELLED message."""

    def stop(self) -> None:
        """Ends the model loop."""

    def when_idle(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """Resolves once nothing is queued, running or being tokenized (or the loop has ended)."""

    def when_stopped(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """Resolves once the model loop has ended."""
