"""The benchmark's workloads: deterministic prompts of exact token lengths, and how they arrive.

Every prompt is built from a fixed seed out of whole-word tokens of the model's own vocabulary, then
checked with the tokenizer (the way braid's server encodes a prompt) to have exactly the length asked
for. Every system gets the same prompts and the same token counts: greedy, `ignore_eos`,
`max_new_tokens` new tokens each.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

SEED = 20240603
NEW_TOKENS = 64
SWEEP = (1, 2, 4, 8, 16, 32)
_WORD = re.compile(r"Ġ[a-z]{3,12}")  # " word": one token after a space in a byte-level BPE vocabulary


@dataclass
class Request:
    prompt: str
    prompt_ids: list[int]  # what the server's tokenizer makes of `prompt`
    max_new_tokens: int = NEW_TOKENS
    cache_salt: str = ""  # braid shares cached prefixes only within one salt ("": the server's default)


@dataclass
class Workload:
    """`requests` run either in a closed loop of `concurrency` streams (each starts its next request
    when its last one ends; concurrency == len(requests) is "all at once"), or, with
    `arrival_offsets`, each at its own time (seconds after the start) whatever is still running."""

    name: str
    title: str
    requests: list[Request]
    concurrency: int
    arrival_offsets: list[float] | None = None
    repeats: int = 1
    same_as: str | None = None  # a workload with the very same requests and concurrency

    @property
    def num_requests(self) -> int:
        return len(self.requests)


class PromptMaker:
    """Prompts of exact token lengths, the same for a given seed and tokenizer."""

    def __init__(self, tokenizer, seed: int = SEED) -> None:
        self._tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self._words = [token[1:] for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if _WORD.fullmatch(token)]
        self._rng = random.Random(seed)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True))

    def prompt(self, num_tokens: int) -> Request:
        words = [self._rng.choice(self._words) for _ in range(num_tokens)]
        words[0] = words[0].capitalize()
        text = " ".join(words)
        # A word can split into two tokens at the start of the text; drop words until it fits.
        while len(ids := self.encode(text)) > num_tokens:
            text = text.rsplit(" ", 1)[0]
        while len(ids) < num_tokens:
            text += " " + self._rng.choice(self._words)
            ids = self.encode(text)
        if len(ids) != num_tokens:
            return self.prompt(num_tokens)  # overshot by a two-token word: draw again
        return Request(text, ids)

    def batch(self, count: int, low: int, high: int) -> list[Request]:
        """`count` prompts with lengths drawn uniformly from [low, high]."""
        return [self.prompt(self._rng.randint(low, high)) for _ in range(count)]

    def poisson_offsets(self, count: int, rate_per_s: float) -> list[float]:
        offsets, t = [], 0.0
        for _ in range(count):
            offsets.append(t)
            t += self._rng.expovariate(rate_per_s)
        return offsets


def build(tokenizer, *, quick: bool = False, poisson_rate: float = 2.0, repeats: int = 3) -> dict[str, Workload]:
    """Every workload by name, in the order they run. `quick` shrinks the slow ones."""
    maker = PromptMaker(tokenizer)
    count = 8 if quick else 16
    single = Workload("single", "single stream, ~40-token prompt", [maker.prompt(40)], 1, repeats=repeats)
    targets = maker.batch(count, 30, 60)
    mixed = maker.batch(count, 20, 300)
    poisson_requests = maker.batch(count, 30, 60)
    workloads = [
        single,
        Workload("targets", f"{count} at once, prompts 30-60 tokens", targets, count, repeats=repeats),
        Workload("mixed", f"{count} at once, prompts 20-300 tokens", mixed, count, repeats=1 if quick else 2),
        Workload(
            "poisson",
            f"{count} Poisson arrivals at {poisson_rate:g}/s, prompts 30-60 tokens",
            poisson_requests,
            count,
            maker.poisson_offsets(count, poisson_rate),
        ),
    ]
    sweep_pool = targets + maker.batch(max(SWEEP) - count, 30, 60)
    for concurrency in (1, 4, 16) if quick else SWEEP:
        # Closed loop: `concurrency` streams, at least 4 requests so that low levels see a few. At
        # `count` streams this is the targets workload itself, which is not run twice.
        num = max(concurrency, 4)
        workloads.append(
            Workload(
                f"sweep-{concurrency}",
                f"closed loop, {concurrency} streams",
                sweep_pool[:num],
                concurrency,
                same_as="targets" if concurrency == count else None,
            )
        )
    return {w.name: w for w in workloads}
