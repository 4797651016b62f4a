"""The detokenizer: whole characters only, no stop-string leak, everything out at the end."""

from __future__ import annotations


from braid.server.engine.detokenizer import IncrementalDetokenizer


# A byte-level toy vocabulary: token i decodes to BYTES[i]; a sequence decodes to its bytes as UTF-8.
BYTES = [b"", b"Hel", b"lo", b" w", b"orld", "é".encode()[:1], "é".encode()[1:], b"!", b"STO", b"P", b"S"]


def _decode(ids) -> str:
    return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def _run(ids, stop=(), prompt=(0,)):
    d = IncrementalDetokenizer(_decode, list(prompt), list(stop))
    pieces = []
    for i in ids:
        d.add(i)
        pieces.append(d.take())
        if d.stopped:
            break
    pieces.append(d.take(final=True))
    return pieces, d


def test_text_comes_out_as_it_is_made():
    pieces, _ = _run([1, 2, 3, 4])
    assert pieces == ["Hel", "lo", " w", "orld", ""]


def test_half_a_character_waits_for_the_other_half():
    pieces, _ = _run([1, 5, 6, 7])
    assert pieces == ["Hel", "", "é", "!", ""]
    assert all("\ufffd" not in p for p in pieces)


def test_a_stop_string_is_cut_and_never_leaks():
    pieces, d = _run([1, 2, 8, 9, 7], stop=["STOP"])
    assert d.stopped and "".join(pieces) == "Hello"
    assert pieces[2] == ""  # "STO" held back: it may begin "STOP"


def test_held_back_text_goes_out_when_it_cannot_be_a_stop_string():
    pieces, d = _run([1, 8, 7], stop=["STOP"])
    assert not d.stopped and pieces == ["Hel", "", "STO!", ""]


def test_held_back_text_goes_out_at_the_end():
    """A stream that ends (a deadline, max_new_tokens) inside a possible stop string still sends it."""
    pieces, d = _run([1, 8], stop=["STOP"])
    assert pieces == ["Hel", "", "STO"]


def test_overlapping_stop_strings_cut_at_the_earliest():
    pieces, d = _run([1, 10, 8, 9], stop=["STOP", "SSTO"])
    assert d.stopped and "".join(pieces) == "Hel"


def test_the_matched_stop_string_is_reported_and_can_be_kept():
    """The earliest of the stop strings found is reported; with include_stop the text ends after
    it. "Hel" "lo": "llo" starts at 2, "lo" at 3, "Hello" at 0 but is longer than the text."""
    for include, text in ((False, "He"), (True, "Hello")):
        d = IncrementalDetokenizer(_decode, [0], ["lo", "llo", "Hello w"], include_stop=include)
        for token in (1, 2, 3, 4):
            d.add(token)
            if d.stopped:
                break
        assert d.stopped and d.stop_sequence == "llo" and d.take(final=True) == text
