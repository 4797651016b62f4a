"""The model runner on a tiny random Llama, in process: passes that sample nothing, and long prompts
fed in chunks give the same next token as in one pass."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from braid.server.engine.session import Session
from braid.server.engine.types import SamplingParams
from braid.server.model.loader import LoadedModel
from braid.server.runner.model_runner import ModelRunner, Work


@pytest.fixture(scope="module", params=[True, False], ids=["kernels-auto", "kernels-torch"])
def runner(request) -> ModelRunner:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, initializer_range=0.3)
    model = LoadedModel(hf_model=LlamaForCausalLM(config).eval(), hf_tokenizer=None, name="tiny",
                        architecture="LlamaForCausalLM", eos_token_ids=(2,))
    return ModelRunner(model, torch.device("cpu"), torch.float32, num_slots=2, max_seq_len=2048,
                       allow_kernels=request.param)


def _session(prompt: list[int], slot: int) -> Session:
    s = Session(id=slot, prompt_ids=prompt, params=SamplingParams(), handle=None, detokenizer=None, rng=None)
    s.slot = slot
    return s


def _feed(runner: ModelRunner, s: Session, n: int) -> int | None:
    [token] = runner.run([Work(s, n)])
    s.num_cached += n
    return token


def test_a_pass_of_prompt_chunks_that_sample_nothing(runner):
    """Issue 10: a 600-token prompt with --prefill-chunk 512 is fed 512 then 88 tokens. The first pass
    has no row to sample; the output head got zero rows, and the C gemm refused them."""
    prompt = [(7 * i) % 500 + 3 for i in range(600)]
    chunked = _session(prompt, slot=0)
    assert _feed(runner, chunked, 512) is None
    token = _feed(runner, chunked, 88)
    whole = _session(prompt, slot=1)
    assert token is not None and _feed(runner, whole, 600) == token
