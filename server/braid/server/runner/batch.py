"""What one forward pass of braid's decoders runs: the packed batch, its prompt chunks and its
decode rows. Both decoders read it (decoder.py, braid's own; transformers_decoder.py, the fallback),
and the model runner builds it from the rows (model_runner.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from braid.server.runner.lora import LoraPass


@dataclass
class PrefillChunk:
    """Tokens [offset, offset + length) of the packed batch extend a sequence from position `start`;
    `pages`: its page table, covering positions [0, start + length)."""

    pages: torch.Tensor  # [ceil((start + length) / P)] long
    start: int
    length: int
    offset: int


@dataclass
class DecodeRows:
    """The last `count` tokens of the packed batch, one new token per sequence; or, with
    `speculative`, several consecutive tokens of a sequence as rows of their own (a speculating
    row's last token and proposals), each attending up to its own position."""

    count: int
    tables: torch.Tensor  # [B, pages] long: each sequence's page table (padded with page 0)
    kv_len: int  # T: longest cached length among them, new token included
    mask: torch.Tensor | None  # [B, 1, 1, T] bool, or None when every length is T
    speculative: bool = False  # rows of one sequence read each other's keys: all written before any attends


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    kv_index: torch.Tensor  # [N * KVH] long: where each token's key of each head goes, in the cache viewed as [-1, D]
    prefills: list[PrefillChunk]
    decode: DecodeRows | None
    logit_rows: torch.Tensor  # [R] long: the packed rows whose next-token logits are wanted
    lora: LoraPass | None = None  # where some rows run with a LoRA adapter: their deltas (runner/lora.py)
    # embeddings: (row, offset, length, mean) for each embedding row (its index among the runner's
    # rows) and its span of the packed tokens, whose hidden states after the final norm are pooled:
    # the last token's (mean False) or the sum of all (True). The decoder's pass writes them, in
    # order, to `pooled` ([len(pools), hidden] float32)
    pools: list[tuple[int, int, int, bool]] = field(default_factory=list)
    pooled: torch.Tensor | None = None

    def row_tables(self) -> tuple[torch.Tensor, bool]:
        """Every packed row's page table ([N, pages] long, padded with page 0), as braid's C
        attention reads it, and whether rows read each other's keys (a prompt chunk's rows, or a
        speculating row's): then every key is written before any row attends. Each row then attends
        by itself, as a decode step's row does, so a position's numbers do not depend on whether a
        prompt chunk, a verification or a decode step computed it."""
        dec = self.decode
        if dec is not None and not self.prefills:
            return dec.tables, dec.speculative
        width = max([len(c.pages) for c in self.prefills] + ([dec.tables.shape[1]] if dec is not None else []))
        tables = self.input_ids.new_zeros(len(self.input_ids), width)
        for c in self.prefills:
            tables[c.offset : c.offset + c.length, : len(c.pages)] = c.pages
        if dec is not None:
            tables[len(self.input_ids) - dec.count :, : dec.tables.shape[1]] = dec.tables
        return tables, True
