"""llama.cpp for the benchmark: find or build `llama-server`, make the f32 GGUF, run the server.

Nothing of llama.cpp lives in the repo. The llama-cpp-python source package on PyPI vendors
llama.cpp (vendor/llama.cpp); `build()` downloads it with pip, builds llama-server and
llama-quantize with cmake into the cache folder, and `f32_gguf()` requantizes the embedded Q4_1
GGUF to F32 (the same weights braid serves, dequantised the same way):

    ~/.cache/braid/llama.cpp/bin/{llama-server,llama-quantize}
    ~/.cache/braid/llama.cpp/BUILD_INFO           what was built, from which source
    ~/.cache/braid/llama.cpp/<model>.F32.gguf
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from metrics import StreamTiming
from processes import logged_process
from workloads import Request

BINARIES = ("llama-server", "llama-quantize")
SDIST = "llama-cpp-python"


@dataclass
class LlamaCpp:
    server: Path
    quantize: Path
    build_info: str


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
    """Downloads the llama-cpp-python sdist and builds llama-server and llama-quantize: about 5 min
    on 2 idle cores (45 min when the cores were shared with other work)."""
    target = cache_dir()
    (target / "bin").mkdir(parents=True, exist_ok=True)
    log_path = target / "build.log"
    with tempfile.TemporaryDirectory(prefix="braid-llama-cpp-") as work, open(log_path, "w") as log:
        work_dir = Path(work)
        sdist = _download_sdist(work_dir, log)
        source, commit = _extract_llama_cpp(sdist, work_dir)
        build_dir = work_dir / "build"
        _log(f"llama.cpp: building {', '.join(BINARIES)} from {sdist.name} (commit {commit[:10]}); "
             f"log in {log_path} ...")
        _run(log, ["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
              "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
              "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              f"-DLLAMA_BUILD_COMMIT={commit[:10]}"])
        _run(log, ["cmake", "--build", str(build_dir), "--config", "Release", f"-j{jobs}",
              "--target", *BINARIES])
        for name in BINARIES:
            shutil.copy2(build_dir / "bin" / name, target / "bin" / name)
    info = f"{sdist.stem.removesuffix('.tar')} vendored llama.cpp {commit[:10]}, Release, GGML_NATIVE=ON"
    (target / "BUILD_INFO").write_text(info + "\n")
    _log(f"llama.cpp: built into {target / 'bin'}")
    return LlamaCpp(target / "bin" / "llama-server", target / "bin" / "llama-quantize", info)


def _download_sdist(work_dir: Path, log) -> Path:
    _run(log, [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          SDIST, "-d", str(work_dir)])
    return next(work_dir.glob("llama_cpp_python-*.tar.gz"))


def _extract_llama_cpp(sdist: Path, work_dir: Path) -> tuple[Path, str]:
    """Extracts vendor/llama.cpp; returns its folder and the commit the sdist pinned it at."""
    with tarfile.open(sdist) as tar:
        tar.extractall(work_dir, filter="data")
    root = next(p for p in work_dir.iterdir() if p.is_dir() and p.name.startswith("llama_cpp_python-"))
    head = root / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    commit = head.read_text().strip() if head.is_file() else "unknown"
    return root / "vendor" / "llama.cpp", commit


def f32_gguf(llama: LlamaCpp, source_gguf: Path) -> Path:
    """`source_gguf` requantized to F32 in the cache folder, made once."""
    out = cache_dir() / f"{source_gguf.stem}.F32.gguf"
    if not out.is_file():
        staging = out.with_suffix(".partial")
        with open(cache_dir() / "quantize.log", "w") as log:
            _run(log, [str(llama.quantize), "--allow-requantize", str(source_gguf), str(staging), "F32"])
        os.replace(staging, out)
    return out


@contextlib.contextmanager
def running_server(llama: LlamaCpp, gguf: Path, port: int, *, parallel: int, context: int,
                   threads: int, log_path: Path):
    """A llama-server on 127.0.0.1:port, ready to serve; yields (its URL, its pid); stopped on exit."""
    command = [str(llama.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(parallel), "-c", str(context), "-t", str(threads), "-tb", str(threads),
               "--no-webui"]
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


def sender(http, base_url: str):
    """The `send` coroutine for drive.run: one streamed /completion call with the request's own token
    ids, greedy, ignore_eos, no prompt cache (braid has none either); `http` is an httpx.AsyncClient."""
    async def send(request: Request) -> StreamTiming:
        body = {"prompt": request.prompt_ids, "n_predict": request.max_new_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True, "cache_prompt": False, "return_tokens": True}
        sent = time.perf_counter()
        first = last = 0.0
        num_tokens = 0
        async with http.stream("POST", base_url + "/completion", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("tokens"):
                    last = time.perf_counter()
                    first = first or last
                    num_tokens += len(chunk["tokens"])
                if chunk.get("stop"):
                    _check_prompt(chunk, request)
        return StreamTiming(sent, first, last, num_tokens)

    return send


def _check_prompt(final: dict, request: Request) -> None:
    evaluated = final.get("tokens_evaluated")
    if evaluated is not None and evaluated != len(request.prompt_ids):
        raise RuntimeError(f"llama-server evaluated {evaluated} prompt tokens, "
                           f"the benchmark sent {len(request.prompt_ids)}")


def _run(log, command: list[str]) -> None:
    subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
