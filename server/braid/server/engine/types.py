"""The small, torch-free types that cross between the gRPC edge and the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from braid.server.config import Mode as Mode  # re-exported: the engine's types include the modes

# re-exported: the runner's row types a front end reads (a token's logprobs, a LoRA adapter's card,
# the sampling parameters' ranges), so that the front ends import the engine's types and never the runner
from braid.server.runner.rows import MAX_REPETITION_PENALTY as MAX_REPETITION_PENALTY
from braid.server.runner.rows import MAX_TEMPERATURE as MAX_TEMPERATURE
from braid.server.runner.rows import RANGED as RANGED
from braid.server.runner.rows import AdapterInfo as AdapterInfo
from braid.server.runner.rows import Pooling as Pooling
from braid.server.runner.rows import Sampling
from braid.server.runner.rows import TokenLogprob as TokenLogprob


class Priority(enum.Enum):
    INTERACTIVE = 1
    BATCH = 2


class FinishReason(enum.Enum):
    """Why a session ended; the values match braid.v1.FinishReason."""

    MAX_TOKENS = 1
    EOS = 2
    STOP_SEQUENCE = 3
    STOP_TOKEN = 4
    CANCELLED = 5
    DEADLINE = 6
    ERROR = 7
    CONSTRAINT = 8  # the output completely matches its constraint
    INVALID_REQUEST = 9  # the request proved impossible once it ran (Finished.error_field names the field)


class InvalidArgument(ValueError):
    """A request field is wrong; the edge turns it into INVALID_ARGUMENT naming the field."""

    def __init__(self, field_name: str, description: str) -> None:
        super().__init__(f"{field_name}: {description}")
        self.field = field_name
        self.description = description


class Overloaded(RuntimeError):
    """The engine cannot take another session now; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailable(RuntimeError):
    """The engine is shutting down or its model thread has stopped."""


class NotFound(LookupError):
    """A named thing (a LoRA adapter) does not exist: NOT_FOUND, the message naming it."""


class AlreadyExists(RuntimeError):
    """A name is taken (a LoRA adapter's): ALREADY_EXISTS."""


class LimitReached(RuntimeError):
    """A configured bound is full (--max-loras): RESOURCE_EXHAUSTED, with no retry hint: it
    frees only when someone unloads."""


class Busy(RuntimeError):
    """The thing cannot change now (an adapter still in use): FAILED_PRECONDITION."""


@dataclass(frozen=True)
class SamplingParams(Sampling):
    """How one session picks its tokens (the runner's Sampling: temperature, top_p, ..., seed,
    logprobs, top_logprobs, which the runner takes as it is) and what else the engine does with
    them; defaults already applied, ranges already checked."""

    max_new_tokens: int = 256
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_sequence: bool = False  # send the stop string that matched as text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    truncate_input_tokens: int = 0  # keep at most this many prompt tokens (0: all)
    bad_words: tuple[str, ...] = ()  # never generated
    report_queue: bool = False  # send Queued events while waiting
    prompt_logprobs: bool = False  # score the prompt's tokens, sent with the first Delta
    disable_speculation: bool = False  # no speculative proposals for this session (--speculative)
    skip_detokenize: bool = False  # token ids only: no text, no per-token detokenizing (no stop strings)
    # max_new_tokens is the server's default, not the caller's: clip it to what fits after the
    # prompt instead of refusing the request
    clip_max_new_tokens: bool = False
    # a reasoning model's reasoning budget: at this many tokens of reasoning braid closes it with the
    # end marker (engine/reasoning.py); None: no budget
    max_reasoning_tokens: int | None = None


@dataclass(frozen=True)
class Constraint:
    """A format the output must match (GenerateRequest.constraint): `kind` is json_schema,
    json_object, regex, choice (text: the choices as a JSON list), lark or gbnf; `field` is the
    request field it came from, for errors."""

    kind: str
    text: str
    field: str


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    # OpenAI's tool turns, for the chat template: an assistant's calls (a JSON list of
    # {"id", "type": "function", "function": {"name", "arguments"}}), a tool result's call id
    tool_calls: str = ""
    tool_call_id: str = ""


class Turn(Protocol):
    """What text_bytes reads of a chat's message: a Message, or the protobuf it is made from."""

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...


def text_bytes(prompt: str | None, messages: Sequence[Turn]) -> int:
    """The UTF-8 size of a prompt, or of a chat's roles and contents."""
    return len((prompt or "").encode()) + sum(len(m.content.encode()) + len(m.role.encode()) for m in messages)


@dataclass(frozen=True)
class GenerationRequest:
    """One Stream call, decoded and checked by the edge: exactly one of prompt, messages and
    prompt_token_ids."""

    prompt: str | None
    messages: tuple[Message, ...]
    params: SamplingParams
    request_id: str
    deadline: float | None = None  # time.monotonic() after which the session is stopped
    priority: Priority = Priority.INTERACTIVE
    cache_salt: str = ""  # prompt prefixes are shared only between requests with the same salt
    n: int = 1  # samples of the prompt, sample i seeded seed + i
    constraint: Constraint | None = None
    resume_token_ids: tuple[int, ...] = ()  # tokens a broken stream delivered: computed, not sent again
    tools: str = ""  # a JSON list of OpenAI tool definitions the chat template renders ("": none)
    chat_template_kwargs: str = ""  # a JSON object of more variables for the chat template ("": none)
    adapter: str = ""  # the LoRA adapter's name ("": the base model)
    prompt_token_ids: tuple[int, ...] = ()  # a prompt already tokenized, taken as it is (no BOS added)


@dataclass(frozen=True)
class EmbeddingRequest:
    """One Embed call (or POST /v1/embeddings), decoded by its front end: exactly one of texts and
    token_ids, each item one input, embedded in its own prompt-only session."""

    texts: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]
    request_id: str
    pooling: Pooling | None = None  # None: the model's (ModelInfo.embedding_pooling)
    normalize: bool = True  # to unit length (L2), after `dimensions` cut it
    dimensions: int = 0  # keep the leading dimensions components (0: all)
    truncate_input_tokens: int = 0  # keep at most this many of each input's last tokens (0: all)
    deadline: float | None = None
    priority: Priority = Priority.INTERACTIVE

    @property
    def inputs(self) -> tuple[str, ...] | tuple[tuple[int, ...], ...]:
        return self.texts or self.token_ids


@dataclass
class Delta:
    """New output of a session: text now safe to send, and the tokens produced since the last one."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token id, when asked for
    # with prompt_logprobs, on the first Delta with tokens: the prompt, and a TokenLogprob per prompt token but its first
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning: str = ""  # a reasoning model's reasoning text, apart from the answer's (engine/reasoning.py)


@dataclass
class Timings:
    queue_ms: float
    time_to_first_token_ms: float
    total_ms: float
    tokens_per_second: float


@dataclass
class Finished:
    """The last event of a session."""

    reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    timings: Timings
    error: str | None = None
    error_field: str | None = None  # INVALID_REQUEST: the request field at fault
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    stop_sequence: str = ""  # the stop string that ended it (reason STOP_SEQUENCE)
    truncated_tokens: int = 0  # prompt tokens cut by truncate_input_tokens
    proposed_tokens: int = 0  # speculative proposals verified (--speculative)
    accepted_tokens: int = 0  # and of those, confirmed by the model
    reasoning_tokens: int = 0  # generated tokens that were reasoning, its markers included
    embedding: list[float] | None = None  # an embedding session's vector, once its input is computed

    def milestones(self) -> dict[str, float]:
        """Seconds from arrival to each point the session reached, in order: queued (0), prefill
        (its first forward pass), first_token, finish."""
        t = self.timings
        points = {"queued": 0.0}
        if t.queue_ms < t.total_ms:  # a session that never ran gets queue_ms == total_ms
            points["prefill"] = t.queue_ms / 1000
        if self.generated_tokens:
            points["first_token"] = t.time_to_first_token_ms / 1000
        points["finish"] = t.total_ms / 1000
        return points


@dataclass
class Queued:
    """The session waits to be admitted, `position`-th in line (1: next); with report_queue."""

    position: int


Event = Delta | Finished | Queued


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    architecture: str
    context_length: int
    vocab_size: int
    dtype: str
    device: str
    mode: Mode
    max_batch_size: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    parameters: int
    weight_formats: dict[str, int]  # tensors served in each format
    weight_bytes: int
    quantization: str
    kernels: str
    kv_cache_dtype: str = "float32"
    prefix_caching: bool = True
    runner: str = "braid"  # "braid": its own decoder; "transformers": the model's own forward
    activations: str = "float32"  # what the weights multiply: "int8", "bf16", "int8+bf16" or "float32" rows
    threads: int = 0  # the CPU pools' threads (affinity, cgroup quota or --threads)
    max_loras: int = 0  # LoRA adapters resident at most (--max-loras); the loaded ones: Engine.adapters
    max_lora_rank: int = 0
    speculative: str = "none"  # --speculative: none, ngram or draft
    speculative_tokens: int = 0  # the most proposals per session and pass; 0 with none
    draft_model: str = ""  # the draft model loaded, "" with none
    # whether the chat template renders `tools` (SmolLM2's does not: the HTTP front end describes
    # them in the system message instead); engine/tokenizer.py finds out once per model
    chat_template_takes_tools: bool = True
    # --served-model-name: every name the model answers to; model_name is the first
    served_model_names: tuple[str, ...] = ()
    model_path: str = ""  # what was loaded: --model as given, or the embedded model's file
    kv_cache_bytes: int = 0  # the KV cache's reservation (its pages, of every layer)
    embedding_dimensions: int = 0  # Embed's vectors' size (the hidden size); 0: no embeddings
    embedding_pooling: Pooling = Pooling.LAST  # the model's own pooling, else LAST (model/pooling.py)
    embedding_pooling_source: str = "default"  # where that came from: gguf, sentence-transformers, default


@dataclass
class EngineStats:
    sessions_active: int = 0
    sessions_queued: int = 0
    sessions_paused: int = 0  # active, but out of the passes: their clients are not reading
    sessions_submitted: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    forward_passes: int = 0
    finished: dict[FinishReason, int] = field(default_factory=lambda: {r: 0 for r in FinishReason})
    # the KV cache (engine/pages.py): totals since start, then pages now
    prompt_tokens_cached: int = 0  # prompt tokens found in the prefix cache (prompt_tokens: those computed)
    preemptions: int = 0  # running sessions whose pages were taken back, to be recomputed
    kv_evictions: int = 0  # cached pages taken back for other use
    kv_pages_total: int = 0
    kv_pages_used: int = 0  # held by running sessions
    kv_pages_cached: int = 0  # held by no session, keeping a prefix for the next
    kv_page_tokens: int = 0  # tokens per page
    # speculative decoding (--speculative): proposals verified since start, and those confirmed
    speculative_proposed_tokens: int = 0
    speculative_accepted_tokens: int = 0
