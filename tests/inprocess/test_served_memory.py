"""What a served model holds beyond its weights and KV cache, and what its build peaks at (issue 40).
The one-call step (runner/kernels/step.py DecodeStep) kept the activation buffers of the largest pass
it had run for the process's life, 62 MiB at the 1B shape after one 512-token prompt chunk: a pass of
a decode batch's size still reuses kept buffers; a prompt chunk's are freed with it. Packing a big
matrix left its transient copies in glibc's heap until the build's end, which raised the 1B shape's
peak by up to 560 MiB: each is handed back as soon as it is packed. Memory is counted as live tensors,
never timed."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from braid_testing.models import loaded, tiny_model

from braid.server.runner.kernels import packing
from braid.server.runner.kernels.pick import kernels_isa
from braid.server.runner.kernels.step import KEPT_SCRATCH_ROWS
from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import Row, Sampling

pytestmark = pytest.mark.skipif(kernels_isa() is None, reason="braid's C kernels do not run on this CPU")

PROMPT = 4 * KEPT_SCRATCH_ROWS  # rows of the prompt's one pass
PAGE = 16  # the runner's page size: positions a page


def _tensor_bytes() -> dict[int, int]:
    """Every live CPU tensor's storage made since gc.freeze(): its address and bytes."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated names warns
        warnings.simplefilter("ignore", FutureWarning)
        found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "cpu"]
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found}


def _held_after(runner: ModelRunner, rows: list[Row]) -> int:
    """Bytes of the tensors that a pass of `rows` left alive (its results dropped)."""
    before = _tensor_bytes()
    runner.run(rows)
    return sum(n for ptr, n in _tensor_bytes().items() if ptr not in before)


def test_a_prompt_chunks_activations_are_freed_with_its_pass_and_a_decode_batchs_kept():
    prompt_pages = PROMPT // PAGE + 1
    num_pages = prompt_pages + KEPT_SCRATCH_ROWS
    model = tiny_model("llama", vocab_size=512)
    runner = ModelRunner(loaded(model), torch.device("cpu"), torch.float32, num_pages=num_pages, max_seq_len=2 * PROMPT)
    assert runner.decoder.one_call  # the C step, whose buffers these are
    sampling = Sampling()

    def rows(count: int, length: int = 1) -> list[Row]:
        """`count` sequences' passes of `length` tokens from position 0, each in pages of its own."""
        tables = [[i] for i in range(count)] if length <= PAGE else [list(range(num_pages - prompt_pages, num_pages))]
        ids = [(5 + i) % 500 for i in range(length)]
        return [Row(pages=t, start=0, token_ids=ids, sample=True, sampling=sampling, rng=None) for t in tables]

    runner.run(rows(1))  # the step is built on the first pass, and keeps one row's buffers
    gc.freeze()  # what lives now is left out of the counts (and of the collector's walks: seconds)
    try:
        one_row = _held_after(runner, rows(2)) / 2  # a row's activations, measured: the 2-row buffers kept
        assert one_row > 0
        # a prompt of PROMPT rows in one pass: before, its buffers were kept (PROMPT * one_row)
        held = _held_after(runner, rows(1, PROMPT))
        assert held < one_row, (held, one_row)
        # a decode batch's pass (up to KEPT_SCRATCH_ROWS rows) keeps its buffers, as before, and reuses them
        assert _held_after(runner, rows(KEPT_SCRATCH_ROWS)) == KEPT_SCRATCH_ROWS * one_row
        assert _held_after(runner, rows(KEPT_SCRATCH_ROWS // 2)) == 0
    finally:
        gc.unfreeze()


def test_a_big_matrix_hands_its_packings_copies_back_once_packed(monkeypatch):
    released = []
    monkeypatch.setattr(packing, "release_freed_heap", lambda: released.append(1) or True)
    small = packing.PackedLinear(torch.randn(64, 64), None)  # a test model's: left to the build's end
    assert small.nbytes < packing.RELEASE_AFTER_BYTES and released == []
    big = packing.PackedLinear(torch.randn(packing.RELEASE_AFTER_BYTES // (4 * 256), 256), None)
    assert big.nbytes >= packing.RELEASE_AFTER_BYTES and released == [1]
