"""braid against llama.cpp's server on models of real shapes (issue 40): random weights in the shapes
of Llama 3.2 1B and 3B and Llama 3.1 8B (and Qwen3 1.7B, on request), written as GGUF Q4_K_M, Q4_0
and Q8_0 (and Q6_K, on request) by llama.cpp's own converter and quantizer, served side by side in one
run:

- decode: output tok/s at 1, 4 and 16 streams (the 8B shape: 1 and 4), and 1 stream's tok/s as a
  share of the bound that the machine's read bandwidth sets (the weights' bytes a token reads);
- prefill: time to first token and prompt tok/s of prompts of 512, 2,048 and 8,000 tokens (each
  prompt its own, nothing cached), alone and while 8 streams decode, with those streams' time per
  output token while the prompt is prefilled;
- memory: resident memory, and the KV cache's bytes a token, both servers holding the same context
  for the same number of sessions;
- quality: mean KL divergence and same-top-token rate of each file as braid serves it by default
  against float32 rows on the unquantized weights, beside llama-perplexity --kl-divergence of the
  same file against its F32 GGUF.

Appends (or replaces) its section of docs/benchmarks.md (report.SIZES_HEADING).

    .venv/bin/python benchmarks/sizes.py                    # 1b, 3b and 8b (hours)
    .venv/bin/python benchmarks/sizes.py --quick --models 1b
    .venv/bin/python benchmarks/sizes.py --models 3b --formats Q4_K_M --systems llama.cpp --no-docs

Model files are made once into ~/.cache/braid/bench/ (format_models.shape_folder, shape_ggufs);
llama.cpp is built once into ~/.cache/braid/llama.cpp/ (llamacpp.py). A configuration that fails,
or that would take more memory than --memory-limit-gib, is a row saying why, and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

import bench
import braid_server
import format_models
import formats
import llamacpp
import machine
import report
import workloads
from format_models import GGUF_TYPES, MORE_GGUF_TYPES, SHAPES, Shape
from sizes_report import Prefill, Quality, SizeOutcome, SizeResults, markdown, table

DEFAULT_MODELS = ("1b", "3b", "8b")
SYSTEMS = ("braid", "llama.cpp")
STREAMS = (1, 4, 16)
BIG_STREAMS = (1, 4)  # the 8B shape's: its KV cache and weights together stay in this machine's memory
PROMPTS = (512, 2048, 8000)
QUICK_PROMPTS = (512,)
LOADED_STREAMS = 8  # decoding while a long prompt is prefilled
LOADED_NEW_TOKENS = 512  # each of those streams' most; they are stopped once the prompt's first token comes
CONTEXT = 16384  # KV-cache tokens both servers hold, shared by up to SESSIONS sessions
SESSIONS = 16
MAX_SEQ_LEN = 8192  # the longest session (the 8,000-token prompt and its new tokens)
PAGE_SIZE = 16  # braid's --kv-page-size (its default)
QUALITY_CHUNK = 256  # llama-perplexity -c: the text in chunks of 256 tokens, each scoring its second half
TEXT = machine.REPO / "tests" / "data" / "perplexity.txt"
GIB = 2**30
# Bytes a parameter that the quality part's float32 reference holds (7.5 GB at most for the 1B shape's
# 1.07 B parameters, measured). braid's first start on a GGUF file converts it a tensor at a time
# (2.3 GB at most for the 1B shape's Q8_0 file, measured): it needs no such room.
FP32_LOAD_BYTES = 7
# bytes of KV cache an element of each --kv-cache-dtype takes (auto: the CPU's, q8_0, every shape's
# head_dim being whole blocks; checked against what the server reports); q8_0: blocks of 32 int8 and
# an fp16 scale
KV_ELEMENT_BYTES = {"auto": 34 / 32, "float32": 4, "bfloat16": 2, "float16": 2, "q8_0": 34 / 32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="32 and 16 new tokens, prompts of 512 tokens only, one run each"
    )
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"of: {', '.join(SHAPES)}")
    parser.add_argument(
        "--formats", default=",".join(GGUF_TYPES), help=f"of: {', '.join(GGUF_TYPES + MORE_GGUF_TYPES)}"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"of: {', '.join(SYSTEMS)}")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each decode measurement; the median is quoted")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for every server")
    parser.add_argument(
        "--memory-limit-gib",
        type=float,
        default=8.0,
        help="skip (as a row saying so) the quality part where its float32 reference would hold more than this",
    )
    parser.add_argument("--skip-prefill", action="store_true", help="no prefill measurements")
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="each server's memory alone: started, warmed up, its RSS read; no decode, prefill or quality",
    )
    parser.add_argument(
        "--braid-kv-dtype",
        default="auto",
        choices=sorted(KV_ELEMENT_BYTES),
        help="braid's --kv-cache-dtype (llama.cpp's KV cache is f16); its --kv-cache-memory holds the same tokens",
    )
    parser.add_argument("--skip-quality", action="store_true", help="no KL divergence measurements")
    parser.add_argument(
        "--output", type=Path, default=bench.DOCS / "benchmarks.md", help="the page to add the section to"
    )
    parser.add_argument("--no-docs", action="store_true", help="print the section only")
    parser.add_argument("--note", action="append", default=[], help="a sentence for the section's notes")
    parser.add_argument(
        "--report-from",
        type=Path,
        metavar="JSON",
        help="write the section from runs' saved results (~/.cache/braid/bench/sizes-*.json); repeat "
        "the flag to put several runs (the 1B shape's, the 8B's) in one section",
        action="append",
    )
    return parser.parse_args(argv)


# ---------------------------------------------------------------- model files


def make_files(shape: Shape, llama, formats_wanted: list[str], tokenizer_folder: Path, quality: bool) -> dict:
    """The shape's bf16 folder ("bf16") and its GGUFs by type (F32 too when `quality`)."""
    folder = format_models.shape_folder(shape, tokenizer_folder)
    ggufs = format_models.shape_ggufs(llama, shape, folder, tuple(formats_wanted), f32=quality)
    return {"bf16": folder, **ggufs}


def shape_parameters(shape: Shape) -> int:
    """The shape's parameters, from its sizes (norms left out)."""
    z = shape.sizes
    head_dim = z.get("head_dim") or z["hidden_size"] // z["num_attention_heads"]
    attention = z["hidden_size"] * head_dim * 2 * (z["num_attention_heads"] + z["num_key_value_heads"])
    mlp = 3 * z["hidden_size"] * z["intermediate_size"]
    embeddings = z["vocab_size"] * z["hidden_size"] * (1 if z.get("tie_word_embeddings") else 2)
    return z["num_hidden_layers"] * (attention + mlp) + embeddings


# ---------------------------------------------------------------- senders that keep every token's time


async def braid_stamps(client, request: workloads.Request, stamps: list[float]) -> None:
    """One streamed braid call of `request` (greedy, ignore_eos, a salt of its own: nothing cached is
    shared), appending each token's arrival time to `stamps`."""
    params = dict(max_new_tokens=request.max_new_tokens, ignore_eos=True, temperature=0)
    async with client.stream(request.prompt, cache_salt=uuid.uuid4().hex, **params) as generation:
        async for message in generation:
            stamps.extend([time.perf_counter()] * len(message.token_ids))


async def llama_stamps(http, url: str, request: workloads.Request, stamps: list[float]) -> None:
    async for chunk in llamacpp.completion_chunks(http, url, llamacpp.completion_body(request)):
        stamps.extend([time.perf_counter()] * len(chunk.get("tokens") or []))


# ---------------------------------------------------------------- one configuration


def prompts(tokenizer, lengths: list[int]) -> dict[str, list[workloads.Request]]:
    """Distinct prompts: one of each length alone, one of each under load, and the loaded streams'."""
    maker = workloads.PromptMaker(tokenizer, seed=workloads.SEED + 40)
    return {
        "alone": [replace(maker.prompt(n), max_new_tokens=2) for n in lengths],
        "loaded": [replace(maker.prompt(n), max_new_tokens=2) for n in lengths],
        "streams": [replace(r, max_new_tokens=LOADED_NEW_TOKENS) for r in maker.batch(LOADED_STREAMS, 30, 60)],
    }


async def measure_prefill(send, stamped, prompt_set: dict) -> list[Prefill]:
    """Each prompt alone (its TTFT), then each again (another of its length) while LOADED_STREAMS
    streams decode: its TTFT and their time per token over the prefill. `stamped(request, stamps)`
    runs one request keeping its tokens' times."""
    results = []
    for alone, loaded in zip(prompt_set["alone"], prompt_set["loaded"]):
        result = Prefill(len(alone.prompt_ids))
        results.append(result)
        bench.log(f"  prefill of {result.prompt_tokens} tokens alone")
        result.ttft_s = (await send(alone)).ttft_s
        bench.log(f"  prefill of {result.prompt_tokens} tokens while {LOADED_STREAMS} streams decode")
        stamps: list[list[float]] = [[] for _ in prompt_set["streams"]]
        tasks = [asyncio.create_task(stamped(r, s)) for r, s in zip(prompt_set["streams"], stamps)]
        try:
            while any(len(s) < 3 for s in stamps):  # every stream past its own prompt
                if any(t.done() for t in tasks):
                    for t in tasks:
                        if t.done():
                            t.result()  # its error
                await asyncio.sleep(0.05)
            timing = await send(loaded)
            result.loaded_ttft_s = timing.ttft_s
            result.loaded_tpot_ms, result.loaded_stall_ms, result.streams_ended = window_tpot(
                stamps, timing.sent, timing.first
            )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(1.0)  # the servers notice the cancelled streams
    return results


def window_tpot(stamps: list[list[float]], start: float, end: float) -> tuple[float, float, int]:
    """The decoding streams' time per token while a prompt was prefilled (from `start` to `end`):
    the median over the streams of (the first token after `end` - the last before `start`) over the
    tokens between, the longest gap between two tokens of one stream that overlaps the window (ms),
    and how many streams had ended before `end`."""
    per_stream, stall, ended = [], 0.0, 0
    for times in stamps:
        before = [t for t in times if t <= start]
        after = [t for t in times if t >= end]
        if not before:
            continue
        if not after:
            ended += 1
            after = [times[-1]]
        inside = [t for t in times if before[-1] < t <= after[0]]
        per_stream.append((after[0] - before[-1]) / max(len(inside), 1) * 1000)
        gaps = [b - a for a, b in zip(times, times[1:]) if b > start and a < end]
        stall = max([stall, *gaps])
    per_stream.sort()
    median = per_stream[len(per_stream) // 2] if per_stream else math.nan
    return median, stall * 1000, ended


def braid_flags(bytes_per_token: float, kv_dtype: str = "auto") -> list[str]:
    """braid holding CONTEXT tokens of KV cache for up to SESSIONS sessions, as llama.cpp's -c/-np."""
    return [
        *([] if kv_dtype == "auto" else ["--kv-cache-dtype", kv_dtype]),
        "--max-sessions",
        str(SESSIONS),
        "--max-seq-len",
        str(MAX_SEQ_LEN),
        "--kv-cache-memory",
        f"{CONTEXT * bytes_per_token / 2**20:g}MiB",
        "--kv-page-size",
        str(PAGE_SIZE),
        "--prefix-caching",
        "off",
    ]


def kv_bytes_per_token(shape: Shape, element_bytes: float) -> float:
    """Keys and values of every layer for one token."""
    sizes = shape.sizes
    head_dim = sizes.get("head_dim") or sizes["hidden_size"] // sizes["num_attention_heads"]
    return 2 * sizes["num_hidden_layers"] * sizes["num_key_value_heads"] * head_dim * element_bytes


async def measure(name: str, outcome: SizeOutcome, send, pid: int, measured, args) -> None:
    """The decode rows after a warm-up (formats.measure_server); with --memory-only, the warm-up and
    the RSS after it alone."""
    if not args.memory_only:
        await formats.measure_server(name, outcome, send, pid, measured)
        return
    await braid_server.warm_up(send, formats.warm_up_requests(measured))
    outcome.rss_mib = await machine.rss_at_rest_mib(pid)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan


async def run_braid(shape, outcome: SizeOutcome, gguf: Path, args, measured, prompt_set) -> None:
    log_path = Path(tempfile.gettempdir()) / f"braid-sizes-{shape.key}-{outcome.weights}-braid.log"
    flags = braid_flags(kv_bytes_per_token(shape, KV_ELEMENT_BYTES[args.braid_kv_dtype]), args.braid_kv_dtype)
    outcome.command = f"--model {gguf.name} " + shlex.join(flags)
    try:
        async with braid_server.running(
            "continuous",
            threads=args.threads,
            max_batch_size=SESSIONS,
            log_path=log_path,
            extra_args=["--model", str(gguf), *flags],
            start_timeout=3600,
        ) as (client, pid):
            info, status = await client.model_info(), await client.server_status()
            outcome.kv_dtype = info.kv_cache_dtype
            outcome.kv_tokens = status.kv_pages_total * PAGE_SIZE
            outcome.kv_bytes_per_token = info.kv_cache_bytes / max(outcome.kv_tokens, 1)
            send = braid_server.sender(client)
            await measure(f"{shape.key} braid {outcome.weights}", outcome, send, pid, measured, args)
            if prompt_set:
                outcome.prefill = await measure_prefill(send, lambda r, s: braid_stamps(client, r, s), prompt_set)
            outcome.peak_rss_mib = peak_rss_mib(pid)
    except Exception as exc:
        raise formats._with_log(exc, log_path) from exc


async def run_llama_cpp(shape, outcome: SizeOutcome, gguf: Path, llama, args, measured, prompt_set) -> None:
    import httpx

    log_path = Path(tempfile.gettempdir()) / f"braid-sizes-{shape.key}-{outcome.weights}-llama.log"
    extra = ["--kv-unified", "--no-cache-prompt", "--cache-ram", "0"]  # nothing cached between requests
    outcome.command = f"-m {gguf.name} -c {CONTEXT} -np {SESSIONS} " + " ".join(extra)
    try:
        with llamacpp.running_server(
            llama,
            gguf,
            braid_server.free_port(),
            parallel=SESSIONS,
            context=CONTEXT,
            threads=args.threads,
            log_path=log_path,
            extra_args=extra,
        ) as (url, pid):
            async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=4 * SESSIONS)) as http:
                send = llamacpp.sender(http, url)
                await measure(f"{shape.key} llama.cpp {outcome.weights}", outcome, send, pid, measured, args)
                if prompt_set:
                    outcome.prefill = await measure_prefill(
                        send, lambda r, s: llama_stamps(http, url, r, s), prompt_set
                    )
            outcome.peak_rss_mib = peak_rss_mib(pid)
        outcome.kv_dtype, outcome.kv_tokens, outcome.kv_bytes_per_token = llama_kv(log_path, shape)
    except Exception as exc:
        raise formats._with_log(exc, log_path) from exc


def llama_kv(log_path: Path, shape: Shape) -> tuple[str, int, float]:
    """llama.cpp's KV cache as its log states it: dtype, cells, bytes a token."""
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    size = re.search(r"llama_kv_cache[^\n]*size =\s*([\d.]+) MiB \(\s*(\d+) cells", text)
    dtype = re.search(r"K \((\w+)\):", text)
    if size:
        cells = int(size.group(2))
        return (dtype.group(1) if dtype else "?"), cells, float(size.group(1)) * 2**20 / cells
    return "f16 (its default; not in its log)", CONTEXT, float(kv_bytes_per_token(shape, 2))


async def run_config(shape, system, gguf_type, files, llama, args, measured, prompt_set) -> SizeOutcome:
    outcome = SizeOutcome(shape.title, system, gguf_type, command="", model_key=shape.key)
    bench.log(f"{shape.key} {system} {gguf_type}: starting")
    try:
        gguf = files[gguf_type]
        outcome.bytes_per_step = format_models.weight_bytes(gguf)
        outcome.file_types = format_models.describe_types(gguf)
        if system == "braid":
            await run_braid(shape, outcome, gguf, args, measured, prompt_set)
        else:
            if isinstance(llama, Exception):
                raise llama
            await run_llama_cpp(shape, outcome, gguf, llama, args, measured, prompt_set)
    except Exception as exc:  # noqa: BLE001 - one failed configuration is a row, not the end of the run
        outcome.error = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        bench.log(f"{shape.key} {system} {gguf_type}: FAILED: {outcome.error}")
    return outcome


# ---------------------------------------------------------------- quality


def llama_kld(llama, files: dict, gguf_type: str, threads: int) -> tuple[float, float, int]:
    """llama-perplexity --kl-divergence of the `gguf_type` file against the F32 one's logits over TEXT:
    (mean KLD, same-top rate, positions)."""
    base = files["F32"].with_suffix(".kld-base")
    common = ["-f", str(TEXT), "-c", str(QUALITY_CHUNK), "-b", str(QUALITY_CHUNK), "-t", str(threads)]
    if not base.is_file():
        _perplexity(llama, ["-m", str(files["F32"]), *common, "--kl-divergence-base", str(base)])
    out = _perplexity(
        llama, ["-m", str(files[gguf_type]), *common, "--kl-divergence-base", str(base), "--kl-divergence"]
    )
    kld = re.search(r"Mean\s+KLD:\s*([-\d.]+)", out)
    top = re.search(r"Same top p:\s*([\d.]+)", out)
    chunks = re.search(r"(?:computing|calculating perplexity) over (\d+) chunks", out)
    if not (kld and top):
        raise RuntimeError(f"llama-perplexity said no KLD: {out.strip().splitlines()[-1]}")
    positions = int(chunks.group(1)) * (QUALITY_CHUNK // 2 - 1) if chunks else 0
    return float(kld.group(1)), float(top.group(1)) / 100, positions


def _perplexity(llama, arguments: list[str]) -> str:
    done = subprocess.run([str(llama.perplexity), *arguments], capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
        raise RuntimeError(f"llama-perplexity failed: {lines[-1]}")
    return done.stdout + done.stderr


def braid_logits(model: str, fp32: bool, threads: int, out: str) -> None:
    """In a child process (the weights leave memory with it): the logits of TEXT's chunks, second
    half of each, of `model` loaded as braid serves it by default, or with `fp32` in float32 with
    float32 rows and an fp32 KV cache; saved to `out`."""
    import torch

    sys.path.insert(0, str(machine.REPO / "tests" / "support"))
    from braid.server.config import EngineConfig
    from braid.server.model.loader import default_cache_dir, load
    from braid.server.runner.model_runner import ModelRunner
    from braid_testing.perplexity import prompt_logits

    flags = dict(dtype="float32", quantization="none", activations="float32", kv_cache_dtype="float32") if fp32 else {}
    config = EngineConfig(threads=threads, max_seq_len=QUALITY_CHUNK, kv_cache_memory="256MiB", **flags)
    loaded = load(model, default_cache_dir())
    runner = ModelRunner.build(config, loaded)
    ids = loaded.hf_tokenizer(TEXT.read_text())["input_ids"]
    chunks = [ids[i : i + QUALITY_CHUNK] for i in range(0, len(ids) - QUALITY_CHUNK + 1, QUALITY_CHUNK)]
    logits = torch.cat([prompt_logits(runner, chunk)[QUALITY_CHUNK // 2 : -1] for chunk in chunks])
    torch.save(logits, out)


def braid_kld(files: dict, gguf_type: str, threads: int, reference: dict) -> tuple[float, float, int]:
    """braid's default on the `gguf_type` file against float32 rows on the bf16 checkpoint (its logits
    kept in `reference` for the next type): (mean KLD, same-top rate, positions)."""
    import torch

    sys.path.insert(0, str(machine.REPO / "tests" / "support"))
    from braid_testing.perplexity import divergence

    def logits(model: Path, fp32: bool) -> torch.Tensor:
        with tempfile.TemporaryDirectory(prefix="braid-sizes-") as work:
            out = Path(work) / "logits.pt"
            code = (
                f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import sizes; "
                f"sizes.braid_logits({str(model)!r}, {fp32}, {threads}, {str(out)!r})"
            )
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"braid's logits of {model.name}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
            return torch.load(out)

    if "base" not in reference:
        saved = files["bf16"].with_name(f"{files['bf16'].name}.float32-logits-{QUALITY_CHUNK}.pt")
        if not saved.is_file():  # made once: the same weights, rows and text give the same logits
            torch.save(logits(files["bf16"], fp32=True), saved)
        reference["base"] = torch.load(saved)
    kld, top = divergence(reference["base"], logits(files[gguf_type], fp32=False))
    return kld, top, len(reference["base"])


def measure_quality(shape, files, llama, formats_wanted, systems, args) -> list[Quality]:
    results, reference = [], {}
    fp32_gib = shape_parameters(shape) * FP32_LOAD_BYTES / GIB
    for gguf_type in formats_wanted:
        for system in systems:
            quality = Quality(shape.title, system, gguf_type)
            results.append(quality)
            bench.log(f"{shape.key} {system} {gguf_type}: quality")
            try:
                if fp32_gib > args.memory_limit_gib:
                    raise RuntimeError(
                        f"not run: the float32 reference holds about {fp32_gib:.0f} GiB, over --memory-limit-gib "
                        f"{args.memory_limit_gib:g}"
                    )
                if system == "braid":
                    quality.kld, quality.same_top, quality.positions = braid_kld(
                        files, gguf_type, args.threads, reference
                    )
                else:
                    if isinstance(llama, Exception):
                        raise llama
                    quality.kld, quality.same_top, quality.positions = llama_kld(llama, files, gguf_type, args.threads)
            except Exception as exc:  # noqa: BLE001 - a row saying why
                quality.error = str(exc).strip().splitlines()[-1]
                bench.log(f"  FAILED: {quality.error}")
    return results


# ---------------------------------------------------------------- the run


async def run_all(args, command: str) -> SizeResults:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    shapes = [SHAPES[m] for m in formats._chosen(args.models, SHAPES, "models")]
    formats_wanted = formats._chosen(args.formats, GGUF_TYPES + MORE_GGUF_TYPES, "formats")
    systems = formats._chosen(args.systems, SYSTEMS, "systems")
    repeats = 1 if args.quick else args.repeats
    if args.memory_only:
        args.skip_prefill = args.skip_quality = True
    lengths = [] if args.skip_prefill else list(QUICK_PROMPTS if args.quick else PROMPTS)
    if "llama.cpp" in systems:
        llama = formats.find_or_build_llama_cpp()
    else:  # braid alone: llama.cpp's tools make the files it lacks where it is built, and nothing else
        llama = llamacpp.find() or RuntimeError("llama.cpp is not built (--systems braid builds none)")
    tokenizer_folder = format_models.smollm_fp32_folder()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, local_files_only=True)
    single_new, multi_new = formats.new_tokens(args.quick)

    info = machine.describe(args.threads).as_dict()
    info["vector_isa"] = machine.vector_isa()
    info["llama_cpp"] = getattr(llama, "build_info", f"absent ({llama})")
    settings = {
        "single_new_tokens": single_new,
        "multi_new_tokens": multi_new,
        "repeats": repeats,
        "quick": args.quick,
        "prompts": lengths,
        "loaded_streams": LOADED_STREAMS,
        "context": CONTEXT,
        "sessions": SESSIONS,
        "max_seq_len": MAX_SEQ_LEN,
        "quality_text": str(TEXT.relative_to(machine.REPO)),
        "quality_chunk": QUALITY_CHUNK,
        "memory_limit_gib": args.memory_limit_gib,
        "braid_kv_dtype": args.braid_kv_dtype,
        "memory_only": args.memory_only,
        "seed": format_models.SEED,
        "disturbed_above": bench.DISTURBED_ABOVE,
    }
    results = SizeResults(info, settings, command, notes=list(args.note))
    results.bandwidth_gbs = machine.read_bandwidth_gbs(args.threads)
    bench.log(f"read bandwidth: {results.bandwidth_gbs:.1f} GB/s with {args.threads} threads")
    json_path = format_models.BENCH_DIR / f"sizes-{time.strftime('%Y%m%d-%H%M%S')}.json"
    bench.log(f"results are saved as they come to {json_path}")

    for shape in shapes:
        streams = list(BIG_STREAMS if shape.key == "8b" else STREAMS)
        measured = formats.build_workloads(tokenizer, streams, quick=args.quick, repeats=repeats)
        prompt_set = prompts(tokenizer, lengths) if lengths and shape.key != "8b" else None
        bench.log(f"{shape.key}: making the model files")
        try:
            fits = shape_parameters(shape) * FP32_LOAD_BYTES / GIB <= args.memory_limit_gib  # a float32 reference
            files = make_files(
                shape,
                llama,
                formats_wanted,
                tokenizer_folder,
                quality=not args.skip_quality and fits and "llama.cpp" in systems,
            )
        except Exception as exc:  # noqa: BLE001 - its rows say why
            files = {}
            for system in systems:
                for gguf_type in formats_wanted:
                    results.outcomes.append(
                        SizeOutcome(
                            shape.title, system, gguf_type, "", model_key=shape.key, error=f"no model file: {exc}"
                        )
                    )
            continue
        for gguf_type in formats_wanted:
            for system in systems:
                outcome = await run_config(shape, system, gguf_type, files, llama, args, measured, prompt_set)
                outcome.streams = streams
                results.outcomes.append(outcome)
                results.save(json_path)
        if not args.skip_quality:
            results.quality += measure_quality(shape, files, llama, formats_wanted, systems, args)
            results.save(json_path)
    results.bandwidth_gbs = max(results.bandwidth_gbs, machine.read_bandwidth_gbs(args.threads))
    results.save(json_path)
    if results.machine["braid_commit"] != machine.braid_commit():
        results.notes.append(f"braid's server/ changed during the run (now {machine.braid_commit()}).")
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    shown = [a for i, a in enumerate(given) if a != "--note" and (i == 0 or given[i - 1] != "--note")]
    command = ".venv/bin/python benchmarks/sizes.py " + shlex.join(shown)  # its notes are the section's
    if args.report_from:
        results = SizeResults.merge([SizeResults.load(path) for path in args.report_from])
        results.notes += args.note
    else:
        results = asyncio.run(run_all(args, command.strip()))
    print("\n" + table(results) + "\n")
    if not args.no_docs:
        report.write_section(args.output, report.SIZES_HEADING, markdown(results))
        bench.log(f"wrote the section {report.SIZES_HEADING!r} of {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
