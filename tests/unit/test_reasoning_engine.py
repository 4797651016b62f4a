"""A reasoning model's output split from its answer (engine/reasoning.py): the markers found from a
template or vocabulary, the text split on fixed texts (markers cut across pieces included), and the
engine core's side over the scripted runner: reasoning and answer apart on each Delta, the budget
closing the reasoning at exactly its count (with and without speculation), a constraint holding
only after the end marker."""

from __future__ import annotations

import pytest

from braid.server.engine.reasoning import Markers, Reasoning, Splitter, find_markers, opens_in_prompt
from braid.server.engine.types import Delta, FinishReason, Message
from engine_fakes import EOS, Harness, NumberTokenizer, ScriptedRunner

THINK = Markers("<think>", "</think>", (7,), (8,))
START, END = 900, 901  # the scripted model's markers: text " 900" and " 901"


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_markers_come_from_the_template_or_the_vocabulary_not_the_name():
    qwen3 = "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    assert find_markers(qwen3, [], _encode) == Markers(
        "<think>", "</think>", tuple(_encode("<think>")), tuple(_encode("</think>"))
    )
    found = find_markers(None, ["<|im_start|>", "<think>", "</think>"], _encode)
    assert found is not None and found.end == "</think>"
    named = [{"name": "default", "template": "{{ '<seed:think>' }}...{{ '</seed:think>' }}"}]
    assert find_markers(named, [], _encode).start == "<seed:think>"
    # a model without them (SmolLM2's template; a lone start token) is unaffected
    assert find_markers("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", ["<think>"], _encode) is None


def test_the_output_starts_inside_the_reasoning_where_the_prompt_opened_it():
    assert opens_in_prompt(THINK, [1, 2, 7, 10])  # "<think>\n"
    assert not opens_in_prompt(THINK, [1, 2, 7, 10, 10, 8, 10])  # enable_thinking false: closed
    assert not opens_in_prompt(THINK, [7, 3, 3, 3, 3, 3, 3])  # a marker far back in the chat
    assert not opens_in_prompt(THINK, [1, 2, 3])


@pytest.mark.parametrize(
    "pieces",
    [
        ["<think>\nLet me see.</think>\n\nIt is 4."],
        ["<th", "ink>", "\nLet me", " see.</", "thi", "nk>\n", "\nIt is 4."],
        list("<think>\nLet me see.</think>\n\nIt is 4."),
    ],
)
def test_the_text_splits_wherever_its_pieces_cut_the_markers(pieces):
    splitter = Splitter(THINK, reasoning=False)
    parts = [splitter.feed(p) for p in pieces] + [splitter.feed("", final=True)]
    assert "".join(r for r, _ in parts) == "Let me see."
    assert "".join(a for _, a in parts) == "It is 4."


def test_text_that_only_looks_like_a_marker_is_released():
    splitter = Splitter(THINK, reasoning=False)
    assert splitter.feed("<th") == ("", "")  # held: it may be the start marker
    assert splitter.feed("e answer") == ("", "<the answer")
    opened = Splitter(THINK, reasoning=True)  # the prompt opened it
    assert opened.feed("\nhmm </") == ("hmm ", "")
    assert opened.feed("b> ok") == ("</b> ok", "")
    assert opened.feed("</", final=True) == ("</", "")  # a reasoning cut short keeps its tail


def test_no_reasoning_when_the_output_does_not_open_it():
    splitter = Splitter(THINK, reasoning=False)
    assert splitter.feed("  Hello") == ("", "  Hello")
    reasoning = Reasoning(THINK, [1, 2])
    reasoning.add(5)
    assert reasoning.num_tokens == 0 and reasoning.applies_constraint


class ReasoningTokenizer(NumberTokenizer):
    reasoning_markers = Markers(str(START), str(END), (START,), (END,))


def _script(*tokens_after: tuple[int, int]):
    """A model that writes `after[last]` after each token in the table, else 50."""
    table = dict(tokens_after)

    def next_token(row) -> int:
        return table.get(row.token_ids[-1], 50)

    return next_token


def chat(text: str) -> list[Message]:
    """A chat of one user message (NumberTokenizer's template: its content's ids)."""
    return [Message("user", text)]


def _parts(h: Harness, handle) -> tuple[str, str]:
    deltas = [e for e in h.events[handle.session_id] if isinstance(e, Delta)]
    return "".join(d.reasoning for d in deltas), "".join(d.text for d in deltas)


def test_the_core_sends_the_reasoning_apart_and_counts_it():
    script = _script((1, START), (START, 10), (10, 11), (11, END), (END, 20), (20, EOS))
    with Harness(ScriptedRunner(next_token=script), tokenizer=ReasoningTokenizer()) as h:
        (handle,) = h.submit("", messages=chat("1"), max_new_tokens=20)
        h.run()
        assert h.tokens(handle) == [START, 10, 11, END, 20, EOS]
        assert _parts(h, handle) == ("10 11 ", "20")
        finished = h.finished(handle)
        assert finished.reason is FinishReason.EOS and finished.reasoning_tokens == 4


def test_a_model_without_markers_sends_no_reasoning():
    script = _script((1, START), (START, 10), (10, END), (END, EOS))
    with Harness(ScriptedRunner(next_token=script)) as h:
        (handle,) = h.submit("", messages=chat("1"), max_new_tokens=20)
        h.run()
        assert _parts(h, handle) == ("", f" {START} 10 {END}")
        assert h.finished(handle).reasoning_tokens == 0


@pytest.mark.parametrize("speculation", [{}, {"speculative": "ngram", "speculative_tokens": 4}])
@pytest.mark.parametrize("budget", [0, 1, 5])
def test_the_budget_closes_the_reasoning_at_exactly_its_count(speculation, budget):
    """The prompt opens the reasoning; the model would reason (50 50 ...) to max_new_tokens. At the
    budget braid writes the end marker itself, and the answer follows; with speculation the n-gram
    proposals of more 50s are cut there (a forced token is no proposal)."""
    script = _script((END, 60), (60, 61), (61, EOS))
    with Harness(ScriptedRunner(next_token=script), tokenizer=ReasoningTokenizer(), **speculation) as h:
        (handle,) = h.submit("", messages=chat(f"1 {START}"), max_new_tokens=40, max_reasoning_tokens=budget)
        h.run()
        assert h.tokens(handle) == [50] * budget + [END, 60, 61, EOS]
        assert _parts(h, handle) == ("50 " * budget, "60 61")
        assert h.finished(handle).reasoning_tokens == budget + 1


def test_a_plain_prompts_output_is_the_models_text_as_it_is():
    script = _script((1, START), (START, 10), (10, END), (END, EOS))
    with Harness(ScriptedRunner(next_token=script), tokenizer=ReasoningTokenizer()) as h:
        (handle,) = h.submit("1", max_new_tokens=20, max_reasoning_tokens=0)
        h.run()
        assert _parts(h, handle) == ("", f" {START} 10 {END}")


def test_no_budget_lets_the_reasoning_run():
    with Harness(ScriptedRunner(next_token=_script()), tokenizer=ReasoningTokenizer()) as h:
        (handle,) = h.submit("", messages=chat(f"1 {START}"), max_new_tokens=12)
        h.run()
        assert h.tokens(handle) == [50] * 12
        assert _parts(h, handle) == ("50 " * 11 + "50", "")
        assert h.finished(handle).reasoning_tokens == 12


class RecordingMatcher:
    """A constraint's matcher that allows anything and records what it is given."""

    def __init__(self) -> None:
        self.consumed: list[int] = []

    def consume_token(self, token: int) -> bool:
        self.consumed.append(token)
        return True

    def is_accepting(self) -> bool:
        return True

    def is_stopped(self) -> bool:
        return False

    def validate_tokens(self, tokens) -> int:
        return len(tokens)

    def deep_copy(self) -> RecordingMatcher:
        return self


def test_a_constraint_holds_the_answer_only():
    from braid.server.engine.types import Constraint, GenerationRequest, SamplingParams

    script = _script((START, 10), (10, END), (END, 20), (20, 21), (21, EOS))
    with Harness(ScriptedRunner(next_token=script), tokenizer=ReasoningTokenizer()) as h:
        request = GenerationRequest(
            prompt=None,
            messages=tuple(chat(f"1 {START}")),
            params=SamplingParams(max_new_tokens=20),
            request_id="r",
            constraint=Constraint("json_object", "", "constraint.json_object"),
        )
        matcher = RecordingMatcher()
        (handle,) = h.admission.submit(h.admission.admit(None, request.messages), request, h.loop, matcher)
        h.events[handle.session_id] = []
        h.run()
        assert h.tokens(handle) == [10, END, 20, 21, EOS]
        assert matcher.consumed == [20, 21]  # EOS ends it where the constraint accepts
        rows = [row for rows in h.runner.passes for row in rows]
        assert [row.matcher is not None for row in rows] == [False, False, True, True, True]
        assert h.finished(handle).reason is FinishReason.CONSTRAINT


class AllowingMatcher(RecordingMatcher):
    """A constraint's matcher that allows only `allowed` (anything may end it) and records what it
    is given, a token it refuses included."""

    def __init__(self, allowed) -> None:
        super().__init__()
        self.allowed = set(allowed)

    def consume_token(self, token: int) -> bool:
        self.consumed.append(token)
        return token in self.allowed

    def validate_tokens(self, tokens) -> int:
        return next((i for i, t in enumerate(tokens) if t not in self.allowed), len(tokens))

    def deep_copy(self) -> AllowingMatcher:  # resume_token_ids' check walks a copy
        return AllowingMatcher(self.allowed)

    def get_error(self) -> str:
        return "a token was refused"


def _sampling_rows(h: Harness) -> list:
    return [row for rows in h.runner.passes for row in rows if row.sample]


@pytest.mark.parametrize("speculation", [{}, {"speculative": "ngram", "speculative_tokens": 4}])
def test_a_constraint_waits_for_a_reasoning_the_model_opens(speculation):
    """The template leaves the output at its opening (no start marker in the prompt). The first
    token may be the start marker besides what the constraint allows: the model takes it, reasons
    in tokens the constraint refuses (50 51), closes, and the answer is held from there."""
    script = _script((1, START), (START, 50), (50, 51), (51, END), (END, 20), (20, 21), (21, EOS))
    with Harness(ScriptedRunner(next_token=script), tokenizer=ReasoningTokenizer(), **speculation) as h:
        matcher = AllowingMatcher({20, 21})
        (handle,) = h.submit("", messages=chat("1"), max_new_tokens=20, matcher=matcher)
        h.run()
        assert h.tokens(handle) == [START, 50, 51, END, 20, 21, EOS]
        assert _parts(h, handle) == ("50 51 ", "20 21")
        assert matcher.consumed == [20, 21]  # never the marker, nor the reasoning
        finished = h.finished(handle)
        assert finished.reason is FinishReason.CONSTRAINT and finished.reasoning_tokens == 4
        rows = _sampling_rows(h)
        # the first row's mask: the constraint's, and the start marker's first token besides
        assert rows[0].matcher is matcher and tuple(rows[0].also_allowed) == (START,)
        assert all(not row.also_allowed for row in rows[1:])
        if not speculation:  # the constraint waits while the model reasons, and holds the answer
            assert [row.matcher is not None for row in rows] == [True, False, False, False, True, True, True]


def test_an_answer_that_starts_at_once_is_held_from_its_first_token():
    script = _script((1, 20), (20, 21), (21, EOS))
    with Harness(ScriptedRunner(next_token=script), tokenizer=ReasoningTokenizer()) as h:
        matcher = AllowingMatcher({20, 21})
        (handle,) = h.submit("", messages=chat("1"), max_new_tokens=20, matcher=matcher)
        h.run()
        assert matcher.consumed == [20, 21] and _parts(h, handle) == ("", " 20 21")
        assert h.finished(handle).reason is FinishReason.CONSTRAINT and h.finished(handle).reasoning_tokens == 0
        rows = _sampling_rows(h)
        assert tuple(rows[0].also_allowed) == (START,) and all(row.matcher is matcher for row in rows)
    with Harness(ScriptedRunner(next_token=_script((1, 50))), tokenizer=ReasoningTokenizer()) as h:
        matcher = AllowingMatcher({20, 21})
        (handle,) = h.submit("", messages=chat("1"), max_new_tokens=20, matcher=matcher)
        h.run()
        assert matcher.consumed == [50]  # not the marker: the constraint's, which refuses it
        assert h.finished(handle).reason is FinishReason.INVALID_REQUEST


MARKER = (START, 902)  # a start marker of two tokens: text "900 902"


class TwoTokenMarkerTokenizer(NumberTokenizer):
    reasoning_markers = Markers(f"{START} 902", str(END), MARKER, (END,))


def test_a_start_marker_of_several_tokens_has_its_rest_forced():
    """The model takes the marker's first token, then would stray (50): braid writes the rest."""
    script = _script((1, START), (START, 50), (902, 10), (10, END), (END, 20), (20, EOS))
    with Harness(ScriptedRunner(next_token=script), tokenizer=TwoTokenMarkerTokenizer()) as h:
        matcher = AllowingMatcher({20})
        (handle,) = h.submit("", messages=chat("1"), max_new_tokens=20, matcher=matcher)
        h.run()
        assert h.tokens(handle) == [START, 902, 10, END, 20, EOS]
        assert _parts(h, handle) == ("10 ", "20") and matcher.consumed == [20]
        assert h.finished(handle).reason is FinishReason.CONSTRAINT and h.finished(handle).reasoning_tokens == 4
        rows = _sampling_rows(h)
        assert tuple(rows[0].also_allowed) == (START,) and rows[1].matcher is None  # the rest: forced


def test_a_proposal_that_opens_a_reasoning_is_cut():
    """The speculator's proposals at the opening stop before a start marker (a guard: only a
    decoding session proposes, and at the opening a session has decoded nothing)."""
    from types import SimpleNamespace

    from braid.server.engine.constraints import Constraints
    from braid.server.engine.reasoning import Reasonings

    reasonings = Reasonings()
    constraints = Constraints(reasonings)
    session = SimpleNamespace(id=1)
    reasonings.add(1, Reasoning(ReasoningTokenizer.reasoning_markers, [1], constrained=True))
    constraints.add(1, AllowingMatcher({START, 20, 21}), "constraint.json_object")
    assert constraints.proposals(session, [START, 20]) == ()
    assert constraints.proposals(session, [20, 21, 5, 20]) == (20, 21)


@pytest.mark.parametrize("opened_by", ["the prompt", "the model"])
def test_a_resumed_constrained_output_walks_past_its_reasoning(opened_by):
    """resume_token_ids that hold a reasoning are accepted and replayed: the constraint takes the
    answer's tokens only, whether the prompt opened the reasoning or the model did."""
    script = _script((20, 21), (21, EOS))
    prompt, delivered = (f"1 {START}", [50, END, 20]) if opened_by == "the prompt" else ("1", [START, 50, END, 20])
    with Harness(ScriptedRunner(next_token=script), tokenizer=ReasoningTokenizer()) as h:
        matcher = AllowingMatcher({20, 21})
        (handle,) = h.submit("", messages=chat(prompt), max_new_tokens=20, matcher=matcher, resume=delivered)
        h.run()
        assert h.tokens(handle) == [21, EOS] and matcher.consumed == [20, 21]
        assert h.finished(handle).reason is FinishReason.CONSTRAINT
        assert h.finished(handle).reasoning_tokens == len(delivered) - 1


def test_resumed_tokens_must_be_what_the_constraint_allows_past_the_reasoning():
    from braid.server.engine.types import InvalidArgument

    with Harness(ScriptedRunner(next_token=_script()), tokenizer=ReasoningTokenizer()) as h:
        with pytest.raises(InvalidArgument, match="token 3 \\(50\\)") as refused:
            h.submit(
                "", messages=chat("1"), max_new_tokens=20, matcher=AllowingMatcher({20}), resume=[START, 50, END, 50]
            )
        assert refused.value.field == "resume_token_ids"
    with Harness(ScriptedRunner(next_token=_script()), tokenizer=TwoTokenMarkerTokenizer()) as h:
        with pytest.raises(InvalidArgument, match="rest of the reasoning's start marker"):  # braid writes 902 there
            h.submit("", messages=chat("1"), max_new_tokens=20, matcher=AllowingMatcher({20, 50}), resume=[START, 50])


def test_a_constraint_holds_from_the_first_token_where_the_prompt_closed_the_reasoning():
    """enable_thinking false: the template writes an empty reasoning ("<think></think>"), so a
    constrained output may not open another; the start marker is the constraint's to refuse."""
    script = _script((10, START), (START, 20), (20, EOS))
    with Harness(ScriptedRunner(next_token=script), tokenizer=ReasoningTokenizer()) as h:
        matcher = AllowingMatcher({20})
        (handle,) = h.submit("", messages=chat(f"1 {START} 10 {END} 10"), max_new_tokens=20, matcher=matcher)
        h.run()
        assert matcher.consumed == [START] and h.finished(handle).reason is FinishReason.INVALID_REQUEST
        assert not _sampling_rows(h)[0].also_allowed
