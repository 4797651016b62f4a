"""Perplexity of a text under a model runner: for measuring a format's quality (--quantization,
--activations) in the tests and benchmarks, never for serving, so it lives beside them and not in
the runner. It calls the runner as the engine does: prompt rows whose targets (prompt_logprobs) are
the text's next tokens."""

from __future__ import annotations

import math
from typing import Sequence

from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import Row, Sampling


def perplexity(runner: ModelRunner, token_ids: Sequence[int], chunk: int = 512) -> float:
    """exp of the mean negative log-likelihood of token_ids[1:], each given all before it: the text
    prefilled into the cache's first pages in chunks, each chunk's rows scoring the token after them.
    On an idle runner (it writes the first pages)."""
    ids = list(token_ids)
    assert 1 < len(ids) <= min(runner.max_seq_len, runner.num_pages * runner.page_size)
    pages = list(range(-(-len(ids) // runner.page_size)))
    nll = 0.0
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : start + chunk]
        row = Row(
            pages=pages,
            start=start,
            token_ids=piece,
            sample=False,
            sampling=Sampling(),
            rng=None,
            is_prompt=True,
            targets=ids[start + 1 : start + len(piece) + 1],
        )
        (scored,) = runner.run([row])
        nll -= sum(t.logprob for t in scored.targets)
    return math.exp(nll / (len(ids) - 1))
