"""The decoder's building blocks: braid's own kernels on the CPU, torch's elsewhere.

On a CPU with AVX-512 or AVX2 + FMA, the linear layers, RMSNorm, SwiGLU and GeGLU, RoPE and the decode
steps' attention run in braid's C kernels (csrc/): each weight matrix is packed once into 32-column panels
in its own format (fp32, bf16, f16, or GGUF's Q8_0/Q4_0/Q4_1/Q6_K/Q4_K blocks), streamed from memory once
per call whatever the number of rows, and widened to fp32 in registers; or, with --activations int8, a
quantized matrix multiplies each row of x quantized to int8 per block of 32 with the CPU's integer dot
products (csrc/int8.c), and with --activations bf16 a bf16 matrix multiplies each row rounded to bf16
with AVX-512 BF16's vdpbf16ps (csrc/bf16.c). Each small op is one call
instead of several torch ops (csrc/kernels.h says why). Elsewhere (CUDA, an older CPU, a build
without a C compiler, or --kernels torch) the same functions run torch's ops on weights dequantized
to the compute dtype.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from braid.server.model.weights import FLOAT_FORMATS, Blocks, Weight, quantize_q8_0

_LOGGER = logging.getLogger(__name__)

PANEL = 32  # columns per packed panel
QBLOCK = 32  # rows of k per block of a panel
# A layer's row of DecodeStep's table, in the C enum's order (csrc/kernels.h says what each holds)
LAYER_FIELDS = ("input_norm", "qkv", "qkv_format", "qkv_bias", "o", "o_format", "post_norm", "gate_up",
                "gate_up_format", "down", "down_format", "k_cache", "v_cache", "q_norm", "k_norm", "attn_out_norm",
                "mlp_out_norm", "window", "cos", "sin")
# A LoRA adapter's row per layer and projection group in DecodeStep (csrc/kernels.h; runner/lora.py builds it)
LORA_FIELDS = ("at", "cols", "rank", "b0", "begin0", "end0", "b1", "begin1", "end1", "b2", "begin2", "end2",
               "fmt")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gating activations the C kernels run, in their enum's order
KV_LAYOUT = 2  # the KV cache the C attention reads: paged, [pages, KV heads, page size, head dim]
# The C kernels' formats, in their enum's order: (bytes per 32-weight row, bytes of scales ahead
# of each block of 32 rows).
FORMATS = {"f32": (128, 0), "bf16": (64, 0), "f16": (64, 0), "q8_0": (32, 64), "q4_0": (16, 64), "q4_1": (16, 128),
           "q6_k": (32, 256), "q4_k": (16, 256)}
FORMAT_CODES = {name: code for code, name in enumerate(FORMATS)}
ISA_VARIABLE = "BRAID_KERNELS_ISA"  # avx512_bf16, avx512_vnni, avx512, avx2_vnni or avx2: that build, not the best
ACTIVATIONS_CHOICES = ("auto", "int8", "bf16", "float32")  # --activations (EngineConfig)
BUILDS = "avx512_bf16, avx512_vnni, avx512, avx2_vnni, avx2"  # the kernels' builds, best first


try:
    from braid.server.runner import _cpu_kernels
except ImportError:  # built without a C compiler: torch's kernels do the work
    _cpu_kernels = None
if _cpu_kernels is not None and (
        (_cpu_kernels.PANEL, _cpu_kernels.QBLOCK, _cpu_kernels.LAYER_FIELDS, getattr(_cpu_kernels, "KV_LAYOUT", 1),
         _cpu_kernels.FORMATS, getattr(_cpu_kernels, "ACTIVATIONS", None), getattr(_cpu_kernels, "LORA_FIELDS", None))
        != (PANEL, QBLOCK, LAYER_FIELDS, KV_LAYOUT, tuple(FORMATS.values()), ACTIVATIONS, LORA_FIELDS)):
    # A stale build of the extension: its memory layout is not this module's. Never run it.
    _LOGGER.error("braid's C kernels were built for another layout than this code's (panels, blocks, table "
                  "fields, KV cache, formats, activations or LoRA fields): rebuild them (make install); running torch's kernels")
    _cpu_kernels = None
# The format flags of the int8 and bf16 paths (csrc/kernels.h: F_INT8, F_BF16_ROWS); None in a build without it.
INT8 = getattr(_cpu_kernels, "INT8", None)
BF16_ROWS = getattr(_cpu_kernels, "BF16_ROWS", None)


def has_bf16_rows() -> bool:
    """Whether the selected build of the kernels runs the bf16 path (it needs AVX-512 BF16)."""
    return BF16_ROWS is not None and _cpu_kernels.isa() is not None and _cpu_kernels.bf16_rows()


def kernels_isa() -> str | None:
    """The instruction set braid's kernels run in on this CPU: BRAID_KERNELS_ISA's if set, else
    the best the CPU has ('avx512_bf16', 'avx512_vnni', 'avx512', 'avx2_vnni', 'avx2'); None where they do
    not run.
    Selects it in the module."""
    if _cpu_kernels is None:
        return None
    wanted = os.environ.get(ISA_VARIABLE, "").strip().lower()
    supported = _cpu_kernels.isas()
    if wanted and wanted not in supported:
        raise ValueError(f"{ISA_VARIABLE}={wanted}: this CPU runs braid's kernels in "
                         f"{', '.join(supported) or 'no instruction set'} (built: {BUILDS})")
    for isa in [wanted] if wanted else supported:
        _cpu_kernels.select_isa(isa)
        if _passes_self_check(isa):
            return isa
        if wanted:
            raise ValueError(f"{ISA_VARIABLE}={wanted}: braid's {wanted} kernels fail their check on this CPU")
    return None


_CHECKED: dict[str, bool] = {}


def _passes_self_check(isa: str) -> bool:
    """A few small matmuls in every format and the row-wise kernels, against torch, once per
    instruction set and process: a build that computes wrong on this CPU (one no test has run on)
    is never used. Takes a few milliseconds."""
    if isa not in _CHECKED:
        try:
            _CHECKED[isa] = _self_check()
        except Exception:  # noqa: BLE001 (any failure means: do not use this build)
            _LOGGER.exception("braid's %s kernels failed their start-up check", isa)
            _CHECKED[isa] = False
        if not _CHECKED[isa]:
            _LOGGER.error("braid's %s kernels give wrong results on this CPU: not using them", isa)
    return _CHECKED[isa]


def _self_check() -> bool:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(70, 96, generator=generator)  # [out, in]: a partial panel, three blocks
    x = torch.randn(5, 96, generator=generator)
    ops = CpuKernelOps(_cpu_kernels.isa())
    for weight in (values, values.bfloat16(), quantize_q8_0(values)):
        reference = dense(weight, torch.float32, torch.device("cpu"))
        layer = PackedLinear(weight, None)
        if not (torch.allclose(layer(x), x @ reference.t(), rtol=1e-4, atol=1e-3)
                and torch.equal(layer(x[:1]), layer(x)[:1])
                and torch.equal(layer.columns(torch.tensor([0, 69])), reference[[0, 69]])):
            return False
    for weight in _random_blocks(70, 96, generator) if INT8 is not None else ():
        # the int8 path: within the activations' quantization error (half a step of 127 per block)
        reference = dense(weight, torch.float32, torch.device("cpu"))
        layer = PackedLinear(weight, None, int8=True)
        error = (layer(x) - x @ reference.t()).abs().max() / (x.abs().max() * reference.abs().sum(1).max())
        if not (error < 1 / 127 and torch.equal(layer(x[1:2]), layer(x)[1:2])
                and torch.equal(layer.columns(torch.tensor([0, 69])), reference[[0, 69]])):
            return False
    if has_bf16_rows():  # the bf16 path: within x's rounding to bf16 (2^-8 of each value; twice that), odd K
        weight = values[:, :95].bfloat16()
        reference = weight.float()
        layer = PackedLinear(weight, None, bf16=True)
        error = (layer(x[:, :95]) - x[:, :95] @ reference.t()).abs() / (x[:, :95].abs() @ reference.abs().t())
        if not (layer.bf16 and error.max() < 2 ** -7 and torch.equal(layer(x[1:2, :95]), layer(x[:, :95])[1:2])
                and torch.equal(layer.columns(torch.tensor([0, 69])), reference[[0, 69]])):
            return False
    norm = torch.rand(96, generator=generator)
    gate_up = torch.randn(5, 96, generator=generator)
    gate, up = gate_up.chunk(2, dim=-1)
    return (torch.allclose(ops.rms_norm(x, norm, 1e-5), F.rms_norm(x, (96,), norm, 1e-5), atol=1e-5)
            and torch.allclose(ops.swiglu(gate_up), F.silu(gate) * up, atol=1e-5)
            and torch.allclose(ops.geglu(gate_up), F.gelu(gate, approximate="tanh") * up, atol=1e-5))


def _random_blocks(out: int, k: int, generator: torch.Generator) -> list[Blocks]:
    """A matrix [out, k] in each GGUF block format, of random quants and scales (not a real matrix's
    quantization: what the kernels compute from them is the same either way)."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator) * 0.1

    def quants(low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(low, high, (out, k // QBLOCK, QBLOCK), generator=generator).to(dtype)

    blocks = k // QBLOCK
    return [Blocks("q8_0", rand(out, blocks).half(), None, quants(-127, 128, torch.int8)),
            Blocks("q4_0", rand(out, blocks).half(), None, quants(0, 16, torch.uint8)),
            Blocks("q4_1", rand(out, blocks).half(), rand(out, blocks).half() - 0.05, quants(0, 16, torch.uint8)),
            Blocks("q6_k", rand(out, 2 * blocks), None, quants(-32, 32, torch.int8)),
            Blocks("q4_k", rand(out, blocks), rand(out, blocks), quants(0, 16, torch.uint8))]


def format_of(weight: Weight) -> str:
    return weight.format if isinstance(weight, Blocks) else FLOAT_FORMATS.get(weight.dtype, "f32")


def dense(weight: Weight, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The matrix as a plain tensor [out, in] in dtype: blocks dequantized as GGUF's reference does."""
    if isinstance(weight, Blocks):
        weight = weight.dequantize()
    return weight.detach().to(device=device, dtype=dtype)


class Linear:
    """y = x @ W.T (+ bias), torch's matmul, W [out, in] held as [in, out].
    `add_into(y, x)` does y += x @ W.T in place; `columns(ids)` is the embedding lookup in a tied
    head: rows ids of W."""

    def __init__(self, weight: Weight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        self.weight = dense(weight, dtype, device).t().contiguous()
        self.bias = None if bias is None else bias.detach().to(device=device, dtype=dtype)
        self.in_features, self.out_features = self.weight.shape
        self.format, self.nbytes = format_of(self.weight), self.weight.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)

    def add_into(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y.addmm_(x, self.weight) if self.bias is None else y.addmm_(x, self.weight).add_(self.bias)

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.index_select(1, ids).t().contiguous()


class PackedLinear(Linear):
    """The weight packed into panels in its own format, for the C kernels' gemm: [ceil(out / 32),
    in, 32] for a float dtype; for GGUF blocks, per panel and block of 32 rows, the 32 columns'
    scales (and mins) then the 32 rows of quants, as bytes."""

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
        self.weight = (_pack_blocks(weight, self.int8) if isinstance(weight, Blocks)
                       else _pack_dense(weight, pairs=self.bf16))
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.nbytes = self.weight.nbytes

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
        _cpu_kernels.columns(self.weight.data_ptr(), self.code, self.in_features, self.out_features,
                             ids.data_ptr(), ids.shape[0], out.data_ptr(), out.stride(0))
        return out

    def _gemm(self, x: torch.Tensor, y: torch.Tensor, accumulate: bool) -> None:
        x = _rows(x)
        assert x.shape[1] == self.in_features and y.stride(-1) == 1
        if x.shape[0] == 0:  # no rows (a pass of prompt chunks that sample nothing): nothing to do,
            return           # as torch.mm does; the C kernel rejects M < 1
        _cpu_kernels.gemm(x.data_ptr(), x.stride(0), self.weight.data_ptr(), self.code, y.data_ptr(), y.stride(0),
                          x.shape[0], self.in_features, self.out_features, int(accumulate),
                          None if self.bias is None else self.bias.data_ptr(), torch.get_num_threads())


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
    """GGUF blocks -> panels [ceil(out / 32), in / 32, block bytes] uint8: per block of 32 rows, the
    32 columns' scales (then mins; Q6_K: the scales of rows 0-15, then of rows 16-31), then 32 rows
    of 32 quants (4-bit ones: column j in the low nibble of byte j, column j + 16 in its high one).
    interleaved (the int8 path's layout): the rows in 8 groups of 4, each column's 4 quants of a
    group in 4 consecutive bytes (4-bit ones: columns j and j + 16 in the low and high nibbles)."""
    n, blocks = b.q.shape[:2]
    panels = -(-n // PANEL)

    def by_panel(t: torch.Tensor) -> torch.Tensor:  # [n, blocks, ...] -> [panels, blocks, 32 columns, ...]
        t = torch.cat([t, t.new_zeros(panels * PANEL - n, *t.shape[1:])])
        return t.view(panels, PANEL, blocks, *t.shape[2:]).transpose(1, 2)

    if b.format == "q6_k":  # [n, 2 blocks of 16 rows per 32] -> [panels, blocks, 2, 32 columns]
        parts = [by_panel(b.d.view(n, blocks, 2)).transpose(2, 3)]
    else:
        parts = [by_panel(b.d)] + ([] if b.m is None else [by_panel(b.m)])
    q = by_panel(b.q).transpose(2, 3)  # [panels, blocks, 32 rows, 32 columns]
    if interleaved:  # [panels, blocks, 8 groups, 32 columns, 4 rows]
        q = q.reshape(panels, blocks, QBLOCK // 4, 4, PANEL).transpose(3, 4)
        if b.format in ("q4_0", "q4_1", "q4_k"):
            q = q[..., :PANEL // 2, :] | (q[..., PANEL // 2:, :] << 4)
    elif b.format in ("q4_0", "q4_1", "q4_k"):
        q = q[..., :PANEL // 2] | (q[..., PANEL // 2:] << 4)
    parts.append(q)
    return torch.cat([p.contiguous().view(torch.uint8).reshape(panels, blocks, -1) for p in parts], dim=-1)


class TorchOps:
    """The decoder's small ops in torch: on CUDA, on a CPU without AVX-512 or AVX2, without the C
    extension, and with --kernels torch. Chosen once, by `pick_ops`. Weights are dequantized to
    the compute dtype."""

    name = "torch"
    isa: str | None = None
    activations = "float32"  # the paths that round rows: "float32" (none), or int8, bf16 or int8+bf16 (CpuKernelOps)
    fused_decode = False  # DecodeStep and decode_attention need the C kernels

    def __init__(self, dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu")) -> None:
        self.dtype, self.device = dtype, device

    def linear(self, weight: Weight, bias: torch.Tensor | None) -> Linear:
        """weight: [out, in], float or GGUF blocks."""
        return Linear(weight, bias, self.dtype, self.device)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [N, hidden]."""
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [N, 2 I], gate then up. Returns silu(gate) * up, [N, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def geglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [N, 2 I], gate then up. Returns gelu_tanh(gate) * up, [N, I] (Gemma's MLP)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def activation(self, name: str):
        """The gated activation a family's MLP runs (Family.activation), as a function of gate_up."""
        return {"silu": self.swiglu, "gelu_pytorch_tanh": self.geglu}[name]

    def rope_tables(self, cos: torch.Tensor, signed_sin: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What `rope_` takes for a pass: the pass's rows of the tables, [N, D], looked up once per
        pass, not once per layer."""
        return cos[positions], signed_sin[positions]

    def rope_(self, qkv: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
              signed_sin: torch.Tensor) -> None:
        """Rotary embedding, in place, on the first `heads` heads of each row of qkv [N, ...]:
        x * cos[pos] + roll(x, D / 2) * signed_sin[pos]."""
        n = qkv.shape[0]
        x = qkv[:, :heads * head_dim].view(n, heads, head_dim)
        c, s = cos.unsqueeze(1), signed_sin.unsqueeze(1)
        x.copy_(torch.addcmul(x * c, x.roll(head_dim // 2, dims=-1), s))


class CpuKernelOps(TorchOps):
    """The same ops in braid's C kernels, on a CPU with AVX-512 or AVX2, activations in fp32: one C
    call each instead of half a dozen torch ops, weights packed into panels in their own format.
    activations "int8": a quantized matrix multiplies rows quantized to int8 per block (csrc/int8.c);
    "bf16": a bf16 matrix multiplies rows rounded to bf16 (csrc/bf16.c); "int8+bf16": both."""

    fused_decode = True

    def __init__(self, isa: str, activations: str = "float32") -> None:
        super().__init__(torch.float32, torch.device("cpu"))
        assert activations in ("int8", "bf16", "int8+bf16", "float32")
        self.isa, self.name, self.activations = isa, f"braid's {isa} kernels", activations

    def linear(self, weight: Weight, bias: torch.Tensor | None) -> Linear:
        paths = self.activations.split("+")
        return PackedLinear(weight, bias, int8="int8" in paths, bf16="bf16" in paths)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = _rows(x)
        out = torch.empty_like(x)
        _cpu_kernels.rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
                              x.shape[0], x.shape[1], eps)
        return out

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return _gated(_cpu_kernels.silu_mul, gate_up)

    def geglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return _gated(_cpu_kernels.gelu_tanh_mul, gate_up)

    def rope_tables(self, cos: torch.Tensor, signed_sin: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole tables [max_seq, D]: the C kernel looks positions up itself."""
        return cos, signed_sin

    def rope_(self, qkv: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
              signed_sin: torch.Tensor) -> None:
        assert qkv.stride(-1) == 1 and positions.dtype == torch.long and positions.is_contiguous()
        _cpu_kernels.rope(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], heads, head_dim, positions.data_ptr(),
                          cos.data_ptr(), signed_sin.data_ptr())


def _gated(kernel, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up by a C kernel (silu_mul, gelu_tanh_mul); gate_up: [N, 2 I], gate then up."""
    gate_up = _rows(gate_up)
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, width)
    kernel(gate_up.data_ptr(), gate_up.stride(0), rows, width, out.data_ptr(), out.stride(0))
    return out


def pick_ops(device: torch.device, dtype: torch.dtype, allow_kernels: bool = True,
             activations: str = "float32") -> TorchOps:
    """braid's C kernels where they run (and are allowed: --kernels auto), torch's elsewhere.
    dtype: the compute dtype torch's ops run in (the C kernels' is fp32). activations
    (--activations): int8 runs quantized matrices on int8 rows where the C kernels have that path;
    bf16 runs bf16 matrices on bf16 rows where the build has AVX-512 BF16; auto runs both where they
    are; float32, and torch's ops, run fp32 rows."""
    assert activations in ACTIVATIONS_CHOICES
    isa = kernels_isa() if allow_kernels and device.type == "cpu" else None
    if isa is None or dtype != torch.float32:
        if activations in ("int8", "bf16"):
            _LOGGER.warning("--activations %s: only braid's C kernels have an %s path; running float32", activations,
                            activations)
        return TorchOps(dtype, device)
    if activations == "bf16" and not has_bf16_rows():
        _LOGGER.warning("--activations bf16: braid's %s kernels have no bf16 path (it needs AVX-512 BF16); running "
                        "float32", isa)
    paths = [path for path, runs in (("int8", INT8 is not None), ("bf16", has_bf16_rows()))
             if runs and activations in ("auto", path)]  # auto: each is the fastest its format has
    return CpuKernelOps(isa, "+".join(paths) or "float32")


def activations_of(layers: list[Linear]) -> str:
    """What a decoder's matrices multiply, for ModelInfo.activations: "int8", "bf16", "int8+bf16"
    (the paths some matrix runs, each on its formats), or "float32" where none rounds its rows."""
    rows = {getattr(layer, "rows", "float32") for layer in layers}
    return "+".join(path for path in ("int8", "bf16") if path in rows) or "float32"


KV_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}  # a KV cache's dtypes, in C


def _kv_format(cache: torch.Tensor) -> int:
    """The C format code of a KV cache tensor's dtype."""
    return FORMAT_CODES[KV_FORMATS[cache.dtype]]


def decode_attention(qkv: torch.Tensor, heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, scale: float,
                     softcap: float | None = None, window: int | None = None) -> None:
    """The C kernel for the decode rows of a pass. qkv: [B, (H + 2 KVH) D], one row per sequence,
    after RoPE. Writes each sequence's new key and value at positions[b], through its page table
    tables[b] ([B, pages] long), into the paged cache [pages, KVH, P, D], and its attention over
    positions [0, positions[b]] (the last `window` of them in a sliding window) into out [B, H D]:
    scores q.k * scale, soft-capped to softcap * tanh(score / softcap) if softcap."""
    b = qkv.shape[0]
    _, kv_heads, page_size, d = k_cache.shape
    assert qkv.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert tables.dtype == positions.dtype == torch.long and tables.is_contiguous() and positions.is_contiguous()
    q = qkv.data_ptr()
    k, v = q + heads * d * qkv.element_size(), q + (heads + kv_heads) * d * qkv.element_size()
    _cpu_kernels.decode_attention(q, k, v, qkv.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                  _kv_format(k_cache), tables.data_ptr(), tables.shape[1],
                                  positions.data_ptr(), b, heads, kv_heads, d, page_size, scale, softcap or 0.0,
                                  window or 0, out.data_ptr(), out.stride(0), torch.get_num_threads())


class DecodeStep:
    """Every layer of a decode-only pass in one call (_cpu_kernels.decode_step): no Python and no
    GIL between the layers' kernels. Holds the table of each layer's weight and cache pointers, and
    its own settings (LAYER_FIELDS); a field a layer does not have is 0."""

    def __init__(self, layers, rope: dict[str, tuple[torch.Tensor, torch.Tensor]], num_heads: int,
                 num_kv_heads: int, head_dim: int, eps: float, scale: float, softcap: float | None,
                 activation: str, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]) -> None:
        """layers: the decoder's LayerWeights; rope: (cos, signed sin) tables [max_seq, D] by
        LayerWeights.rope; scale, softcap: the attention's (softcap None: none)."""
        def ptr(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.data_ptr()

        def row(w, k: torch.Tensor, v: torch.Tensor) -> list[int]:
            cos, sin = rope[w.rope]
            fields = dict(input_norm=ptr(w.input_norm), qkv=ptr(w.qkv.weight), qkv_format=w.qkv.code,
                          qkv_bias=ptr(w.qkv.bias), o=ptr(w.o.weight), o_format=w.o.code, post_norm=ptr(w.post_norm),
                          gate_up=ptr(w.gate_up.weight), gate_up_format=w.gate_up.code, down=ptr(w.down.weight),
                          down_format=w.down.code, k_cache=ptr(k), v_cache=ptr(v), q_norm=ptr(w.q_norm),
                          k_norm=ptr(w.k_norm), attn_out_norm=ptr(w.attn_out_norm), mlp_out_norm=ptr(w.mlp_out_norm),
                          window=w.window or 0, cos=ptr(cos), sin=ptr(sin))
            return [fields[name] for name in LAYER_FIELDS]

        self.table = torch.tensor([row(w, k, v) for w, k, v in zip(layers, k_cache, v_cache)], dtype=torch.long)
        self._keep = (layers, k_cache, v_cache, rope)  # the memory the table points into
        self.hidden = layers[0].qkv.in_features
        self.intermediate = layers[0].down.in_features
        self.shape = (num_heads, num_kv_heads, head_dim, self.intermediate, len(layers), k_cache[0].shape[2],
                      _kv_format(k_cache[0]))
        self.activation = ACTIVATIONS.index(activation)
        self.eps, self.scale, self.softcap = eps, scale, softcap or 0.0
        self._scratch: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                 lora: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
        """x: [B, hidden] embeddings, contiguous; tables: [B, pages] long, each sequence's page
        table. lora: the rows' LoRA adapters (LoraPass.step_args: each row's index into the adapters'
        tables, or -1; the tables' addresses; their widest A^T), or None. On return x holds the last
        layer's residual stream."""
        b = x.shape[0]
        assert x.is_contiguous() and positions.is_contiguous() and tables.is_contiguous()
        if not self._scratch or self._scratch[0].shape[0] < b:
            heads, kv_heads, d, inter = self.shape[:4]
            widths = (self.hidden, (heads + 2 * kv_heads) * d, heads * d, 2 * inter, inter)
            self._scratch = [x.new_empty(b, w) for w in widths]
        h, qkv, attn, gate_up, act = self._scratch
        _cpu_kernels.decode_step(b, self.hidden, *self.shape, self.activation, self.eps, self.scale, self.softcap,
                                 self.table.data_ptr(), positions.data_ptr(), tables.data_ptr(), tables.shape[1],
                                 x.data_ptr(), h.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(),
                                 act.data_ptr(), torch.get_num_threads(),
                                 *((lora[0].data_ptr(), lora[1].data_ptr(), lora[2]) if lora else (None, None, 0)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along its last dim (rows may be strided), as the C kernels read it."""
    return x if x.stride(-1) == 1 else x.contiguous()
