"""Log probabilities as a user reads them: one per token, of the model's raw distribution, equal to
transformers' log-softmax for the same prefix, aligned however the server merges messages."""

from __future__ import annotations

import grpc
import pytest

from conftest import MODES, SMALL_WINDOW, _reference_logits, wait_for


def _collect(generation) -> tuple[list, list[int], list]:
    """Every message, all token ids and all logprob entries of a stream."""
    messages = list(generation)
    ids = [t for m in messages for t in m.token_ids]
    logprobs = [lp for m in messages for lp in m.logprobs]
    return messages, ids, logprobs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_k": 40, "seed": 5}], ids=["greedy", "sampled"])
def test_logprobs_are_transformers_log_softmax(servers, tiny_dir, mode, sampling):
    with servers(mode).client() as client:
        prompt_ids = list(client.tokenize("The weather today is").token_ids)
        messages, ids, logprobs = _collect(
            client.stream(
                "The weather today is", max_new_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=5, **sampling
            )
        )
    assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
    reference = _reference_logits(tiny_dir, tuple(prompt_ids + ids[:-1]))[len(prompt_ids) - 1 :].log_softmax(-1)
    for step, (token, lp) in enumerate(zip(ids, logprobs)):
        expected = reference[step]
        assert lp.logprob == pytest.approx(expected[token].item(), abs=1e-3)
        # a near-tie (within fp32 rounding) may swap ranks, nothing more
        lowest, highest = (int((expected > expected[token] + d).sum()) + 1 for d in (1e-3, -1e-3))
        assert lowest <= lp.rank <= highest
        top_values, _ = expected.topk(5)
        assert [t.logprob for t in lp.top] == pytest.approx(top_values.tolist(), abs=1e-3)
        if not sampling:
            assert lp.rank == 1 and lp.top[0].token_id == token


def test_logprobs_stay_aligned_when_a_slow_reader_gets_merged_messages(servers):
    """A client that reads late gets several tokens in one message: each still has its entry. Its
    channel's receive window is 1 KiB and never grows, so the server's writes wait at once and the
    session is paused; what it generated meanwhile is merged. (A fixed sleep with grpc's default
    window did not always build a backlog: the window can take the whole stream.)"""
    server = servers("continuous")
    with server.client(options=SMALL_WINDOW) as client, server.client() as watcher:
        generation = client.stream("Once upon a time", max_new_tokens=900, ignore_eos=True, top_logprobs=20)
        wait_for(lambda: watcher.server_status(timeout=10).sessions_paused == 1, timeout=60)
        messages, ids, logprobs = _collect(generation)
    assert len(ids) == 900 and len(logprobs) == 900
    assert any(len(m.token_ids) > 1 for m in messages)
    assert all(len(m.logprobs) == len(m.token_ids) for m in messages)


def test_without_logprobs_there_are_none_and_the_eos_token_has_its_entry(servers):
    with servers("continuous").client() as client:
        _, plain_ids, plain = _collect(client.stream("Hello", max_new_tokens=4, ignore_eos=True))
        # 2 is the tiny model's end-of-sequence token: forced, it ends the stream, sent as no text
        messages, ids, logprobs = _collect(
            client.stream("Hello", max_new_tokens=3, logprobs=True, logit_bias={2: 100.0})
        )
    assert len(plain_ids) == 4 and plain == []
    assert ids == [2] and "".join(m.text for m in messages) == "" and len(logprobs) == 1


@pytest.mark.parametrize("fields", [{"top_logprobs": 21}])
def test_top_logprobs_past_20_is_invalid_argument(servers, fields):
    with servers("continuous").client() as client, pytest.raises(grpc.RpcError) as err:
        client.generate("Hi", max_new_tokens=1, **fields)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in err.value.details()


@pytest.mark.parametrize("mode", MODES)
def test_prompt_logprobs_score_every_prompt_token_in_the_first_message(servers, tiny_dir, mode):
    """A prompt longer than one prefill chunk, sent twice with one cache_salt: both times the first
    message carries the prompt's tokens and, for each after the first, transformers' log-softmax of
    it given those before (the second call computes its prompt again rather than read the cache)."""
    prompt = " ".join(f"word{i % 37}" for i in range(260))
    with servers(mode).client() as client:
        prompt_ids = list(client.tokenize(prompt).token_ids)
        assert len(prompt_ids) > 512  # more than one --prefill-chunk
        runs = [
            list(
                client.stream(
                    prompt, max_new_tokens=3, ignore_eos=True, prompt_logprobs=True, top_logprobs=2, cache_salt="same"
                )
            )
            for _ in range(2)
        ]
    reference = _reference_logits(tiny_dir, tuple(prompt_ids)).log_softmax(-1)
    for messages in runs:
        first, rest = messages[0], messages[1:]
        assert list(first.prompt_token_ids) == prompt_ids and len(first.prompt_logprobs) == len(prompt_ids) - 1
        assert not any(m.prompt_logprobs or m.prompt_token_ids for m in rest)
        for i, lp in enumerate(first.prompt_logprobs):
            assert lp.logprob == pytest.approx(reference[i, prompt_ids[i + 1]].item(), abs=1e-3)
            assert len(lp.top) == 2 and lp.top[0].logprob >= lp.logprob - 1e-3
        assert sum(len(m.logprobs) for m in messages) == 3  # top_logprobs implies logprobs


def test_prompt_logprobs_with_n_come_once_on_sample_0(servers):
    with servers("continuous").client() as client:
        messages = list(
            client.stream("The weather today is", max_new_tokens=2, ignore_eos=True, n=3, prompt_logprobs=True, seed=1)
        )
    carrying = [m for m in messages if m.prompt_logprobs]
    assert len(carrying) == 1 and carrying[0].index == 0
    assert len(carrying[0].prompt_logprobs) == len(carrying[0].prompt_token_ids) - 1
