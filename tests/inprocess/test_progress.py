"""The progress bar of a conversion, as a terminal shows it: it moves within the long steps, tensor by
tensor, not only between steps (the embedded model's sat at 14% for 70 of 78 s), and the file is
parsed once for all the steps."""

from __future__ import annotations

import pytest
from test_request_log import tiny_gguf  # a tiny Llama's GGUF file, converted in seconds

from braid.server.model import conversion, progress


@pytest.fixture
def terminal(monkeypatch):
    """stderr taken for a terminal: the bar is drawn (into pytest's capture)."""
    monkeypatch.setattr(progress, "on_terminal", lambda: True)


def test_a_step_that_walks_its_items_moves_the_bar_within_its_share(terminal):
    with progress.Steps("converting x.gguf", {"tokenizer": 1, "weights": 4, "saving": 1}) as steps:
        with steps.step("tokenizer"):
            pass
        seen = []
        with steps.step("weights"):
            for _ in progress.counted(range(8), steps.advance):
                seen.append(steps.position)
            inside = steps.position
        assert seen == [1 + 4 * i / 8 for i in range(8)]  # from the step's start, an eighth at a time
        assert inside == steps.position == 5
        steps.advance(0.5)  # between steps: nothing to move
        assert steps.position == 5


def test_a_conversion_moves_the_bar_during_its_weights_and_parses_the_file_once(terminal, tmp_path, monkeypatch):
    import gguf

    gguf_file = tiny_gguf(tmp_path / "tiny.gguf")
    moves: list[tuple[str, float]] = []
    advance = progress.Steps.advance

    def watched(steps, fraction):
        advance(steps, fraction)
        moves.append((steps._current, steps.position))

    monkeypatch.setattr(progress.Steps, "advance", watched)
    parses, make, name_map = [], gguf.GGUFReader, gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **kw: parses.append(a) or make(*a, **kw))
    counting = gguf.GGUFReader
    conversion.converted(gguf_file, tmp_path / "cache")

    weights = conversion.CONVERSION_STEPS
    names = list(weights)
    for step in ("weights",):
        start = sum(weights[n] for n in names[: names.index(step)])
        inside = [at for name, at in moves if name == step]
        # a move per tensor of the tiny model (2 layers)
        assert len(inside) >= 10, step
        assert inside == sorted(inside) and start < inside[0] and inside[-2] < start + weights[step], step
    assert len(parses) == 1  # one parse, shared by the tokenizer, the config and the weights
    assert gguf.GGUFReader is counting and gguf.get_tensor_name_map is name_map  # put back
