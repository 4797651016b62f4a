"""The models users bring: tiny random models of each architecture, saved to a folder or written as a
GGUF file (tests/gguf_files.py) and served by braid, generate transformers' greedy tokens. Qwen3,
Phi-3, Gemma 2 and Gemma 3 run on braid's own decoder, a GGUF file's matrices in their own block
formats (multiplying float32 rows, --activations float32, for transformers' rule); GPT-2 has no native path and runs through transformers' forward, with braid's scheduler,
streaming, cancellation and stop rules all the same. A folder or a GGUF file transformers cannot
load says so in one line."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from braid.client import AsyncClient
from braid.v1 import generate_pb2 as pb
from braid_testing.models import save_model, tiny_model
from conftest import LOGPROB_TOLERANCE, Server, _reference_logits, assert_greedy, compute_dtype, wait_for
from gguf import GGMLQuantizationType
from gguf_files import GEMMA_SPECIALS, LAYER_FORMATS, PHI3_SPECIALS, embedded_bpe, sentencepiece, write_gguf
from test_startup_errors import assert_one_line, braid

PROMPTS = ["The sea is", "Once upon a time, in a land far away, there lived a", "1 2 3 4 5"]
GGUF_PROMPTS = ["The sea is calm and the land", "1 2 3 4 5 6"]  # 7 to 11 tokens each
# A GGUF file's config where it is not the folder's: transformers reads no head_dim from a Qwen3
# file and takes its default, 128 (every released Qwen3's)
GGUF_CONFIG = {"qwen3": dict(head_dim=128)}
FP32_CACHE = ("--kv-cache-dtype", "float32")  # tokens compared with transformers' to fp32 rounding (_serve)
# A model whose matrices can be K-quants (super-blocks of 256 inputs); gguf_files writes random blocks
K_QUANT_MODEL = dict(
    hidden_size=256, intermediate_size=512, layer_formats=(GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)
)
# Settings stored in a GGUF file where transformers does not read them (model/gguf_config.py):
# case -> (kind, its config beyond GGUF_CONFIG, the runner that serves it). Gemma 2's soft-caps
# (braid_testing.models: 20 and 10) are among them too; transformers' defaults are 50 and 30.
GGUF_CASES = {
    # Gemma 3 4B and up: linear RoPE scaling on the global layers only (6 layers: the sixth is
    # global, in the pattern every Gemma 3 has and llama.cpp assumes, as no GGUF key holds it)
    "gemma3-linear-rope": (
        "gemma3",
        dict(
            num_hidden_layers=6,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        ),
        "braid",
    ),
    "qwen3-yarn": (
        "qwen3",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 256,
            }
        ),
        "braid",
    ),
    # Llama 3.1 and up: its RoPE scaling as a tensor of divisors (Llama 3.2's parameters; 8,192
    # positions scaled, so that the tiny model's few frequencies fall in every band)
    "llama-3-rope": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        ),
        "braid",
    ),
    # Q4_K and Q6_K layers in each new family, served in their own format
    "qwen3-k-quants": ("qwen3", K_QUANT_MODEL, "braid"),
    "phi3-k-quants": ("phi3", K_QUANT_MODEL, "braid"),
    "gemma3-k-quants": ("gemma3", dict(K_QUANT_MODEL, head_dim=64, query_pre_attn_scalar=64), "braid"),
    # Phi-4-mini's kind: LongRoPE (length-dependent: transformers runs it) over 3/4 of each head
    "phi3-longrope": (
        "phi3",
        dict(
            original_max_position_embeddings=256,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "long_factor": [1.0, 1.5, 2.0, 4.0, 8.0, 16.0],
                "short_factor": [1.0, 1.2, 1.6, 2.5, 4.0, 9.0],
            },
        ),
        "transformers",
    ),
}


def _tiny_for_gguf(kind: str, **config):
    """The tiny model of `kind`, and a vocabulary of the kind its models have: sentencepiece for
    Gemma and Phi-3 (small, of the prompts' words), else the embedded model's byte-level BPE (cut to
    512 tokens)."""
    specials = {"gemma2": GEMMA_SPECIALS, "gemma3": GEMMA_SPECIALS, "phi3": PHI3_SPECIALS}.get(kind)
    vocab = sentencepiece(" ".join(GGUF_PROMPTS), specials) if specials else embedded_bpe(512)
    return tiny_model(kind, len(vocab.tokens), **config), vocab


def _gguf(path: Path, kind: str, **config) -> Path:
    """The tiny model of `kind` as a GGUF file at path."""
    model, vocab = _tiny_for_gguf(kind, **config)
    return write_gguf(model, path, vocab)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smol_dir):
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = save_model(tmp_path_factory.mktemp(kind), tiny_model(kind), tokenizer_from=smol_dir)
        return made[kind]

    return get


def _serve(model: Path, *flags: str) -> Server:
    """An fp32 KV cache (--kv-cache-dtype float32): the tests compare tokens and logprobs with
    transformers' to fp32 rounding, which the CPU's default cache (q8_0, or float16 for head_dims
    that are not whole q8_0 blocks) does not keep."""
    return Server(
        ["--model", str(model), "--threads", "1", "--max-batch-size", "8", "--max-wait-ms", "5", *FP32_CACHE, *flags]
    )


@pytest.fixture(scope="module")
def served(folders):
    """A server per (architecture, mode), started on first use and shared by the module."""
    started: dict[tuple[str, str], Server] = {}

    def get(kind: str, mode: str = "continuous") -> Server:
        if (kind, mode) not in started:
            started[kind, mode] = _serve(folders(kind), "--mode", mode)
        return started[kind, mode]

    yield get
    for server in started.values():
        server.stop()


async def _greedy_all(
    target: str, prompts: list[str] = PROMPTS, n: int = 12, logprobs: list | None = None
) -> list[tuple[list[int], list[int]]]:
    """Every prompt at once (so continuous mode batches them): (prompt ids, generated ids) each;
    where `logprobs` is a list, each prompt's generated tokens' log-probabilities (a list each) are
    put in it, in the prompts' order."""
    async with AsyncClient(target) as client:

        async def one(prompt: str):
            ids = list((await client.tokenize(prompt)).token_ids)
            messages = [
                m
                async for m in client.stream(
                    prompt=prompt, max_new_tokens=n, ignore_eos=True, logprobs=logprobs is not None
                )
            ]
            return ids, [t for m in messages for t in m.token_ids], [lp.logprob for m in messages for lp in m.logprobs]

        results = await asyncio.gather(*(one(p) for p in prompts))
    if logprobs is not None:
        logprobs.extend(chosen for _, _, chosen in results)
    return [(ids, out) for ids, out, _ in results]


def test_greedy_tokens_are_transformers_own(served, folders):
    """Through a real server, on transformers' fallback (GPT-2): greedy tokens and their logprobs,
    three prompts of different lengths at once (their decode rows run as one padded batch). Every
    mode and the other families: the in-process test below."""
    server = served("gpt2", "continuous")
    with server.client() as client:
        assert client.model_info().runner == "transformers"
    logprobs: list[list[float]] = []
    results = asyncio.run(_greedy_all(server.target, logprobs=logprobs))
    _check_greedy_and_logprobs(folders("gpt2"), [(ids, out, lp) for (ids, out), lp in zip(results, logprobs)])


def _check_greedy_and_logprobs(folder: Path, results: list[tuple[list[int], list[int], list[float]]]) -> None:
    """results: per prompt (prompt ids, 12 greedy tokens, their logprobs), against transformers'."""
    import torch

    for prompt_ids, generated, chosen in results:
        assert len(generated) == 12
        assert_greedy(folder, prompt_ids, generated)
        logits = _reference_logits(folder, tuple(prompt_ids + generated[:-1]))[len(prompt_ids) - 1 :]
        expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(generated)), generated]
        assert chosen == pytest.approx(expected.tolist(), **LOGPROB_TOLERANCE[compute_dtype()])


@pytest.mark.parametrize(
    "kind, mode, runner",
    [
        ("gpt2", "continuous", "transformers"),
        ("gpt2", "sequential", "transformers"),
        ("gpt2", "interleaved", "transformers"),
        ("gpt2", "batched", "transformers"),
        ("opt", "continuous", "transformers"),
        ("qwen3", "continuous", "braid"),
        ("phi3", "continuous", "braid"),
        ("gemma2", "continuous", "braid"),
        ("gemma3", "continuous", "braid"),
    ],
)
def test_greedy_tokens_are_transformers_own_in_every_mode(folders, in_process, kind, mode, runner):
    """In process (tests/in_process.py), the engine in the mode over the runner a server builds:
    greedy tokens and their logprobs, three prompts of different lengths at once (on the fallback,
    their decode rows run as one padded batch where the mode batches them)."""
    from in_process import generate

    model = in_process(folders(kind), kv_cache_dtype="float32")  # transformers' fp32 rounding: _serve
    assert model.runner.path == runner
    requests = [dict(prompt=p, max_new_tokens=12, ignore_eos=True, logprobs=True) for p in PROMPTS]
    outcomes = generate(model, requests, mode=mode, max_batch_size=8, max_wait_ms=5)
    _check_greedy_and_logprobs(
        folders(kind),
        [
            (model.tokenizer.encode_prompt(p), o.token_ids, [lp.logprob for lp in o.logprobs])
            for p, o in zip(PROMPTS, outcomes)
        ],
    )


# One GGUF file goes through a real server (conversion at start, Tokenize, Stream, ModelInfo); the
# other cases check the same thing in this process, on the same loader and runner a server builds,
# without a server's start each (issue 27's test tiers).
SERVED_GGUF_CASE = "qwen3-yarn"


@pytest.mark.parametrize("case", ["qwen3", "phi3", "gemma2", "gemma3", "gpt2", *GGUF_CASES])
def test_a_gguf_file_generates_the_tokens_transformers_does_from_it(tmp_path, case):
    """A GGUF file as llama.cpp's converter writes it: braid's decoder serves its matrices in their
    own block formats, and greedy tokens are those of transformers running the same file's weights
    with the config the file was written from (all of it: also what transformers' GGUF loader drops)."""
    kind, config, runner = GGUF_CASES.get(case, (case, {}, "transformers" if case == "gpt2" else "braid"))
    config = dict(config)
    formats = config.pop("layer_formats", LAYER_FORMATS)
    model, vocab = _tiny_for_gguf(kind, **GGUF_CONFIG.get(kind, {}) | config)
    path = write_gguf(model, tmp_path / f"{kind}.gguf", vocab, layer_formats=formats)
    # float32 rows: transformers' rule (by default a quantized matrix multiplies int8 rows)
    if case == SERVED_GGUF_CASE:
        server = _serve(path, "--cache-dir", str(tmp_path), "--activations", "float32")  # stopped here
        try:
            with server.client() as client:
                info = client.model_info()
            logprobs: list[list[float]] = []
            greedy = asyncio.run(_greedy_all(server.target, GGUF_PROMPTS, logprobs=logprobs))
        finally:
            server.stop()
        served_by, activations, weight_formats = info.runner, info.activations, dict(info.weight_formats)
    else:
        served_by, activations, weight_formats, greedy, logprobs = _greedy_in_process(path, tmp_path, GGUF_PROMPTS)
    assert served_by == runner and activations == "float32"
    if runner == "braid":  # each matrix in its block format, each norm and bias in f32
        assert weight_formats == _formats_in(path)
    else:
        assert set(weight_formats) == {"f32"}  # dequantized, as transformers loads them
    reference, tokenizer = _gguf_reference(path, model.config)
    for prompt, (prompt_ids, generated), chosen in zip(GGUF_PROMPTS, greedy, logprobs):
        assert prompt_ids == tokenizer(prompt).input_ids
        assert len(generated) == 12
        _assert_greedy_on(reference, prompt_ids, generated, chosen)


def _greedy_in_process(path: Path, cache_dir: Path, prompts: list[str], n: int = 12):
    """What `braid serve --model path --cache-dir cache_dir --activations float32` says of the
    file and generates greedily, on the loader, tokenizer and runner it builds, in this process:
    (runner path, activations, weight formats, [(prompt ids, generated ids)], [their logprobs])."""
    import torch

    from braid.server.engine.tokenizer import Tokenizer
    from braid.server.model.loader import load
    from braid.server.runner.model_runner import ModelRunner
    from braid.server.runner.rows import Row, Sampling

    loaded = load(str(path), cache_dir)
    runner = ModelRunner(
        loaded, torch.device("cpu"), torch.float32, num_pages=16, max_seq_len=64, activations="float32"
    )
    tokenizer, sampling = Tokenizer(loaded.hf_tokenizer, loaded.eos_token_ids), Sampling(logprobs=True)
    greedy, logprobs = [], []
    for prompt in prompts:
        prompt_ids, generated, chosen = tokenizer.encode(prompt, ()), [], []
        pages = list(range(-(-(len(prompt_ids) + n) // runner.page_size)))
        row = Row(pages=pages, start=0, token_ids=prompt_ids, sample=True, sampling=sampling, rng=None, is_prompt=True)
        for _ in range(n):
            (sampled,) = runner.run([row])
            generated.append(sampled.token)
            chosen.append(sampled.logprob.logprob)
            start = len(prompt_ids) + len(generated) - 1
            row = Row(pages=pages, start=start, token_ids=[sampled.token], sample=True, sampling=sampling, rng=None)
        greedy.append((prompt_ids, generated))
        logprobs.append(chosen)
    return runner.path, runner.activations, dict(runner.weight_formats), greedy, logprobs


def _formats_in(path: Path) -> dict[str, int]:
    """The GGUF file's weights counted by type, as braid names them (not RoPE's factors: no weights)."""
    from gguf import GGUFReader

    from braid.server.model.weights import gguf_type_name

    return dict(
        Counter(gguf_type_name(t.tensor_type) for t in GGUFReader(str(path)).tensors if not t.name.startswith("rope_"))
    )


def _gguf_reference(path: Path, config):
    """transformers' model of the GGUF file's weights with `config`, and the file's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, config=config
        ).eval(),
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name),
    )


def _assert_greedy_on(model, prompt_ids: list[int], generated: list[int], logprobs: list[float] = ()) -> None:
    """conftest.assert_greedy's near-tie rule, against a model transformers has loaded (from a GGUF
    file); and where braid gave them, each chosen token's log-probability (greedy tokens alone can
    miss a wrong setting: the tiny Gemma 3 picks the same ones without its RoPE scaling)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + generated[:-1]])).logits[0, len(prompt_ids) - 1 :]
    for step, token in enumerate(generated):
        best = logits[step].max()
        assert (best - logits[step][token]).item() <= 1e-4 * max(1.0, best.abs().item()), (
            f"step {step}: braid chose {token}, transformers {logits[step].argmax().item()}"
        )
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(generated)), generated]
    assert list(logprobs) == pytest.approx(expected.tolist()[: len(logprobs)], abs=1e-3)


def test_the_fallback_matches_transformers_generate(served, folders):
    """Beyond the near-tie rule: token for token what `generate` gives, on a prompt with no near-tie."""
    import torch

    from conftest import _reference_model

    with served("gpt2").client() as client:
        ids = list(client.tokenize(PROMPTS[0]).token_ids)
        got = client.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True).token_ids
    expected = (
        _reference_model(folders("gpt2"))
        .generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, len(ids) :]
        .tolist()
    )
    assert list(got) == expected


def test_the_fallback_stops_at_a_stop_string_and_is_cancelled(served):
    with served("gpt2").client() as client:
        full = client.generate(PROMPTS[1], max_new_tokens=24, ignore_eos=True)
        stop = full.text[len(full.text) // 2 :][:4]
        assert stop.strip(), "need a visible stop string"
        stopped = client.generate(PROMPTS[1], max_new_tokens=24, ignore_eos=True, stop=[stop])
        assert stopped.final.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
        assert stopped.text == full.text[: full.text.find(stop)]

        before = client.server_status()
        stream = client.stream("Count with me:", max_new_tokens=900, ignore_eos=True)
        next(iter(stream))  # it is running on the transformers path
        stream.cancel()

        def cancelled():
            s = client.server_status()
            return (
                s
                if s.sessions_active == 0 and s.sessions_finished.cancelled > before.sessions_finished.cancelled
                else None
            )

        status = wait_for(cancelled)
        assert status.kv_pages_used == 0 and status.tokens_generated - before.tokens_generated < 900


def test_an_architecture_transformers_cannot_load_is_one_line(tmp_path, smol_dir):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}))
    shutil.copy(smol_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    assert_one_line(braid("serve", "--model", str(tmp_path), "--port", "0"), "NoSuchForCausalLM", "cannot load")


@pytest.mark.parametrize("layers, scalar", [(2, 32), (46, 16)])
def test_a_gemma_2_files_soft_caps_and_attention_scale_are_read_from_it(tmp_path, layers, scalar):
    """What transformers leaves at its defaults for a Gemma 2 file: the soft-caps the file states,
    and the attention scale llama.cpp uses (no key holds it): the head size, or for the 27B model
    (46 layers) hidden size / heads. Greedy tokens never show a final soft-cap: it keeps the order."""
    from transformers import AutoConfig

    from braid.server.model import gguf_config

    model, vocab = _tiny_for_gguf(
        "gemma2", num_hidden_layers=layers, head_dim=32, query_pre_attn_scalar=scalar, layer_types=None
    )
    path = write_gguf(model, tmp_path / "gemma2.gguf", vocab)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)  # transformers' own
    gguf_config.restore(path, config)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (20.0, 10.0)
    assert config.query_pre_attn_scalar == scalar


def test_rope_divisors_that_are_not_llama_3s_scaling_are_not_taken_for_it():
    from braid.server.model.gguf_config import _llama3_parameters

    divisors = list(_divisors_of_llama_3_2(head_dim=64))
    assert _llama3_parameters(divisors, 500000.0, 64) == dict(
        factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    assert _llama3_parameters([d * 1.01 for d in divisors], 500000.0, 64) is None
    assert _llama3_parameters(divisors[:-1], 500000.0, 64) is None


def _divisors_of_llama_3_2(head_dim: int):
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3.2's RoPE (gguf_files)."""
    from transformers import LlamaConfig

    from gguf_files import _extra_tensors

    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    ((name, divisors),) = _extra_tensors(config)
    return divisors.tolist()


def test_a_gguf_file_missing_a_tensor_is_one_line(tmp_path):
    """transformers loads such a file with that tensor left at its random initial values, and only
    logs a warning: braid refuses to serve it."""
    vocab = embedded_bpe(512)
    model = tiny_model("qwen3", len(vocab.tokens), head_dim=128)
    path = write_gguf(model, tmp_path / "qwen3.gguf", vocab, leave_out=("blk.1.ffn_down.weight",))
    out = braid("serve", "--model", str(path), "--port", "0", "--cache-dir", str(tmp_path), "--log-level", "warning")
    assert_one_line(out, "Qwen3ForCausalLM", "model.layers.1.mlp.down_proj.weight", "not in the file")


def test_a_gguf_file_transformers_cannot_load_is_one_line(tmp_path):
    """A Qwen3 file whose heads are not 128 wide: transformers reads no head size from the file."""
    path = _gguf(tmp_path / "qwen3.gguf", "qwen3")  # the folder's head_dim, 32
    out = braid("serve", "--model", str(path), "--port", "0", "--cache-dir", str(tmp_path), "--log-level", "warning")
    assert_one_line(out, "Qwen3ForCausalLM", "cannot load", "[32] in the file, [128] in the model")
