"""truncate_input_tokens: a prompt too long for the context is cut, not refused, and the usage says
by how much; a chat keeps its system message and loses its oldest turns first."""

from __future__ import annotations

import grpc
import pytest

WORDS = " the sea rises and falls with the moon" * 200  # some 1,600 tokens: past the 1,024 context


def test_a_prompt_keeps_its_last_tokens(servers):
    with servers("continuous").client() as client:
        total = len(client.tokenize(WORDS).token_ids)
        with pytest.raises(grpc.RpcError) as err:
            client.generate(WORDS, max_new_tokens=4)
        cut = client.generate(WORDS, max_new_tokens=4, truncate_input_tokens=100)
        short = client.generate("Hi", max_new_tokens=2, truncate_input_tokens=100)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert cut.usage.prompt_tokens == 100 and cut.usage.truncated_tokens == total - 100
    assert len(cut.token_ids) == 4
    assert short.usage.truncated_tokens == 0


def test_a_chat_keeps_its_system_message_and_drops_the_oldest_turns(servers):
    system = {"role": "system", "content": "You answer in one word."}
    turns = []
    for i in range(6):
        turns += [
            {"role": "user", "content": f"Question {i}:" + " tell me more" * 20},
            {"role": "assistant", "content": f"Answer {i}."},
        ]
    chat = [system, *turns, {"role": "user", "content": "And now?"}]
    with servers("continuous").client() as client:
        full = len(client.tokenize(messages=chat).token_ids)
        keep = full - 60  # some turns must go
        reply = client.generate(messages=chat, max_new_tokens=2, truncate_input_tokens=keep)
        # what the server should have kept: the system message and the fewest oldest turns dropped
        expected = next(
            n
            for n in range(1, len(turns) + 1)
            if len(client.tokenize(messages=[system, *turns[n:], chat[-1]]).token_ids) <= keep
        )
        kept = len(client.tokenize(messages=[system, *turns[expected:], chat[-1]]).token_ids)
    assert reply.usage.prompt_tokens == kept <= keep
    assert reply.usage.truncated_tokens == full - kept
