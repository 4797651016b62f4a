"""Turns a session's tokens into text that is safe to send: whole characters, no stop-string leaks;
and a list of ids into text by the same rules (Detokenize)."""

from __future__ import annotations

from typing import Callable, Sequence

# Tokens of context decoded before the new ones, so tokenizers that drop a leading space when a
# piece starts the text (SentencePiece) still produce it mid-stream.
_CONTEXT_TOKENS = 4
# Tokens decoded before a cut to tell whether the text ends there on a whole character (Detokenize).
_CUT_WINDOW = 8


class IncrementalDetokenizer:
    """Decodes generated tokens one at a time, as text-generation-inference and vLLM do.

    Text is released only once it ends in a whole character (a byte-level token may carry half a
    UTF-8 sequence, which decodes to U+FFFD), and text that could still become one of the stop
    strings is held back until it cannot.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        prompt_ids: Sequence[int],
        stop: Sequence[str],
        include_stop: bool = False,
    ) -> None:
        """include_stop: the text ends after the stop string that matched, not before it."""
        self._decode = decode
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # ids[prefix:read] were decoded already and give the context text
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop
        self.text = ""  # all output text decoded so far (cut at a stop string once one is found)
        self._sent = 0  # characters of self.text already released
        self.stopped = False
        self.stop_sequence = ""  # the stop string that matched, once stopped

    def add(self, token_id: int) -> None:
        """Adds one generated token. Sets `stopped` once a stop string appears."""
        if self.stopped:
            return
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return  # an incomplete character: wait for its next byte
        self.text += after[len(before) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._find_stop()

    def _find_stop(self) -> None:
        if not self._stop:
            return
        window_start = max(0, self._sent - self._longest_stop)
        hits = [(i, -len(s), s) for s, i in ((s, self.text.find(s, window_start)) for s in self._stop) if i >= 0]
        if hits:
            at, _, self.stop_sequence = min(hits)  # the earliest; of two there, the longest
            self.text = self.text[: at + (len(self.stop_sequence) if self._include_stop else 0)]
            self.stopped = True

    def take(self, final: bool = False) -> str:
        """The text that can be released now; with final=True, everything that is left."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        out = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self.text
        for n in range(min(self._longest_stop - 1, len(text) - self._sent), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0


class IdsOnly(IncrementalDetokenizer):
    """The detokenizer of a session that sends token ids only (skip_detokenize): it decodes nothing
    and its text stays empty. Such a session has no stop strings (the request checks refuse them)."""

    def __init__(self) -> None:
        super().__init__(lambda ids: "", (), ())

    def add(self, token_id: int) -> None:
        pass


def detokenize(decode: Callable[[Sequence[int]], str], token_ids: Sequence[int]) -> tuple[str, int]:
    """The ids' text as a stream would send it, and how many of the last ids it leaves out because
    they end in part of a character (what a stream holds back until the character's next byte).
    Decodes the ids once where the text ends on a whole character, as it usually does; else steps
    back over the last ids, looking at a few ids' text before each cut (no character is longer than
    4 bytes, nor a token shorter than 1, but for special tokens)."""
    text = decode(token_ids)
    if not text.endswith("\ufffd"):
        return text, 0
    n = len(token_ids)
    cut = next(
        (k for k in range(1, n) if not decode(token_ids[max(0, n - k - _CUT_WINDOW) : n - k]).endswith("\ufffd")), n
    )
    return decode(token_ids[: n - cut]), cut
