"""A build of the kernels checked against torch at start, on the CPU it runs on: a build that
computes wrong here (one no test has run on) is never used."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from braid.server.model.weights import Blocks
from braid.server.runner.kernels.extension import INT8, QBLOCK, _cpu_kernels, has_bf16_rows
from braid.server.runner.kernels.ops import CpuKernelOps
from braid.server.runner.kernels.packing import PackedLinear, dense
from braid.server.runner.kernels.step import decode_attention
from braid.server.runner import kv_cache

_LOGGER = logging.getLogger(__name__)

_CHECKED: dict[str, bool] = {}


def passes_self_check(isa: str) -> bool:
    """A few small matmuls in every format and the row-wise kernels, against torch, and the matmuls'
    bits against the plain-C reference (csrc/reference.c), once per instruction set and process: a
    build that computes wrong on this CPU (one no test has run on) is never used. Takes a few
    milliseconds."""
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
    for weight in (values, values.bfloat16(), _q8_0(values)):
        reference = dense(weight, torch.float32, torch.device("cpu"))
        layer = PackedLinear(weight, None)
        if not (
            torch.allclose(layer(x), x @ reference.t(), rtol=1e-4, atol=1e-3)
            and torch.equal(layer(x), layer.reference(x))
            and torch.equal(layer(x[:1]), layer(x)[:1])
            and torch.equal(layer.columns(torch.tensor([0, 69])), reference[[0, 69]])
        ):
            return False
    wide = torch.randn(5, 256, generator=generator)  # a K-quant's super-block of rows
    for weight in _random_blocks(70, 96, generator) if INT8 is not None else ():
        # the int8 path: within the activations' quantization error (half a step of 127 per block)
        reference = dense(weight, torch.float32, torch.device("cpu"))
        layer = PackedLinear(weight, None, int8=True)
        rows = x if weight.shape[1] == x.shape[1] else wide
        error = (layer(rows) - rows @ reference.t()).abs().max() / (rows.abs().max() * reference.abs().sum(1).max())
        if not (
            error < 1 / 127
            and torch.equal(layer(rows), layer.reference(rows))
            and torch.equal(layer(rows[1:2]), layer(rows)[1:2])
            and torch.equal(layer.columns(torch.tensor([0, 69])), reference[[0, 69]])
        ):
            return False
    if has_bf16_rows():  # the bf16 path: within x's rounding to bf16 (2^-8 of each value; twice that), odd K
        weight = values[:, :95].bfloat16()
        reference = weight.float()
        layer = PackedLinear(weight, None, bf16=True)
        error = (layer(x[:, :95]) - x[:, :95] @ reference.t()).abs() / (x[:, :95].abs() @ reference.abs().t())
        if not (
            layer.bf16
            and error.max() < 2**-7
            and torch.equal(layer(x[:, :95]), layer.reference(x[:, :95]))
            and torch.equal(layer(x[1:2, :95]), layer(x[:, :95])[1:2])
            and torch.equal(layer.columns(torch.tensor([0, 69])), reference[[0, 69]])
        ):
            return False
    if not (_q8_0_attention_checks(generator) and _tiled_attention_checks(generator)):
        return False
    norm = torch.rand(96, generator=generator)
    gate_up = torch.randn(5, 96, generator=generator)
    gate, up = gate_up.chunk(2, dim=-1)
    return (
        torch.allclose(ops.rms_norm(x, norm, 1e-5), F.rms_norm(x, (96,), norm, 1e-5), atol=1e-5)
        and torch.allclose(ops.swiglu(gate_up), F.silu(gate) * up, atol=1e-5)
        and torch.allclose(ops.geglu(gate_up), F.gelu(gate, approximate="tanh") * up, atol=1e-5)
    )


def _q8_0_attention_checks(generator: torch.Generator) -> bool:
    """Decode attention over a q8_0 KV cache (--kv-cache-dtype q8_0), two sequences of 20 positions
    on pages of 16, against torch's over the dequantized cache; the new key and value written as
    runner/kv_cache.py quantizes them."""
    heads, kv_heads, d, page = 4, 2, 64, 16
    k_cache, v_cache = (
        kv_cache.quantize_q8_0(torch.randn(4, kv_heads, page, d, generator=generator)) for _ in range(2)
    )
    qkv = torch.randn(2, (heads + 2 * kv_heads) * d, generator=generator)
    tables, positions = torch.tensor([[3, 1], [0, 2]]), torch.tensor([19, 19])
    out = torch.empty(2, heads * d)
    decode_attention(qkv, heads, k_cache, v_cache, tables, positions, out, d**-0.5)
    for b in range(2):
        k_new, v_new = qkv[b, heads * d :].view(2, kv_heads, d)
        if not torch.equal(k_cache[tables[b, 1], :, 3], kv_cache.quantize_q8_0(k_new)):
            return False
        if not torch.equal(v_cache[tables[b, 1], :, 3], kv_cache.quantize_q8_0(v_new)):
            return False
        keys, values = (
            kv_cache.dequantize_q8_0(c[tables[b]].transpose(0, 1).reshape(kv_heads, -1, c.shape[-1])[:, :20])
            for c in (k_cache, v_cache)
        )
        q = qkv[b, : heads * d].view(kv_heads, heads // kv_heads, d)
        expected = F.scaled_dot_product_attention(q, keys, values, scale=d**-0.5)  # [KVH, G, D]
        if not torch.allclose(out[b], expected.reshape(-1), rtol=1e-4, atol=1e-5):
            return False
    return True


def _tiled_attention_checks(generator: torch.Generator) -> bool:
    """A prompt chunk's rows (keys written already: in tiles, csrc/attention.c), 20 of one sequence
    from mid-page, past a whole block of 64 positions (which every row attends: their heads scored
    and weighed together), over an fp32 and a q8_0 cache: each row the bits it gets alone, and
    torch's answer to rounding for the last."""
    heads, kv_heads, d, page = 4, 2, 64, 16
    qkv = torch.randn(20, (heads + 2 * kv_heads) * d, generator=generator)
    pages = [3, 1, 5, 0, 2, 4]
    tables, positions = torch.tensor([pages]).expand(20, 6).contiguous(), torch.arange(70, 90)
    for encode in (lambda c: c, kv_cache.quantize_q8_0):
        k_cache, v_cache = (encode(torch.randn(6, kv_heads, page, d, generator=generator)) for _ in range(2))
        out, alone = torch.empty(20, heads * d), torch.empty(1, heads * d)
        decode_attention(qkv, heads, k_cache, v_cache, tables, positions, out, d**-0.5, write=False)
        for b in range(20):
            decode_attention(
                qkv[b : b + 1], heads, k_cache, v_cache, tables[:1], positions[b : b + 1], alone, d**-0.5, write=False
            )
            if not torch.equal(out[b], alone[0]):
                return False
    keys, values = (
        kv_cache.dequantize_q8_0(c[pages].transpose(0, 1).reshape(kv_heads, -1, c.shape[-1])[:, :90])
        for c in (k_cache, v_cache)
    )
    q = qkv[19, : heads * d].view(kv_heads, heads // kv_heads, d)
    expected = F.scaled_dot_product_attention(q, keys, values, scale=d**-0.5)  # [KVH, G, D], all 90 positions
    return torch.allclose(out[19], expected.reshape(-1), rtol=1e-4, atol=1e-5)


def _q8_0(values: torch.Tensor) -> Blocks:
    """values [out, in] in Q8_0 blocks, quantized in torch: a scale per block of 32, its largest
    value at 127. (model/weights.quantize_q8_0 is llama.cpp's bit-exact rounding, through gguf-py,
    whose import was half the check's cost at every start; the check needs only some Q8_0 matrix
    and its own dequantization.)"""
    blocks = values.reshape(values.shape[0], -1, QBLOCK)  # [out, in / 32, 32]
    d = (blocks.abs().amax(-1) / 127).half()
    q = (blocks / d.float().clamp(min=2**-24).unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return Blocks("q8_0", d, None, q)


def _random_blocks(out: int, k: int, generator: torch.Generator) -> list[Blocks]:
    """A matrix [out, k] in each GGUF block format (the K-quants: [out, 256], one super-block), of random
    quants and scales (not a real matrix's quantization: what the kernels compute from them is the
    same either way)."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator) * 0.1

    def scales(low: int, high: int, groups: int) -> torch.Tensor:  # a K-quant's int8 sub-block ones
        return torch.randint(low, high, (out, groups), generator=generator).to(torch.int8)

    def quants(low: int, high: int, dtype: torch.dtype, k: int = k) -> torch.Tensor:
        return torch.randint(low, high, (out, k // QBLOCK, QBLOCK), generator=generator).to(dtype)

    blocks, top = k // QBLOCK, 256 // QBLOCK
    return [
        Blocks("q8_0", rand(out, blocks).half(), None, quants(-127, 128, torch.int8)),
        Blocks("q4_0", rand(out, blocks).half(), None, quants(0, 16, torch.uint8)),
        Blocks("q4_1", rand(out, blocks).half(), rand(out, blocks).half() - 0.05, quants(0, 16, torch.uint8)),
        Blocks("q6_k", scales(-128, 128, 2 * top), None, quants(-32, 32, torch.int8, 256), rand(out, 1, 1).half()),
        Blocks("q4_k", scales(0, 64, top), scales(0, 64, top), quants(0, 16, torch.uint8, 256), rand(out, 1, 2).half()),
    ]
