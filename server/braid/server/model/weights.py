"""Weights in their own precision: GGUF's quantized blocks as the file holds them, read with gguf-py.

transformers reads a GGUF model dequantized to fp32, five times the bytes of a Q4 file. This module
reads the file's block-quantized matrices as they are (Blocks), so the runner's kernels can stream
them in their own format and a converted folder keeps no fp32 copy of them (model/conversion.py);
Blocks.dequantize gives one matrix's fp32 values where a float copy is needed. It also quantizes a
float matrix to Q8_0 for --quantization q8_0. Each block tensor is checked against transformers'
dequantized values when it is converted: a layout mistake fails the conversion, it never runs
silently wrong.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch


_LOGGER = logging.getLogger(__name__)

QBLOCK = 32  # weights per GGUF block (Q8_0, Q4_0, Q4_1; a K-quant's sub-block), along a matrix's input
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1", "q6_k", "q4_k")  # the block formats braid's kernels run
FOUR_BIT = ("q4_0", "q4_1", "q4_k")  # those whose quants are 0..15: kept two to a byte at rest
FLOAT_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


@dataclass
class Blocks:
    """A matrix [out, in] in GGUF blocks of 32 along `in`, unpacked from the file's bytes: quants
    q [out, in / 32, 32] (int8 for Q8_0; q - 32 in int8 for Q6_K; uint8 0..15 for the 4-bit ones)
    and scales d: [out, in / 32] fp16 for Q8_0, Q4_0, Q4_1 (and Q4_1's mins m likewise). The
    K-quants keep GGUF's two levels: d (and Q4_K's m) are the int8 sub-block scales (and mins),
    [out, in / 16] for Q6_K, [out, in / 32] for Q4_K, and s the fp16 super-block scales of each 256
    inputs, [out, in / 256, 1] (Q6_K's d) or [out, in / 256, 2] (Q4_K's d and dmin); a weight's scale
    is s's d times its d (and its min dmin times its m), as GGUF's reference forms them first."""

    format: str
    d: torch.Tensor
    m: torch.Tensor | None
    q: torch.Tensor
    s: torch.Tensor | None = None  # the K-quants' super-block scales

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * QBLOCK

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32, computed as GGUF's reference does it (gguf-py, ggml): d * q, then + m
        (- m for Q4_K), each step rounded to fp32."""
        d, q = self.scales().unsqueeze(-1), self.q.float()
        if self.format == "q8_0":
            w = q * d
        elif self.format == "q4_0":
            w = d * (q - 8)
        elif self.format == "q6_k":
            w = d * q.view(q.shape[0], -1, 16)
        elif self.format == "q4_k":
            w = d * q - self.scales(mins=True).unsqueeze(-1)
        else:
            w = d * q + self.m.float().unsqueeze(-1)
        return w.reshape(self.shape)

    def scales(self, mins: bool = False) -> torch.Tensor:
        """The scales d (mins: m) in fp32, [out, scale groups]: a K-quant's as the products of its
        two levels (exact in fp32: an fp16 times a 6- or 8-bit integer)."""
        own = self.m if mins else self.d
        if self.s is None:
            return own.float()
        top = self.s[..., int(mins)].float()  # [out, in / 256]
        return top.repeat_interleave(own.shape[1] // top.shape[1], dim=1) * own.float()

    def rows(self, index: torch.Tensor) -> Blocks:
        """The matrix with its rows (outputs) taken in `index` order."""
        return Blocks(
            self.format,
            self.d[index],
            None if self.m is None else self.m[index],
            self.q[index],
            None if self.s is None else self.s[index],
        )

    @staticmethod
    def cat(parts: list[Blocks]) -> Blocks:
        """Matrices of one format stacked along out (q, k and v fused into one)."""
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        s = None if parts[0].s is None else torch.cat([p.s for p in parts])
        return Blocks(parts[0].format, torch.cat([p.d for p in parts]), m, torch.cat([p.q for p in parts]), s)


Weight = torch.Tensor | Blocks  # a matrix [out, in]: float, or in GGUF blocks


@dataclass
class Parts:
    """Matrices of different formats stacked along out as one, each kept in its own: q, k and v where a
    GGUF file keeps v in another format than q and k (Q4_K_M does in half the layers). The runner's
    kernels multiply each part in its format (runner/kernels/packing.py's PackedParts); fused in one
    format, the matrix would be fp32."""

    parts: list[Weight]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: each part's values (Blocks.dequantize's for blocks)."""
        return torch.cat([p.dequantize() if isinstance(p, Blocks) else p.float() for p in self.parts])


def unpack_gguf(format: str, raw: np.ndarray, packed: bool = False) -> Blocks:
    """Blocks from a GGUF tensor's bytes, [out, blocks per row * block bytes] uint8. A Q4 block's
    16 quant bytes hold element j in the low nibble of byte j and element j + 16 in its high one.
    packed: 4-bit quants left two to a byte (pack_nibbles': Q4_0's and Q4_1's own bytes), as a
    converted folder keeps them."""
    if format in ("q6_k", "q4_k"):
        b = _unpack_k_quant(format, raw)
        if packed and format in FOUR_BIT:
            b.q = pack_nibbles(b.q)
        return b
    out = raw.shape[0]
    head = 4 if format == "q4_1" else 2
    body = QBLOCK if format == "q8_0" else QBLOCK // 2
    blocks = torch.from_numpy(np.array(raw, copy=True)).view(out, -1, head + body)
    d = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1) if format == "q4_1" else None
    quants = blocks[..., head:].contiguous()
    if format == "q8_0":
        q = quants.view(torch.int8)
    else:
        q = quants if packed else unpack_nibbles(quants)
    return Blocks(format, d, m, q)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit quants [..., 32] (uint8, 0..15) two to a byte, [..., 16]: element j in the low nibble
    of byte j, element j + 16 in its high one (a Q4_0 block's own layout)."""
    return q[..., :16] | (q[..., 16:] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles undone: [..., 16] bytes -> [..., 32] quants."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _unpack_k_quant(format: str, raw: np.ndarray) -> Blocks:
    """Q6_K and Q4_K super-blocks of 256 as braid's Blocks: the bit unpacking of gguf-py's own
    dequantize_blocks (gguf/quants.py), stopped before its multiplications, whose operands are kept
    (the two levels of scales; the kernels multiply them as it does)."""
    from gguf.quants import Q4_K

    out = raw.shape[0]
    blocks = np.array(raw, copy=True)
    if format == "q6_k":
        blocks = blocks.reshape(-1, 210)
        ql, qh, scales, d = np.split(blocks, [128, 192, 208], axis=1)
        top = d.view(np.float16).reshape(out, -1, 1)  # [out, in / 256, 1]
        d = scales.view(np.int8)  # [n, 16]
        ql = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        qh = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        q = (ql.reshape(-1, 8, 32) | (qh.reshape(-1, 8, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
        return Blocks(
            format,
            torch.from_numpy(d.reshape(out, -1)),
            None,
            torch.from_numpy(q.reshape(out, -1, 32)),
            torch.from_numpy(top),
        )
    blocks = blocks.reshape(-1, 144)
    d, dmin, scales, qs = np.split(blocks, [2, 4, 16], axis=1)
    sc, mn = Q4_K.get_scale_min(scales)  # [n, 8] each, 0..63
    top = np.concatenate([d, dmin], axis=1).view(np.float16).reshape(out, -1, 2)  # [out, in / 256, 2]
    q = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    return Blocks(
        format,
        torch.from_numpy(sc.astype(np.int8).reshape(out, -1)),
        torch.from_numpy(mn.astype(np.int8).reshape(out, -1)),
        torch.from_numpy(q.reshape(out, -1, 32)),
        torch.from_numpy(np.ascontiguousarray(top)),
    )


def quantize_q8_0(weight: torch.Tensor) -> Blocks:
    """A float matrix [out, in] (in a multiple of 32) in Q8_0 blocks, quantized by gguf-py's
    reference (bit-exact with llama.cpp's quantize_row_q8_0)."""
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(weight.detach().float().numpy(), GGMLQuantizationType.Q8_0)
    return unpack_gguf("q8_0", raw)


def gguf_type_name(tensor_type) -> str:
    """A GGML tensor type as braid names formats: 'q4_1', 'f32', 'bf16', 'q6_k'."""
    name = tensor_type.name.lower()
    return {"f32": "f32", "f16": "f16", "bf16": "bf16"}.get(name, name)


def stored_blocks(processor, tensor, kind: str, file_name: str, sample: int = 64) -> Blocks | None:
    """A GGUF block matrix as a converted folder keeps it (4-bit quants two to a byte,
    pack_nibbles'), its rows in the order transformers' tensor processor puts them
    in; None where the processor does more than reorder rows (its values are kept in fp32). Never
    dequantized whole: `sample` rows spread over the matrix are checked against gguf-py's own
    dequantization of the file's rows (a layout mistake shows in every row: it fails the
    conversion, it never runs silently wrong)."""
    from gguf import dequantize

    n = tensor.data.shape[0]
    order = row_order(processor, tensor.name, n)
    if order is None:
        return None
    b = unpack_gguf(kind, tensor.data, packed=True)
    if not np.array_equal(order, np.arange(n)):
        b = b.rows(torch.from_numpy(order.copy()))
    rows = torch.from_numpy(np.unique(np.linspace(0, n - 1, min(n, sample)).astype(np.int64)))
    checked = b.rows(rows)
    if kind in FOUR_BIT:
        checked.q = unpack_nibbles(checked.q)
    expected = torch.from_numpy(np.asarray(dequantize(tensor.data[order[rows.numpy()]], tensor.tensor_type)))
    if checked.shape != tuple(expected.shape) or not torch.equal(checked.dequantize(), expected.float()):
        raise ValueError(
            f"--model {file_name}: tensor {tensor.name} ({kind}) does not read back as transformers "
            "loads it; braid will not serve it in its own format (--quantization none does)"
        )
    return b


def row_order(processor, name: str, rows: int) -> np.ndarray | None:
    """The order transformers' tensor processor puts the rows of a matrix [rows, in] in, found by
    running it on the row numbers; None where it does more than reorder them (GPT-2's Conv1D
    matrices, which it transposes; GPT-2's output.weight, which it stores as lm_head itself)."""
    numbers = np.arange(rows).reshape(-1, 1)
    processed = processor.process(weights=numbers, name=name, parsed_parameters={"tensors": {}}, tensor_key_mapping={})
    order = np.asarray(processed.weights)
    if processed.name != name or order.shape != numbers.shape:
        return None
    if not np.array_equal(np.sort(order.reshape(-1)), numbers.reshape(-1)):
        return None  # it changes values, not only their order
    return order.reshape(-1)
