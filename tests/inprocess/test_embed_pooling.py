"""Embeddings through braid's own decoder, in process: a tiny random Qwen3 and Llama (built from a
transformers config) behind the real model runner, sessions made by the real admission and stepped
by the engine core (tests/unit/engine_fakes.Harness). The pooled vector is transformers' last hidden
state (after the final norm), last-token or mean pooled, in one pass or in chunks; an embedding in
the passes of a decoding session leaves its tokens as they were, in every mode."""

from __future__ import annotations

import math

import pytest
import torch

from braid_testing.models import tiny_model
from conftest import _reference_model

from braid.server.engine.types import EmbeddingRequest, FinishReason, Pooling
from braid.server.model.loader import LoadedModel
from braid.server.runner.model_runner import ModelRunner
from tests.unit.engine_fakes import Harness

MODES = ["sequential", "interleaved", "batched", "continuous"]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny(request):
    return tiny_model(
        request.param, vocab_size=300, max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=None
    )


@pytest.fixture(scope="module", params=[True, False], ids=["kernels-auto", "kernels-torch"])
def runner(request, tiny) -> ModelRunner:
    model = LoadedModel(hf_model=tiny, hf_tokenizer=None, name="tiny", architecture="tiny", eos_token_ids=(2,))
    return ModelRunner(
        model, torch.device("cpu"), torch.float32, num_pages=64, max_seq_len=256, allow_kernels=request.param
    )


@pytest.fixture(scope="module")
def kernels_runner(tiny) -> ModelRunner:
    """braid's kernels alone (the passes' order matters here, not which ops compute them)."""
    model = LoadedModel(hf_model=tiny, hf_tokenizer=None, name="tiny", architecture="tiny", eos_token_ids=(2,))
    return ModelRunner(model, torch.device("cpu"), torch.float32, num_pages=64, max_seq_len=256)


def _reference(tiny, ids: list[int], pooling: Pooling) -> torch.Tensor:
    """transformers' last hidden state (after the final norm), pooled."""
    with torch.no_grad():
        hidden = tiny.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return hidden[-1] if pooling is Pooling.LAST else hidden.mean(0)


def _embed(h: Harness, inputs: list[list[int]], **fields) -> list:
    request = EmbeddingRequest(texts=(), token_ids=tuple(map(tuple, inputs)), request_id="e", **fields)
    handles = h.admission.embed(h.admission.admit_embedding(request), request, h.loop, Pooling.LAST)
    for handle in handles:
        h.events.setdefault(handle.session_id, [])
    return handles


def _relative_error(got: list[float], want: torch.Tensor) -> float:
    return float((torch.tensor(got) - want).abs().max() / want.abs().max())


INPUTS = [[(7 * i + 3) % 297 + 3 for i in range(n)] for n in (1, 5, 37, 80)]


@pytest.mark.parametrize("pooling", [Pooling.LAST, Pooling.MEAN])
@pytest.mark.parametrize("chunk", [512, 32], ids=["one-pass", "chunked"])
def test_the_pooled_vector_is_transformers_last_hidden_state_pooled(runner, tiny, pooling, chunk):
    with Harness(runner=runner, mode="continuous", prefill_chunk=chunk) as h:
        handles = _embed(h, INPUTS, pooling=pooling, normalize=False)
        h.run()
        for ids, handle in zip(INPUTS, handles):
            finished = h.finished(handle)
            assert finished is not None and finished.reason is FinishReason.MAX_TOKENS
            assert finished.prompt_tokens == len(ids) and finished.generated_tokens == 0
            assert _relative_error(finished.embedding, _reference(tiny, ids, pooling)) < 1e-5


def test_dimensions_keep_the_leading_components_and_normalize_makes_them_unit_length(runner, tiny):
    ids = INPUTS[2]
    with Harness(runner=runner) as h:
        [whole, cut] = _embed(h, [ids], pooling=Pooling.MEAN), _embed(h, [ids], pooling=Pooling.MEAN, dimensions=16)
        h.run()
        whole, cut = h.finished(whole[0]).embedding, h.finished(cut[0]).embedding
    want = _reference(tiny, ids, Pooling.MEAN)
    assert len(whole) == 64 and len(cut) == 16
    assert math.isclose(math.fsum(v * v for v in whole), 1.0, rel_tol=1e-9)
    assert math.isclose(math.fsum(v * v for v in cut), 1.0, rel_tol=1e-9)
    cosine = float(torch.nn.functional.cosine_similarity(torch.tensor(cut), want[:16], dim=0))
    assert cosine > 1 - 1e-6
    assert _relative_error(cut, want[:16] / want[:16].norm()) < 1e-5


class Spy:
    """The runner, its passes' rows recorded."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.passes = runner, []

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def run(self, rows):
        self.passes.append(list(rows))
        return self.runner.run(rows)


@pytest.mark.parametrize("mode", MODES)
def test_an_embedding_beside_a_decoding_session_leaves_its_tokens_unchanged(kernels_runner, mode):
    prompt = " ".join(str(t) for t in INPUTS[2])
    chunk = 16

    def generate(embed: bool) -> tuple[list[int], list, list]:
        spy = Spy(kernels_runner)
        with Harness(runner=spy, mode=mode, prefill_chunk=chunk, max_batch_size=4) as h:
            [gen] = h.submit(prompt, max_new_tokens=12, ignore_eos=True)
            for _ in range(6):  # its prompt computed, a few tokens decoded
                h.step()
            handles = _embed(h, INPUTS[1:3], pooling=Pooling.MEAN) if embed else []
            h.run()
            return h.tokens(gen), [h.finished(e).embedding for e in handles], spy.passes

    alone, _, _ = generate(embed=False)
    beside, vectors, passes = generate(embed=True)
    assert len(alone) == 12 and beside == alone
    assert all(v is not None and len(v) == 64 for v in vectors)
    shared = [rows for rows in passes if any(r.pool for r in rows) and any(r.sample for r in rows)]
    if mode == "continuous":  # in the same packed passes, each holding at most one prompt chunk
        assert shared
        assert all(sum(len(r.token_ids) for r in rows if r.is_prompt) <= chunk for rows in passes)
    else:  # the others give each pass to one session, or start a batch once the last has left
        assert not shared


@pytest.fixture(scope="module")
def embedded_model() -> LoadedModel:
    """The embedded model as `braid serve` loads it (its GGUF's Q4_1 blocks), loaded once for both runners."""
    from braid.server.model.loader import default_cache_dir, load

    return load(None, default_cache_dir())


@pytest.fixture(scope="module", params=["float32", "auto"], ids=["fp32-activations", "int8-activations"])
def embedded(request, embedded_model):
    """The embedded model in process: with fp32 activations and an fp32 KV cache (BOUNDS' float32 row
    is fp32 rounding, which the CPU's default q8_0 cache does not keep), and with the default (int8
    rows on a CPU that has the kernels, q8_0 cache)."""
    from in_process import load_model

    from braid.server.model.loader import default_cache_dir

    kv_cache_dtype = "float32" if request.param == "float32" else "auto"
    return load_model(
        None,
        default_cache_dir(),
        embedded_model,
        max_seq_len=512,
        activations=request.param,
        kv_cache_dtype=kv_cache_dtype,
    )


@pytest.fixture(scope="module")
def smol_reference(smol_dir):
    """transformers' own model of the embedded model's weights, dequantized, in fp32."""
    return _reference_model(smol_dir)


TEXTS = ["The quick brown fox jumps over the lazy dog.", "braid embeds text with its own decoder and kernels, " * 6]
# (1 - cosine, relative error) at most, against transformers' fp32 forward of the same dequantized
# weights. Measured on a two-core Zen 3 (AVX2): fp32 activations 2e-7 and 1.6e-6; int8 activations
# (each matrix's input rows quantized to 8 bits, as llama.cpp does) 7.4e-4 and 3.8e-2, with an fp32
# KV cache; the int8 case runs the default's q8_0 cache and stays within its bounds.
BOUNDS = {"float32": (1e-6, 1e-5), "int8": (3e-3, 0.1)}


@pytest.mark.parametrize("pooling", [Pooling.LAST, Pooling.MEAN])
def test_the_embedded_models_vector_is_transformers(embedded, smol_reference, pooling):
    model = embedded
    with Harness(runner=model.runner, tokenizer=model.tokenizer, prefill_chunk=32) as h:
        request = EmbeddingRequest(texts=tuple(TEXTS), token_ids=(), request_id="e", pooling=pooling, normalize=False)
        handles = h.admission.embed(h.admission.admit_embedding(request), request, h.loop, Pooling.LAST)
        for handle in handles:
            h.events.setdefault(handle.session_id, [])
        h.run()
        vectors = [h.finished(handle).embedding for handle in handles]
    cosine_bound, relative_bound = BOUNDS["float32" if model.runner.activations == "float32" else "int8"]
    for text, got in zip(TEXTS, vectors):
        want = _reference(smol_reference, model.tokenizer.encode(text, ()), pooling)
        cosine = float(torch.nn.functional.cosine_similarity(torch.tensor(got), want, dim=0))
        assert 1 - cosine < cosine_bound and _relative_error(got, want) < relative_bound, (cosine, text)
