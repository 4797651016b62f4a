"""The progress bar of a conversion, as a terminal shows it: it moves within the long steps, tensor by
tensor, not only between steps (the embedded model's sat at 14% for 70 of 78 s), and the file is
parsed once for all the steps."""

from __future__ import annotations

import pytest
from test_request_log import tiny_gguf  # a tiny Llama's GGUF file, converted in seconds
from transformers import modeling_gguf_pytorch_utils as gguf_utils

from braid.server.model import loader, progress


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


def test_transformers_own_tensor_walk_moves_the_bar_and_draws_none(terminal):
    drawn = gguf_utils.tqdm
    with progress.Steps("converting x.gguf", {"weights": 10}) as steps, progress.gguf_tensors(steps):
        with steps.step("weights"):
            seen = [steps.position for _ in gguf_utils.tqdm(list(range(5)), desc="Converting and de-quantizing")]
    assert seen == [0, 2, 4, 6, 8]
    assert gguf_utils.tqdm is drawn  # put back


def test_a_conversion_moves_the_bar_during_its_weights_and_blocks_and_parses_the_file_once(
    terminal, tmp_path, monkeypatch
):
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
    loader._converted(gguf_file, tmp_path / "cache")

    weights = loader.CONVERSION_STEPS
    names = list(weights)
    for step in ("weights", "quantized blocks"):
        start = sum(weights[n] for n in names[: names.index(step)])
        inside = [at for name, at in moves if name == step]
        # a move per tensor of the tiny model (2 layers)
        assert len(inside) >= 10, step
        assert inside == sorted(inside) and start < inside[0] and inside[-2] < start + weights[step], step
    assert len(parses) == 1  # one parse, shared by the tokenizer, the config, the weights and the blocks
    assert gguf.GGUFReader is counting and gguf.get_tensor_name_map is name_map  # put back
