"""The port between the engine and whatever runs the model: rows in, sampled tokens out, and the
few facts the engine must know (the KV cache's pages, the vocabulary, the context). The engine
imports nothing of the runner but its row types (runner/rows.py, torch-free); braid's ModelRunner
implements this, and the engine's tests drive the engine with a scripted one."""

from __future__ import annotations

from typing import Protocol, Sequence

from braid.server.runner.rows import AdapterInfo, Row, Sampled, Sampling


class Runner(Protocol):
    max_seq_len: int  # most tokens a sequence may hold
    vocab_size: int

    @property
    def num_pages(self) -> int:
        """KV-cache pages the runner holds, numbered 0 .. num_pages - 1."""

    @property
    def page_size(self) -> int:
        """Tokens per KV-cache page."""

    def random_state(self, sampling: Sampling, skip: int = 0) -> object:
        """A sequence's random state (Row.rng), advanced past `skip` draws."""

    def run(self, rows: Sequence[Row]) -> list[Sampled | None]:
        """One forward pass: for each row, what it sampled (or scored), or None."""

    def load_adapter(self, adapter_id: int, name: str, path: str, max_rank: int) -> AdapterInfo:
        """Makes a LoRA adapter resident as adapter_id (Row.adapter); ValueError, one line, if it
        is not an adapter of this model or its rank is past max_rank. Any thread."""

    def unload_adapter(self, adapter_id: int) -> None:
        """Frees an adapter no row names any more."""
