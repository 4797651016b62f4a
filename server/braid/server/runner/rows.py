"""What one forward pass takes: a row per sequence. The runner's own input type, torch-free, so the
engine builds rows without knowing tensors, and the runner never sees a session or a queue."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Sequence

# Temperatures below this decode greedily, as in vLLM: dividing logits by a temperature near zero
# overflows to inf and NaN (1e-38 sampled garbage where 1e-30 was still greedy).
GREEDY_BELOW_TEMPERATURE = 1e-5


class Pooling(enum.Enum):
    """How an embedding is made of a sequence's positions; the values match braid.v1.Pooling."""

    LAST = 1  # the last position's hidden state
    MEAN = 2  # the mean of every position's


class Limits(NamedTuple):
    """A numeric sampling parameter's accepted values: [lo, hi], or (lo, hi] where lo_open; hi None:
    the vocabulary's size. zero_unset: the .proto's field is plain proto3, whose 0 cannot be told
    from unset, so 0 means the default (a new parameter is `optional` there: unset is the default,
    and 0 is 0)."""

    lo: float
    hi: float | None
    lo_open: bool = False
    zero_unset: bool = False


def limits(lo: float, hi: float | None, lo_open: bool = False, zero_unset: bool = False) -> dict[str, Limits]:
    """A Sampling field's metadata: its Limits, which the front ends read it by and check it against."""
    return {"limits": Limits(lo, hi, lo_open, zero_unset)}


MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty, as OpenAI's


@dataclass(frozen=True)
class Sampling:
    """How a sequence picks its next tokens; ranges already checked. A request's parameters
    (engine/types.py's SamplingParams) are this and the engine's own fields.

    A numeric parameter is declared once, here, with its default and its `limits`: each front end
    copies it from its request by name (the .proto's field, the HTTP body's) and the shared checks
    (frontend/checks.py) check it against them, in this order. A new one is its field here, the
    sampler's use of it, the .proto's field and the OpenAI body's."""

    temperature: float = field(default=0.0, metadata=limits(0.0, MAX_TEMPERATURE))
    top_p: float = field(default=1.0, metadata=limits(0.0, 1.0, zero_unset=True))
    top_k: int = field(default=0, metadata=limits(0, None))
    min_p: float = field(default=0.0, metadata=limits(0.0, 1.0))
    # locally typical sampling: the tokens whose surprise is nearest the entropy, up to this mass
    typical_p: float = field(default=1.0, metadata=limits(0.0, 1.0, lo_open=True))
    repetition_penalty: float = field(
        default=1.0, metadata=limits(0.0, MAX_REPETITION_PENALTY, lo_open=True, zero_unset=True)
    )
    presence_penalty: float = field(default=0.0, metadata=limits(-MAX_PENALTY, MAX_PENALTY))
    frequency_penalty: float = field(default=0.0, metadata=limits(-MAX_PENALTY, MAX_PENALTY))
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids sorted
    seed: int = 0
    logprobs: bool = False  # the sampled token's log probability ...
    top_logprobs: int = 0  # ... and the top_logprobs most likely tokens'

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def num_logprobs(self) -> int | None:
        """None: no log probabilities; k: the sampled token's and the k most likely tokens'."""
        return self.top_logprobs if self.logprobs else None


class Ranged(NamedTuple):
    """A numeric parameter of Sampling, as the front ends read and check it."""

    name: str
    default: float
    limits: Limits


RANGED = tuple(
    Ranged(f.name, getattr(Sampling(), f.name), f.metadata["limits"])
    for f in fields(Sampling)
    if "limits" in f.metadata
)


@dataclass(frozen=True)
class Row:
    """Feed `token_ids` at positions [start, start + len) of a sequence whose KV-cache pages are
    `pages`, in position order (they cover every position up to start + len); when `sample`, pick
    the next token after them.

    `rng` is the sequence's random state, made once by the runner (`random_state`) and carried by
    the caller, so a seeded sequence draws the same numbers whatever shares its pass. `history`
    (the sequence's tokens so far, for the repetition penalty), `num_prompt` (how many of them are
    the prompt: the rest are generated, for the presence and frequency penalties) and `banned`
    (token ids that must not be picked now) matter only when sampling.
    """

    pages: Sequence[int]
    start: int
    token_ids: Sequence[int]
    sample: bool
    sampling: Sampling
    rng: object
    history: Sequence[int] = ()
    num_prompt: int = 0
    banned: Sequence[int] = ()
    is_prompt: bool = False  # prompt tokens (prefill attention), else the one last generated token
    # prompt_logprobs: targets[i] is the prompt token after token_ids[i], whose log probability
    # (with sampling.top_logprobs most likely tokens) the pass returns; may be shorter than token_ids
    targets: Sequence[int] = ()
    # a constraint's matcher (llguidance.LLMatcher, made by the engine): when sampling, only the
    # tokens its mask allows now can be picked
    matcher: object = None
    # tokens the row may pick besides those its matcher's mask allows (a reasoning's start marker,
    # which the engine keeps from the matcher)
    also_allowed: Sequence[int] = ()
    # speculative decoding: the last num_proposals of token_ids are proposals, not yet the
    # sequence's. The row samples after each of its last num_proposals + 1 tokens, in order, as
    # plain steps would (history grown by the tokens kept, one random draw each), and keeps going
    # while what it sampled equals the next proposal (Sampled.more)
    num_proposals: int = 0
    # the LoRA adapter the row runs with: its load id (ModelRunner.load_adapter), 0 for the base model
    adapter: int = 0
    # an embedding's row (it never samples): LAST returns the hidden state after the final norm of
    # its last token, MEAN the sum of its tokens' (Sampled.pooled); None: nothing pooled
    pool: Pooling | None = None


@dataclass(frozen=True)
class AdapterInfo:
    """A loaded LoRA adapter, as ModelInfo lists it: its rank and lora_alpha, the scale its
    low-rank product is multiplied by, and the projections it targets."""

    name: str
    path: str
    rank: int
    alpha: float
    scale: float
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log probability under the model's raw distribution (the log-softmax of its
    logits, before penalties, bias, temperature and truncation), its rank there (1: the most likely),
    and the most likely tokens with theirs, most likely first."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class Sampled(NamedTuple):
    """What a row that samples or scores gets back from a pass."""

    token: int | None  # None: the row only scored its targets
    logprob: TokenLogprob | None = None  # when its Sampling asked for logprobs
    targets: tuple[TokenLogprob, ...] = ()  # one per Row.targets
    # a row with proposals: the tokens sampled after `token`, with their log probabilities (or
    # None); each but the last equals its proposal, so len(more) proposals were accepted
    more: tuple[tuple[int, TokenLogprob | None], ...] = ()
    pooled: list[float] | None = None  # a pooling row's hidden state (Row.pool), float32 values


def prompt_row(
    token_ids: Sequence[int],
    pages: Sequence[int] | None = None,
    *,
    start: int = 0,
    page_size: int = 16,
    sample: bool = False,
    sampling: Sampling = Sampling(),
    rng: object = None,
    **fields: Any,
) -> Row:
    """A row of prompt tokens at positions [start, start + len), into `pages` (by default the first
    pages, enough for them at `page_size` positions a page), that samples nothing unless `sample`;
    `fields`: Row's others (targets, adapter, pool...)."""
    if pages is None:
        pages = list(range(-(-(start + len(token_ids)) // page_size)))
    return Row(pages, start, token_ids, sample, sampling, rng, is_prompt=True, **fields)
