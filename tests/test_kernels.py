"""braid's C kernels for the CPU decode step (server/braid/server/runner/_cpu_kernels.c).

They must give torch's answer to rounding, and give a row the same bits whatever other rows share
the call: that is what lets a seeded or greedy request come out the same in any batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from braid.server.runner import kernels
from braid.server.runner.kernels import PackedLinear, TorchOps, pick_ops

CPU = torch.device("cpu")
AVX512 = kernels.kernels_available(CPU, torch.float32)
OPS = pick_ops(CPU, torch.float32)  # the C kernels where they run; the tests compare them with torch's
TORCH = TorchOps()
# Without AVX-512 the decoder runs torch's kernels (checked below), and there is nothing to compare.
needs_avx512 = pytest.mark.skipif(not AVX512, reason="this CPU has no AVX-512: braid's C kernels do not run here")

# (in, out): the SmolLM2 shapes, the tiny test model's, and odd sizes that leave a partial panel.
SHAPES = [(576, 960), (1536, 576), (64, 128), (577, 100), (3, 17), (64, 33)]
ROWS = [1, 2, 7, 13, 16, 64, 65, 130]


def test_the_extension_is_built_and_matches_this_code():
    """`make install` compiles it; without it (or with a stale build, whose layout the module checks
    when imported) braid silently runs torch's slower kernels."""
    assert kernels._cpu_kernels is not None, "braid.server.runner._cpu_kernels was not built, or is stale"
    assert (kernels._cpu_kernels.PANEL, kernels._cpu_kernels.LAYER_FIELDS) == (kernels.PANEL, kernels.LAYER_FIELDS)


def test_the_kernels_are_used_only_where_they_run():
    assert kernels.kernels_available(CPU, torch.float32) == bool(kernels._cpu_kernels.has_avx512())
    assert not kernels.kernels_available(CPU, torch.bfloat16)
    assert not kernels.kernels_available(torch.device("cuda"), torch.float32)
    assert type(pick_ops(CPU, torch.float32, allow_kernels=False)) is TorchOps
    assert type(TORCH.linear(torch.randn(4, 4), None)) is kernels.Linear
    assert (type(OPS) is kernels.CpuKernelOps) == AVX512


@needs_avx512
@pytest.mark.parametrize("shape", SHAPES)
def test_packed_matmul_matches_torch(shape):
    torch.manual_seed(0)
    k, n = shape
    weight, bias = torch.randn(k, n), torch.randn(n)
    with_bias, plain = PackedLinear(weight, bias), PackedLinear(weight, None)
    for m in ROWS:
        x = torch.randn(m, k)
        torch.testing.assert_close(with_bias(x), torch.addmm(bias, x, weight), rtol=1e-4, atol=1e-3)
        y = torch.randn(m, n)
        expected = y + x @ weight
        assert plain.add_into(y, x) is y
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-3)


@needs_avx512
@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_gets_the_same_bits_alone_and_in_a_batch(shape):
    torch.manual_seed(1)
    k, n = shape
    layer = PackedLinear(torch.randn(k, n), torch.randn(n))
    x = torch.randn(70, k)
    together = layer(x)
    for row in (0, 1, 12, 13, 69):
        assert torch.equal(layer(x[row:row + 1]), together[row:row + 1]), row
    # and in a batch of another size, where the rows split into tiles differently
    assert torch.equal(layer(x[5:22]), together[5:22])


def test_rms_norm_matches_torch():
    torch.manual_seed(2)
    for rows, width in ((1, 576), (9, 64), (3, 100)):
        x, weight = torch.randn(rows, width), torch.randn(width)
        expected = F.rms_norm(x, (width,), weight, 1e-5)
        torch.testing.assert_close(OPS.rms_norm(x, weight, 1e-5), expected, rtol=1e-5, atol=1e-5)


def test_swiglu_matches_torch():
    torch.manual_seed(3)
    for rows, width in ((1, 1536), (5, 64), (2, 100)):
        gate_up = torch.randn(rows, 2 * width) * 4
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(OPS.swiglu(gate_up), F.silu(gate) * up,
                                   rtol=1e-5, atol=1e-5)


def test_rope_matches_torch():
    torch.manual_seed(4)
    heads, d, max_seq = 5, 64, 50
    cos, sin = torch.randn(max_seq, d), torch.randn(max_seq, d)
    positions = torch.tensor([0, 7, 49, 3])
    qkv = torch.randn(4, (heads + 2) * d)
    original, expected = qkv.clone(), qkv.clone()
    TORCH.rope_(expected, heads, d, positions, *TORCH.rope_tables(cos, sin, positions))
    OPS.rope_(qkv, heads, d, positions, *OPS.rope_tables(cos, sin, positions))
    torch.testing.assert_close(qkv, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, heads * d:], original[:, heads * d:])  # only the first `heads` heads turn
    assert not torch.equal(qkv[:, :heads * d], original[:, :heads * d])


@needs_avx512
def test_decode_attention_matches_sdpa_and_writes_the_cache():
    torch.manual_seed(5)
    heads, kv_heads, d, slots, max_seq = 6, 2, 32, 4, 40
    k_cache, v_cache = torch.randn(slots, kv_heads, max_seq, d), torch.randn(slots, kv_heads, max_seq, d)
    seq_slots, positions = torch.tensor([2, 0, 3]), torch.tensor([9, 0, 39])  # lengths 10, 1, 40
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d)
    out = torch.empty(3, heads * d)
    before_k = k_cache.clone()
    kernels.decode_attention(qkv, heads, k_cache, v_cache, seq_slots, positions, out)
    for b, (slot, pos) in enumerate(zip(seq_slots.tolist(), positions.tolist())):
        q = qkv[b, :heads * d].view(heads, 1, d)
        k_new = qkv[b, heads * d:(heads + kv_heads) * d].view(kv_heads, d)
        v_new = qkv[b, (heads + kv_heads) * d:].view(kv_heads, d)
        assert torch.equal(k_cache[slot, :, pos], k_new) and torch.equal(v_cache[slot, :, pos], v_new)
        keys, values = k_cache[slot, :, :pos + 1], v_cache[slot, :, :pos + 1]
        expected = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                                  enable_gqa=True)[0]
        torch.testing.assert_close(out[b].view(heads, d), expected[:, 0], rtol=1e-5, atol=1e-5)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[seq_slots] = False
    assert torch.equal(k_cache[untouched], before_k[untouched])  # slot 1 is nobody's


@needs_avx512
def test_a_linear_layer_takes_zero_rows():
    """A pass made only of prompt chunks that do not reach their prompt's end samples no row, so the
    output head gets zero rows: the C gemm refuses M < 1, and every prompt over --prefill-chunk
    failed with INTERNAL 'gemm: bad shape' (issue 10)."""
    layer = PackedLinear(torch.randn(64, 33), torch.randn(33))
    assert layer(torch.empty(0, 64)).shape == (0, 33)
    y = torch.empty(0, 33)
    assert layer.add_into(y, torch.empty(0, 64)).shape == (0, 33)
