"""What one forward pass of braid's decoders runs: the packed batch, its prompt chunks and its
decode rows, and `pack`, which builds it from the rows. Both decoders read it (decoder.py, braid's
own; transformers_decoder.py, the fallback); the model runner packs each pass's rows with it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

import torch

from braid.server.runner.kv_cache import KVCache
from braid.server.runner.lora import Adapter, LoraPass
from braid.server.runner.rows import Pooling, Row


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


class Packed(NamedTuple):
    """A pass's batch, and where each row's results are among its logits (ForwardBatch.logit_rows)."""

    batch: ForwardBatch
    # the rows that sample, in the order of their logit rows (1 + num_proposals each), which come
    # after every scored row's
    sampled: list[int]
    # each row with targets: its logit rows [begin, end), which come first
    scored: dict[int, tuple[int, int]]


def pack(
    rows: Sequence[Row], cache: KVCache, adapters: Mapping[int, Adapter] | None = None, native: bool = True
) -> Packed:
    """Packs the rows' new tokens side by side: prompt chunks first (rows with proposals among them
    on the transformers path), then one token per decoding row, each group by LoRA adapter.
    `adapters`: the resident ones, by load id (Row.adapter); `native`: braid's decoder runs the pass
    (else transformers', which neither pools nor decodes a speculating row's tokens as rows)."""
    if not native and any(r.pool is not None for r in rows):
        raise ValueError("embeddings need braid's native decoder; this model runs through transformers")
    # a speculating row's tokens go as decode rows of their own on braid's decoder (its decode
    # attention, the same numbers as plain steps), as a chunk on the transformers path
    is_prefill = [r.is_prompt or (len(r.token_ids) > 1 and not (r.num_proposals and native)) for r in rows]
    # grouped by LoRA adapter (stable: without adapters the order is the rows'), so that each
    # adapter's tokens are a run of the packed batch (runner/lora.py)
    prefills = sorted((i for i, r in enumerate(rows) if is_prefill[i]), key=lambda i: rows[i].adapter)
    decodes = sorted((i for i, r in enumerate(rows) if not is_prefill[i]), key=lambda i: rows[i].adapter)
    ids: list[int] = []
    positions: list[int] = []
    token_pages: list[int] = []  # the page each packed token's key and value go to
    chunks: list[PrefillChunk] = []
    logit_rows: list[int] = []
    sampled: list[int] = []
    scored: dict[int, tuple[int, int]] = {}
    sample_at: list[int] = []  # the packed token each sampling row's logits come from
    token_adapters: list[int] = []  # each packed token's adapter (Row.adapter)
    pools: list[tuple[int, int, int, bool]] = []  # embedding rows' spans (ForwardBatch.pools)
    dev, page_size, kv_heads = cache.device, cache.page_size, cache.num_kv_heads
    for i in prefills + decodes:
        r = rows[i]
        end = r.start + len(r.token_ids)
        if is_prefill[i]:
            table = torch.tensor(r.pages[: -(-end // page_size)], dtype=torch.long, device=dev)
            chunks.append(PrefillChunk(pages=table, start=r.start, length=len(r.token_ids), offset=len(ids)))
        if r.targets:
            scored[i] = (len(logit_rows), len(logit_rows) + len(r.targets))
            logit_rows += range(len(ids), len(ids) + len(r.targets))
        if r.pool is not None:
            pools.append((i, len(ids), len(r.token_ids), r.pool is Pooling.MEAN))
        ids += r.token_ids
        token_adapters += [r.adapter] * len(r.token_ids)
        positions += range(r.start, end)
        token_pages += [r.pages[p // page_size] for p in range(r.start, end)]
        if r.sample:  # a row with proposals samples after each of them too
            sample_at += range(len(ids) - 1 - r.num_proposals, len(ids))
            sampled.append(i)
    position_tensor = torch.tensor(positions, dtype=torch.long, device=dev)
    # [N * KVH]: the row of the cache viewed as [-1, D] each token's key of each head goes to
    offsets = (
        torch.tensor(token_pages, dtype=torch.long, device=dev) * kv_heads * page_size + position_tensor % page_size
    )
    heads = torch.arange(kv_heads, device=dev) * page_size
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
        positions=position_tensor,
        kv_index=(offsets.unsqueeze(1) + heads.unsqueeze(0)).flatten(),
        prefills=chunks,
        decode=_decode_rows([rows[i] for i in decodes], page_size, dev) if decodes else None,
        logit_rows=torch.tensor(logit_rows + sample_at, dtype=torch.long, device=dev),
        lora=_lora_pass(token_adapters, adapters or {}),
        pools=pools,
    )
    return Packed(batch, sampled, scored)


def _lora_pass(token_adapters: list[int], resident: Mapping[int, Adapter]) -> LoraPass | None:
    """The pass's LoRA deltas: each run of packed tokens with the same adapter (pack groups them),
    or None where no row runs with one."""
    if not any(token_adapters):
        return None
    runs = []
    begin = 0
    for end in range(1, len(token_adapters) + 1):
        if end == len(token_adapters) or token_adapters[end] != token_adapters[begin]:
            if token_adapters[begin]:
                adapter = resident.get(token_adapters[begin])
                if adapter is None:  # the engine holds an adapter until its sessions end: a bug
                    raise RuntimeError(f"rows name a LoRA adapter that is not loaded: {token_adapters[begin]}")
                runs.append((adapter, begin, end))
            begin = end
    return LoraPass(runs)


def _decode_rows(decodes: list[Row], page_size: int, device: torch.device) -> DecodeRows:
    """One decode row per token: a speculating row's tokens each attend up to their own position."""
    lengths = [r.start + j + 1 for r in decodes for j in range(len(r.token_ids))]  # the new token included
    owners = [r for r in decodes for _ in r.token_ids]
    kv_len = max(lengths)
    width = -(-kv_len // page_size)
    tables = torch.tensor(
        [list(r.pages[:width]) + [0] * (width - len(r.pages[:width])) for r in owners], dtype=torch.long, device=device
    )
    mask = None
    if any(n != kv_len for n in lengths):
        mask = (
            torch.arange(kv_len, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)
        ).view(len(owners), 1, 1, kv_len)
    return DecodeRows(
        count=len(owners), tables=tables, kv_len=kv_len, mask=mask, speculative=len(owners) > len(decodes)
    )
