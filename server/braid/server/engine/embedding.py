"""An embedding session's vector: pooled as its input's chunks are computed, then cut and scaled.

The runner returns, per chunk, the hidden state after the final norm of the chunk's last token
(LAST, only for the chunk that ends the input) or the sum over its tokens (MEAN); this adds the
chunks up and, once the whole input is computed, makes the vector the request asked for: the mean,
its leading `dimensions` components (Matryoshka), then unit length (L2) where asked. Plain Python
over one vector per chunk: the engine never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from braid.server.engine.types import Pooling


@dataclass
class Embedding:
    """What an embedding session pools, and its sum so far."""

    pooling: Pooling
    normalize: bool = True
    dimensions: int = 0  # 0: every component
    total: list[float] = field(default_factory=list)  # the sum of the pooled hidden states so far
    count: int = 0  # positions summed

    def add(self, pooled: list[float], start: int, num_tokens: int) -> None:
        """A chunk's pooled state (LAST: only the chunk that ends the input has one); a chunk from
        position 0 starts the sum again (a preempted session recomputes its input)."""
        if self.pooling is Pooling.LAST:
            self.total, self.count = list(pooled), 1
        elif start == 0:
            self.total, self.count = list(pooled), num_tokens
        else:
            self.total = [a + b for a, b in zip(self.total, pooled)]
            self.count += num_tokens

    def pooled_by(self, end: int, num_prompt: int) -> Pooling | None:
        """What the row of a chunk ending at position `end` pools: every chunk's sum for MEAN, the
        last token of the chunk that ends the input for LAST; None for any other chunk."""
        if self.pooling is Pooling.MEAN or end == num_prompt:
            return self.pooling
        return None

    def vector(self) -> list[float]:
        return finish_vector(self.total, self.count, self.dimensions, self.normalize)


def finish_vector(total: list[float], count: int, dimensions: int, normalize: bool) -> list[float]:
    """The mean of `count` summed states, its first `dimensions` (0: all), at unit length when
    `normalize` (a zero vector stays zero)."""
    kept = total[:dimensions] if dimensions else total
    vector = [v / count for v in kept] if count > 1 else list(kept)
    if normalize:
        norm = math.sqrt(math.fsum(v * v for v in vector))
        if norm > 0:
            vector = [v / norm for v in vector]
    return vector
