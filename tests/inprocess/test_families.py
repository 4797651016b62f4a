"""Which path a model takes (runner/families.py), Gemma 2 and 3 on braid's decoder, and the
transformers path, in process: tiny random models whose greedy tokens through braid's runner, fed in
chunks and read from shared pages, are transformers' `generate`'s."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as t

from braid.server.model.loader import LoadedModel
from braid.server.runner.families import FAMILIES, attention_window, native_family
from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import Row, Sampling
from braid_testing import models
from braid_testing.perplexity import perplexity

LLAMA_LIKE = dict(models.LLAMA_LIKE, vocab_size=512, initializer_range=0.3)  # the tiny shape, any config class


@pytest.mark.parametrize(
    "model, native",
    [
        (lambda: t.LlamaForCausalLM(t.LlamaConfig(**LLAMA_LIKE)), True),
        (lambda: t.Qwen3ForCausalLM(t.Qwen3Config(**LLAMA_LIKE)), True),
        (lambda: t.Phi3ForCausalLM(t.Phi3Config(**LLAMA_LIKE, pad_token_id=0)), True),
        (lambda: t.LlamaForCausalLM(t.LlamaConfig(**LLAMA_LIKE, hidden_act="gelu")), False),
        (lambda: t.Phi3ForCausalLM(t.Phi3Config(**LLAMA_LIKE, pad_token_id=0, partial_rotary_factor=0.5)), False),
        (
            lambda: t.LlamaForCausalLM(
                t.LlamaConfig(**LLAMA_LIKE, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
            ),
            False,
        ),
        (lambda: t.GPT2LMHeadModel(t.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4)), False),
        (lambda: t.Gemma2ForCausalLM(t.Gemma2Config(**LLAMA_LIKE)), True),
        (lambda: t.Gemma2ForCausalLM(t.Gemma2Config(**LLAMA_LIKE, hidden_activation="silu")), False),
    ],
)
def test_what_runs_natively(model, native):
    family, why_not = native_family(model())
    assert (family is not None) == native and bool(why_not) != native


def test_a_sliding_window_bounds_a_native_session():
    llama = FAMILIES["LlamaForCausalLM"]
    assert attention_window(llama, t.MistralConfig(**LLAMA_LIKE, sliding_window=256)) == 256
    assert attention_window(llama, t.Qwen3Config(**LLAMA_LIKE)) is None  # use_sliding_window is off
    assert attention_window(llama, t.LlamaConfig(**LLAMA_LIKE)) is None
    assert attention_window(FAMILIES["Gemma2ForCausalLM"], t.Gemma2Config(**LLAMA_LIKE, sliding_window=256)) is None


def _generate(runner: ModelRunner, prompt: list[int], steps: int, pages: list[int], cached: int = 0) -> list[int]:
    """Greedy tokens: the prompt from position `cached` (those before already in `pages`) in two
    chunks, then one pass per token."""
    sampling = Sampling()
    rng = runner.random_state(sampling)
    middle = (cached + len(prompt)) // 2
    runner.run(
        [
            Row(
                pages=pages,
                start=cached,
                token_ids=prompt[cached:middle],
                sample=False,
                sampling=sampling,
                rng=rng,
                is_prompt=True,
            )
        ]
    )
    [first] = runner.run(
        [
            Row(
                pages=pages,
                start=middle,
                token_ids=prompt[middle:],
                sample=True,
                sampling=sampling,
                rng=rng,
                is_prompt=True,
            )
        ]
    )
    tokens = [first.token]
    for _ in range(steps - 1):
        [out] = runner.run(
            [
                Row(
                    pages=pages,
                    start=len(prompt) + len(tokens) - 1,
                    token_ids=tokens[-1:],
                    sample=True,
                    sampling=sampling,
                    rng=rng,
                )
            ]
        )
        tokens.append(out.token)
    return tokens


GEMMA = dict(LLAMA_LIKE, num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)


@pytest.mark.parametrize(
    "make",
    [
        # soft-capped attention scores and logits, sliding windows on alternate layers
        lambda: t.Gemma2ForCausalLM(t.Gemma2Config(**GEMMA, final_logit_softcapping=3.0, attn_logit_softcapping=2.0)),
        # per-head q/k norms, local layers with their own RoPE
        lambda: t.Gemma3ForCausalLM(
            t.Gemma3TextConfig(**GEMMA, layer_types=["sliding_attention", "full_attention"] * 2)
        ),
    ],
    ids=["gemma2", "gemma3"],
)
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels-auto", "kernels-torch"])
def test_gemma_runs_natively_as_transformers_does(make, kernels):
    """Every position's log-likelihood (perplexity, in chunks that cross the window), and greedy
    tokens decoded past the window."""
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():  # away from the zero init of Gemma's norms, so no layer is trivial
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if "norm" in name else 0.15)
    runner = ModelRunner(
        LoadedModel(
            hf_model=model, hf_tokenizer=None, name="tiny", architecture=type(model).__name__, eos_token_ids=(2,)
        ),
        torch.device("cpu"),
        torch.float32,
        num_pages=16,
        max_seq_len=64,
        page_size=16,
        allow_kernels=kernels,
    )
    assert runner.path == "braid"
    ids = [(7 * i) % 500 + 3 for i in range(40)]
    with torch.no_grad():
        expected = math.exp(model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item())
    assert perplexity(runner, ids, chunk=13) == pytest.approx(expected, rel=1e-4)
    prompt = ids[:21]
    tokens = model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)[
        0, len(prompt) :
    ].tolist()
    assert _generate(runner, prompt, 10, pages=[4, 5, 6, 7]) == tokens


@pytest.mark.parametrize(
    "make",
    [
        lambda: t.GPT2LMHeadModel(t.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)),
        # sliding-window layers alternating with global ones, soft-capping: all the model's own (a
        # Gemma 2 with an activation braid's decoder does not run)
        lambda: t.Gemma2ForCausalLM(
            t.Gemma2Config(**LLAMA_LIKE, head_dim=16, sliding_window=8, hidden_activation="silu")
        ),
    ],
    ids=["gpt2", "gemma2-silu"],
)
def test_the_transformers_path_generates_transformers_tokens(make):
    torch.manual_seed(0)
    model = make().eval()
    runner = ModelRunner(
        LoadedModel(
            hf_model=model, hf_tokenizer=None, name="tiny", architecture=type(model).__name__, eos_token_ids=(2,)
        ),
        torch.device("cpu"),
        torch.float32,
        num_pages=16,
        max_seq_len=64,
        page_size=8,
    )
    assert runner.path == "transformers"
    prompt = [(7 * i) % 500 + 3 for i in range(21)]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)[
        0, len(prompt) :
    ].tolist()
    assert _generate(runner, prompt, 10, pages=[0, 1, 2, 3]) == expected
    # a second sequence whose first two pages are the first one's (a shared prefix) reads them
    assert _generate(runner, prompt, 10, pages=[0, 1, 4, 5], cached=16) == expected
