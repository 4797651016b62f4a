"""A build of the kernels checked against torch at start, on the CPU it runs on: a build that
computes wrong here (one no test has run on) is never used."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from braid.server.model.weights import Blocks, quantize_q8_0
from braid.server.runner.kernels.extension import INT8, QBLOCK, _cpu_kernels, has_bf16_rows
from braid.server.runner.kernels.ops import CpuKernelOps
from braid.server.runner.kernels.packing import PackedLinear, dense

_LOGGER = logging.getLogger(__name__)

_CHECKED: dict[str, bool] = {}


def passes_self_check(isa: str) -> bool:
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
        if not (
            torch.allclose(layer(x), x @ reference.t(), rtol=1e-4, atol=1e-3)
            and torch.equal(layer(x[:1]), layer(x)[:1])
            and torch.equal(layer.columns(torch.tensor([0, 69])), reference[[0, 69]])
        ):
            return False
    for weight in _random_blocks(70, 96, generator) if INT8 is not None else ():
        # the int8 path: within the activations' quantization error (half a step of 127 per block)
        reference = dense(weight, torch.float32, torch.device("cpu"))
        layer = PackedLinear(weight, None, int8=True)
        error = (layer(x) - x @ reference.t()).abs().max() / (x.abs().max() * reference.abs().sum(1).max())
        if not (
            error < 1 / 127
            and torch.equal(layer(x[1:2]), layer(x)[1:2])
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
            and torch.equal(layer(x[1:2, :95]), layer(x[:, :95])[1:2])
            and torch.equal(layer.columns(torch.tensor([0, 69])), reference[[0, 69]])
        ):
            return False
    norm = torch.rand(96, generator=generator)
    gate_up = torch.randn(5, 96, generator=generator)
    gate, up = gate_up.chunk(2, dim=-1)
    return (
        torch.allclose(ops.rms_norm(x, norm, 1e-5), F.rms_norm(x, (96,), norm, 1e-5), atol=1e-5)
        and torch.allclose(ops.swiglu(gate_up), F.silu(gate) * up, atol=1e-5)
        and torch.allclose(ops.geglu(gate_up), F.gelu(gate, approximate="tanh") * up, atol=1e-5)
    )


def _random_blocks(out: int, k: int, generator: torch.Generator) -> list[Blocks]:
    """A matrix [out, k] in each GGUF block format, of random quants and scales (not a real matrix's
    quantization: what the kernels compute from them is the same either way)."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator) * 0.1

    def quants(low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(low, high, (out, k // QBLOCK, QBLOCK), generator=generator).to(dtype)

    blocks = k // QBLOCK
    return [
        Blocks("q8_0", rand(out, blocks).half(), None, quants(-127, 128, torch.int8)),
        Blocks("q4_0", rand(out, blocks).half(), None, quants(0, 16, torch.uint8)),
        Blocks("q4_1", rand(out, blocks).half(), rand(out, blocks).half() - 0.05, quants(0, 16, torch.uint8)),
        Blocks("q6_k", rand(out, 2 * blocks), None, quants(-32, 32, torch.int8)),
        Blocks("q4_k", rand(out, blocks), rand(out, blocks), quants(0, 16, torch.uint8)),
    ]
