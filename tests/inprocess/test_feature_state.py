"""Per-feature state freed with its session, over a real model runner (tests/in_process.py): the
constraints' llguidance matchers, the reasonings, the speculator's, the scheduler's paused
sessions, kept by session id (engine/session.py) and given back however a session ends. The tiny
model with a small KV cache, so sessions are preempted; one is cancelled while paused, one while
running. The Harness checks after every step that no component keeps state for a session that has
ended (EngineCore.leftovers); tests/unit/test_session_state.py has each ending on its own."""

from __future__ import annotations

from braid.server.engine.grammars import Grammars
from braid.server.engine.reasoning import Markers
from braid.server.engine.tokenizer import Tokenizer
from braid.server.engine.types import Constraint, FinishReason, Message
from unit.engine_fakes import Harness

PAGE_TOKENS = 16
TOKEN_BYTES = 256  # the tiny model's keys and values a token in its default cache (tests/inprocess/test_paging.py)


def test_every_components_state_is_freed_when_its_session_ends(tiny_dir, in_process):
    model = in_process(tiny_dir, max_seq_len=256, kv_cache_memory=f"{20 * PAGE_TOKENS * TOKEN_BYTES}B")
    hf = model.tokenizer.hf_tokenizer
    tokenizer = Tokenizer(hf, model.tokenizer.eos_token_ids)  # a reasoning model's, with <think> markers
    encode = lambda text: tuple(hf.encode(text, add_special_tokens=False))  # noqa: E731
    tokenizer.reasoning_markers = Markers("<think>", "</think>", encode("<think>"), encode("</think>"))
    grammars = Grammars(hf, model.tokenizer.eos_token_ids, model.runner.vocab_size, compile_timeout_s=None)
    lowercase = Constraint("regex", "[a-z ]*", "constraint.regex")
    with Harness(model.runner, tokenizer=tokenizer, mode="continuous", speculative="ngram") as h:
        handles = []
        for i in range(4):
            chat = [Message("user", f"Question {i}: how far is the horizon from a mast {i} meters tall?")]
            handles += h.submit(
                "", messages=chat, matcher=grammars.matcher(lowercase), max_new_tokens=150, ignore_eos=True
            )
        paused, cancelled = handles[2], handles[3]
        held: set[str] = set()
        for step in range(10_000):
            if not h.core.sessions:
                break
            if step == 20:
                paused.is_backlogged = lambda: True  # its client stops reading: it sits out the passes
            if step == 30:
                assert h.core.scheduler.paused == {paused.session_id}
                h.abort(paused, FinishReason.CANCELLED)
                h.abort(cancelled, FinishReason.CANCELLED)
            h.step()
            held |= {name for name, ids in h.core.kept().items() if ids}
        assert not h.core.sessions and h.books.snapshot().preemptions > 0
        assert held >= {"constraints", "reasonings", "speculator", "paused"}
        assert h.core.kept() == {
            name: set() for name in ("constraints", "reasonings", "speculator", "output", "paused")
        }
        assert h.core.pages.num_used == 0
        assert [h.finished(x).reason for x in handles[2:]] == [FinishReason.CANCELLED] * 2
        assert all(h.finished(x).reason in (FinishReason.MAX_TOKENS, FinishReason.CONSTRAINT) for x in handles[:2])
    grammars.close()
