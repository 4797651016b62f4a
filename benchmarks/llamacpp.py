"""llama.cpp for the benchmark: find or build `llama-server`, make GGUF files, run the server.

Nothing of llama.cpp lives in the repo. The llama-cpp-python source package on PyPI vendors
llama.cpp (vendor/llama.cpp); `build()` downloads it with pip, builds llama-server, llama-quantize
and llama-perplexity with cmake into the cache folder and keeps the source tree's Hugging Face to
GGUF converter (`convert_hf_to_gguf.py` with its `conversion` and `gguf-py` packages, so that the
converter runs with the gguf library of its own commit). `f32_gguf()` requantizes the embedded Q4_1
GGUF to F32 (the same weights braid serves, dequantised the same way); `convert()` and `quantize()`
make the other formats:

    ~/.cache/braid/llama.cpp/bin/{llama-server,llama-quantize,llama-perplexity}
    ~/.cache/braid/llama.cpp/convert/convert_hf_to_gguf.py
    ~/.cache/braid/llama.cpp/BUILD_INFO           what was built, from which source
    ~/.cache/braid/llama.cpp/<model>.F32.gguf
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from metrics import StreamTiming
from processes import logged_process
from workloads import Request

BINARIES = ("llama-server", "llama-quantize", "llama-perplexity")
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")  # the script and the packages it imports
SDIST = "llama-cpp-python"


@dataclass
class LlamaCpp:
    server: Path
    quantize: Path
    build_info: str

    @property
    def perplexity(self) -> Path:
        """llama-perplexity, beside llama-server (its --kl-divergence measures a GGUF against another's logits)."""
        return self.server.parent / "llama-perplexity"


def cache_dir() -> Path:
    from braid.server.model.loader import default_cache_dir

    return default_cache_dir() / "llama.cpp"


def find() -> LlamaCpp | None:
    """The built binaries in the cache folder, or llama-server on PATH; None if absent."""
    bin_dir, info_file = cache_dir() / "bin", cache_dir() / "BUILD_INFO"
    if all((bin_dir / name).is_file() for name in BINARIES):
        info = info_file.read_text().strip() if info_file.is_file() else "unknown build"
        return LlamaCpp(bin_dir / "llama-server", bin_dir / "llama-quantize", info)
    on_path = [shutil.which(name) for name in BINARIES]
    if all(on_path):
        return LlamaCpp(Path(on_path[0]), Path(on_path[1]), "from PATH")
    return None


def build(jobs: int = 2) -> LlamaCpp:
    """Downloads the llama-cpp-python sdist and builds BINARIES: about 5 min on 2 idle cores (45 min
    when the cores were shared with other work; over an hour with five other jobs on them). A build
    without llama-perplexity (made before sizes.py needed it) is built again."""
    target = cache_dir()
    (target / "bin").mkdir(parents=True, exist_ok=True)
    log_path = target / "build.log"
    with tempfile.TemporaryDirectory(prefix="braid-llama-cpp-") as work, open(log_path, "w") as log:
        work_dir = Path(work)
        sdist = _download_sdist(work_dir, log)
        source, commit = _extract_llama_cpp(sdist, work_dir)
        build_dir = work_dir / "build"
        _log(
            f"llama.cpp: building {', '.join(BINARIES)} from {sdist.name} (commit {commit[:10]}); log in {log_path} ..."
        )
        _run(
            log,
            [
                "cmake",
                "-S",
                str(source),
                "-B",
                str(build_dir),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DLLAMA_CURL=OFF",
                "-DGGML_NATIVE=ON",
                "-DBUILD_SHARED_LIBS=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_USE_PREBUILT_UI=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                f"-DLLAMA_BUILD_COMMIT={commit[:10]}",
            ],
        )
        _run(log, ["cmake", "--build", str(build_dir), "--config", "Release", f"-j{jobs}", "--target", *BINARIES])
        for name in BINARIES:
            shutil.copy2(build_dir / "bin" / name, target / "bin" / name)
        _keep_converter(source)
    info = f"{sdist.stem.removesuffix('.tar')} vendored llama.cpp {commit[:10]}, Release, GGML_NATIVE=ON"
    (target / "BUILD_INFO").write_text(info + "\n")
    _log(f"llama.cpp: built into {target / 'bin'}")
    return LlamaCpp(target / "bin" / "llama-server", target / "bin" / "llama-quantize", info)


def _download_sdist(work_dir: Path, log, version: str | None = None) -> Path:
    _run(
        log,
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            SDIST,  # only llama.cpp's source: its build tools' wheels prepare its metadata (from source, minutes)
            f"{SDIST}=={version}" if version else SDIST,
            "-d",
            str(work_dir),
        ],
    )
    return next(work_dir.glob("llama_cpp_python-*.tar.gz"))


def _extract_llama_cpp(sdist: Path, work_dir: Path) -> tuple[Path, str]:
    """Extracts vendor/llama.cpp; returns its folder and the commit the sdist pinned it at."""
    with tarfile.open(sdist) as tar:
        tar.extractall(work_dir, filter="data")
    root = next(p for p in work_dir.iterdir() if p.is_dir() and p.name.startswith("llama_cpp_python-"))
    head = root / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    commit = head.read_text().strip() if head.is_file() else "unknown"
    return root / "vendor" / "llama.cpp", commit


def _keep_converter(source: Path) -> None:
    """Copies the converter out of the llama.cpp source tree into the cache folder."""
    target = cache_dir() / "convert"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in CONVERTER:
        if (source / name).is_dir():
            shutil.copytree(source / name, target / name)
        else:
            shutil.copy2(source / name, target / name)


def converter() -> Path:
    """convert_hf_to_gguf.py in the cache folder; fetched (not built: a few seconds) from the sdist of
    the llama.cpp build, when that build predates keeping it."""
    script = cache_dir() / "convert" / CONVERTER[0]
    if script.is_file():
        return script
    info = (cache_dir() / "BUILD_INFO").read_text() if (cache_dir() / "BUILD_INFO").is_file() else ""
    version = info.split()[0].removeprefix("llama_cpp_python-") if info.startswith("llama_cpp_python-") else None
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="braid-llama-cpp-") as work, open(cache_dir() / "convert.log", "w") as log:
        source, _ = _extract_llama_cpp(_download_sdist(Path(work), log, version), Path(work))
        _keep_converter(source)
    return script


def convert(hf_folder: Path, out: Path, outtype: str) -> Path:
    """A Hugging Face folder converted to a GGUF file of `outtype` (f32, bf16, f16, q8_0), made once.
    The converter runs in this Python (it needs torch, transformers, numpy) with the gguf-py package
    of its own llama.cpp commit ahead of any installed gguf."""
    if out.is_file():
        return out
    script = converter()
    staging = out.with_suffix(".partial")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(script.parent / "gguf-py"), str(script.parent)]),
        "HF_HUB_OFFLINE": "1",
    }
    log_path = out.with_suffix(".convert.log")
    with open(log_path, "w") as log:
        done = subprocess.run(
            [sys.executable, str(script), str(hf_folder), "--outfile", str(staging), "--outtype", outtype],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if done.returncode != 0:
        lines = log_path.read_text().strip().splitlines() or ["(no output)"]
        raise RuntimeError(f"convert_hf_to_gguf.py {hf_folder.name} failed: {lines[-1]} (log: {log_path})")
    os.replace(staging, out)
    return out


def quantize(
    llama: LlamaCpp,
    source_gguf: Path,
    out: Path,
    gguf_type: str,
    *,
    allow_requantize: bool = False,
    embedding_type: str | None = None,
) -> Path:
    """`source_gguf` quantized to `gguf_type` (Q4_0, Q8_0, BF16, F32, ...) by llama-quantize, made
    once; `embedding_type`: the token embedding's and the output projection's type, instead of the
    one llama-quantize picks for them (Q6_K for Q4_0)."""
    if not out.is_file():
        staging = out.with_suffix(".partial")
        flags = ["--allow-requantize"] if allow_requantize else []
        if embedding_type:
            flags += ["--token-embedding-type", embedding_type, "--output-tensor-type", embedding_type]
        with open(out.with_suffix(".quantize.log"), "w") as log:
            _run(log, [str(llama.quantize), *flags, str(source_gguf), str(staging), gguf_type])
        os.replace(staging, out)
    return out


def f32_gguf(llama: LlamaCpp, source_gguf: Path) -> Path:
    """`source_gguf` requantized to F32 in the cache folder, made once."""
    return quantize(llama, source_gguf, cache_dir() / f"{source_gguf.stem}.F32.gguf", "F32", allow_requantize=True)


def context_size(parallel: int, longest: int) -> int:
    """The server's -c: `parallel` slots, each holding the longest request (prompt and new tokens)."""
    return parallel * 256 * math.ceil((longest + 64) / 256)


@contextlib.contextmanager
def running_server(
    llama: LlamaCpp,
    gguf: Path,
    port: int,
    *,
    parallel: int,
    context: int,
    threads: int,
    log_path: Path,
    extra_args: Sequence[str] = (),
):
    """A llama-server on 127.0.0.1:port, ready to serve, with `extra_args` (--spec-type, ...) on its
    command line; yields (its URL, its pid); stopped on exit."""
    command = [
        str(llama.server),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(parallel),
        "-c",
        str(context),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--no-webui",
        *extra_args,
    ]
    with logged_process(command, log_path, grace_s=20) as process:
        _wait_healthy(f"http://127.0.0.1:{port}/health", process)
        yield f"http://127.0.0.1:{port}", process.pid


def _wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        time.sleep(0.3)
    raise TimeoutError(f"llama-server not healthy after {timeout_s:.0f} s")


def sender(http, base_url: str, cache_prompt: bool = False, lora: list[dict] | None = None):
    """The `send` coroutine for drive.run: one streamed /completion call with the request's own token
    ids, greedy, ignore_eos; `cache_prompt`: reuse the prefix a slot already holds (off: every prompt
    is computed in full); `lora`: the request's adapters and their scales ([{"id": 0, "scale": 1.0}];
    those the server loaded and the list leaves out run at scale 0). `http` is an httpx.AsyncClient."""

    async def send(request: Request) -> StreamTiming:
        body = completion_body(request, cache_prompt, lora)
        sent = time.perf_counter()
        first = last = 0.0
        num_tokens = 0
        async for chunk in completion_chunks(http, base_url, body):
            if chunk.get("tokens"):
                last = time.perf_counter()
                first = first or last
                num_tokens += len(chunk["tokens"])
            if chunk.get("stop"):
                _check_prompt(chunk, request)
                if chunk.get("tokens_predicted", 0) > num_tokens:  # see completion_chunks
                    last, num_tokens = time.perf_counter(), chunk["tokens_predicted"]
        return StreamTiming(sent, first, last, num_tokens)

    return send


def completion_body(request: Request, cache_prompt: bool = False, lora: list[dict] | None = None) -> dict:
    """The streamed /completion call of `request`: its token ids, greedy, ignore_eos (see sender)."""
    return {
        "prompt": request.prompt_ids,
        "n_predict": request.max_new_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "cache_prompt": cache_prompt,
        "return_tokens": True,
        **({"lora": lora} if lora else {}),
    }


async def completion_chunks(http, base_url: str, body: dict):
    """The chunks (dicts) of one streamed /completion call of `body` (which has "stream": true), as
    they come; the last has "stop" true, the server's counts (tokens_predicted, tokens_evaluated) and
    its "timings" (with draft_n and draft_n_accepted when it speculated). A token whose text ends
    inside a UTF-8 character is held back and comes in no chunk's "tokens" (a random model's output
    has such): the last chunk's tokens_predicted counts it."""
    async with http.stream("POST", base_url + "/completion", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                yield json.loads(line[len("data: ") :])


async def apply_template(http, base_url: str, messages: list[dict]) -> str:
    """The prompt text llama-server makes of chat `messages` with its chat template (the GGUF's)."""
    response = await http.post(base_url + "/apply-template", json={"messages": messages})
    response.raise_for_status()
    return response.json()["prompt"]


def _check_prompt(final: dict, request: Request) -> None:
    evaluated = final.get("tokens_evaluated")
    if evaluated is not None and evaluated != len(request.prompt_ids):
        raise RuntimeError(
            f"llama-server evaluated {evaluated} prompt tokens, the benchmark sent {len(request.prompt_ids)}"
        )


def _run(log, command: list[str]) -> None:
    subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
