"""Picks each row's next token from its logits, with that row's own parameters and random state."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import NamedTuple, Sequence

import torch

from braid.server.runner.rows import Row, Sampled, Sampling, TokenLogprob


def random_state(sampling: Sampling, skip: int = 0) -> torch.Generator:
    """A sequence's own generator, seeded once: what Row.rng carries; advanced past `skip` draws."""
    generator = torch.Generator().manual_seed(sampling.seed)
    if skip:
        torch.rand(skip, generator=generator)  # the same numbers as `skip` draws of one
    return generator


def sample(
    logits: torch.Tensor, rows: Sequence[Row], allowed: tuple[list[int], torch.Tensor] | None = None
) -> list[Sampled]:
    """logits: [R, V] float32, one row per sampled Row (modified in place). Returns R tokens, with
    their log probabilities for the rows that ask (of the raw logits, before anything below).
    allowed: the constrained rows' indices and [C, V] bool masks of the tokens each may pick
    (runner/masks.py), applied after penalties, bias and bans.

    Every sampled row draws exactly one uniform number from its own generator per token, so a
    seeded sequence gets the same tokens whichever other sequences share its batch.
    """
    wanted = [i for i, row in enumerate(rows) if row.sampling.num_logprobs is not None]
    raw = logits[wanted].log_softmax(dim=-1) if wanted else None  # [W, V], a copy
    for i, row in enumerate(rows):
        _penalise(logits[i], row)
    if allowed is not None:
        idx, mask = allowed
        logits[idx] = logits[idx].masked_fill(~mask.to(logits.device), float("-inf"))
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.sampling.is_greedy]
    if sampled:
        tokens[sampled] = _draw(logits[sampled], [rows[i] for i in sampled])
    out = [Sampled(t) for t in tokens.tolist()]
    if wanted:
        for i, logprob in zip(wanted, _logprobs(raw, tokens[wanted], [rows[i].sampling.num_logprobs for i in wanted])):
            out[i] = Sampled(out[i].token, logprob)
    return out


def verify(logits: torch.Tensor, row: Row, masks: torch.Tensor | None = None) -> Sampled:
    """A row with k proposals (Row.num_proposals): logits [k + 1, V], row j predicting the token
    after the j-th last of its tokens; masks: [k + 1, V] bool, its constraint's after each.

    Samples position by position exactly as k + 1 plain steps would: the history (penalties) grown
    by the tokens kept, one draw from the row's generator per token sampled, the constraint's mask
    as it stands after them. Stops at the first sample that differs from its proposal (or after the
    last proposal): that sample is the token the model would have produced there instead. So the
    tokens, and the generator's state after them, are those of plain decoding, greedy or seeded.
    """
    proposals = list(row.token_ids[len(row.token_ids) - row.num_proposals :])
    if masks is None and _plain_greedy(row.sampling):
        # Nothing a step would change depends on the tokens kept before it: every position's
        # argmax at once (one call instead of k + 1 samples, most of a verification's Python).
        if row.banned:
            logits[:, list(row.banned)] = float("-inf")
        tokens = logits.argmax(dim=-1).tolist()
        kept = next((j for j, p in enumerate(proposals) if tokens[j] != p), len(proposals))
        return Sampled(tokens[0], more=tuple((t, None) for t in tokens[1 : kept + 1]))
    history = list(row.history)
    picked: list[Sampled] = []
    for j in range(len(proposals) + 1):
        step = dataclasses.replace(row, history=history, num_proposals=0)
        allowed = ([0], masks[j : j + 1]) if masks is not None else None
        picked.append(sample(logits[j : j + 1], [step], allowed)[0])
        if j == len(proposals) or picked[-1].token != proposals[j]:
            break
        history.append(picked[-1].token)
    return Sampled(picked[0].token, picked[0].logprob, more=tuple((p.token, p.logprob) for p in picked[1:]))


def _plain_greedy(p: Sampling) -> bool:
    """Greedy, with nothing that depends on the history (penalties) and no log probabilities."""
    return (
        p.is_greedy
        and p.num_logprobs is None
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
        and not p.logit_bias
    )


def score(logits: torch.Tensor, targets: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits: [T, V] float32, where row i predicts targets[i]: each target's log probability,
    rank and the `top` most likely tokens (prompt_logprobs)."""
    chosen = torch.tensor(targets, dtype=torch.long, device=logits.device)
    return _logprobs(logits.log_softmax(dim=-1), chosen, [top] * len(targets))


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[TokenLogprob]:
    """raw: [W, V] log-softmax rows; tokens: [W] the sampled ones; tops: how many most likely
    tokens each row wants. Batched, with one copy to Python for all the rows."""
    chosen = raw.gather(1, tokens.unsqueeze(1))  # [W, 1]
    ranks = (raw > chosen).sum(dim=1) + 1
    most = max(tops)
    best = raw.topk(most) if most else None
    values = best.values.tolist() if best is not None else [[] for _ in tops]
    ids = best.indices.tolist() if best is not None else values
    return [
        TokenLogprob(logprob=lp, rank=rank, top=tuple(zip(ids[j][:k], values[j][:k])))
        for j, (lp, rank, k) in enumerate(zip(chosen.squeeze(1).tolist(), ranks.tolist(), tops))
    ]


def _penalise(logits: torch.Tensor, row: Row) -> None:
    """The row's penalties and bias, in place: repetition (over prompt and output, as transformers),
    presence and frequency (over the output, as OpenAI: logit - frequency * count - presence), the
    logit bias, then the banned tokens."""
    p = row.sampling
    device = logits.device
    if p.repetition_penalty != 1.0 and row.history:
        seen = torch.tensor(sorted(set(row.history)), dtype=torch.long, device=device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    generated = row.history[row.num_prompt :]
    if (p.presence_penalty or p.frequency_penalty) and generated:
        counts = Counter(generated)
        ids = torch.tensor(list(counts), dtype=torch.long, device=device)
        times = torch.tensor(list(counts.values()), dtype=logits.dtype, device=device)
        logits[ids] -= p.frequency_penalty * times + p.presence_penalty
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias)
        logits[list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=device)
    if row.banned:
        logits[list(row.banned)] = float("-inf")


# The most likely tokens _draw sorts first: a row whose kept tokens (top-k, top-p, min-p) all lie
# among them never sorts its whole vocabulary (49,152 tokens: most of a sampled step's time).
CANDIDATES = 256


class Cuts(NamedTuple):
    """Each row's truncation parameters, [R, 1] tensors (top_k: the vocabulary's size where off)."""

    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    typical_p: torch.Tensor

    @staticmethod
    def of_rows(params: Sequence[Sampling], vocab_size: int, device: torch.device) -> Cuts:
        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, device=device).unsqueeze(1)

        return Cuts(
            column([p.top_k or vocab_size for p in params]),
            column([p.top_p for p in params]),
            column([p.min_p for p in params]),
            column([p.typical_p for p in params]),
        )

    def of(self, rows: torch.Tensor) -> Cuts:
        """These rows' parameters (rows: their indices)."""
        return Cuts(*(t[rows] for t in self))


def _draw(logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p over the sorted distribution, then typical
    sampling over what they keep, then one draw per row. A row with a cut (top-k, top-p, min-p) is
    drawn from its CANDIDATES most likely tokens (topk) where its kept tokens end among them; the
    others from their whole vocabulary sorted; either way with the same numbers, so a row's token
    does not depend on which it took, nor on the other rows."""
    device = logits.device
    params = [row.sampling for row in rows]
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    cuts = Cuts.of_rows(params, logits.shape[1], device)
    u = torch.cat([torch.rand(1, generator=row.rng) for row in rows]).to(device).unsqueeze(1)

    scaled = logits / temps
    lse = scaled.logsumexp(dim=-1, keepdim=True)  # the probabilities' log normaliser, over the whole row
    tokens = torch.empty(len(rows), dtype=torch.long, device=device)
    inside = torch.zeros(len(rows), dtype=torch.bool, device=device)
    count = min(CANDIDATES, scaled.shape[1])
    # rows with a cut (top-k, top-p, min-p) try their candidates; the others keep every token (typical
    # sampling's tokens are not the most likely ones: it needs a cut before it to stay among them)
    cut = ((cuts.top_k < scaled.shape[1]) | (cuts.top_p < 1) | (cuts.min_p > 0))[:, 0].nonzero().squeeze(1)
    if count < scaled.shape[1] and len(cut):
        values, order = scaled[cut].topk(count, dim=-1)  # sorted, most likely first
        tokens[cut], inside[cut] = _pick(values, order, lse[cut], cuts.of(cut), u[cut])
    whole = (~inside).nonzero().squeeze(1)  # the rest: the whole row, sorted
    if len(whole):
        values, order = scaled[whole].sort(dim=-1, descending=True)
        tokens[whole] = _pick(values, order, lse[whole], cuts.of(whole), u[whole])[0]
    return tokens


def _pick(
    values: torch.Tensor, order: torch.Tensor, lse: torch.Tensor, cuts: Cuts, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """values [R, C]: each row's C most likely scaled logits, sorted (order: their token ids); lse
    [R, 1]: the log normaliser of the whole row; u [R, 1]: each row's uniform draw. Returns the
    tokens drawn, and per row whether its kept tokens end within the C (where C is not the whole
    vocabulary and they do not, that row's draw is not its distribution's: draw it again from all)."""
    probs, inside = kept(values - lse, cuts)
    cdf = probs.cumsum(dim=-1)
    choice = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=probs.shape[1] - 1)
    return order.gather(1, choice).squeeze(1), inside


def kept(logp: torch.Tensor, cuts: Cuts) -> tuple[torch.Tensor, torch.Tensor]:
    """logp [R, C]: log probabilities of each row's C most likely tokens, sorted (most likely
    first). Their probabilities with the dropped ones 0 (not renormalised), and per row whether
    top-k, top-p and min-p end within the C (typical sampling then keeps fewer)."""
    probs = logp.exp()
    rank = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    drop = (rank >= cuts.top_k) | (before > cuts.top_p) | (probs < cuts.min_p * probs[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    inside = drop[:, -1].clone()  # (typical sampling drops more below)
    typical = (cuts.typical_p < 1)[:, 0].nonzero().squeeze(1)
    if len(typical):
        drop[typical] |= _atypical(logp[typical].masked_fill(drop[typical], float("-inf")), cuts.typical_p[typical])
    return probs.masked_fill(drop, 0.0), inside


def _atypical(logp: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """logp [R, C]: log probabilities (-inf: dropped already); mass [R, 1]. The tokens locally
    typical sampling drops (Meister et al. 2022), as transformers' TypicalLogitsWarper does after
    top-k, top-p and min-p: over the kept tokens renormalised, of entropy H, take them in order of
    |-log p - H| (the nearest to the expected surprise first) until their mass reaches `mass`, and
    any tied with the last taken. Sums are cumulative, in order, so the C most likely tokens and the
    whole row (0 beyond them) give the same."""
    logq = logp - logp.exp().cumsum(dim=-1)[:, -1:].log()  # renormalised over the kept tokens
    q = logq.exp()
    entropy = -torch.where(q > 0, q * logq, 0.0).cumsum(dim=-1)[:, -1:]
    shifted = (-logq - entropy).abs()  # inf where dropped
    ordered, by_typicality = shifted.sort(dim=-1, stable=True)
    reached = q.gather(1, by_typicality).cumsum(dim=-1)
    last = (reached < mass).sum(dim=1, keepdim=True).clamp_(max=shifted.shape[1] - 1)
    return shifted > ordered.gather(1, last)
