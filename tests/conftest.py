"""Real servers on free ports, as a user would run them: `braid serve` in a subprocess.

Most tests use a tiny randomly initialised Llama (built here, with the embedded model's tokenizer) so
they are fast; tests marked by the `smol` fixture use the embedded SmolLM2-135M-Instruct itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from braid.client import Client

REPO = Path(__file__).resolve().parent.parent
BRAID = str(Path(sys.executable).parent / "braid")
MODES = ("sequential", "interleaved", "batched", "continuous")
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running `braid serve` process."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, log_path: Path | None = None,
                 client_kw: dict | None = None) -> None:
        """client_kw: how this server's clients connect (TLS settings, API key)."""
        self.client_kw = client_kw or {}
        if env and "BRAID_API_KEY" in env:
            self.client_kw.setdefault("api_key", env["BRAID_API_KEY"])
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        if log_path is not None:
            self.log = open(log_path, "w")
        else:
            self.log = open(os.devnull, "w") if not os.environ.get("BRAID_TEST_LOGS") else None
        self.proc = subprocess.Popen(
            [BRAID, "serve", "--host", "127.0.0.1", "--port", str(self.port), *args],
            env={**os.environ, **(env or {})}, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_serving()

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        with self.client() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"braid serve exited with {self.proc.returncode}")
                with contextlib.suppress(grpc.RpcError):
                    if client.health(timeout=1) == "SERVING":
                        return
                time.sleep(0.2)
        self.stop()
        raise TimeoutError("braid serve did not become healthy")

    def client(self, **kw) -> Client:
        return Client(self.target, **{**self.client_kw, **kw})

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log:
            self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The embedded model, converted once into braid's cache (what `braid warmup` does)."""
    from braid.server.model.loader import default_cache_dir, resolve

    return Path(resolve(None, default_cache_dir())[1])


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smol_dir) -> Path:
    """A tiny random Llama with the embedded model's tokenizer: fast, and real enough to run."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
                         initializer_range=0.3)  # peaked logits, so greedy decoding has few near-ties
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smol_dir / name).exists():
            shutil.copy(smol_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def servers(tiny_dir):
    """One tiny-model server per mode, started on first use and shared by the whole session."""
    started: dict[str, Server] = {}

    def get(mode: str) -> Server:
        if mode not in started:
            started[mode] = Server(["--model", str(tiny_dir), "--mode", mode, "--threads", "1",
                                    "--max-batch-size", "16", "--max-wait-ms", "5"])
        return started[mode]

    yield get
    for server in started.values():
        server.stop()


@pytest.fixture(scope="session")
def smol(smol_dir):
    """The embedded model in continuous mode, started with no --model at all, as `make serve` does."""
    server = Server(["--mode", "continuous"])
    yield server
    server.stop()


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05):
    """Polls until predicate() returns something truthy, which it returns; fails after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)
