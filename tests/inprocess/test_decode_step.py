"""The one-call decode step (runner/kernels/step.py DecodeStep, csrc/decode_step.c) on tiny random Qwen3,
Gemma 2 and Gemma 3 models, in process: rows of different lengths decode together, past the sliding
window, and every pass's logits are the per-op path's (each op its own call, the same kernels) bit for
bit, and those of the per-op path with torch's attention to float rounding. With any one of the
layers' fields or the model's settings dropped from the step, they are not."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers as t
from braid_testing.models import LLAMA_LIKE, loaded

from braid.server.runner import decoder
from braid.server.runner.kernels.extension import ACTIVATIONS, LAYER_FIELDS, has_bf16_rows
from braid.server.runner.kernels.packing import PackedParts
from braid.server.runner.kernels.pick import kernels_isa
from braid.server.runner.kernels.step import DecodeStep
from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import Row, Sampling

pytestmark = pytest.mark.skipif(kernels_isa() is None, reason="braid's C kernels do not run on this CPU")

SHAPE = dict(LLAMA_LIKE, vocab_size=512, num_hidden_layers=4, head_dim=16, max_position_embeddings=128)
# query_pre_attn_scalar is not head_dim, so Gemma's scale is not the default one
GEMMA = dict(SHAPE, sliding_window=8, query_pre_attn_scalar=24)
MODELS = {
    "qwen3": lambda: t.Qwen3ForCausalLM(t.Qwen3Config(**SHAPE)),
    "gemma2": lambda: t.Gemma2ForCausalLM(
        t.Gemma2Config(**GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=5.0)
    ),
    "gemma3": lambda: t.Gemma3ForCausalLM(
        t.Gemma3TextConfig(**GEMMA, rope_local_base_freq=100.0, layer_types=["sliding_attention", "full_attention"] * 2)
    ),
}
PROMPTS = [[(7 * i + 3 * b) % 500 + 3 for i in range(n)] for b, n in enumerate((3, 17, 30))]  # B = 3
STEPS = 12  # the shortest row passes the window of 8 on its way
PAGES = 4  # a row's pages of 16 positions: at most 64 of them
TOKENS = torch.randint(3, 500, (STEPS, len(PROMPTS)), generator=torch.Generator().manual_seed(1)).tolist()


@functools.cache
def _model(kind: str):
    torch.manual_seed(0)
    model = MODELS[kind]().eval()
    with torch.no_grad():  # norms away from their init, so that dropping one shows
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.15)
    return model


def _runner(model, **kwargs) -> ModelRunner:
    return ModelRunner(
        loaded(model), torch.device("cpu"), torch.float32, num_pages=PAGES * len(PROMPTS), max_seq_len=64, **kwargs
    )


def _decode(runner: ModelRunner) -> torch.Tensor:
    """Prefills each prompt into its own pages, then decodes the rows together, fed TOKENS: the
    logits of every decode pass, [STEPS, B, V]."""
    sampling = Sampling()
    pages = [list(range(b * PAGES, (b + 1) * PAGES)) for b in range(len(PROMPTS))]
    for prompt, table in zip(PROMPTS, pages):
        runner.run(
            [Row(pages=table, start=0, token_ids=prompt, sample=False, sampling=sampling, rng=None, is_prompt=True)]
        )
    logits = []
    for step, tokens in enumerate(TOKENS):
        rows = [
            Row(pages=table, start=len(prompt) + step, token_ids=[token], sample=True, sampling=sampling, rng=None)
            for prompt, table, token in zip(PROMPTS, pages, tokens)
        ]
        batch = runner.pack(rows).batch
        logits.append(runner.decoder.forward(batch, runner.cache))
    return torch.stack(logits)


def _per_op(kind: str, torch_attention: bool) -> torch.Tensor:
    runner = _runner(_model(kind))
    runner.decoder.one_call = False
    runner.decoder.fused_attention = not torch_attention
    return _decode(runner)


@functools.cache
def _reference(kind: str) -> torch.Tensor:
    """The per-op path's logits, with torch's attention over the gathered pages."""
    return _per_op(kind, torch_attention=True)


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_step_gives_the_per_op_paths_logits(kind):
    runner = _runner(_model(kind))
    assert runner.decoder.one_call
    logits = _decode(runner)
    assert runner.decoder._step is not None  # the decode passes ran in one call
    assert torch.equal(logits, _per_op(kind, torch_attention=False))  # the same kernels, op by op
    torch.testing.assert_close(logits, _reference(kind), rtol=1e-4, atol=1e-4)


def _step_and_per_op(kind: str, weights: dict, rows: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-call step's logits with weights (ModelRunner's settings), checked equal bit for bit to
    the per-op path's on the same, and float32 rows' logits on the same weights."""
    runner = _runner(_model(kind), **weights)
    assert runner.activations == rows
    logits = _decode(runner)
    assert runner.decoder._step is not None
    per_op = _runner(_model(kind), **weights)
    per_op.decoder.one_call = False
    assert torch.equal(logits, _decode(per_op))
    return logits, _decode(_runner(_model(kind), **dict(weights, activations="float32")))


@pytest.mark.parametrize("kind", list(MODELS))
def test_with_int8_activations_the_step_gives_the_per_op_paths_logits(kind):
    """Q8_0 weights multiplied by int8 rows (--activations int8): the one-call step and the per-op
    path run the same int8 kernels, bit for bit; against float32 rows on the same weights, the
    logits move by the rows' quantization only: on these random models (whose activations are far
    rougher than a trained model's), by 2-5% of their spread on average, at most 8% of the largest.
    The embedded model's perplexity is the real measure (tests/test_precision.py)."""
    logits, float_rows = _step_and_per_op(kind, dict(quantization="q8_0", activations="int8"), "int8")
    difference = (logits - float_rows).abs()
    assert 0 < difference.mean() < 0.08 * float_rows.std()
    assert difference.max() < 0.12 * float_rows.abs().max()


@pytest.mark.parametrize("kind", list(MODELS))
def test_with_bf16_activations_the_step_gives_the_per_op_paths_logits(kind):
    """bf16 weights multiplied by bf16 rows (--activations bf16, AVX-512 BF16's vdpbf16ps): the
    one-call step and the per-op path, bit for bit; against float32 rows on the same weights, the
    logits move by the rows' rounding to bf16 only (2^-8 of each value): on these random models by
    about 1% of their spread on average, at most 3% of the largest (int8 rows: 2-5%, 8%)."""
    if not has_bf16_rows():
        pytest.skip(
            "this CPU has no AVX-512 BF16: the bf16 path does not run here (where it does, the start-up "
            "self-check covers it)"
        )
    logits, float_rows = _step_and_per_op(
        kind, dict(weight_dtype="bfloat16", quantization="none", activations="bf16"), "bf16"
    )
    difference = (logits - float_rows).abs()
    assert 0 < difference.mean() < 0.02 * float_rows.std()
    assert difference.max() < 0.04 * float_rows.abs().max()


@pytest.mark.parametrize(
    "weights",
    [
        {},
        dict(quantization="q8_0", activations="int8"),
        dict(quantization="q8_0", activations="float32"),
        dict(weight_dtype="bfloat16", quantization="none", activations="auto"),
    ],
)
@pytest.mark.parametrize("kind", list(MODELS))
def test_the_step_gives_the_same_bits_on_any_number_of_threads(kind, weights):
    """The step runs in one parallel region, the matmuls' panels and the attention's tasks shared
    out among the threads: a row's logits do not depend on how many there are (3: an uneven split)."""
    before = torch.get_num_threads()
    try:
        logits = {}
        for threads in (1, 3):
            torch.set_num_threads(threads)
            logits[threads] = _decode(_runner(_model(kind), **weights))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(logits[1], logits[3])


def _pass(runner: ModelRunner, rows: list[Row]) -> torch.Tensor:
    batch = runner.pack(rows).batch
    return runner.decoder.forward(batch, runner.cache)


@pytest.mark.parametrize("weights", [{}, dict(quantization="q8_0", activations="int8")])
@pytest.mark.parametrize("kind", list(MODELS))
def test_a_position_gets_the_same_logits_whichever_kind_of_row_computes_it(kind, weights):
    """A prompt chunk's row, a speculating row's proposal and a decode step's row at the same
    position of the same tokens: the same bits, whatever else shares the pass. What resuming a
    stream (its tokens prefilled again) and speculation (k positions verified in one pass) rest on:
    before every row attended by itself through its page table, a prompt chunk's torch attention
    differed from the decode step's by float rounding, which int8 rows turn into different tokens."""
    sampling, prompt, table = Sampling(), PROMPTS[2], list(range(PAGES))
    tokens = [row[0] for row in TOKENS]  # the sequence goes on with these

    def row(pages, start, ids, **kwargs) -> Row:
        return Row(pages=pages, start=start, token_ids=ids, sample=True, sampling=sampling, rng=None, **kwargs)

    runner = _runner(_model(kind), **weights)
    _pass(runner, [row(table, 0, prompt, is_prompt=True)])
    steps = [_pass(runner, [row(table, len(prompt) + i, [token])])[0] for i, token in enumerate(tokens)]
    for k in (1, 5, len(tokens)):  # the prompt and k tokens as one chunk, beside another sequence's chunk
        fresh = _runner(_model(kind), **weights)
        other = [row(list(range(PAGES, 2 * PAGES)), 0, PROMPTS[1], is_prompt=True)]
        logits = _pass(fresh, other + [row(table, 0, prompt + tokens[:k], is_prompt=True)])
        assert torch.equal(logits[1], steps[k - 1]), k
    fresh = _runner(_model(kind), **weights)  # in two chunks, the second from mid-page, then proposals
    _pass(fresh, [row(table, 0, prompt[:20], is_prompt=True)])
    _pass(fresh, [row(table, 20, prompt[20:] + tokens[:3], is_prompt=True)])
    other = [row(list(range(PAGES, 2 * PAGES)), 0, PROMPTS[0], is_prompt=True)]
    logits = _pass(fresh, other + [row(table, len(prompt) + 3, tokens[3:8], num_proposals=4)])
    assert torch.equal(logits[1:], torch.stack(steps[3:8]))


def _clear(field: str):
    def clear(step: DecodeStep) -> None:
        step.table[:, LAYER_FIELDS.index(field)] = 0

    return clear


def _global_rope(step: DecodeStep) -> None:
    """Every layer reads the global layers' RoPE tables (layer 1's)."""
    for field in ("cos", "sin"):
        column = LAYER_FIELDS.index(field)
        step.table[:, column] = step.table[1, column]


BREAKS = {
    "q_norm": _clear("q_norm"),
    "k_norm": _clear("k_norm"),
    "attn_out_norm": _clear("attn_out_norm"),
    "mlp_out_norm": _clear("mlp_out_norm"),
    "window": _clear("window"),
    "rope": _global_rope,
    "scale": lambda step: setattr(step, "scale", SHAPE["head_dim"] ** -0.5),
    "softcap": lambda step: setattr(step, "softcap", 0.0),
    "activation": lambda step: setattr(step, "activation", ACTIVATIONS.index("silu")),
}
USES = {
    "qwen3": ["q_norm", "k_norm"],
    "gemma2": ["attn_out_norm", "mlp_out_norm", "window", "scale", "softcap", "activation"],
    "gemma3": ["q_norm", "k_norm", "attn_out_norm", "mlp_out_norm", "window", "rope", "scale", "activation"],
}


@pytest.mark.parametrize("kind, field", [(kind, field) for kind, fields in USES.items() for field in fields])
def test_a_step_that_drops_a_field_is_caught(monkeypatch, kind, field):
    """What test_the_step_gives_the_per_op_paths_logits would see of a step that ignored the field."""

    def broken(*args, **kwargs) -> DecodeStep:
        step = DecodeStep(*args, **kwargs)
        BREAKS[field](step)
        return step

    monkeypatch.setattr(decoder, "DecodeStep", broken)
    logits = _decode(_runner(_model(kind)))
    assert not torch.allclose(logits, _reference(kind), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def mixed_qkv(tmp_path_factory):
    """A tiny Llama as a GGUF file that keeps every layer's v in Q6_K beside q and k in Q4_K (llama.cpp's
    Q4_K_M does so in half the layers), loaded as `braid serve --model` loads it."""
    from braid_testing.models import tiny_model
    from gguf import GGMLQuantizationType
    from gguf_files import embedded_bpe, write_gguf

    from braid.server.model.loader import load

    folder, vocab = tmp_path_factory.mktemp("mixed"), embedded_bpe(512)
    model = tiny_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    formats = dict(layer_formats=(GGMLQuantizationType.Q4_K,), tensor_formats={"attn_v": GGMLQuantizationType.Q6_K})
    return load(str(write_gguf(model, folder / "mixed.gguf", vocab, **formats)), folder)


@pytest.mark.parametrize("activations", ["int8", "float32"])
def test_a_qkv_of_two_formats_keeps_both_and_the_step_gives_the_per_op_paths_logits(mixed_qkv, activations):
    """q and k in Q4_K, v in Q6_K: the fused q/k/v keeps each part in its format (it was fused in
    fp32, 5x Q4_K's bytes), the one-call step multiplies the parts in one call with the per-op path's
    logits bit for bit, and with float32 rows those are the dequantized fp32 model's to rounding."""

    def runner(**kwargs) -> ModelRunner:
        return ModelRunner(
            mixed_qkv, torch.device("cpu"), torch.float32, num_pages=PAGES * len(PROMPTS), max_seq_len=64, **kwargs
        )

    step = runner(activations=activations)
    qkv = step.decoder.layers[0].qkv
    assert isinstance(qkv, PackedParts) and qkv.format == "q4_k+q6_k"
    assert qkv.nbytes < qkv.in_features * qkv.out_features  # under a byte a weight; fp32 is 4
    logits = _decode(step)
    assert step.decoder._step is not None
    per_op = runner(activations=activations)
    per_op.decoder.one_call = False
    assert torch.equal(logits, _decode(per_op))
    if activations == "float32":
        fp32 = _decode(runner(activations="float32", quantization="none"))
        # the quantized kernels fold each group's scale into its sums (csrc/weights.c): other rounding
        torch.testing.assert_close(logits, fp32, rtol=0, atol=1e-4 * fp32.abs().max().item())


@pytest.mark.parametrize("field, value, error", [(0, 0, "1 to 4"), (2, 33, "whole panels"), (1, 1 << 10, "no parts")])
def test_a_step_refuses_a_matrix_of_parts_it_cannot_read(mixed_qkv, field, value, error):
    """The list of parts a fused q/k/v hands the C step (csrc/kernels.h's F_PARTS) is checked before
    the step reads it: a count of none, a first part that ends mid-panel, a part that lists parts."""
    runner = ModelRunner(mixed_qkv, torch.device("cpu"), torch.float32, num_pages=PAGES, max_seq_len=64)
    runner.decoder.layers[1].qkv.weight[field] = value
    row = Row(pages=[0], start=0, token_ids=[5, 6], sample=True, sampling=Sampling(), rng=None, is_prompt=True)
    with pytest.raises(ValueError, match=error):
        _pass(runner, [row])
