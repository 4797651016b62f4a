"""A reasoning model's output split into its reasoning and its answer, once for every front end.

Reasoning models (Qwen3, the DeepSeek-R1 distills) write `<think>…</think>` before the answer. The
markers come from the model, not from its name: a pair is the model's when its chat template writes
the end marker, or its tokenizer has both as tokens of their own (`find_markers`). A model without
them gets no `Reasoning` at all, and its output is never touched.

A session's `Reasoning` follows its tokens (the phase, the reasoning's token count, the budget at
which braid closes the reasoning by forcing the end marker's tokens, as llama.cpp's
--reasoning-budget does; whether a constraint applies yet) and splits its text (`Splitter`, which
holds back a tail that may be a marker cut across tokens).

A constraint (a JSON schema, a forced tool call) holds the answer, not the reasoning before it.
Where the prompt opened the reasoning, it waits for the end marker. Where the output opens
(Qwen3's own template with thinking on, the R1 distills), the first token may be what the
constraint allows or the start marker's first token (`opening_tokens`): the marker opens a
reasoning of the model's own (the rest of a marker of several tokens forced), and the constraint
waits for its end; any other token is the answer's, held from there. The start marker's first
token is the reasoning's even where the constraint would allow it too. Where the prompt closed the
reasoning (enable_thinking false), a constrained output is the answer from its first token.

`Reasonings` keeps each session's by its id, from the session's add until it ends. The output
(engine/output.py) sends the two parts apart on each Delta; the engine core (engine/core.py)
forces the markers' tokens (`forced`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

if TYPE_CHECKING:
    from braid.server.engine.session import Session

# start and end markers that reasoning models write; a model's pair is found in its template or vocabulary
MARKER_PAIRS = (
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
)
# how near the prompt's end its last start marker must be for the output to begin inside the
# reasoning (Qwen3's and R1's generation prompt ends "<think>\n")
_OPEN_TAIL_TOKENS = 3


@dataclass(frozen=True)
class Markers:
    """A model's reasoning markers, as text and as the token ids the tokenizer makes of them."""

    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]


def find_markers(
    template: str | dict[str, str] | Sequence[Any] | None, vocabulary: Iterable[str], encode: Callable[[str], list[int]]
) -> Markers | None:
    """The first pair of MARKER_PAIRS whose end marker the chat template writes, or whose two
    markers are tokens of the tokenizer's own (`vocabulary`: its added tokens); None where neither."""
    text: str
    if isinstance(template, str):
        text = template
    elif isinstance(template, dict):
        text = "\n".join(str(t) for t in template.values())
    elif isinstance(template, (list, tuple)):  # transformers' named templates: [{"name", "template"}]
        text = "\n".join(str(t.get("template", "")) if isinstance(t, dict) else str(t) for t in template)
    else:
        text = ""
    tokens = set(vocabulary)
    for start, end in MARKER_PAIRS:
        if end in text or (start in tokens and end in tokens):
            start_ids, end_ids = tuple(encode(start)), tuple(encode(end))
            if start_ids and end_ids:
                return Markers(start, end, start_ids, end_ids)
    return None


class Phase(enum.Enum):
    OPENING = enum.auto()  # nothing yet: the output may open with the start marker
    REASONING = enum.auto()
    ANSWER = enum.auto()


def opens_in_prompt(markers: Markers, prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt leaves the output inside the reasoning: its last start marker is among its
    last tokens, with no end marker after it (Qwen3's generation prompt "<think>\\n"; with
    enable_thinking false it is "<think>\\n\\n</think>\\n\\n": closed)."""
    start, end = list(markers.start_ids), list(markers.end_ids)
    tail = list(prompt_ids[-(_OPEN_TAIL_TOKENS + len(start)) :])
    at = _rfind(tail, start)
    return at >= 0 and _rfind(tail[at:], end) < 0


def closes_in_prompt(markers: Markers, prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt closes a reasoning just before the output: an end marker among its last
    tokens (Qwen3's generation prompt with enable_thinking false, "<think>\n\n</think>\n\n")."""
    end = list(markers.end_ids)
    return _rfind(list(prompt_ids[-(_OPEN_TAIL_TOKENS + len(end)) :]), end) >= 0


def _rfind(tokens: list[int], pattern: list[int]) -> int:
    for i in range(len(tokens) - len(pattern), -1, -1):
        if tokens[i : i + len(pattern)] == pattern:
            return i
    return -1


class Reasoning:
    """One session's reasoning, token by token (model thread only): its phase, the tokens it took,
    the budget, and its text split by `text`."""

    def __init__(
        self, markers: Markers, prompt_ids: Sequence[int], budget: int | None = None, constrained: bool = False
    ) -> None:
        """budget: the most tokens of reasoning (those between the markers) before braid closes it;
        constrained: the session has a constraint, which waits for a reasoning the model opens."""
        self.markers = markers
        self.budget = budget
        self.constrained = constrained
        self.phase = Phase.REASONING if opens_in_prompt(markers, prompt_ids) else Phase.OPENING
        if constrained and self.phase is Phase.OPENING and closes_in_prompt(markers, prompt_ids):
            self.phase = Phase.ANSWER  # thinking off: the constraint holds the output from its first token
        self.text = Splitter(markers, self.phase is Phase.REASONING, opens=self.phase is Phase.OPENING)
        self.num_tokens = 0  # generated in the reasoning, its markers included (Usage.reasoning_tokens)
        self._inside = 0  # of those, the ones after the start marker (what the budget counts)
        self._recent: list[int] = []  # the last generated tokens, as long as the longer marker
        self.closed_now = False  # the last token added closed the reasoning

    @property
    def applies_constraint(self) -> bool:
        """Whether a constraint (a JSON schema, a forced tool call) holds the next token: not while
        the model reasons, nor while braid forces the rest of a start marker. At the opening it
        does, but the start marker's first token is allowed besides (`opening_tokens`)."""
        return self.phase is Phase.ANSWER or (self.phase is Phase.OPENING and not self._inside)

    def opening_tokens(self) -> tuple[int, ...]:
        """The tokens a constrained session may take next besides those its constraint allows: the
        start marker's first, at the opening (the model opens a reasoning, which the constraint
        waits for the end of); () otherwise."""
        if self.constrained and self.phase is Phase.OPENING and not self._inside:
            return self.markers.start_ids[:1]
        return ()

    def holds(self, token: int) -> bool:
        """Whether a constraint takes `token`, the next token: the answer's, not the reasoning's
        nor its markers' (the one rule of the live output and of resume_token_ids' check)."""
        return self.applies_constraint and token not in self.opening_tokens()

    def forced(self) -> tuple[int, ...]:
        """The tokens to take instead of the next one sampled: the rest of the start marker once a
        constrained session took its first (`opening_tokens`); the end marker's, once the
        reasoning has used its budget without closing; () otherwise."""
        if self.constrained and self.phase is Phase.OPENING and self._inside:
            return self.markers.start_ids[self._inside :]
        if self.phase is Phase.REASONING and self.budget is not None and self._inside >= self.budget:
            return self.markers.end_ids
        return ()

    def add(self, token: int) -> None:
        """Takes a generated token (closed_now: whether it closed the reasoning)."""
        m = self.markers
        self._recent = (self._recent + [token])[-max(len(m.start_ids), len(m.end_ids)) :]
        self.closed_now = False
        if self.phase is Phase.OPENING:
            self._inside += 1  # the start marker's tokens so far; taken back below if they are none
            opened = self._recent[-self._inside :] if self._inside <= len(m.start_ids) else []
            if list(m.start_ids) == opened:
                self.phase, self.num_tokens, self._inside = Phase.REASONING, self._inside, 0
            elif list(m.start_ids[: len(opened)]) != opened or not opened:
                self.phase, self._inside = Phase.ANSWER, 0
        elif self.phase is Phase.REASONING:
            self.num_tokens += 1
            self._inside += 1
            if self._recent[-len(m.end_ids) :] == list(m.end_ids):
                self.phase, self.closed_now = Phase.ANSWER, True


class Reasonings:
    """The reasoning sessions' Reasoning, by session id (model thread only)."""

    def __init__(self) -> None:
        self._sessions: dict[int, Reasoning] = {}

    def add(self, session_id: int, reasoning: Reasoning) -> None:
        self._sessions[session_id] = reasoning

    def of(self, s: Session) -> Reasoning | None:
        """The session's reasoning; None for a model without markers, or a plain prompt's session."""
        return self._sessions.get(s.id)

    def release(self, s: Session) -> None:
        """The session has ended: its reasoning goes."""
        self._sessions.pop(s.id, None)

    def session_ids(self) -> set[int]:
        return set(self._sessions)


class Splitter:
    """A session's text split into reasoning and answer as it arrives (`feed`): the markers are
    dropped, and so is the whitespace that follows each. A tail that may be the start of a marker
    is held back until the next text tells (a marker can be cut across tokens), or the end."""

    def __init__(self, markers: Markers, reasoning: bool, opens: bool = True) -> None:
        """reasoning: the prompt opened the reasoning; else opens: the output may open one (False:
        it is all answer)."""
        self._start, self._end = markers.start, markers.end
        self._phase = Phase.REASONING if reasoning else Phase.OPENING if opens else Phase.ANSWER
        self._held = ""
        self._trim = reasoning  # drop the whitespace that begins the part now being written

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) that `text` adds; final: the output has ended, nothing is held."""
        text, self._held = self._held + text, ""
        reasoning, answer = "", ""
        while text:
            if self._phase is Phase.OPENING:
                stripped = text.lstrip()
                if stripped.startswith(self._start):
                    self._phase, self._trim, text = Phase.REASONING, True, stripped[len(self._start) :]
                elif self._start.startswith(stripped) and not final:
                    self._held, text = text, ""
                else:
                    self._phase = Phase.ANSWER
                continue
            if self._trim:
                text = text.lstrip()
                self._trim = not text
                continue
            if self._phase is Phase.ANSWER:
                answer, text = answer + text, ""
                continue
            at = text.find(self._end)
            if at >= 0:
                reasoning += text[:at]
                self._phase, self._trim, text = Phase.ANSWER, True, text[at + len(self._end) :]
                continue
            keep = 0 if final else _partial(text, self._end)
            reasoning += text[: len(text) - keep]
            self._held, text = text[len(text) - keep :], ""
        return reasoning, answer


def _partial(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
