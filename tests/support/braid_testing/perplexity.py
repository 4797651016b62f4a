"""Perplexity of a text under a model runner: for measuring a format's quality (--quantization,
--activations) in the tests and benchmarks, never for serving, so it lives beside them and not in
the runner. It calls the runner as the engine does: prompt rows whose targets (prompt_logprobs) are
the text's next tokens."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import prompt_row


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
        row = prompt_row(piece, pages, start=start, targets=ids[start + 1 : start + len(piece) + 1])
        (scored,) = runner.run([row])
        nll -= sum(t.logprob for t in scored.targets)
    return math.exp(nll / (len(ids) - 1))


def prompt_logits(runner: ModelRunner, token_ids: Sequence[int]) -> torch.Tensor:
    """The logits [len(token_ids), V] at every position of token_ids, in fp32: one prompt pass of the
    runner's decoder into the cache's first pages. On an idle runner (it writes them)."""
    ids = list(token_ids)
    batch = runner.pack([prompt_row(ids, page_size=runner.page_size)]).batch
    batch.logit_rows = torch.arange(len(ids))
    with torch.no_grad():
        return runner.decoder.forward(batch, runner.cache).float()


def logits_perplexity(logits: torch.Tensor, token_ids: Sequence[int]) -> float:
    """exp of the mean negative log-likelihood of token_ids[1:] under logits [len(token_ids), V]
    (prompt_logits'), each position's logits scoring the token after it. The log-softmax in fp32: on
    the fixed text's first 512 tokens the perplexity moves by 2e-5 of itself from float64's, the same
    for every model (their ratio to 1e-6), and it costs a third."""
    targets = torch.tensor(list(token_ids)[1:])[:, None]
    nll = -torch.log_softmax(logits[:-1].float(), -1).gather(1, targets).double().mean()
    return math.exp(nll.item())


def divergence(base: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(mean KL divergence, same-top-token rate) of logits [N, V] against base [N, V], position by
    position: what llama.cpp's `llama-perplexity --kl-divergence` reports of a quantized model against
    its base (KL(base || logits), in nats, the mean over the N positions; and the share of positions
    whose most likely token is the base's)."""
    # fp32: on the fixed text's first 512 positions int8 rows' mean KLD is 0.00348947 against float64's
    # 0.00348945 (the default's 0.00392006 against 0.00392005), at half float64's cost
    base_lp, lp = torch.log_softmax(base.float(), -1), torch.log_softmax(logits.float(), -1)
    kld = (base_lp.exp() * (base_lp - lp)).sum(-1)
    return kld.mean().item(), (base.argmax(-1) == logits.argmax(-1)).double().mean().item()


def nudge_(x: torch.Tensor, seed: int) -> None:
    """Every element of x one ulp up or down (at random, from seed), in place."""
    up = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    x.copy_(torch.nextafter(x, torch.where(up, float("inf"), float("-inf"))))


def nudged_logits(runner: ModelRunner, token_ids: Sequence[int], seed: int) -> torch.Tensor:
    """prompt_logits with the pass's embeddings each moved by one ulp (nudge_). int8 rows re-draw
    their rounding from any last-bit change (docs/benchmarks.md, "int8 rows' figure is one draw"):
    passes nudged so are the other draws that another build's bits, or a change to any float
    kernel, would give. (It replaces the decoder's private _embed for the pass: a seam of the tests
    and benchmarks/int8_spread.py, not of serving.)"""
    embed = runner.decoder._embed

    def nudged(input_ids: torch.Tensor) -> torch.Tensor:
        x = embed(input_ids).clone()  # never the embedding's own storage
        nudge_(x, seed)
        return x

    runner.decoder._embed = nudged
    try:
        return prompt_logits(runner, token_ids)
    finally:
        del runner.decoder._embed  # the bound method again
