"""n samples of one prompt in one stream: each reproducible alone, the prompt computed once, all
cancelled together."""

from __future__ import annotations

import uuid
from collections import defaultdict

import grpc
import pytest

from braid.v1 import generate_pb2 as pb
from conftest import MODES, wait_for

PROMPT = "Once upon a time, in a land far away, there lived a " * 4  # about 60 tokens


@pytest.mark.parametrize("mode", MODES)
def test_sample_i_is_the_request_alone_with_seed_plus_i(servers, mode):
    salt = uuid.uuid4().hex
    sampling = dict(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=100)
    with servers(mode).client() as client:
        before = client.server_status()
        generation = client.stream(PROMPT, n=4, cache_salt=salt, **sampling)
        messages = list(generation)
        after = client.server_status()
        alone = [client.generate(PROMPT, **{**sampling, "seed": 100 + i}).token_ids for i in range(4)]
    ids, finals = defaultdict(list), defaultdict(list)
    for m in messages:
        ids[m.index] += m.token_ids
        if m.finish_reason:
            finals[m.index].append(m)
    assert sorted(ids) == [0, 1, 2, 3] and all(len(finals[i]) == 1 for i in range(4))
    assert [ids[i] for i in range(4)] == alone
    assert [c.token_ids for c in generation.completions()] == alone  # the client splits them by index
    assert [finals[i][0].seed for i in range(4)] == [100, 101, 102, 103]
    assert messages[-1].finish_reason  # the stream ends with the last sample's final message
    prompt = finals[0][0].usage.prompt_tokens
    # computed once: samples 1-3 read its full pages from the cache, computing only the last one
    computed = after.prompt_tokens_computed - before.prompt_tokens_computed
    assert computed <= prompt + 3 * 16
    assert [finals[i][0].usage.cached_tokens for i in range(1, 4)] == [(prompt - 1) // 16 * 16] * 3


def test_cancelling_the_stream_cancels_every_sample(servers):
    with servers("continuous").client() as client:
        before = client.server_status().sessions_finished.cancelled
        generation = client.stream(PROMPT, n=3, max_new_tokens=900, ignore_eos=True, temperature=1.0)
        for message in generation:
            if message.token_ids:
                break
        generation.cancel()
        status = wait_for(lambda: (s := client.server_status()).sessions_active == 0 and s.sessions_queued == 0 and s)
    assert status.sessions_finished.cancelled - before == 3


def test_more_than_16_samples_is_invalid_argument(servers):
    with servers("continuous").client() as client, pytest.raises(grpc.RpcError) as err:
        list(client.stream("Hi", max_new_tokens=1, n=17))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "n:" in err.value.details()


def test_one_sample_has_no_index(servers):
    with servers("continuous").client() as client:
        messages = list(client.stream("Hi", max_new_tokens=2, n=1))
    assert all(m.index == 0 for m in messages) and messages[-1].finish_reason == pb.FINISH_REASON_MAX_TOKENS
