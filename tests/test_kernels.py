"""braid's C kernels for the CPU decoder (server/braid/server/runner/csrc/), in every weight format
and every instruction-set build this CPU runs (AVX-512 and AVX2 where it has both; the AVX2 build is
what BRAID_KERNELS_ISA=avx2 forces).

They must give torch's answer to rounding, and give a row the same bits whatever other rows share
the call: that is what lets a seeded or greedy request come out the same in any batch. A float
format must give, bit for bit, the fp32 kernel's answer on its values; a quantized one, torch's
answer (to rounding) on the weights gguf-py dequantizes, and an embedding lookup those weights exactly.
With int8 activations (--activations int8), a quantized format gives torch's answer to rounding on
x quantized per row and block of 32 as the kernels quantize it, so within that quantization's error
of the fp32 answer, and the same bits in every build. With bf16 activations (--activations bf16, the
avx512_bf16 build: AVX-512 BF16's vdpbf16ps), a bf16 matrix gives torch's answer to rounding on x
rounded to bf16, so within 2^-8 of the fp32 answer's sum of |x W|.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from braid.server import resources
from braid.server.model.weights import BLOCK_FORMATS, FLOAT_FORMATS, Blocks, unpack_gguf
from gguf_files import K_QUANTS, k_quant_bytes
from braid.server.runner.kernels import extension, packing, pick, selfcheck, step
from braid.server.runner import kv_cache
from braid.server.runner.kernels.ops import CpuKernelOps, TorchOps
from braid.server.runner.kernels.packing import PackedLinear
from braid.server.runner.kernels.pick import pick_ops

CPU = torch.device("cpu")
ISAS = extension._cpu_kernels.isas() if extension._cpu_kernels is not None else []
TORCH = TorchOps()
needs_kernels = pytest.mark.skipif(
    not ISAS, reason="this CPU has neither AVX-512 nor AVX2: braid's C kernels do not run here"
)
QUANTIZED = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q6_k": GGMLQuantizationType.Q6_K,
    "q4_k": GGMLQuantizationType.Q4_K,
}
FLOATS = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}

# (in, out): the SmolLM2 shapes, the tiny test model's, and odd sizes that leave a partial panel.
# Quantized formats need `in` a multiple of 32 (GGUF's block size), the K-quants of 256.
SHAPES = [(576, 960), (1536, 576), (64, 128), (577, 100), (3, 17), (64, 33)]
BLOCK_SHAPES = [(576, 960), (1536, 577), (64, 33), (96, 17), (32, 1)]
K_SHAPES = [(1536, 577), (256, 33), (512, 100)]
ROWS = [1, 3, 7, 12, 16, 128]


@pytest.fixture(params=ISAS or ["none"])
def isa(request):
    """Each instruction-set build of the kernels this CPU runs, selected for the test."""
    if not ISAS:
        pytest.skip("this CPU has neither AVX-512 nor AVX2: braid's C kernels do not run here")
    before = extension._cpu_kernels.isa()
    extension._cpu_kernels.select_isa(request.param)
    yield CpuKernelOps(request.param)
    extension._cpu_kernels.select_isa(before or ISAS[0])


def matrix(fmt: str, shape: tuple[int, int], seed: int):
    """(the matrix [out, in] as braid's loader gives it, its values in fp32 as the reference has
    them): GGUF blocks made and dequantized by gguf-py, or a float tensor."""
    k, n = shape
    torch.manual_seed(seed)
    values = torch.randn(n, k)
    if fmt in FLOATS:
        weight = values.to(FLOATS[fmt])
        return weight, weight.float()
    raw = k_quant_bytes(fmt, n, k, seed) if fmt in K_QUANTS else quants.quantize(values.numpy(), QUANTIZED[fmt])
    return unpack_gguf(fmt, raw), torch.from_numpy(np.asarray(quants.dequantize(raw, QUANTIZED[fmt])))


def test_the_extension_is_built_and_matches_this_code():
    """`make install` compiles it; without it (or with a stale build, whose layout the module checks
    when imported) braid silently runs torch's slower kernels."""
    assert extension._cpu_kernels is not None, "braid.server.runner._cpu_kernels was not built, or is stale"
    assert extension._cpu_kernels.LAYER_FIELDS == extension.LAYER_FIELDS
    assert tuple(extension.FORMATS) == extension.FORMAT_NAMES


def test_the_c_table_has_every_format_braid_loads_and_these_tests_cover():
    """csrc/formats.h's rows are the formats: the loader's block formats are its quantized rows, torch's
    float dtypes its float rows, and every row is tested here (a new row fails this until it is)."""
    formats = extension.FORMATS
    assert {name for name, f in formats.items() if f.scale_bytes} == set(BLOCK_FORMATS) == set(QUANTIZED)
    assert {name for name, f in formats.items() if not f.scale_bytes} == set(FLOAT_FORMATS.values()) == set(FLOATS)
    for name, f in formats.items():  # the bytes follow from the row
        assert f.block_bytes == f.head_bytes + f.block_rows * 32 * f.bits // 8, name
        assert f.head_bytes == 32 * f.scale_bytes * (f.groups + (f.min != 0)), name


def test_the_kernels_are_used_only_where_they_run(monkeypatch):
    assert type(pick_ops(CPU, torch.float32, allow_kernels=False)) is TorchOps
    assert type(pick_ops(torch.device("cuda"), torch.bfloat16)) is TorchOps
    assert type(TORCH.linear(torch.randn(4, 4), None)) is packing.Linear
    assert (type(pick_ops(CPU, torch.float32)) is CpuKernelOps) == bool(ISAS)
    monkeypatch.setenv(extension.ISA_VARIABLE, "sse2")
    with pytest.raises(ValueError, match="BRAID_KERNELS_ISA=sse2"):
        pick_ops(CPU, torch.float32)


@needs_kernels
def test_the_isa_variable_forces_a_build(monkeypatch):
    """BRAID_KERNELS_ISA=avx2 runs the AVX2 build on an AVX-512 CPU too (and is the best here
    when the CPU has no AVX-512)."""
    monkeypatch.setenv(extension.ISA_VARIABLE, "avx2")
    ops = pick_ops(CPU, torch.float32)
    assert ops.isa == "avx2" and extension._cpu_kernels.isa() == "avx2"
    monkeypatch.delenv(extension.ISA_VARIABLE)
    assert pick_ops(CPU, torch.float32).isa == ISAS[0]


@pytest.mark.parametrize("fmt", [*FLOATS, *QUANTIZED])
def test_packed_matmul_in_every_format_matches_the_dequantized_reference(isa, fmt):
    """x @ W.T at 1, 3, 16 and 128 rows, with bias and accumulating, against torch on the fp32
    values of W (gguf-py's dequantization for a GGUF format); a float format bit for bit as the fp32
    kernel on those values."""
    shapes = K_SHAPES if fmt in K_QUANTS else BLOCK_SHAPES if fmt in QUANTIZED else SHAPES
    for i, shape in enumerate(shapes):
        weight, reference = matrix(fmt, shape, seed=i)
        k, n = shape
        bias = torch.randn(n)
        layer, plain, fp32 = isa.linear(weight, bias), isa.linear(weight, None), isa.linear(reference, bias)
        assert layer.format == fmt
        for m in ROWS:
            x = torch.randn(m, k)
            out = layer(x)
            torch.testing.assert_close(out, torch.addmm(bias, x, reference.t()), rtol=1e-4, atol=2e-3)
            if fmt in FLOATS:
                assert torch.equal(out, fp32(x)), (shape, m)
            y = torch.randn(m, n)
            expected = y + x @ reference.t()
            assert plain.add_into(y, x) is y
            torch.testing.assert_close(y, expected, rtol=1e-4, atol=2e-3)


@pytest.mark.parametrize("fmt", [*FLOATS, *QUANTIZED])
def test_an_embedding_lookup_reads_the_packed_head_exactly(isa, fmt):
    weight, reference = matrix(fmt, (256, 101), seed=7)  # a vocabulary of 101, hidden 256
    ids = torch.tensor([0, 100, 31, 32, 33, 64, 5, 5])
    assert torch.equal(isa.linear(weight, None).columns(ids), reference[ids])
    assert torch.equal(TORCH.linear(weight, None).columns(ids), reference[ids])
    with pytest.raises(IndexError, match="101"):
        isa.linear(weight, None).columns(torch.tensor([101]))


@pytest.mark.parametrize("fmt", [*FLOATS, *QUANTIZED])
def test_a_row_gets_the_same_bits_alone_and_in_a_batch(isa, fmt):
    weight, _ = matrix(fmt, (512, 100), seed=1)
    layer = isa.linear(weight, torch.randn(100))
    x = torch.randn(70, 512)
    together = layer(x)
    for row in (0, 1, 12, 13, 69):
        assert torch.equal(layer(x[row : row + 1]), together[row : row + 1]), row
    # and in a batch of another size, where the rows split into tiles differently
    assert torch.equal(layer(x[5:22]), together[5:22])


def reference(layer, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """csrc/reference.c's answer for a packed layer (or anything with its fields: a weight packed for a
    path this CPU lacks), whichever build is selected."""
    return PackedLinear.reference(layer, x, y)


def exact_weights(weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(W [out, in] in float64 as its format defines it, d (q - offset) + min m computed exactly; a
    bound on every term a weight puts into the kernels' sums, |d| (|q| + offset) + |m|)."""
    if not isinstance(weight, Blocks):
        return weight.double(), weight.double().abs()
    f = extension.FORMATS[weight.format]
    n, blocks = weight.q.shape[:2]
    d = weight.scales().double().view(n, blocks, f.groups, 1).expand(-1, -1, -1, 32 // f.groups).reshape(n, blocks, 32)
    q, m = weight.q.double(), 0 if weight.m is None else weight.scales(mins=True).double().unsqueeze(-1)
    return (d * (q - f.offset) + f.min * m).view(n, -1), (d.abs() * (q.abs() + f.offset) + abs(m)).view(n, -1)


# (the path, the format) of every matmul the contract says gives the same bits in every build
REFERENCE_PATHS = [("float32", fmt) for fmt in [*FLOATS, *QUANTIZED]] + [("int8", fmt) for fmt in QUANTIZED]
# rows: one (the one-row path), tiles of every build (AVX2's int8 tiles of 2 and 3, AVX-512's of 6 taking
# turns), past 16 (long k-blocks) and past 64 (chunks of rows)
REFERENCE_ROWS = [1, 2, 3, 7, 13, 17, 70]


@pytest.mark.parametrize("path, fmt", REFERENCE_PATHS, ids=[f"{p}-{f}" for p, f in REFERENCE_PATHS])
def test_every_build_gives_the_bits_of_the_plain_c_reference(isa, path, fmt):
    """csrc/kernels.h: each output of the matmul is summed lane by lane in a fixed order, so every
    build, whatever its vector width, gives the bits of csrc/reference.c, which sums the same terms
    one value at a time (float32 rows: the same fused multiply-add chain and folds; int8 rows: the
    same quantization of x, exact integer sums and folds). With bias, and added into y.

    And the reference is within its rounding of the exact answer, from the arithmetic: every term
    of an output passes through at most K + 64 roundings (a scale group's chain of up to 32, its fold,
    one fold per block, the bias and y), each off by at most 2^-24 of the sum of the terms'
    magnitudes, |x| (|d| (|q| + offset) + |m|) summed over k, plus |bias| and |y|."""
    ops = CpuKernelOps(isa.isa, activations="int8" if path == "int8" else "float32")
    shapes = [(512, 100), (256, 33)] + ([(577, 40), (3, 17)] if fmt in FLOATS else [(1536, 40)])
    for i, (k, n) in enumerate(shapes):
        weight, _ = matrix(fmt, (k, n), seed=i)
        layer, plain = ops.linear(weight, torch.randn(n)), ops.linear(weight, None)
        assert layer.rows == path
        exact, magnitude = exact_weights(weight)
        for m in REFERENCE_ROWS:
            x = torch.randn(m, k)
            expected = reference(layer, x)
            assert torch.equal(layer(x).view(torch.int32), expected.view(torch.int32)), (isa.isa, (k, n), m)
            y = torch.randn(m, n)
            into = reference(plain, x, y.clone())
            assert torch.equal(plain.add_into(y, x).view(torch.int32), into.view(torch.int32)), (isa.isa, (k, n), m)
            rows = quantized_rows(x) if path == "int8" else x.double()  # what the reference multiplies
            bound = (k + 64) * 2.0**-24 * (rows.abs() @ magnitude.t() + layer.bias.double().abs())
            assert ((expected.double() - (rows @ exact.t() + layer.bias.double())).abs() <= bound).all(), ((k, n), m)


def test_the_bf16_references_error_is_xs_rounding_and_its_sums():
    """The bf16 path's reference (csrc/reference.c, run here whatever the CPU): x rounded to bf16 moves
    each term by at most 2^-8 of it (bf16 has 8 bits of precision), the products are exact and each of
    the K + 2 adds rounds by at most 2^-24 of the sum of the terms' magnitudes. Odd K: a pad of 0."""
    code = extension.FORMAT_CODES["bf16"] | extension.BF16_ROWS
    for k, n in [(255, 33), (512, 40)]:
        weight = torch.randn(n, k).bfloat16()
        layer = SimpleNamespace(
            weight=packing._pack_dense(weight, pairs=True),
            code=code,
            in_features=k,
            out_features=n,
            bias=torch.randn(n),
        )
        x = torch.randn(7, k)
        out = reference(layer, x).double()
        exact = x.double() @ weight.double().t() + layer.bias.double()
        magnitude = x.double().abs() @ weight.double().abs().t() + layer.bias.double().abs()
        assert ((out - exact).abs() <= (2**-8 + (k + 2) * 2**-24) * magnitude).all()
        assert not torch.equal(out, exact.float().double())  # and x was rounded: not the fp32 answer


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the int8 path sees it, in float64: per row and block of 32, d = max|x| / 127 and
    q = round(x / d), as llama.cpp's quantize_row_q8_0."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (q.double() * (amax / 127).double()).view_as(x)


@pytest.mark.parametrize("fmt", [*QUANTIZED])
def test_int8_activations_in_every_quantized_format(isa, fmt):
    """--activations int8 at 1, 3, 7, 12, 16 and 128 rows, with bias and accumulating: torch's answer on the
    quantized rows to fp32 rounding (the integer sums are exact); and within the quantization's error
    of the fp32 answer: each x moves by at most half a step, max|x of its block| / 254, so an output
    by at most sum_k |W[n, k]| * max|x| / 254 (the tolerance is twice that)."""
    int8 = CpuKernelOps(isa.isa, activations="int8")
    for i, shape in enumerate(K_SHAPES if fmt in K_QUANTS else BLOCK_SHAPES):
        weight, reference = matrix(fmt, shape, seed=i)
        k, n = shape
        bias = torch.randn(n)
        layer, plain = int8.linear(weight, bias), int8.linear(weight, None)
        assert layer.int8 and layer.format == fmt
        for m in ROWS:
            x = torch.randn(m, k)
            out = layer(x)
            exact = quantized_rows(x) @ reference.double().t() + bias.double()
            scale = x.abs().amax(1, keepdim=True).double() * reference.abs().sum(1).double()  # [m, n]
            assert ((out.double() - exact).abs() <= 1e-5 * scale + 1e-5).all(), (shape, m)
            assert (
                (out.double() - (x.double() @ reference.double().t() + bias.double())).abs() <= scale / 127 + 1e-5
            ).all(), (shape, m)
            y = torch.randn(m, n)
            expected = y.double() + quantized_rows(x) @ reference.double().t()
            assert plain.add_into(y, x) is y
            assert ((y.double() - expected).abs() <= 1e-5 * scale + 1e-4).all(), (shape, m)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_int8_sums_of_4_bit_quants_at_their_extremes_are_exact(isa, fmt):
    """Builds without VNNI sum a block's products of 4-bit quants in 16 bits (int8.c, SUMS_16): with
    every weight quant at 15 and every x quant at 127 (or -127) each 16-bit sum is 16 * 15 * 127 =
    30,480, just under where it would saturate; the answer is still exact. One more group of 4 rows
    a sum would overflow, and these outputs would be far off."""
    k, n = 512, 40
    block = torch.full((32,), -7 / 8) if fmt == "q4_0" else torch.ones(32)
    block[0] = 1.0 if fmt == "q4_0" else 0.0  # the block's other end: its quant is 0, all the rest 15
    values = block.repeat(n, k // 32) * torch.linspace(0.5, 2, n)[:, None]
    raw = quants.quantize(values.numpy(), QUANTIZED[fmt])
    reference = torch.from_numpy(np.asarray(quants.dequantize(raw, QUANTIZED[fmt])))
    assert torch.allclose(reference, values, rtol=1e-2)  # the quants are at their ends
    layer = CpuKernelOps(isa.isa, activations="int8").linear(unpack_gguf(fmt, raw), None)
    for x in (torch.ones(3, k), -torch.ones(3, k), torch.ones(3, k) * torch.tensor([1.0, -1.0]).repeat(k // 2)):
        exact = x.double() @ reference.double().t()
        assert ((layer(x).double() - exact).abs() <= 1e-5 * exact.abs() + 1e-4).all(), fmt


@pytest.mark.parametrize("fmt", [*QUANTIZED])
def test_int8_activations_give_a_row_the_same_bits_alone_in_a_batch_and_in_every_build(isa, fmt):
    weight, _ = matrix(fmt, (512, 100), seed=1)
    x = torch.randn(70, 512)
    outs = {}
    for build in ISAS:  # every build the CPU runs computes the same integer sums and folds
        extension._cpu_kernels.select_isa(build)
        layer = CpuKernelOps(build, activations="int8").linear(
            weight, torch.randn(100, generator=torch.Generator().manual_seed(3))
        )
        outs[build] = together = layer(x)
        for row in (0, 1, 12, 13, 69):
            assert torch.equal(layer(x[row : row + 1]), together[row : row + 1]), (build, row)
        for rows in ((5, 22), (0, 3), (10, 26), (2, 9), (30, 42), (40, 49)):  # 17, 3, 16, 7, 12, 9 rows
            assert torch.equal(layer(x[rows[0] : rows[1]]), together[rows[0] : rows[1]]), (build, rows)
    extension._cpu_kernels.select_isa(isa.isa)
    assert all(torch.equal(out, outs[ISAS[0]]) for out in outs.values()), list(outs)


@pytest.mark.parametrize("fmt", [*QUANTIZED])
def test_an_embedding_lookup_reads_an_int8_packed_head_exactly(isa, fmt):
    weight, reference = matrix(fmt, (256, 101), seed=7)
    ids = torch.tensor([0, 100, 31, 32, 33, 64, 5, 5])
    assert torch.equal(CpuKernelOps(isa.isa, activations="int8").linear(weight, None).columns(ids), reference[ids])


def test_activations_auto_runs_int8_where_the_kernels_run():
    """--activations: auto runs the int8 path in braid's kernels, and the bf16 path where the build
    has it; int8 and bf16 each run their own; float32, and torch's ops (which have neither), run
    float32 rows."""
    if ISAS:
        pick_ops(CPU, torch.float32)  # selects the best build
    bf16 = bool(ISAS) and extension.has_bf16_rows()
    auto = "int8+bf16" if bf16 else "int8" if ISAS else "float32"
    assert pick_ops(CPU, torch.float32, activations="auto").activations == auto
    assert pick_ops(CPU, torch.float32, activations="int8").activations == ("int8" if ISAS else "float32")
    assert pick_ops(CPU, torch.float32, activations="bf16").activations == ("bf16" if bf16 else "float32")
    assert pick_ops(CPU, torch.float32, activations="float32").activations == "float32"
    assert pick_ops(CPU, torch.float32, allow_kernels=False, activations="int8").activations == "float32"
    assert pick_ops(CPU, torch.float32, allow_kernels=False, activations="bf16").activations == "float32"


def _bf16_builds() -> list[str]:
    """The builds this CPU runs that have the bf16 path (AVX-512 BF16)."""
    before, builds = extension._cpu_kernels.isa(), []
    for build in ISAS:
        extension._cpu_kernels.select_isa(build)
        if extension.has_bf16_rows():
            builds.append(build)
    if before:
        extension._cpu_kernels.select_isa(before or ISAS[0])
    return builds


BF16_BUILDS = _bf16_builds() if ISAS else []
NO_BF16 = (
    "this CPU has no AVX-512 BF16: the bf16 path does not run here (where it does, the start-up self-check covers it)"
)


@pytest.fixture(params=BF16_BUILDS or ["none"])
def bf16_isa(request):
    """Each build this CPU runs with the bf16 path, selected for the test."""
    if not BF16_BUILDS:
        pytest.skip(NO_BF16)
    before = extension._cpu_kernels.isa()
    extension._cpu_kernels.select_isa(request.param)
    yield CpuKernelOps(request.param, activations="bf16")
    extension._cpu_kernels.select_isa(before or ISAS[0])


def bf16_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the bf16 path sees it, in float64: each value rounded to bf16 (to nearest even)."""
    return x.bfloat16().double()


def test_bf16_activations_against_the_fp32_reference(bf16_isa):
    """--activations bf16 at 1, 3, 16 and 128 rows, odd sizes (a partial panel, an odd K), with bias
    and accumulating: torch's answer on the rows rounded to bf16 to fp32 rounding (bf16 products are
    exact in fp32); and within that rounding's error of the fp32 answer: each x moves by at most
    2^-8 of itself, so an output by at most 2^-8 sum_k |x_k W[n, k]| (the tolerance is twice that)."""
    for i, shape in enumerate(SHAPES):
        weight, reference = matrix("bf16", shape, seed=i)
        k, n = shape
        bias = torch.randn(n)
        layer, plain = bf16_isa.linear(weight, bias), bf16_isa.linear(weight, None)
        assert layer.bf16 and layer.rows == "bf16" and layer.format == "bf16"
        for m in ROWS:
            x = torch.randn(m, k)
            out = layer(x).double()
            scale = x.abs().double() @ reference.abs().double().t()  # [m, n]: sum_k |x_k W[n, k]|
            exact = bf16_rows(x) @ reference.double().t() + bias.double()
            assert ((out - exact).abs() <= 1e-5 * scale + 1e-5).all(), (shape, m)
            fp32 = x.double() @ reference.double().t() + bias.double()
            assert ((out - fp32).abs() <= 2**-7 * scale + 1e-5).all(), (shape, m)
            y = torch.randn(m, n)
            expected = y.double() + bf16_rows(x) @ reference.double().t()
            assert plain.add_into(y, x) is y
            assert ((y.double() - expected).abs() <= 1e-5 * scale + 1e-5).all(), (shape, m)


def test_bf16_activations_give_a_row_the_same_bits_alone_and_in_a_batch(bf16_isa):
    weight, _ = matrix("bf16", (577, 100), seed=1)
    layer = bf16_isa.linear(weight, torch.randn(100))
    x = torch.randn(70, 577)
    together = layer(x)
    for row in (0, 1, 12, 13, 69):
        assert torch.equal(layer(x[row : row + 1]), together[row : row + 1]), row
    for rows in ((5, 22), (0, 3), (10, 26)):  # other tile splits
        assert torch.equal(layer(x[rows[0] : rows[1]]), together[rows[0] : rows[1]]), rows


def test_the_bf16_path_gives_the_bits_of_the_plain_c_reference(bf16_isa):
    """vdpbf16ps adds, per pair of k, the odd product and then the even one, each product exact and
    each add rounded (the SDM's order): csrc/reference.c's bf16 path, whose bits the build gives, at
    rows that take every tile, K even and odd, with bias and added into y."""
    ops = CpuKernelOps(bf16_isa.isa, activations="bf16")
    for k, n in [(512, 100), (255, 33)]:
        weight, _ = matrix("bf16", (k, n), seed=k)
        layer, plain = ops.linear(weight, torch.randn(n)), ops.linear(weight, None)
        assert layer.rows == "bf16"
        for m in REFERENCE_ROWS:
            x = torch.randn(m, k)
            assert torch.equal(layer(x).view(torch.int32), reference(layer, x).view(torch.int32)), (k, m)
            y = torch.randn(m, n)
            into = reference(plain, x, y.clone())
            assert torch.equal(plain.add_into(y, x).view(torch.int32), into.view(torch.int32)), (k, m)


@pytest.mark.parametrize("k", [256, 255])
def test_an_embedding_lookup_reads_a_bf16_rows_packed_head_exactly(bf16_isa, k):
    weight, reference = matrix("bf16", (k, 101), seed=7)
    ids = torch.tensor([0, 100, 31, 32, 33, 64, 5, 5])
    assert torch.equal(bf16_isa.linear(weight, None).columns(ids), reference[ids])


def _refuses(layer: PackedLinear, flag: int, match: str) -> None:
    """gemm refuses layer's packed weight with its code and flag (a path it has no such weight for)."""
    with pytest.raises(ValueError, match=match):
        extension._cpu_kernels.gemm(0, 64, layer.weight.data_ptr(), layer.code | flag, 0, 40, 1, 64, 40, 0, None, 1)


@pytest.mark.parametrize("path", ["int8", "bf16"])
def test_only_its_formats_have_a_path_of_rounded_rows(isa, path):
    """int8 rows are for quantized formats, bf16 rows for bf16: an fp32 matrix keeps fp32 rows, and
    gemm refuses the flag on it."""
    flag = extension.INT8 if path == "int8" else extension.BF16_ROWS
    layer = CpuKernelOps(isa.isa, activations=path).linear(torch.randn(40, 64), None)
    assert layer.rows == "float32" and layer.code == extension.FORMAT_CODES["f32"]
    _refuses(layer, flag, path)


def test_a_build_without_avx512_bf16_has_no_bf16_path(isa):
    bf16 = CpuKernelOps(isa.isa, activations="bf16").linear(torch.randn(40, 64).bfloat16(), None)
    assert bf16.bf16 == (isa.isa in BF16_BUILDS)
    if isa.isa not in BF16_BUILDS:  # and refuses the format, whoever asks
        _refuses(bf16, extension.BF16_ROWS, "AVX-512 BF16")


@pytest.mark.skipif(not BF16_BUILDS or len(ISAS) < 2, reason=NO_BF16 + ", or no other build to switch to")
def test_a_step_packed_for_bf16_rows_is_refused_by_a_build_without_them(monkeypatch):
    """A decoder packed while the avx512_bf16 build was selected, run after another build is: the
    one-call step refuses it (it would read the pairs as another layout), it never runs it."""
    from braid.server.runner.model_runner import ModelRunner
    from braid_testing.models import loaded, tiny_model

    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    model = loaded(tiny_model(vocab_size=64, **shape))
    # The runner picks its build as a server does (BRAID_KERNELS_ISA's, which make test's AVX2 rerun
    # sets, else the best): name the bf16 build there, and put back whichever build ran before.
    before = extension._cpu_kernels.isa()
    monkeypatch.setenv(extension.ISA_VARIABLE, BF16_BUILDS[0])
    runner = ModelRunner(
        model,
        CPU,
        torch.float32,
        num_pages=4,
        max_seq_len=64,
        weight_dtype="bfloat16",
        quantization="none",
        activations="bf16",
    )
    assert runner.activations == "bf16"
    other = next(build for build in ISAS if build not in BF16_BUILDS)
    extension._cpu_kernels.select_isa(other)
    try:
        decode_step = step.DecodeStep(
            runner.decoder.layers,
            runner.decoder.rope,
            2,
            1,
            16,
            1e-5,
            0.25,
            None,
            "silu",
            runner.cache.k,
            runner.cache.v,
        )
        with pytest.raises(ValueError, match="AVX-512 BF16"):
            decode_step(torch.zeros(1, 32), torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    finally:
        extension._cpu_kernels.select_isa(before or ISAS[0])


@pytest.mark.parametrize("fmt, most", [("q4_k", 0.58), ("q6_k", 0.83)])
def test_a_k_quant_keeps_its_two_levels_of_scales(isa, fmt, most):
    """A K-quant's sub-block scales stay int8 beside its super-blocks' fp16 d (csrc/kernels.h): Q4_K
    packs in 0.578 bytes a weight (the file: 0.5625), Q6_K in 0.820, the file's (its quants in 6 bits;
    1.07 as a byte each). As fp32 products of the two they took 0.75 and 1.25."""
    weight, _ = matrix(fmt, (2048, 64), seed=4)
    for int8 in (False, True):
        layer = PackedLinear(weight, None, int8=int8)
        assert layer.nbytes / (2048 * 64) < most
        assert torch.equal(layer.columns(torch.arange(64)), weight.dequantize())  # the weights, exactly


def anon_huge_pages(address: int) -> int:
    """AnonHugePages of the mapping that holds address, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            begin, end = (int(v, 16) for v in head.split("-"))
            inside = begin <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def test_a_packed_matrix_is_read_from_huge_pages_where_the_kernel_has_them(isa):
    """Every token reads all of the packed weights: a matrix starts on a huge-page boundary and its
    whole huge pages are transparent huge pages (packing.in_huge_pages), counted for the start-up line.
    One smaller than a huge page keeps torch's memory."""
    weight, _ = matrix("q4_0", (4096, 2048), seed=5)  # 4.5 MiB packed
    layer = PackedLinear(weight, None, int8=True)
    size = resources.huge_page_size()
    if layer.huge_bytes == 0:
        pytest.skip("this kernel has no transparent huge pages or no madvise(MADV_COLLAPSE) (Linux 6.1+)")
    assert layer.weight.data_ptr() % size == 0
    assert layer.huge_bytes == layer.nbytes // size * size == 2 * size
    assert anon_huge_pages(layer.weight.data_ptr()) >= layer.huge_bytes
    assert torch.equal(layer.columns(torch.arange(2048)), weight.dequantize())
    small = PackedLinear(matrix("q4_0", (256, 2048), seed=5)[0], None, int8=True)
    assert small.huge_bytes == 0


def test_a_quantized_matrix_needs_whole_blocks(isa):
    weight, _ = matrix("q8_0", (64, 40), seed=2)
    layer = isa.linear(weight, None)
    with pytest.raises(ValueError, match="multiple of 32"):
        extension._cpu_kernels.gemm(0, 40, layer.weight.data_ptr(), layer.code, 0, 40, 1, 40, 40, 0, None, 1)


def test_rms_norm_matches_torch(isa):
    torch.manual_seed(2)
    for rows, width in ((1, 576), (9, 64), (3, 100)):
        x, weight = torch.randn(rows, width), torch.randn(width)
        expected = F.rms_norm(x, (width,), weight, 1e-5)
        torch.testing.assert_close(isa.rms_norm(x, weight, 1e-5), expected, rtol=1e-5, atol=1e-5)


def test_swiglu_matches_torch(isa):
    torch.manual_seed(3)
    for rows, width in ((1, 1536), (5, 64), (2, 100)):
        gate_up = torch.randn(rows, 2 * width) * 4
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(isa.swiglu(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_rope_matches_torch(isa):
    torch.manual_seed(4)
    heads, d, max_seq = 5, 64, 50
    cos, sin = torch.randn(max_seq, d), torch.randn(max_seq, d)
    positions = torch.tensor([0, 7, 49, 3])
    qkv = torch.randn(4, (heads + 2) * d)
    original, expected = qkv.clone(), qkv.clone()
    TORCH.rope_(expected, heads, d, positions, *TORCH.rope_tables(cos, sin, positions))
    isa.rope_(qkv, heads, d, positions, *isa.rope_tables(cos, sin, positions))
    torch.testing.assert_close(qkv, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, heads * d :], original[:, heads * d :])  # only the first `heads` heads turn
    assert not torch.equal(qkv[:, : heads * d], original[:, : heads * d])


def test_geglu_matches_torch(isa):
    """Gemma's MLP activation, gelu with the tanh approximation: its tanh, from exp, to torch's."""
    torch.manual_seed(6)
    gate_up = torch.cat([torch.linspace(-12, 12, 4 * 83).view(4, 83), torch.randn(4, 83)], dim=1)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(isa.geglu(gate_up), F.gelu(gate, approximate="tanh") * up, rtol=1e-6, atol=1e-6)


# (scale, soft-cap, window): Llama's, Gemma 2's capped scores, a sliding window (which starts within a
# page for some rows and covers a whole short row for another), both, and a window of 100 (long rows
# attend whole blocks inside it)
ATTENTION = [(32**-0.5, None, None), (0.3, 2.0, None), (32**-0.5, None, 5), (0.2, 1.5, 18), (32**-0.5, None, 100)]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, kv_cache.Q8_0], ids=str)
@pytest.mark.parametrize("scale, softcap, window", ATTENTION, ids=["llama", "softcap", "window", "both", "long-window"])
def test_decode_attention_reads_and_writes_through_page_tables(isa, kv_dtype, scale, softcap, window):
    """Pages of 16 positions, each sequence's scattered and out of order; two sequences share their
    first page (a common prefix). A bf16 or f16 cache is written rounded as torch rounds, and read
    back widened; a q8_0 cache (--kv-cache-dtype q8_0) written in the blocks runner/kv_cache.py
    makes, and read as torch dequantizes them (the attention over them to fp32 rounding). Scores are
    scaled, soft-capped and windowed as transformers' eager attention does."""
    torch.manual_seed(5)
    heads, kv_heads, d, num_pages, page = 6, 2, 64, 12, 16
    k_cache = kv_cache.encode(torch.randn(num_pages, kv_heads, page, d), kv_dtype)
    v_cache = kv_cache.encode(torch.randn(num_pages, kv_heads, page, d), kv_dtype)
    tables = torch.tensor([[7, 2, 0], [7, 11, 0], [5, 9, 3]])  # rows padded with page 0
    positions = torch.tensor([20, 16, 39])  # lengths 21, 17, 40
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d) * 2  # scores large enough for the cap to bend them
    out = torch.empty(3, heads * d)
    before_k = k_cache.clone()
    step.decode_attention(qkv, heads, k_cache, v_cache, tables, positions, out, scale, softcap, window)
    for b, pos in enumerate(positions.tolist()):
        q = qkv[b, : heads * d].view(heads, 1, d)
        k_new = qkv[b, heads * d : (heads + kv_heads) * d].view(kv_heads, d)
        v_new = qkv[b, (heads + kv_heads) * d :].view(kv_heads, d)
        where = tables[b, pos // page], pos % page
        assert torch.equal(k_cache[where[0], :, where[1]], kv_cache.encode(k_new, kv_dtype))
        assert torch.equal(v_cache[where[0], :, where[1]], kv_cache.encode(v_new, kv_dtype))
        expected = _attention(q, k_cache, v_cache, tables[b, : pos // page + 1], pos, scale, softcap, window)
        torch.testing.assert_close(out[b].view(heads, d), expected, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(num_pages, dtype=torch.bool)
    untouched[[2, 11, 3]] = False  # the pages the new tokens went to
    assert torch.equal(k_cache[untouched], before_k[untouched])  # the shared page 7 included


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, kv_cache.Q8_0], ids=str)
@pytest.mark.parametrize("scale, softcap, window", ATTENTION, ids=["llama", "softcap", "window", "both", "long-window"])
@pytest.mark.parametrize("heads, kv_heads, d", [(6, 2, 64), (8, 2, 64), (2, 2, 32), (5, 1, 48)])
def test_prompt_rows_attend_in_tiles_with_the_bits_of_a_row_alone(
    isa, kv_dtype, scale, softcap, window, heads, kv_heads, d
):
    """Rows that read keys written already (write=False: a prompt chunk's, csrc/attention.c) attend in
    tiles of up to 32 rows of one sequence, a block of 64 keys and values loaded once for them all:
    each row's output is the bits it gets alone, for every KV dtype, group size and head size, in a
    sliding window or soft-capped. A chunk of 37 rows from mid-page (tiles of 32 and 5), another
    sequence's chunk at the very next positions (its pages differ: a new tile), a decode row, then
    two long chunks whose rows attend whole blocks (scored and weighed together, many rows' heads at
    once), one of 70 rows ending mid-block (tiles of 32, 32 and 6) and one of 40 ending 40 keys into a
    block (its last row attends the whole of that block)."""
    d = 96 if kv_dtype is kv_cache.Q8_0 and d % 32 else d  # a q8_0 cache needs head_dim a multiple of 32
    torch.manual_seed(6)
    num_pages, page = 36, 16
    k_cache = kv_cache.encode(torch.randn(num_pages, kv_heads, page, d), kv_dtype)
    v_cache = kv_cache.encode(torch.randn(num_pages, kv_heads, page, d), kv_dtype)
    long_a, long_b = list(range(12, 27)), [28, 30, 27, 31, 29, 32, 33]  # 15 and 7 pages, out of order
    rows = (
        [([7, 2, 9, 0], p) for p in range(5, 42)]
        + [([5, 1, 10, 8], p) for p in range(42, 62)]
        + [([3, 4, 0, 0], 30)]
        + [(long_a, p) for p in range(160, 230)]
        + [(long_b, p) for p in range(64, 104)]
    )
    rows = [(table + [0] * (15 - len(table)), p) for table, p in rows]  # page tables padded with page 0
    tables = torch.tensor([table for table, _ in rows])
    positions = torch.tensor([p for _, p in rows])
    qkv = torch.randn(len(rows), (heads + 2 * kv_heads) * d) * 2
    out = torch.empty(len(rows), heads * d)
    before = k_cache.clone(), v_cache.clone()
    step.decode_attention(qkv, heads, k_cache, v_cache, tables, positions, out, scale, softcap, window, write=False)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    for b in range(len(rows)):
        alone = torch.empty(1, heads * d)
        step.decode_attention(
            qkv[b : b + 1],
            heads,
            k_cache,
            v_cache,
            tables[b : b + 1],
            positions[b : b + 1],
            alone,
            scale,
            softcap,
            window,
            write=False,
        )
        assert torch.equal(out[b], alone[0]), b
    for b in (0, 20, 36, 37, 56, 57, 58, 127, 128, 167):  # and torch's answer (first and last rows of chunks)
        pos = positions[b].item()
        q = qkv[b, : heads * d].view(heads, 1, d)
        expected = _attention(q, k_cache, v_cache, tables[b, : pos // page + 1], pos, scale, softcap, window)
        torch.testing.assert_close(out[b].view(heads, d), expected, rtol=1e-5, atol=1e-5)


def _attention(q, k_cache, v_cache, pages, pos, scale, softcap, window) -> torch.Tensor:
    """Transformers' eager attention of one row's query heads q [H, 1, D] at position pos over its
    pages of the paged cache (dequantized as torch does): [H, D]."""
    heads, kv_heads = q.shape[0], k_cache.shape[1]
    keys, values = (
        kv_cache.decode(
            c[pages].transpose(0, 1).reshape(kv_heads, -1, c.shape[-1])[:, : pos + 1], torch.float32
        ).repeat_interleave(heads // kv_heads, dim=0)
        for c in (k_cache, v_cache)
    )
    scores = q @ keys.transpose(1, 2) * scale  # [H, 1, T]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if window:
        scores[..., : max(0, pos + 1 - window)] = float("-inf")
    return (scores.softmax(dim=-1) @ values)[:, 0]


def test_a_linear_layer_takes_zero_rows(isa):
    """A pass made only of prompt chunks that do not reach their prompt's end samples no row, so the
    output head gets zero rows: the C gemm refuses M < 1, and every prompt over --prefill-chunk
    failed with INTERNAL 'gemm: bad shape' (issue 10)."""
    layer = PackedLinear(torch.randn(33, 64), torch.randn(33))
    assert layer(torch.empty(0, 64)).shape == (0, 33)
    y = torch.empty(0, 33)
    assert layer.add_into(y, torch.empty(0, 64)).shape == (0, 33)


@needs_kernels
def test_a_build_that_fails_its_start_up_check_is_never_used(monkeypatch, caplog):
    """Each instruction-set build is checked against torch the first time it is picked; one that
    computes wrong on this CPU (a CPU no test has run on) falls back to the next, then to torch.
    (With the variable unset: `make test` runs this module again with the AVX2 build forced.)"""
    monkeypatch.delenv(extension.ISA_VARIABLE, raising=False)
    monkeypatch.setattr(selfcheck, "_CHECKED", {})
    monkeypatch.setattr(selfcheck, "_self_check", lambda: False)
    assert pick.kernels_isa() is None
    assert type(pick_ops(CPU, torch.float32)) is TorchOps
    assert "give wrong results" in caplog.text
    monkeypatch.setenv(extension.ISA_VARIABLE, ISAS[-1])
    with pytest.raises(ValueError, match="fail their check"):
        pick.kernels_isa()
    monkeypatch.undo()
    monkeypatch.delenv(extension.ISA_VARIABLE, raising=False)
    assert pick.kernels_isa() == ISAS[0]  # and the real check passes here


def test_the_real_start_up_check_passes_in_every_build(isa):
    assert selfcheck._self_check()
