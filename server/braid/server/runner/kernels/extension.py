"""braid's C extension (csrc/, built by setup.py), loaded once and checked against this code's
layout, and that layout's constants. None where it is not built or stale: torch's ops run."""

from __future__ import annotations

import logging
from typing import NamedTuple

_LOGGER = logging.getLogger(__name__)

PANEL = 32  # columns per packed panel
QBLOCK = 32  # rows of k per block of a panel
U6_LIFT = 32  # a 6-bit quant (Q6_K's, in [-32, 31]) is stored as q + 32, 0..63 (csrc/formats.h)
# A layer's row of DecodeStep's table, in the C enum's order (csrc/kernels.h says what each holds)
LAYER_FIELDS = (
    "input_norm",
    "qkv",
    "qkv_format",
    "qkv_bias",
    "o",
    "o_format",
    "post_norm",
    "gate_up",
    "gate_up_format",
    "down",
    "down_format",
    "k_cache",
    "v_cache",
    "q_norm",
    "k_norm",
    "attn_out_norm",
    "mlp_out_norm",
    "window",
    "cos",
    "sin",
)
# A LoRA adapter's row per layer and projection group in DecodeStep (csrc/kernels.h; runner/lora.py builds it)
LORA_FIELDS = ("at", "cols", "rank", "b0", "begin0", "end0", "b1", "begin1", "end1", "b2", "begin2", "end2", "fmt")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gating activations the C kernels run, in their enum's order
# the KV cache the C attention reads: paged, [pages, KV heads, page size, head dim], of f32, bf16, f16 or q8_0 rows
KV_LAYOUT = 3
# The C kernels' weight formats by name, in the order of their codes: csrc/formats.h has one row per
# format, which the extension exports (FORMATS below). The names are what the rest of braid calls a
# format by (a weight's, the KV cache's, LoRA's), with or without the extension, and are checked
# against the extension's rows when it loads.
FORMAT_NAMES = ("f32", "bf16", "f16", "q8_0", "q4_0", "q4_1", "q6_k", "q4_k")
FORMAT_CODES = {name: code for code, name in enumerate(FORMAT_NAMES)}
ISA_VARIABLE = "BRAID_KERNELS_ISA"  # avx512_bf16, avx512_vnni, avx512, avx2_vnni or avx2: that build, not the best
BUILDS = "avx512_bf16, avx512_vnni, avx512, avx2_vnni, avx2"  # the kernels' builds, best first


try:
    from braid.server.runner import _cpu_kernels
except ImportError:  # built without a C compiler: torch's kernels do the work
    _cpu_kernels = None
if _cpu_kernels is not None and (
    (
        _cpu_kernels.PANEL,
        _cpu_kernels.QBLOCK,
        _cpu_kernels.LAYER_FIELDS,
        getattr(_cpu_kernels, "KV_LAYOUT", 1),
        tuple(row[0] if isinstance(row, tuple) else row for row in _cpu_kernels.FORMATS),
        getattr(_cpu_kernels, "ACTIVATIONS", None),
        getattr(_cpu_kernels, "LORA_FIELDS", None),
        getattr(_cpu_kernels, "U6_LIFT", None),
    )
    != (PANEL, QBLOCK, LAYER_FIELDS, KV_LAYOUT, FORMAT_NAMES, ACTIVATIONS, LORA_FIELDS, U6_LIFT)
):
    # A stale build of the extension: its memory layout is not this module's. Never run it.
    _LOGGER.error(
        "braid's C kernels were built for another layout than this code's (panels, blocks, table "
        "fields, KV cache, formats, activations, LoRA fields or 6-bit quants' lift): rebuild them (make install); "
        "running torch's kernels"
    )
    _cpu_kernels = None


class Format(NamedTuple):
    """A weight format's row of the C kernels' table (csrc/formats.h), as the extension exports it."""

    name: str
    block_rows: int  # rows of k per block of a panel: 1 (a float format) or QBLOCK
    bits: int  # per stored value: 32, 16 (float formats), 8 or 4 (quants)
    block_bytes: int  # one block of a panel: its head, then block_rows rows of 32 values
    head_bytes: int  # a quantized block's scales (then mins) ahead of its rows; 0 for a float format
    scale_bytes: int  # each scale's: 2 (fp16, GGUF's own), 1 (int8, the K-quants' sub-block ones), 0 (none)
    groups: int  # scales per column per block (Q6_K: 2, one per 16 rows)
    offset: int  # a quantized weight is d (q - offset) + min m: Q4_0's offset is 8,
    min: int  # and min +1 (Q4_1), -1 (Q4_K) or 0 (no mins after the scales)
    super_bytes: int  # a K-quant's super-block scales in a panel, per 256 rows (fp16 d, then dmin); 0


# Each format's traits, from the extension's table; empty without it (torch's kernels need none).
FORMATS: dict[str, Format] = {row[0]: Format(*row) for row in _cpu_kernels.FORMATS} if _cpu_kernels is not None else {}
# The format flags of the int8 and bf16 paths (csrc/kernels.h: F_INT8, F_BF16_ROWS); None in a build without it.
INT8 = getattr(_cpu_kernels, "INT8", None)
BF16_ROWS = getattr(_cpu_kernels, "BF16_ROWS", None)
# The format code of a matrix of parts in different formats (csrc/kernels.h: F_PARTS; a decode step's).
PARTS = getattr(_cpu_kernels, "PARTS", None)


def has_bf16_rows() -> bool:
    """Whether the selected build of the kernels runs the bf16 path (it needs AVX-512 BF16)."""
    return BF16_ROWS is not None and _cpu_kernels.isa() is not None and _cpu_kernels.bf16_rows()
