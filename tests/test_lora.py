"""LoRA adapters as their users meet them: adapters made by PEFT, served by braid beside the base model,
each request naming its own, and each generating the greedy tokens transformers + PEFT do with the
same weights; loaded and unloaded at run time while generations run; every mistake a clear status."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path

import grpc
import httpx
import pytest

from braid.client import AsyncClient
from braid.client.errors import BraidError
from braid.server.engine.types import EngineStats, FinishReason
from braid_testing.models import save_model, tiny_model
from conftest import Server, _reference_logits, assert_greedy, free_port, tiny_server
from in_process import generate, load_model
from in_process import run as run_in_process
from gguf_files import write_gguf
from lora_files import ALL_TARGETS, make_adapter, merged, peft_logits, write_gguf_adapter
from test_architectures import GGUF_CONFIG, _tiny_for_gguf
from test_startup_errors import assert_one_line, braid

PROMPTS = ["The sea is", "Once upon a time, in a land far away, there lived a", "1 2 3 4 5"]
# two adapters per base: rank 8 on every projection, and rank 16 on a few (rsLoRA's scale)
# an fp32 KV cache where tokens are compared with transformers' and PEFT's to fp32 rounding, which the
# CPU's default cache (float16 for the tiny models' head_dim 16, q8_0 for Qwen3's 32) does not keep
FP32_CACHE = ("--kv-cache-dtype", "float32")
ADAPTERS = {
    "r8": dict(rank=8, targets=ALL_TARGETS, seed=1),
    "r16": dict(rank=16, targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"), seed=2, rslora=True),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory, tiny_dir, smol_dir) -> dict[str, Path]:
    """The tiny Llama (conftest's) and a tiny Qwen3, each saved with the embedded tokenizer."""
    return {
        "llama": tiny_dir,
        "qwen3": save_model(tmp_path_factory.mktemp("qwen3"), tiny_model("qwen3"), tokenizer_from=smol_dir),
    }


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, bases) -> dict[tuple[str, str], tuple[Path, Path]]:
    """(base, adapter) -> the adapter's folder and the base with it merged in by PEFT."""
    made = {}
    root = tmp_path_factory.mktemp("adapters")
    for kind, base in bases.items():
        for name, spec in ADAPTERS.items():
            folder = make_adapter(base, root / f"{kind}-{name}", **spec)
            made[kind, name] = folder, merged(base, folder, root / f"{kind}-{name}-merged")
    return made


def _lora_args(adapters, kind: str) -> list[str]:
    return [arg for name in ADAPTERS for arg in ("--lora", f"{name}={adapters[kind, name][0]}")]


async def _greedy(target: str, jobs: list[tuple[str, str]], n: int = 12) -> list[tuple[list[int], list[int]]]:
    """Every (prompt, adapter) at once: (prompt ids, greedy tokens) each."""
    async with AsyncClient(target) as client:

        async def one(prompt: str, adapter: str):
            ids = list((await client.tokenize(prompt)).token_ids)
            messages = [
                m async for m in client.stream(prompt=prompt, max_new_tokens=n, ignore_eos=True, adapter=adapter)
            ]
            return ids, [t for m in messages for t in m.token_ids]

        return await asyncio.gather(*(one(p, a) for p, a in jobs))


def test_peft_reference_merged_and_not_agree(bases, adapters):
    """The reference itself: PEFT's unmerged forward and the merged weights give the same logits,
    and the adapter moves them far from the base model's (a braid that ignored it would fail)."""
    ids = [1, 400, 300, 50, 700, 12, 99]
    for (kind, name), (folder, merged_dir) in adapters.items():
        unmerged = peft_logits(bases[kind], folder, ids)
        assert (unmerged - _reference_logits(merged_dir, tuple(ids))).abs().max() < 1e-3
        assert (unmerged - _reference_logits(bases[kind], tuple(ids))).abs().max() > 0.5, (kind, name)


def test_greedy_tokens_with_an_adapter_are_transformers_and_pefts(bases, adapters):
    """Through a real server: each prompt with each adapter and with none, all at once, each call
    naming its adapter; every token is the merged model's greedy one (conftest's near-tie rule), the
    adapters' tokens are not the base's, and ModelInfo lists the adapters. (Every mode, Qwen3 and
    torch's ops: the in-process test below.)"""
    server = Server(
        [
            *("--model", str(bases["llama"]), "--threads", "1", "--max-batch-size", "16", *FP32_CACHE),
            *_lora_args(adapters, "llama"),
        ]
    )
    try:
        with server.client() as client:
            info = client.model_info()
        assert [(a.name, a.rank, len(a.target_modules)) for a in info.adapters] == [("r16", 16, 5), ("r8", 8, 7)]
        jobs = [(p, a) for p in PROMPTS for a in ("", *ADAPTERS)]
        results = asyncio.run(_greedy(server.target, jobs))
    finally:
        server.stop()
    _check_greedy(adapters, "llama", bases["llama"], dict(zip(jobs, results)))


def _check_greedy(adapters, kind: str, base: Path, by_job: dict) -> None:
    """by_job: (prompt, adapter) -> (prompt ids, greedy tokens), 12 of them; base: the base model."""
    for (prompt, adapter), (prompt_ids, generated) in by_job.items():
        assert len(generated) == 12
        reference = adapters[kind, adapter][1] if adapter else base
        assert_greedy(reference, prompt_ids, generated)
    for adapter in ADAPTERS:
        assert any(by_job[p, adapter][1] != by_job[p, ""][1] for p in PROMPTS), adapter


@pytest.mark.parametrize(
    "kind, mode, kernels",
    [
        ("llama", "continuous", "auto"),
        ("llama", "sequential", "auto"),
        ("llama", "interleaved", "auto"),
        ("llama", "batched", "auto"),
        ("llama", "continuous", "torch"),  # CUDA's path: torch's ops
        ("qwen3", "continuous", "auto"),
        ("qwen3", "sequential", "auto"),
        ("qwen3", "interleaved", "auto"),
        ("qwen3", "batched", "auto"),
    ],
)
def test_greedy_tokens_with_an_adapter_in_every_mode(bases, adapters, in_process, kind, mode, kernels):
    """In process, the engine in each mode over the base's runner with both adapters loaded
    (--lora): each prompt with each adapter and with none, all at once, every token the merged
    model's greedy one, the adapters' not the base's, and no page held after."""
    model = in_process(bases[kind], kernels=kernels, kv_cache_dtype="float32")  # FP32_CACHE
    jobs = [(p, a) for p in PROMPTS for a in ("", *ADAPTERS)]
    outcomes = generate(
        model,
        [dict(prompt=p, adapter=a, max_new_tokens=12, ignore_eos=True) for p, a in jobs],
        adapters=[(name, adapters[kind, name][0]) for name in ADAPTERS],
        mode=mode,
        max_batch_size=16,
    )
    by_job = {job: (model.tokenizer.encode_prompt(job[0]), o.token_ids) for job, o in zip(jobs, outcomes)}
    _check_greedy(adapters, kind, bases[kind], by_job)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_gguf_adapter_on_a_gguf_base_gives_the_tokens_of_its_peft_folder(tmp_path, kind):
    """A GGUF base model (Q4 layers) with the same adapter as a PEFT folder and as llama.cpp's
    converter writes it (Llama's q and k rows of B permuted, Qwen3's not): each prompt's greedy
    tokens are the same with either, and not the base model's. In process (tests/in_process.py):
    the runner `braid serve --model base.gguf --lora peft=... --lora gguf=...` builds, with the
    adapters loaded as --lora loads them; --lora on the wire is the server test's above."""
    model, vocab = _tiny_for_gguf(kind, **GGUF_CONFIG.get(kind, {}))
    base = write_gguf(model, tmp_path / f"{kind}.gguf", vocab)
    model.save_pretrained(tmp_path / "hf")  # PEFT makes its adapter on the transformers model
    folder = make_adapter(tmp_path / "hf", tmp_path / "peft", rank=8, seed=7, spread=0.2)
    gguf = write_gguf_adapter(folder, model.config, tmp_path / "adapter.gguf")
    loaded = load_model(base, tmp_path)  # converted into tmp_path, as --cache-dir tmp_path does
    jobs = [(p, a) for p in PROMPTS for a in ("", "peft", "gguf")]
    outcomes = generate(
        loaded,
        [dict(prompt=p, adapter=a, max_new_tokens=12, ignore_eos=True) for p, a in jobs],
        adapters=[("peft", folder), ("gguf", gguf)],
    )
    by_job = {job: o.token_ids for job, o in zip(jobs, outcomes)}
    for prompt in PROMPTS:
        assert by_job[prompt, "gguf"] == by_job[prompt, "peft"], prompt
    assert any(by_job[p, "gguf"] != by_job[p, ""] for p in PROMPTS)


def test_a_mixed_pass_gives_each_session_the_tokens_it_gets_alone(tmp_path, tiny_dir, in_process):
    """16 sessions over 4 adapters and the base model, all in the same passes, against each run
    alone. In process (tests/in_process.py): the engine over one runner with the adapters its
    sessions name loaded (--lora), as a tiny server with --max-batch-size 16 runs them."""
    folders = {f"a{i}": make_adapter(tiny_dir, tmp_path / f"a{i}", rank=8 * (1 + i % 2), seed=10 + i) for i in range(4)}
    model = in_process(tiny_dir)
    names = ["", *folders]
    jobs = [(PROMPTS[i % 3] + " " * (i // 5), names[i % 5]) for i in range(16)]

    def run(some: list[tuple[str, str]]) -> tuple[list[list[int]], EngineStats]:
        outcomes, books = run_in_process(
            model,
            [dict(prompt=p, adapter=a, max_new_tokens=16, ignore_eos=True) for p, a in some],
            adapters=[(name, folders[name]) for name in sorted({a for _, a in some} - {""})],
            max_batch_size=16,
        )
        return [o.token_ids for o in outcomes], books

    together, books = run(jobs)
    alone = [run([job])[0][0] for job in jobs]
    assert together == alone
    assert all(len(t) == 16 for t in together)
    assert len({tuple(t) for t in together}) >= 10  # the adapters do change the tokens
    assert 16 <= books.forward_passes < 16 * 16  # shared passes (16 tokens each: alone, 256 passes)
    assert books.sessions_active == 0 and books.finished[FinishReason.MAX_TOKENS] == 16


def test_adapters_load_and_unload_while_generations_run(tmp_path, tiny_dir):
    """A load and an unload under load: the unload waits for the generations using the adapter
    (new requests for it are NOT_FOUND meanwhile), none fails, the books balance, and a new adapter
    loaded under the old name never reads the old one's cached prompt pages."""
    first = make_adapter(tiny_dir, tmp_path / "first", rank=8, seed=21)
    second = make_adapter(tiny_dir, tmp_path / "second", rank=16, seed=22)
    references = {
        first: merged(tiny_dir, first, tmp_path / "first-merged"),
        second: merged(tiny_dir, second, tmp_path / "second-merged"),
    }
    server = tiny_server(tiny_dir, "--max-batch-size", "16", *FP32_CACHE, env={"BRAID_INJECT_FAULT": "delay:20"})
    prompt = " ".join([PROMPTS[1]] * 3)  # 39 tokens: two full pages, cached for the next with the same adapter

    async def scenario():
        async with AsyncClient(server.target) as client:
            ids = list((await client.tokenize(prompt)).token_ids)
            base = [asyncio.ensure_future(_collect(client, prompt, "", 60)) for _ in range(3)]
            info = await client.load_adapter("tenant", str(first))
            assert info.rank == 8 and sorted(info.target_modules) == sorted(ALL_TARGETS)
            using = [asyncio.ensure_future(_collect(client, prompt, "tenant", 40)) for _ in range(4)]
            await asyncio.sleep(0.5)  # they are running
            unload = asyncio.ensure_future(client.unload_adapter("tenant", timeout=60))
            while "tenant" in [a.name for a in (await client.model_info()).adapters]:
                await asyncio.sleep(0.02)
            with pytest.raises(BraidError) as err:
                await _collect(client, prompt, "tenant", 4)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'tenant'" in err.value.details()
            assert not unload.done()  # it waits for the four
            outputs = await asyncio.gather(*using)
            await unload
            assert all(reason == "MAX_TOKENS" for reason, _ in outputs)
            assert len({tuple(tokens) for _, tokens in outputs}) == 1
            assert_greedy(references[first], ids, outputs[0][1])
            # the same name, another adapter: its tokens are its own, not the cached prompt's of the first
            await client.load_adapter("tenant", str(second))
            reason, tokens = await _collect(client, prompt, "tenant", 12)
            assert_greedy(references[second], ids, tokens)
            assert tokens != outputs[0][1][:12]
            for reason, _ in await asyncio.gather(*base):
                assert reason == "MAX_TOKENS"
            await client.unload_adapter("tenant")
            status = await client.server_status()
            assert status.sessions_active == 0 and status.sessions_queued == 0
            f = status.sessions_finished
            assert f.max_tokens == 8 and f.error == 0 and f.cancelled == 0
            assert list((await client.model_info()).adapters) == []

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


async def _collect(client: AsyncClient, prompt: str, adapter: str, n: int) -> tuple[str, list[int]]:
    """A greedy generation's finish reason and tokens."""
    messages = [m async for m in client.stream(prompt=prompt, max_new_tokens=n, ignore_eos=True, adapter=adapter)]
    from braid.v1 import generate_pb2 as pb

    return pb.FinishReason.Name(messages[-1].finish_reason).removeprefix("FINISH_REASON_"), [
        t for m in messages for t in m.token_ids
    ]


def test_bad_adapters_and_names_get_clear_statuses_and_the_server_stays_up(tmp_path, tiny_dir, bases, adapters):
    qwen3_adapter = adapters["qwen3", "r8"][0]  # another base's: its k_proj is 64 -> 64, not 64 -> 32
    ranked = make_adapter(tiny_dir, tmp_path / "rank16", rank=16, seed=3)
    fine = make_adapter(tiny_dir, tmp_path / "fine", rank=8, seed=4)
    server = tiny_server(tiny_dir, "--max-loras", "1", "--max-lora-rank", "8")

    def status_of(call) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(BraidError) as err:
            call()
        assert "\n" not in err.value.details()
        return err.value.code(), err.value.details()

    try:
        with server.client() as client:
            code, details = status_of(lambda: client.load_adapter("x", str(qwen3_adapter)))
            assert (
                code == grpc.StatusCode.INVALID_ARGUMENT
                and "layers.0.self_attn.k_proj.lora_B.weight: shape [64, 8], but this model with r=8 needs [32, 8]"
                in details
            )
            code, details = status_of(lambda: client.load_adapter("x", str(ranked)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "r=16 is past --max-lora-rank 8" in details
            code, details = status_of(lambda: client.load_adapter("x", str(tmp_path / "nowhere")))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a PEFT adapter folder" in details
            for path, message in [
                *_bad_gguf_adapters(tmp_path, tiny_dir, bases, adapters),
                *_bad_configs(tmp_path, fine),
            ]:
                code, details = status_of(lambda: client.load_adapter("x", str(path)))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, (path, details)
            code, details = status_of(lambda: client.generate("hi", adapter="ghost", max_new_tokens=2))
            assert code == grpc.StatusCode.NOT_FOUND and "'ghost'" in details
            assert client.load_adapter("ok", str(fine)).rank == 8
            code, details = status_of(lambda: client.load_adapter("more", str(fine)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-loras" in details
            code, details = status_of(lambda: client.unload_adapter("ghost"))
            assert code == grpc.StatusCode.NOT_FOUND
            assert client.generate("hi", adapter="ok", max_new_tokens=3, ignore_eos=True).finish_reason == "MAX_TOKENS"
            assert [a.name for a in client.model_info().adapters] == ["ok"]
    finally:
        server.stop()


def _bad_configs(tmp_path: Path, fine: Path) -> list[tuple[Path, str]]:
    """Copies of a good adapter with a bad adapter_config.json (issue 39 items 18 and 19: these loaded,
    got INTERNAL, or OOM-killed the server), each with what its status says. Every kind, against the
    reader alone: tests/inprocess/test_lora_reading.py."""
    configs = {
        "list": ("[1, 2]", "a JSON list, expected an object"),
        "deep": ("[" * 100_000, "JSON nested too deep"),
        "nan": ('{"r": 8, "lora_alpha": NaN}', "lora_alpha is nan"),
        "huge-alpha": ('{"r": 8, "lora_alpha": 1e308}', "lora_alpha is 1e+308"),
        "huge": (None, f"{20 << 30} bytes; a LoRA adapter's config is at most"),
    }
    made = []
    for name, (text, message) in configs.items():
        folder = Path(shutil.copytree(fine, tmp_path / f"config-{name}"))
        with open(folder / "adapter_config.json", "r+") as f:
            if text is None:
                f.truncate(20 << 30)  # sparse: no disk
            else:
                f.truncate(0)
                f.write(text)
        made.append((folder, message))
    return made


def _bad_gguf_adapters(tmp_path, tiny_dir, bases, adapters) -> list[tuple[Path, str]]:
    """GGUF files that are not LoRA adapters of the tiny Llama, each with what its status says."""
    from transformers import AutoConfig

    from braid.server.model.loader import embedded_gguf

    llama, qwen3 = (AutoConfig.from_pretrained(bases[k]) for k in ("llama", "qwen3"))
    qwen3_adapter, llama_adapter = adapters["qwen3", "r8"][0], adapters["llama", "r8"][0]
    ranked = make_adapter(tiny_dir, tmp_path / "rank16-for-gguf", rank=16, seed=3)
    return [
        (embedded_gguf(), "not a GGUF LoRA adapter (general.type is 'model'"),  # a base model, not an adapter
        (tmp_path / "nowhere.gguf", "nowhere.gguf: no such file"),
        (write_gguf_adapter(qwen3_adapter, qwen3, tmp_path / "q.gguf"), "an adapter of a qwen3 model"),
        # another base's adapter, converted as if for this one (its k_proj is 64 -> 64, not 64 -> 32)
        (
            write_gguf_adapter(qwen3_adapter, llama, tmp_path / "q-as-l.gguf"),
            "blk.0.attn_k.weight.lora_b: shape [64, 8], but this model with r=8 needs [32, 8]",
        ),
        (
            write_gguf_adapter(llama_adapter, llama, tmp_path / "half.gguf", leave_out=("blk.1.ffn_up.weight.lora_b",)),
            "layer 1 up_proj: lora_B is missing",
        ),
        (write_gguf_adapter(ranked, llama, tmp_path / "r16.gguf"), "rank r=16 (blk.0."),
        # a type llama.cpp reads but its converter never writes for an adapter
        (
            write_gguf_adapter(llama_adapter, llama, tmp_path / "q4.gguf", "q4_0"),
            ".lora_a: type Q4_0; braid reads LoRA matrices in F32, F16, BF16 or Q8_0",
        ),
    ]


def test_an_adapter_that_cannot_load_at_start_is_one_line(tmp_path, tiny_dir, adapters):
    out = braid(
        "serve",
        "--model",
        str(tiny_dir),
        "--device",
        "cpu",
        "--port",
        "0",
        "--lora",
        f"other={adapters['qwen3', 'r8'][0]}",
        "--log-level",
        "warning",
        timeout=180,
    )
    assert_one_line(out, "--lora other=", "k_proj.lora_B.weight: shape [64, 8]")


def test_the_openai_model_names_an_adapter_and_models_lists_them(tiny_dir, adapters):
    http_port = free_port()
    server = tiny_server(tiny_dir, "--http-port", str(http_port), *_lora_args(adapters, "llama"))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as http:
            models = [m["id"] for m in http.get("/v1/models").json()["data"]]
            assert models[1:] == ["r16", "r8"]
            body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            texts = {
                model: http.post("/v1/completions", json={**body, "model": model}).json()["choices"][0]["text"]
                for model in (models[0], "r8")
            }
        with server.client() as client:
            assert client.generate(PROMPTS[0], adapter="r8", max_new_tokens=8, ignore_eos=True).text == texts["r8"]
            assert client.generate(PROMPTS[0], max_new_tokens=8, ignore_eos=True).text == texts[models[0]]
        assert texts["r8"] != texts[models[0]]
    finally:
        server.stop()


def test_an_unload_waits_without_holding_up_other_calls(tiny_dir, adapters):
    """While an unload waits for a long generation, the server still answers other calls, and the
    unload ends once the generation has. (More unloads waiting than asyncio has threads, and a load
    meanwhile: tests/unit/test_servicer.py.)"""
    server = tiny_server(tiny_dir, *_lora_args(adapters, "llama"), env={"BRAID_INJECT_FAULT": "delay:50"})
    try:
        with server.client() as client:
            stream = client.stream(PROMPTS[0], adapter="r8", max_new_tokens=30, ignore_eos=True)
            next(iter(stream))
            done = threading.Event()
            waiter = threading.Thread(target=lambda: (client.unload_adapter("r8", timeout=60), done.set()))
            waiter.start()
            assert client.model_info().model_name
            assert not done.is_set()
            list(stream)
            assert stream.finish_reason == "MAX_TOKENS"
            waiter.join(30)
            assert done.is_set() and [a.name for a in client.model_info().adapters] == ["r16"]
    finally:
        server.stop()
