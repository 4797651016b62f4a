"""The sampler's edge cases: temperatures so small that dividing by them overflows, bans, seeds; typical_p
against transformers' TypicalLogitsWarper."""

from __future__ import annotations

import pytest
import torch

from braid.server.runner.rows import GREEDY_BELOW_TEMPERATURE, Row, Sampling
from braid.server.runner.sampler import random_state
from braid.server.runner.sampler import sample as sample_with_logprobs


def sample(logits, rows) -> list[int]:
    return [s.token for s in sample_with_logprobs(logits, rows)]


def _row(temperature: float, seed: int, **kw) -> Row:
    sampling = Sampling(temperature=temperature, seed=seed)
    return Row(pages=[0], start=0, token_ids=[1], sample=True, sampling=sampling, rng=random_state(sampling), **kw)


@pytest.mark.parametrize("temperature", [0.0, 1e-38, 1e-30, 1e-6, GREEDY_BELOW_TEMPERATURE / 2])
def test_a_temperature_near_zero_is_greedy(temperature):
    torch.manual_seed(0)
    logits = torch.randn(8, 49152) * 20
    expected = logits.argmax(dim=-1).tolist()
    rows = [_row(temperature, seed) for seed in range(8)]
    assert sample(logits.clone(), rows) == expected


def test_a_small_but_real_temperature_still_samples_validly():
    logits = torch.zeros(1, 1000)
    logits[0, 7] = 1.0
    assert sample(logits, [_row(GREEDY_BELOW_TEMPERATURE, 0)]) == [7]  # no NaN on the way


def test_banned_tokens_are_never_picked():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    assert sample(logits, [_row(0.0, 0, banned=(3,)), _row(1.0, 1, banned=(3, 4))]) != [3, 3]
    logits = torch.zeros(1, 10)
    logits[0, 3] = 5.0
    assert sample(logits, [_row(0.0, 0, banned=(3,))]) != [3]


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_pass():
    torch.manual_seed(1)
    logits = torch.randn(3, 500)
    alone = sample(logits[1:2].clone(), [_row(1.0, 42)])
    together = sample(logits.clone(), [_row(1.0, 7), _row(1.0, 42), _row(0.7, 9)])
    assert together[1] == alone[0]


def test_the_repetition_penalty_lowers_seen_tokens():
    logits = torch.zeros(1, 10)
    logits[0, 3], logits[0, 4] = 2.0, 1.9
    sampling = Sampling(repetition_penalty=1.5)
    row = Row(
        pages=[0], start=0, token_ids=[3], sample=True, sampling=sampling, rng=random_state(sampling), history=[3]
    )
    assert sample(logits, [row]) == [4]


def test_presence_frequency_and_bias_as_openai_defines_them():
    """logit - frequency * count - presence (over generated tokens only) + bias, by hand."""
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.5]])
    sampling = Sampling(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, -10.0), (0, 2.0)))
    # prompt [2, 3]; generated 3, 3, 1: token 3 twice, token 1 once; token 2 only in the prompt
    row = Row(
        pages=[0],
        start=0,
        token_ids=[1],
        sample=True,
        sampling=sampling,
        rng=random_state(sampling),
        history=[2, 3, 3, 3, 1],
        num_prompt=2,
    )
    from braid.server.runner.sampler import _penalise

    _penalise(logits[0], row)
    expected = [1.0 + 2.0, 2.0 - 0.25 - 0.5, 3.0, 4.0 - 0.5 - 0.5, 0.5 - 10.0]
    torch.testing.assert_close(logits[0], torch.tensor(expected))
    assert sample(torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.5]]), [row]) == [0]  # the bias moves greedy choices


def test_a_bias_of_100_forces_a_token_even_when_sampling():
    sampling = Sampling(temperature=1.0, seed=3, logit_bias=((7, 100.0),))
    row = Row(pages=[0], start=0, token_ids=[1], sample=True, sampling=sampling, rng=random_state(sampling))
    torch.manual_seed(0)
    assert sample(torch.randn(1, 50) * 5, [row]) == [7]


def test_logprobs_are_of_the_raw_distribution_whatever_the_sampling():
    """Before temperature, penalties, bias and truncation: a token forced by a bias of +100 still
    reports its raw log probability and rank; the top list is the raw top, most likely first."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    raw = logits.log_softmax(dim=-1)[0]
    sampling = Sampling(temperature=0.5, top_k=1, logit_bias=((2, 100.0),), logprobs=True, top_logprobs=2, seed=1)
    row = Row(pages=[0], start=0, token_ids=[1], sample=True, sampling=sampling, rng=random_state(sampling))
    [out] = sample_with_logprobs(logits.clone(), [row])
    assert out.token == 2 and out.logprob.rank == 3
    assert abs(out.logprob.logprob - raw[2].item()) < 1e-6
    assert [t for t, _ in out.logprob.top] == [1, 3]
    greedy = Row(pages=[0], start=0, token_ids=[1], sample=True, sampling=Sampling(logprobs=True), rng=None)
    [best] = sample_with_logprobs(logits.clone(), [greedy])
    assert best.token == 1 and best.logprob.rank == 1 and best.logprob.top == ()
    [plain] = sample_with_logprobs(logits.clone(), [_row(0.0, 0)])
    assert plain.logprob is None


def test_a_constraint_mask_limits_greedy_and_sampled_rows_but_not_their_logprobs():
    """Rows 1 and 2 are constrained to tokens 5..9; row 0 is not. Logprobs stay the raw ones."""
    torch.manual_seed(1)
    logits = torch.randn(3, 64) * 5
    logits[:, 0] = 50.0  # everyone's favourite, and not allowed to the constrained rows
    mask = torch.zeros(2, 64, dtype=torch.bool)
    mask[:, 5:10] = True
    rows = [_row(0.0, 0), _row(0.0, 0), _row(1.0, 3)]
    rows = [
        Row(**{**vars(r), "sampling": Sampling(temperature=r.sampling.temperature, seed=3, logprobs=True)})
        for r in rows
    ]
    raw = logits.log_softmax(dim=-1)
    out = sample_with_logprobs(logits.clone(), rows, allowed=([1, 2], mask))
    assert out[0].token == 0
    assert out[1].token == int(logits[1, 5:10].argmax()) + 5
    assert 5 <= out[2].token < 10
    assert out[1].logprob.logprob == pytest.approx(raw[1, out[1].token].item(), abs=1e-5)
    assert out[1].logprob.rank > 1  # ranked in the raw distribution, where token 0 leads


@pytest.mark.parametrize(
    "params",
    [
        dict(top_p=0.9),
        dict(top_k=40),
        dict(min_p=0.05),
        dict(top_p=0.95, top_k=300),
        dict(),
        dict(top_p=0.999),
        dict(typical_p=0.9),
        dict(top_k=40, typical_p=0.5),
        dict(top_p=0.9, typical_p=0.9),
    ],
)
def test_a_row_drawn_from_its_most_likely_tokens_gets_the_whole_sorted_rows_token(monkeypatch, params):
    """The sampler sorts only a row's CANDIDATES most likely tokens where its kept tokens (top-k,
    top-p, min-p) end among them, and the whole row where they do not (plain temperature, a wide
    top_p): the same token either way, for each seed, as sorting every row whole gives."""
    from braid.server.runner import sampler

    torch.manual_seed(4)
    # 8,192 tokens (a sort of 49,152 rows took most of the module's 15 s of CPU), as flat as needed
    logits = torch.randn(6, 8192) * 2
    logits[:3] *= 4.5  # sharper rows: their top 256 tokens hold most of the mass, as a trained model's do
    # both ways _draw goes: the sharp rows' kept tokens (top_p 0.999 and below) end among the
    # candidates, the flat rows' (top_p 0.9 and above) beyond them
    mass = (logits / 0.8).softmax(dim=-1).topk(sampler.CANDIDATES).values.sum(dim=-1)
    assert (mass[:3] > 0.999).all() and (mass[3:] < 0.9).all(), mass

    def draw(first_seed: int) -> list[int]:
        samplings = [Sampling(temperature=0.8, seed=first_seed + i, **params) for i in range(6)]
        return sample(
            logits.clone(),
            [Row(pages=[0], start=0, token_ids=[1], sample=True, sampling=s, rng=random_state(s)) for s in samplings],
        )

    for first_seed in range(0, 120, 6):
        fast = draw(first_seed)
        monkeypatch.setattr(sampler, "CANDIDATES", logits.shape[1])
        assert draw(first_seed) == fast
        monkeypatch.undo()


def _typical_kept(logits: torch.Tensor, **params) -> torch.Tensor:
    """The sampler's distribution for each row (temperature 1, then its cuts), over the vocabulary."""
    from braid.server.runner import sampler

    values, order = logits.sort(dim=-1, descending=True)
    cuts = sampler.Cuts.of_rows([Sampling(**params)] * len(logits), logits.shape[1], logits.device)
    probs, _ = sampler.kept(values.log_softmax(dim=-1), cuts)
    spread = torch.zeros_like(logits).scatter(1, order, probs)
    return spread / spread.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("mass", [0.05, 0.2, 0.5, 0.9, 0.95, 0.999])
@pytest.mark.parametrize("top_k", [0, 50])
def test_typical_p_keeps_what_transformers_typical_warper_keeps(mass, top_k):
    """On random logits, sharp and flat: the same tokens kept, with the same probabilities, as
    transformers' TypicalLogitsWarper (after its TopKLogitsWarper, where top_k is set)."""
    from transformers.generation.logits_process import TopKLogitsWarper, TypicalLogitsWarper

    torch.manual_seed(11)
    logits = torch.randn(24, 2000) * torch.linspace(0.3, 6.0, 24).unsqueeze(1)
    theirs = logits.clone()
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    theirs = TypicalLogitsWarper(mass)(None, theirs).softmax(dim=-1)
    mine = _typical_kept(logits, top_k=top_k, typical_p=mass)
    assert torch.equal(mine > 0, theirs > 0)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-7)


def test_a_tiny_typical_p_always_draws_the_most_typical_token():
    """With typical_p near 0 one token is kept, whatever the seed: transformers' pick, which is not
    the most likely token."""
    from transformers.generation.logits_process import TypicalLogitsWarper

    torch.manual_seed(12)
    logits = torch.randn(4, 500) * 2
    expected = TypicalLogitsWarper(1e-6)(None, logits.clone()).argmax(dim=-1).tolist()
    assert expected != logits.argmax(dim=-1).tolist()
    for seed in range(5):
        rows = []
        for i in range(4):
            sampling = Sampling(temperature=1.0, typical_p=1e-6, seed=seed * 4 + i)
            rows.append(
                Row(pages=[0], start=0, token_ids=[1], sample=True, sampling=sampling, rng=random_state(sampling))
            )
        assert sample(logits.clone(), rows) == expected


def test_typical_p_1_changes_nothing_and_other_rows_typical_p_does_not_reach_a_row():
    """typical_p=1 keeps every token; and a row's tokens are the same whether or not another row in
    its pass samples typically."""
    torch.manual_seed(13)
    logits = torch.randn(3, 800) * 2
    plain = _typical_kept(logits, typical_p=1.0)
    torch.testing.assert_close(plain, logits.softmax(dim=-1))

    def draw(typical_of_first: float) -> list[int]:
        samplings = [
            Sampling(temperature=0.9, seed=20 + i, typical_p=typical_of_first if i == 0 else 1.0) for i in range(3)
        ]
        return sample(
            logits.clone(),
            [Row(pages=[0], start=0, token_ids=[1], sample=True, sampling=s, rng=random_state(s)) for s in samplings],
        )

    assert draw(0.3)[1:] == draw(1.0)[1:]
