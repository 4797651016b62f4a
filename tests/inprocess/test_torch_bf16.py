"""The CUDA path's Python code, run in process: braid's decoder on torch's ops (kernels.TorchOps, which
pick_ops gives CUDA) with the weights, activations and KV cache in bf16 (pick_device's dtype on CUDA).
A server never computes in bf16 on a CPU (pick_device keeps fp32 there), so this is where that code
runs without a GPU; with --device cuda (make gpu-check) the same test runs it on the GPU.

On a CPU it does not cover CUDA's own kernels, a tensor made on the wrong device, nor the KV cache's
GPU memory (kv_cache._zeros and free_memory take their CPU branches).
"""

from __future__ import annotations

import pytest
import torch

import conftest
from braid.server.model.loader import load
from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import Row, Sampling
from conftest import assert_greedy

PROMPTS = [
    "Hi",
    "The weather today is",
    "Once upon a time, in a land far away, there lived a " * 3,
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "A much longer prompt that goes on " * 12,
    "Tell me",
]
PAGES = 1024 // 16  # pages of one 1,024-token sequence
STEPS = 12


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load(str(tiny_dir), tiny_dir.parent)


@pytest.fixture(scope="module")
def runner(model) -> ModelRunner:
    return ModelRunner(
        model,
        torch.device(conftest.DEVICE),
        torch.bfloat16,
        num_pages=len(PROMPTS) * PAGES,
        max_seq_len=1024,
        allow_kernels=False,
    )


def _generate(runner: ModelRunner, prompts: list[list[int]], stagger: bool) -> list[list[int]]:
    """STEPS greedy tokens for each prompt, each in pages of its own, all in the same passes; with
    `stagger`, prompt i joins at pass i, so passes mix a prompt with decode rows as continuous mode's do."""
    sampling = Sampling()
    generated: list[list[int]] = [[] for _ in prompts]
    num_passes = 0
    while any(len(tokens) < STEPS for tokens in generated):
        rows, which = [], []
        for i, (prompt, tokens) in enumerate(zip(prompts, generated)):
            if len(tokens) == STEPS or (stagger and i > num_passes):
                continue
            pages = range(i * PAGES, (i + 1) * PAGES)
            start, fed = (0, prompt) if not tokens else (len(prompt) + len(tokens) - 1, tokens[-1:])
            rows.append(
                Row(
                    pages=pages,
                    start=start,
                    token_ids=fed,
                    sample=True,
                    sampling=sampling,
                    rng=runner.random_state(sampling),
                    is_prompt=not tokens,
                )
            )
            which.append(i)
        for i, sampled in zip(which, runner.run(rows)):
            generated[i].append(sampled.token)
        num_passes += 1
    return generated


def test_the_cuda_path_is_torchs_ops_in_bf16(runner):
    assert (runner.path, runner.kernels) == ("braid", "torch")
    assert (runner.dtype_name, runner.kv_dtype_name) == ("bfloat16", "bfloat16")


def test_greedy_tokens_alone_and_batched_obey_the_near_tie_rule(runner, model, tiny_dir):
    prompts = [list(model.hf_tokenizer.encode(p)) for p in PROMPTS]
    alone = [_generate(runner, [prompt], stagger=False)[0] for prompt in prompts]
    together = _generate(runner, prompts, stagger=False)
    staggered = _generate(runner, prompts, stagger=True)
    for prompt, *runs in zip(prompts, alone, together, staggered):
        for generated in runs:
            assert_greedy(tiny_dir, prompt, generated, dtype="bfloat16")


def test_one_tokens_embedding_row_has_the_row_stride_cublas_needs():
    """A tied head's embedding lookup of one token (every decode step of one stream) was a [1, hidden]
    transpose with strides (1, 1): contiguous() keeps those, and cuBLASLt refused the in-place addmm_
    into that residual row with CUBLAS_STATUS_INVALID_VALUE (found on an H200: every one-stream step
    on CUDA failed)."""
    from braid.server.runner.kernels.packing import Linear

    linear = Linear(torch.randn(100, 64), None, torch.float32, torch.device("cpu"))
    for ids in ([3], [3, 7]):
        rows = linear.columns(torch.tensor(ids))
        assert rows.stride() == (64, 1)
        assert torch.equal(rows, linear.weight.t()[ids])
