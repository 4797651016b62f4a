"""The model runner on a tiny random Llama, in process: passes that sample nothing, and long prompts
fed in chunks give the same next token as in one pass."""

from __future__ import annotations

import pytest
import torch

from braid_testing.models import loaded, tiny_model
from braid.server.runner.kernels import step as kernel_step
from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import Row, Sampling, prompt_row


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=None)


@pytest.fixture(scope="module", params=[True, False], ids=["kernels-auto", "kernels-torch"])
def runner(request, tiny) -> ModelRunner:
    return ModelRunner(
        loaded(tiny),
        torch.device("cpu"),
        torch.float32,
        num_pages=4 * PAGES,
        max_seq_len=2048,
        allow_kernels=request.param,
    )


PAGES = 2048 // 16  # pages of one 2048-token sequence


def _slot(i: int) -> list[int]:
    """The pages of sequence i, when each has pages for 2048 tokens of its own."""
    return list(range(i * PAGES, (i + 1) * PAGES))


def _feed(runner: ModelRunner, prompt: list[int], start: int, n: int, slot: int | list[int]) -> int | None:
    """Feeds prompt[start:start + n] into the pages of sequence `slot` (or those pages); the next
    token if that reaches the prompt's end."""
    sampling = Sampling()
    pages = _slot(slot) if isinstance(slot, int) else slot
    chunk = prompt[start : start + n]
    [token] = runner.run(
        [prompt_row(chunk, pages, start=start, sample=start + n == len(prompt), rng=runner.random_state(sampling))]
    )
    return token


def test_a_pass_of_prompt_chunks_that_sample_nothing(runner):
    """Issue 10: a 600-token prompt with --prefill-chunk 512 is fed 512 then 88 tokens. The first pass
    has no row to sample; the output head got zero rows, and the C gemm refused them."""
    prompt = [(7 * i) % 500 + 3 for i in range(600)]
    assert _feed(runner, prompt, 0, 512, slot=0) is None
    token = _feed(runner, prompt, 512, 88, slot=0)
    assert token is not None and _feed(runner, prompt, 0, 600, slot=1) == token


def test_tokens_come_back_in_the_order_of_the_rows(runner):
    """Prompt chunks are packed before decode rows; each row still gets its own token back."""
    sampling = Sampling()
    prompt = [5, 9, 14, 3]
    first = _feed(runner, prompt, 0, 4, slot=0).token  # sequence 0 now decodes from position 4
    other = [8, 8, 2]
    decode = Row(
        pages=_slot(0), start=4, token_ids=[first], sample=True, sampling=sampling, rng=runner.random_state(sampling)
    )
    chunk = prompt_row(other, _slot(1), sample=True, rng=runner.random_state(sampling))
    mixed = runner.run([decode, chunk])  # the decode row first, packed last
    assert mixed[1] == _feed(runner, other, 0, 3, slot=1)
    assert mixed[0] == runner.run([decode])[0]


def _greedy(runner: ModelRunner, pages: list[int], prompt: list[int], start: int, steps: int) -> list[int]:
    """Prefills prompt[start:] (positions before `start` already in `pages`), then decodes
    `steps` tokens one pass each; the tokens."""
    sampling = Sampling()
    tokens = [_feed(runner, prompt, start, len(prompt) - start, pages).token]
    for _ in range(steps - 1):
        position = len(prompt) + len(tokens) - 1
        [token] = runner.run(
            [
                Row(
                    pages=pages,
                    start=position,
                    token_ids=[tokens[-1]],
                    sample=True,
                    sampling=sampling,
                    rng=runner.random_state(sampling),
                )
            ]
        )
        tokens.append(token.token)
    return tokens


def test_any_pages_in_any_order_give_the_same_tokens(runner):
    """A sequence reads and writes only through its page table: scattered pages, in any order,
    give what a run of consecutive pages gives."""
    prompt = [(11 * i) % 500 + 3 for i in range(70)]
    scattered = [3 * PAGES + 9, 17, 2 * PAGES + 1, 5, 40, 3 * PAGES]
    assert _greedy(runner, scattered, prompt, 0, 20) == _greedy(runner, _slot(0), prompt, 0, 20)


def test_a_shared_prefix_is_read_not_recomputed(runner):
    """A second sequence whose table starts with the first's full pages prefills only the rest of
    its prompt, and generates what it would have from scratch; the shared pages are not written."""
    prefix = [(13 * i) % 500 + 3 for i in range(48)]  # three full pages
    first = _slot(0)
    _feed(runner, prefix + [9], 0, 49, first)
    shared = [p.clone() for p in runner.cache.k[:1]]
    second = first[:3] + _slot(1)[3:]
    prompt = prefix + [21, 4, 7]
    assert _greedy(runner, second, prompt, 48, 12) == _greedy(runner, _slot(2), prompt, 0, 12)
    assert torch.equal(runner.cache.k[0][first[:3]], shared[0][first[:3]])


def test_prompt_targets_score_as_transformers_in_chunks_beside_other_rows(runner, tiny):
    """prompt_logprobs: a prompt fed in two chunks, each pass also carrying another sequence's
    decode row, scores every prompt token after the first as log_softmax of transformers' logits,
    and the rows that sample still get their own tokens."""
    prompt = [(11 * i) % 500 + 3 for i in range(40)]
    with torch.no_grad():
        expected = torch.log_softmax(tiny(torch.tensor([prompt])).logits[0].float(), dim=-1)
    other = [4, 9, 16]
    decoding = _feed(runner, other, 0, 3, slot=1).token
    sampling = Sampling(logprobs=True, top_logprobs=3)
    scores = []
    for start, end in ((0, 25), (25, 40)):
        rows = [
            prompt_row(
                prompt[start:end],
                _slot(0),
                start=start,
                sample=end == 40,
                sampling=sampling,
                rng=runner.random_state(sampling),
                targets=prompt[start + 1 : min(end, 39) + 1],
            ),
            Row(
                pages=_slot(1), start=3 + (start > 0), token_ids=[decoding], sample=True, sampling=Sampling(), rng=None
            ),
        ]
        scored, other_token = runner.run(rows)
        assert other_token.token is not None and not other_token.targets
        scores += scored.targets
        decoding = other_token.token
    assert scored.token is not None  # the last chunk sampled the first generated token too
    assert len(scores) == 39
    for i, lp in enumerate(scores):
        assert abs(lp.logprob - expected[i, prompt[i + 1]].item()) < 1e-3
        assert lp.rank == int((expected[i] > expected[i, prompt[i + 1]]).sum()) + 1
        assert [t for t, _ in lp.top] == expected[i].topk(3).indices.tolist()


def _peft_folder(path, rank: int, hidden: int = 64, kv: int = 32, seed: int = 0, dtype=torch.float32):
    """A LoRA adapter in PEFT's file format for the tiny Llama (q and v projections of both
    layers), written by hand, its matrices saved in dtype."""
    import json

    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module, out in (("q_proj", hidden), ("v_proj", kv)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, hidden, generator=generator) * 0.3).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=generator) * 0.3).to(dtype)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps({"r": rank, "lora_alpha": 2 * rank, "peft_type": "LORA", "target_modules": ["q_proj", "v_proj"]})
    )
    return path


def _logits(runner: ModelRunner, rows: list[Row]) -> torch.Tensor:
    batch = runner.pack(rows).batch
    return runner.decoder.forward(batch, runner.cache)


def test_rows_with_adapters_and_without_share_a_pass_and_an_unloaded_adapter_is_gone(runner, tmp_path):
    """Rows of two adapters and of none, interleaved in one pass, get each the logits they get
    alone; the base rows' are the base model's; an unloaded adapter's matrices are dropped."""
    runner.load_adapter(101, "a", str(_peft_folder(tmp_path / "a", 8, seed=1)), 64)
    info = runner.load_adapter(102, "b", str(_peft_folder(tmp_path / "b", 16, seed=2)), 64)
    assert info.rank == 16 and info.scale == 2.0 and info.target_modules == ("q_proj", "v_proj")
    prompt = [5, 9, 33, 7, 100, 41]

    def row(i: int, adapter: int) -> Row:
        return prompt_row(prompt, _slot(i), sample=True, adapter=adapter)

    adapters = [101, 0, 102, 101]  # the runner has pages for 4 sequences
    together = _logits(runner, [row(i, a) for i, a in enumerate(adapters)])
    # pack groups the rows by adapter: the logits come in that order
    order = sorted(range(len(adapters)), key=lambda i: adapters[i])
    for k, i in enumerate(order):
        alone = _logits(runner, [row(0, adapters[i])])[0]
        assert torch.allclose(together[k], alone, atol=1e-4), (i, adapters[i])
    base, with_a, with_b = (_logits(runner, [row(0, a)])[0] for a in (0, 101, 102))
    assert (base - with_a).abs().max() > 0.1 and (with_a - with_b).abs().max() > 0.1
    runner.unload_adapter(101)
    runner.unload_adapter(102)
    assert runner._adapters == {}
    with pytest.raises(RuntimeError, match="not loaded"):
        _logits(runner, [row(0, 101)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_with_adapters_get_the_same_logits_in_the_one_call_step_as_layer_by_layer(
    runner, tmp_path, dtype, monkeypatch
):
    """A decode pass with rows of two adapters (q and v, not k: modules apart in the fused q/k/v)
    and of none: on braid's kernels the one C call adds each row's delta itself; its logits are
    the layer-by-layer path's, and each row's are those it gets alone. Adapters saved in bf16 (their
    scale 2: every value a bf16 one) the step reads in bf16, those in fp32 in fp32: the same values."""
    runner.load_adapter(301, "a", str(_peft_folder(tmp_path / "a", 8, seed=3, dtype=dtype)), 64)
    runner.load_adapter(302, "b", str(_peft_folder(tmp_path / "b", 16, seed=4, dtype=dtype)), 64)
    assert [runner._adapters[i].bf16 for i in (301, 302)] == [dtype == torch.bfloat16] * 2
    adapters = [301, 0, 302, 301]
    prompt = [5, 9, 33, 7, 100, 41]
    for i, adapter in enumerate(adapters):
        _logits(runner, [prompt_row(prompt, _slot(i), sample=True, adapter=adapter)])

    def decode(slots: list[int]) -> list[Row]:
        return [
            Row(
                pages=_slot(i),
                start=len(prompt),
                token_ids=[11 + i],
                sample=True,
                sampling=Sampling(),
                rng=None,
                is_prompt=False,
                adapter=adapters[i],
            )
            for i in slots
        ]

    one_call = _logits(runner, decode([0, 1, 2, 3]))
    decoder = runner.decoder
    was, decoder.one_call = decoder.one_call, False
    try:
        layer_by_layer = _logits(runner, decode([0, 1, 2, 3]))
    finally:
        decoder.one_call = was
    assert torch.allclose(one_call, layer_by_layer, atol=1e-4)
    order = sorted(range(len(adapters)), key=lambda i: adapters[i])  # pack groups rows by adapter
    for k, i in enumerate(order):
        assert torch.allclose(one_call[k], _logits(runner, decode([i]))[0], atol=1e-4), (i, adapters[i])
    if runner.decoder.one_call:  # x A^T shared out among the threads or done by each: the same bits
        for alone in (0, 1 << 40):
            monkeypatch.setattr(kernel_step, "LORA_ALONE_MACS", alone)
            assert torch.equal(_logits(runner, decode([0, 1, 2, 3])), one_call), alone
    runner.unload_adapter(301)
    runner.unload_adapter(302)


def test_an_adapter_for_another_model_is_refused_naming_the_tensor(runner, tmp_path):
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj\.lora_A\.weight: shape \[8, 32\]"):
        runner.load_adapter(201, "x", str(_peft_folder(tmp_path / "x", 8, hidden=32)), 64)
    with pytest.raises(ValueError, match="r=16 is past --max-lora-rank 8"):
        runner.load_adapter(202, "y", str(_peft_folder(tmp_path / "y", 16)), 8)
    assert runner._adapters == {}


def test_an_fp32_adapter_is_read_in_bf16_only_where_the_bases_rows_are_rounded_too(runner, tmp_path, monkeypatch):
    """On fp32 rows an fp32 adapter keeps its every value (its tokens are PEFT's); where the base's
    rows are rounded (--activations int8 or bf16), it is rounded to bf16, half the bytes to read,
    and every path reads the rounded values."""
    folder = str(_peft_folder(tmp_path / "a", 8, seed=5))
    assert runner.activations == "float32"
    runner.load_adapter(401, "exact", folder, 64)
    monkeypatch.setattr(runner, "activations", "int8")
    runner.load_adapter(402, "rounded", folder, 64)
    exact, rounded = runner._adapters[401], runner._adapters[402]
    assert (exact.bf16, rounded.bf16) == (False, True)
    for group, stack in rounded.layers[0].items():
        matrices = [stack.at, *(part[4] for part in stack.parts)]
        originals = [exact.layers[0][group].at, *(part[4] for part in exact.layers[0][group].parts)]
        for matrix, original in zip(matrices, originals):
            assert torch.equal(matrix, original.to(torch.bfloat16).to(matrix.dtype)), group
            assert not torch.equal(matrix, original), group
    runner.unload_adapter(401)
    runner.unload_adapter(402)


@pytest.mark.parametrize("outtype, tolerance", [("f32", 0), ("f16", 1e-3), ("bf16", 8e-3), ("q8_0", 8e-3)])
def test_a_gguf_adapter_reads_as_its_peft_folder(runner, tiny, tmp_path, outtype, tolerance):
    """The same adapter as a PEFT folder and as llama.cpp's converter writes it to GGUF, in each
    type it writes: the same matrices (exactly from f32; within the type's rounding otherwise),
    q's rows put back in transformers' order (the converter permutes them for Llama's RoPE)."""
    from lora_files import write_gguf_adapter

    folder = _peft_folder(tmp_path / "peft", 8, seed=5)
    gguf = write_gguf_adapter(folder, tiny.config, tmp_path / "adapter.gguf", outtype)
    peft_info = runner.load_adapter(401, "peft", str(folder), 64)
    gguf_info = runner.load_adapter(402, "gguf", str(gguf), 64)
    try:
        assert (gguf_info.rank, gguf_info.scale, gguf_info.target_modules) == (8, 2.0, ("q_proj", "v_proj"))
        assert (peft_info.rank, peft_info.scale, peft_info.target_modules) == (8, 2.0, ("q_proj", "v_proj"))
        for want, got in zip(runner._adapters[401].layers, runner._adapters[402].layers):
            m, n = want["qkv"], got["qkv"]  # A^T, and the block-diagonal B^T times the scale
            for a, b in [(m.at, n.at), *((p[4], q[4]) for p, q in zip(m.parts, n.parts))]:
                assert (a - b).abs().max() <= tolerance * a.abs().max(), outtype
    finally:
        runner.unload_adapter(401)
        runner.unload_adapter(402)


def test_in_process_runners_are_built_on_pytests_device_where_a_gpu_is(tiny_dir, monkeypatch):
    """tests/in_process.load_model builds its runner on pytest's --device (cpu unless told), as the
    servers the tests start run: on a machine with a GPU, braid's own default (--device auto) put it on
    CUDA, and four of test_precision's tests failed so on an H200's host. Here torch claims a GPU."""
    from in_process import load_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert load_model(tiny_dir, tiny_dir.parent).runner.device == torch.device("cpu")
