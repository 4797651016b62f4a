"""Weight matrices for the decoder's linear layers: torch's (Linear) or packed into panels in their
own format for braid's gemm (PackedLinear)."""

from __future__ import annotations

import mmap

import torch

from braid.server.model.weights import FLOAT_FORMATS, Blocks, Parts, Weight
from braid.server.resources import huge_page_size, release_freed_heap
from braid.server.runner.kernels.extension import (
    BF16_ROWS,
    FORMAT_CODES,
    FORMATS,
    INT8,
    PANEL,
    PARTS,
    QBLOCK,
    U6_LIFT,
    _cpu_kernels,
    has_bf16_rows,
)


# A matrix of this many packed bytes or more is followed by a release of the heap's free pages
# (release_freed_heap) as soon as it is packed: its transient copies (1-100 MB), freed between the
# packed results that stay, were kept by glibc and not all reused by the next matrix's, so the 1B
# shape's build peaked at 1,592-2,142 MiB (varying with where `load` had left the heap's free space)
# where it needs 1,551-1,609 (docs/benchmarks.md; about 65 releases, 0.5-0.8 s of a 7-20 s build).
# Smaller matrices (every test model's) leave it to the build's end.
RELEASE_AFTER_BYTES = 4 * 2**20


def format_of(weight: Weight) -> str:
    return weight.format if isinstance(weight, Blocks) else FLOAT_FORMATS.get(weight.dtype, "f32")


def dense(weight: Weight | Parts, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The matrix as a plain tensor [out, in] in dtype: blocks dequantized as GGUF's reference does."""
    if isinstance(weight, (Blocks, Parts)):
        weight = weight.dequantize()
    return weight.detach().to(device=device, dtype=dtype)


class Linear:
    """y = x @ W.T (+ bias), torch's matmul, W [out, in] held as [in, out].
    `add_into(y, x)` does y += x @ W.T in place; `columns(ids)` is the embedding lookup in a tied
    head: rows ids of W."""

    huge_bytes = 0  # of the weight, in transparent huge pages (torch's memory: none counted; in_huge_pages)

    def __init__(
        self, weight: Weight | Parts, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.weight = dense(weight, dtype, device).t().contiguous()
        self.bias = None if bias is None else bias.detach().to(device=device, dtype=dtype)
        self.in_features, self.out_features = self.weight.shape
        self.format, self.nbytes = format_of(self.weight), self.weight.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)

    def add_into(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y.addmm_(x, self.weight) if self.bias is None else y.addmm_(x, self.weight).add_(self.bias)

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        # clone, not contiguous(): for one id the transpose [1, in] has strides (1, 1), which
        # counts as contiguous and stays, and cuBLASLt refuses a row stride of 1 (an in-place
        # addmm_ into the residual stream failed on CUDA: CUBLAS_STATUS_INVALID_VALUE).
        return self.weight.index_select(1, ids).t().clone(memory_format=torch.contiguous_format)


class PackedLinear(Linear):
    """The weight packed into panels in its own format, for the C kernels' gemm: [ceil(out / 32),
    in, 32] for a float dtype; for GGUF blocks, per panel and block of 32 rows, the 32 columns'
    scales (and mins) then the 32 rows of quants, as bytes (a K-quant's super-block scales after
    the blocks)."""

    def __init__(self, weight: Weight, bias: torch.Tensor | None, int8: bool = False, bf16: bool = False) -> None:
        """int8: quantize x to int8 per row and block for integer dot products (GGUF blocks only;
        their quants packed for it, csrc/kernels.h's F_INT8). bf16: round x to bf16 per row for
        vdpbf16ps (a bf16 weight, where the selected build has it; packed in pairs of rows, F_BF16_ROWS)."""
        self.out_features, self.in_features = weight.shape
        self.format = format_of(weight)
        self.int8 = int8 and isinstance(weight, Blocks) and INT8 is not None
        self.bf16 = bf16 and self.format == "bf16" and has_bf16_rows()
        self.rows = "int8" if self.int8 else "bf16" if self.bf16 else "float32"  # what x is multiplied as
        self.code = FORMAT_CODES[self.format] | (INT8 if self.int8 else 0) | (BF16_ROWS if self.bf16 else 0)
        self.weight = (
            _pack_blocks(weight, self.int8) if isinstance(weight, Blocks) else _pack_dense(weight, pairs=self.bf16)
        )
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.nbytes = self.weight.nbytes
        self.weight, self.huge_bytes = in_huge_pages(self.weight)
        if self.nbytes >= RELEASE_AFTER_BYTES:
            release_freed_heap()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x.new_empty(x.shape[0], self.out_features)
        self._gemm(x, y, accumulate=False)
        return y

    def add_into(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self._gemm(x, y, accumulate=True)
        return y

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.contiguous()
        out = torch.empty(ids.shape[0], self.in_features)
        _cpu_kernels.columns(
            self.weight.data_ptr(),
            self.code,
            self.in_features,
            self.out_features,
            ids.data_ptr(),
            ids.shape[0],
            out.data_ptr(),
            out.stride(0),
        )
        return out

    def reference(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T + bias (y: added into y, which it returns) by the plain-C reference (csrc/reference.c),
        one value at a time: the bits every build's gemm gives (csrc/kernels.h). Slow; for checks."""
        x = rows_of(x)
        out = x.new_empty(x.shape[0], self.out_features) if y is None else y
        _cpu_kernels.reference_gemm(
            x.data_ptr(),
            x.stride(0),
            self.weight.data_ptr(),
            self.code,
            out.data_ptr(),
            out.stride(0),
            x.shape[0],
            self.in_features,
            self.out_features,
            int(y is not None),
            None if self.bias is None else self.bias.data_ptr(),
        )
        return out

    def by_part(self, y: torch.Tensor):
        """Each matrix one gemm call takes, with its columns of y (a view): this one, all of y."""
        yield self, y

    def _gemm(self, x: torch.Tensor, y: torch.Tensor, accumulate: bool) -> None:
        x = rows_of(x)
        assert x.shape[1] == self.in_features and y.stride(-1) == 1
        if x.shape[0] == 0:  # no rows (a pass of prompt chunks that sample nothing): nothing to do,
            return  # as torch.mm does; the C kernel rejects M < 1
        _cpu_kernels.gemm(
            x.data_ptr(),
            x.stride(0),
            self.weight.data_ptr(),
            self.code,
            y.data_ptr(),
            y.stride(0),
            x.shape[0],
            self.in_features,
            self.out_features,
            int(accumulate),
            None if self.bias is None else self.bias.data_ptr(),
            torch.get_num_threads(),
        )


class PackedParts(PackedLinear):
    """A matrix of parts in different formats (model.weights.Parts), each packed in its own as a
    PackedLinear. A decode step multiplies them all in one call (csrc/kernels.h's F_PARTS: `weight`
    lists the parts' codes, columns and packed weights); elsewhere each part fills its columns of y."""

    def __init__(self, weight: Parts, bias: torch.Tensor | None, int8: bool = False, bf16: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.parts: list[PackedLinear] = []
        begin = 0
        for part in weight.parts:
            part_bias = None if bias is None else bias[begin : begin + part.shape[0]]
            self.parts.append(PackedLinear(part, part_bias, int8=int8, bf16=bf16))
            begin += part.shape[0]
        self.format = "+".join(p.format for p in self.parts)
        self.rows = "+".join(dict.fromkeys(p.rows for p in self.parts))
        self.int8, self.bf16 = any(p.int8 for p in self.parts), any(p.bf16 for p in self.parts)
        self.code = PARTS
        fields = [[p.code, p.out_features, p.weight.data_ptr()] for p in self.parts]
        self.weight = torch.tensor([len(self.parts), *(v for f in fields for v in f)], dtype=torch.int64)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.nbytes = sum(p.nbytes for p in self.parts)
        self.huge_bytes = sum(p.huge_bytes for p in self.parts)

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("a matrix of parts is q/k/v's, never an embedding")

    def reference(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = x.new_empty(x.shape[0], self.out_features) if y is None else y
        for part, columns in self.by_part(out):
            part.reference(x, columns)
        return out

    def _gemm(self, x: torch.Tensor, y: torch.Tensor, accumulate: bool) -> None:
        for part, columns in self.by_part(y):
            part._gemm(x, columns, accumulate)

    def by_part(self, y: torch.Tensor):
        """Each part, with its columns of y (a view)."""
        begin = 0
        for part in self.parts:
            yield part, y[:, begin : begin + part.out_features]
            begin += part.out_features


MADV_COLLAPSE = 25  # linux/mman.h; Python 3.11's mmap module does not name it


def in_huge_pages(packed: torch.Tensor) -> tuple[torch.Tensor, int]:
    """packed, copied to start on a huge-page boundary of memory of its own whose whole huge pages
    (2 MiB on x86-64) are transparent huge pages, and how many bytes are. Every token reads all of a
    model's packed weights, and in 4 KiB pages each page of them costs a TLB miss. A token's matmuls
    at the 1B shape, one row, each matrix its own copy (so read from memory), took 0.89-0.95x the time
    on one thread and 0.89-0.90x on two (docs/benchmarks.md, "Huge pages for the weights").
    - madvise(MADV_HUGEPAGE) before the copy: most distributions' THP setting is "madvise", where
      memory nobody advised stays in 4 KiB pages. MADV_COLLAPSE (Linux 6.1) then moves any page the
      writes' faults left small, whatever the setting.
    - Only the whole huge pages are advised. The partial one at the end stays in 4 KiB pages, so
      nothing past the matrix is committed; nor is the room before its start, never written.
    - A matrix smaller than a huge page, or a kernel without them, keeps torch's memory (0 bytes)."""
    size, nbytes = huge_page_size(), packed.nbytes
    whole = nbytes // size * size if size else 0
    if not whole:
        return packed, 0
    memory = mmap.mmap(-1, nbytes + size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    room = torch.frombuffer(memory, dtype=torch.uint8)  # holds the mapping for as long as a view lives
    start = -room.data_ptr() % size
    try:
        memory.madvise(mmap.MADV_HUGEPAGE, start, whole)
    except OSError:  # a kernel built without transparent huge pages
        return packed, 0
    out = room[start : start + nbytes]
    out.copy_(packed.contiguous().view(-1).view(torch.uint8))
    try:
        memory.madvise(MADV_COLLAPSE, start, whole)
    except OSError:  # before Linux 6.1, or no huge page free: what the writes' faults took, uncounted
        whole = 0
    return out.view(packed.dtype).view(packed.shape), whole


def _pack_dense(weight: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """[out, in] -> [ceil(out / 32), in, 32], zero-padded, in the weight's dtype (fp32 for others).
    pairs (the bf16 path's layout): [ceil(out / 32), ceil(in / 2), 32, 2], each column's rows 2p and
    2p + 1 side by side, an odd `in` padded with a row of zeros."""
    weight = weight.detach()
    if weight.dtype not in FLOAT_FORMATS:
        weight = weight.float()
    n, k = weight.shape
    panels, rows = -(-n // PANEL), k + (k % 2 if pairs else 0)
    padded = weight.new_zeros(panels * PANEL, rows)
    padded[:n, :k] = weight
    if pairs:
        return padded.view(panels, PANEL, rows // 2, 2).transpose(1, 2).contiguous()
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def _pack_blocks(b: Blocks, interleaved: bool = False) -> torch.Tensor:
    """GGUF blocks -> panels [ceil(out / 32), panel bytes] uint8, as the format's row of the C table
    says (csrc/formats.h): per block of 32 rows, the 32 columns' scales (per scale group: Q6_K has
    two, rows 0-15 and 16-31), then their mins if any, then 32 rows of 32 quants (4-bit ones: column
    j in the low nibble of byte j, column j + 16 in its high one); after the blocks, a K-quant's
    super-block scales (per 256 rows, the 32 columns' fp16 d, then Q4_K's dmin). interleaved (the
    int8 path's layout): the rows in 8 groups of 4, each column's 4 quants of a group in 4
    consecutive bytes (4-bit ones: columns j and j + 16 in the low and high nibbles)."""
    fmt = FORMATS[b.format]
    n, blocks = b.q.shape[:2]
    panels = -(-n // PANEL)

    def by_panel(t: torch.Tensor) -> torch.Tensor:  # [n, blocks, ...] -> [panels, blocks, 32 columns, ...]
        t = torch.cat([t, t.new_zeros(panels * PANEL - n, *t.shape[1:])])
        return t.view(panels, PANEL, t.shape[1], *t.shape[2:]).transpose(1, 2)

    # [n, blocks * groups] -> [panels, blocks, groups, 32 columns]
    parts = [by_panel(b.d.view(n, blocks, fmt.groups)).transpose(2, 3)] + ([] if b.m is None else [by_panel(b.m)])
    q = by_panel(b.q).transpose(2, 3)  # [panels, blocks, 32 rows, 32 columns]
    columns = -1  # the dim of a row's (or a group's) columns
    if interleaved:  # [panels, blocks, 8 groups, 32 columns, 4 rows]
        q = q.reshape(panels, blocks, QBLOCK // 4, 4, PANEL).transpose(3, 4)
        columns = -2
    if fmt.bits < 8:
        parts.append(_planes(q, fmt.bits, columns))
    else:
        parts.append(q)
    packed = torch.cat([p.contiguous().view(torch.uint8).reshape(panels, blocks, -1) for p in parts], dim=-1)
    if (
        packed.shape[-1] != fmt.block_bytes
        or (b.m is not None) != (fmt.min != 0)
        or (b.s is None) != (fmt.super_bytes == 0)
    ):
        raise ValueError(f"{b.format} blocks of {packed.shape[-1]} bytes do not match the C kernels' {fmt}")
    packed = packed.reshape(panels, -1)
    if b.s is None:
        return packed
    # [n, supers, levels] -> [panels, supers, levels, 32 columns]
    top = by_panel(b.s).permute(0, 1, 3, 2).contiguous().view(torch.uint8).reshape(panels, -1)
    return torch.cat([packed, top], dim=-1)


def _planes(q: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Quants of 4 or 6 bits packed along dim (a row's or a group's 32 columns) as csrc/kernels.h lays
    them out: the low 4 bits of column j (j < 16) and j + 16 in the low and high nibbles of one byte,
    then (6 bits: stored as q + 32) the high 2 bits of columns j, j + 8, j + 16 and j + 24 (j < 8) in
    the bit pairs of one byte. A row's planes (dim -1), or a group's ([32 columns, 4 rows], dim -2:
    each plane's columns of 4 bytes, one per row), one after the other."""
    u = (q.to(torch.int16) + U6_LIFT).to(torch.uint8) if bits == 6 else q.to(torch.uint8)
    nibbles = u & 0x0F
    low = nibbles.narrow(dim, 0, PANEL // 2) | (nibbles.narrow(dim, PANEL // 2, PANEL // 2) << 4)
    if bits == 4:
        return low
    high = u >> 4
    pairs = [high.narrow(dim, PANEL // 4 * t, PANEL // 4) << (2 * t) for t in range(4)]
    high = pairs[0] | pairs[1] | pairs[2] | pairs[3]
    if dim == -2:
        low, high = low.flatten(-2), high.flatten(-2)
    return torch.cat([low, high], dim=-1)


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along its last dim (rows may be strided), as the C kernels read it."""
    return x if x.stride(-1) == 1 else x.contiguous()
