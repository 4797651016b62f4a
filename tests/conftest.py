"""Real servers on free ports, as a user would run them: `braid serve` in a subprocess.

Most tests use a tiny randomly initialised Llama (built here, with the embedded model's tokenizer) so
they are fast; tests marked by the `smol` fixture use the embedded SmolLM2-135M-Instruct itself. Servers run on
pytest's --device (default cpu; make gpu-check runs the parity and mode tests with --device cuda).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import sys
import time
from pathlib import Path
from typing import Callable

import grpc
import pytest

from braid.client import Client
from braid_testing.models import WITH_TEMPLATE, fp32_model, save_model, tiny_model
from braid_testing.process import BraidProcess, free_port  # noqa: F401  (free_port: for the tests)

REPO = Path(__file__).resolve().parent.parent
MODES = ("sequential", "interleaved", "batched", "continuous")
LONG = dict(max_new_tokens=900, ignore_eos=True)
# Every pass of a SLOW server takes 3 ms longer, so a LONG stream lasts at least 2.7 s on any machine
# (the tiny model alone runs 900 tokens in well under a second).
SLOW = {"BRAID_INJECT_FAULT": "delay:3"}
START_TIMEOUT_S = 180
DEVICE = "cpu"  # pytest's --device: where every Server runs (braid serve --device)
# Under pytest-xdist (make test: three workers on a 2-core machine), a server the tests start runs on
# one thread unless it names --threads: two workers' servers with a thread per core each, beside
# the workers' own reference computations, left more runnable threads than cores, and every pass's
# OpenMP barriers waited out other processes' time slices. The tests of the threaded kernels pass
# --threads themselves (and the in-process ones use torch's threads).
# The same holds for the workers' own torch (the in-process tier's runners and references): each
# worker's OpenMP pool had a thread per core, two workers four spinning threads on two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("BRAID_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# braid's loader sets these when it loads a model from a folder (nothing may reach the network, and
# no progress bar where the output is no terminal), and nearly every worker loads one in process: set
# from the start, so that a worker's first zygote (braid_testing/zygote.py) imports under them and forks
# every server of the run, where the first in-process load made the next server start a second zygote
# (9 s of CPU a worker). A test that means the hub to be asked says so (test_startup_errors' hub id).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# SDKS_WHERE_USED: the API SDKs (openai, anthropic, pydantic_ai) are imported in the tests that call
# them, not at the top of their modules: every xdist worker collects every module, and importing
# them at collection cost each worker about 4 CPU-s (12 of a 2-core run's ~670) for the dozen
# tests, on one worker each, that use them.


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="braid serve --device for the servers the tests start: cpu (default), cuda or cuda:N",
    )


def pytest_configure(config) -> None:
    global DEVICE
    DEVICE = config.getoption("--device")


# The tiers are folders. tests/unit/ is the fast tier (`make test-unit`): torch-free and in process,
# no server; every test under it is marked unit, whatever its module says. tests/inprocess/ holds the
# in-process tests that need torch (a real runner, tokenizer or model file), and tests/ itself the
# end-to-end ones. (These hooks live here: a tests/unit/conftest.py would shadow this module for the
# tests that import from it.)
UNIT_DIR = REPO / "tests" / "unit"


def _unit_run(config) -> bool:
    """Whether this run is the fast tier alone: every path it was given lies under tests/unit/."""
    paths = [Path(arg.split("::")[0]).resolve() for arg in config.args]
    return bool(paths) and all(path.is_relative_to(UNIT_DIR) for path in paths)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.path.is_relative_to(UNIT_DIR):
            item.add_marker(pytest.mark.unit)


def pytest_sessionfinish(session, exitstatus) -> None:
    if _unit_run(session.config) and "torch" in sys.modules:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(
            "\nmake test-unit: a module under tests/unit/ imported torch (the fast tier is torch-free: "
            "move it to tests/inprocess/)",
            file=sys.stderr,
        )


class Server(BraidProcess):
    """A running `braid serve` (braid_testing.process), and clients for it."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        client_kw: dict | None = None,
    ) -> None:
        """client_kw: how this server's clients connect (TLS settings, API key)."""
        self.client_kw = client_kw or {}
        if env and "BRAID_API_KEY" in env:
            self.client_kw.setdefault("api_key", env["BRAID_API_KEY"])
        if "--device" not in args:
            args = [*args, "--device", DEVICE]
        super().__init__(
            args,
            env=env,
            log_path=log_path,
            show_output=bool(os.environ.get("BRAID_TEST_LOGS")),
            start_timeout=START_TIMEOUT_S,
            channel_credentials=_credentials(self.client_kw),
        )

    def client(self, **kw) -> Client:
        return Client(self.target, **{**self.client_kw, **kw})


def _credentials(client_kw: dict) -> grpc.ChannelCredentials | None:
    roots = client_kw.get("root_certificates")
    if roots is None:
        return None
    read = lambda p: None if p is None else Path(p).read_bytes()  # noqa: E731
    return grpc.ssl_channel_credentials(
        read(roots), read(client_kw.get("client_key")), read(client_kw.get("client_cert"))
    )


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The embedded model, converted once into braid's cache (what `braid warmup` does)."""
    from braid.server.model.loader import default_cache_dir, resolve

    return Path(resolve(None, default_cache_dir())[1])


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smol_dir) -> Path:
    """A tiny random Llama (braid_testing.models) with a 1,024-token context and the embedded
    model's tokenizer and chat template: fast, and real enough to run."""
    return save_model(
        tmp_path_factory.mktemp("tiny-llama"), tiny_model(tie_word_embeddings=True), smol_dir, WITH_TEMPLATE
    )


@pytest.fixture(scope="session")
def servers(tiny_dir):
    """One tiny-model server per mode, started on first use and shared by the whole session. An fp32
    KV cache: test_logprobs compares their logprobs with transformers' to 1e-3, which the CPU's
    default cache (float16 for the tiny model's head_dim 16) does not keep."""
    started: dict[str, Server] = {}

    def get(mode: str) -> Server:
        if mode not in started:
            started[mode] = Server(
                [
                    "--model",
                    str(tiny_dir),
                    "--mode",
                    mode,
                    "--threads",
                    "1",
                    "--max-batch-size",
                    "16",
                    "--max-wait-ms",
                    "5",
                    "--kv-cache-dtype",
                    "float32",
                ]
            )
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


def tiny_server(tiny_dir: Path, *args: str, env: dict[str, str] | None = None, log_path: Path | None = None) -> Server:
    """A server of the tiny model on one torch thread, with more flags."""
    return Server(["--model", str(tiny_dir), "--threads", "1", *args], env=env, log_path=log_path)


def start_together(*starts: Callable[[], Server]) -> list[Server]:
    """Servers started two at a time (a start is mostly one core importing torch), in order; if one
    fails to start, the others are stopped and its error raised."""
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="start-server") as pool:
        futures = [pool.submit(start) for start in starts]
        concurrent.futures.wait(futures)
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < len(futures):
        for server in started:
            server.stop()
        raise next(f.exception() for f in futures if f.exception() is not None)
    return started


@pytest.fixture(scope="session")
def slow(tiny_dir):
    """A continuous-mode tiny server whose passes each take 3 ms longer (SLOW), shared by the session."""
    server = tiny_server(tiny_dir, "--mode", "continuous", env=SLOW)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def in_process():
    """in_process(path, **config): the model at `path`, its runner and tokenizer in this process
    (tests/in_process.py), built once a module for each path and set of EngineConfig fields. One
    engine at a time runs on it (a draft needs a runner of its own: in_process.load_model). A path's
    runners share one load of its checkpoint (the embedded model's took 4-5 s of CPU, and a module
    built five runners of it), as braid's native decoder only reads the loaded weights; a model that
    runs through transformers' own forward (which moves it to its dtype in place) is loaded anew."""
    from braid.server.model.loader import load
    from in_process import Model, load_model  # torch: not at import, for make test-unit

    made: dict[tuple, Model] = {}
    loaded: dict[str, object] = {}  # path -> its LoadedModel, where its runners are braid's own

    def get(path: Path, **config) -> Model:
        key = (str(path), tuple(sorted(config.items())))
        if key not in made:
            model = loaded.get(str(path)) or load(str(path), path.parent)
            made[key] = load_model(path, path.parent, loaded=model, **config)
            if made[key].runner.path == "braid":
                loaded[str(path)] = model
        return made[key]

    return get


# Channel options for a client that stops reading: a 1 KiB receive window per stream that never
# grows (no BDP probing), and a connection of its own. With grpc's defaults the window can take a
# whole stream of small messages without the client reading any of it, so the server never has a
# backlog; with this one its writes wait at once and the session is paused.
SMALL_WINDOW = [
    ("grpc.http2.lookahead_bytes", 1024),
    ("grpc.http2.bdp_probe", 0),
    ("grpc.use_local_subchannel_pool", 1),
]


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


@functools.lru_cache(maxsize=None)
def _reference_model(model_dir: Path):
    return fp32_model(model_dir)


@functools.lru_cache(maxsize=None)
def _reference_logits(model_dir: Path, ids: tuple[int, ...], last: int = 0):
    """transformers' logits at every position of ids, or at its `last` positions only (cached: most
    modes generate the same tokens). Where only the generated tokens are checked, the head runs on
    their rows alone: on a 4,000-token prompt its logits at every position were 0.8 GB and most of
    the reference's time (the same bits at the rows kept)."""
    import torch

    keep = {"logits_to_keep": last} if last else {}
    with torch.no_grad():
        return _reference_model(model_dir)(torch.tensor([list(ids)]), **keep).logits[0]


# The near-tie rule's tolerance, a fraction of the best logit (at least 1), by the dtype braid computes
# in. float32 (a CPU's): braid sums in another order than transformers does. bfloat16 (CUDA's default)
# keeps 8 significant bits of every activation, and the rounding grows through the layers: on the tests'
# tiny random models, run through the CUDA path's torch ops in bf16 on a CPU (tests/inprocess/test_torch_bf16.py),
# the token braid chose was up to 5% of the best logit below it, against fp32 transformers. 12.5% (16 of
# bf16's epsilons) leaves room for CUDA's own kernels and still accepts only the few best tokens of a
# step (7 of 49,152 on average, on the tiny Llama), so a wrong computation does not pass by chance.
NEAR_TIE = {"float32": 1e-4, "bfloat16": 0.125}
# A chosen token's logprob against fp32 transformers', by the same dtype: float32 to summation order;
# bfloat16 to 8 of its epsilons (2**-8 each) of the logprob, since every logit it comes from keeps 8
# significant bits (on an H200, GPT-2 through transformers' fallback in bf16: up to 1.7% off).
LOGPROB_TOLERANCE = {"float32": {"abs": 1e-3}, "bfloat16": {"abs": 1e-3, "rel": 2**-5}}


def compute_dtype() -> str:
    """The dtype braid computes in on --device, with --dtype auto: float32 on a CPU, bfloat16 on CUDA."""
    from braid.server.runner.model_runner import pick_device

    return str(pick_device(DEVICE)[1]).removeprefix("torch.")


def near_tie(logits, token: int, dtype: str | None = None) -> bool:
    """Whether `token`'s logit is within the near-tie rule's tolerance of the best of logits [V] (fp32
    transformers'), for braid computing in `dtype` (None: compute_dtype())."""
    best = logits.max()
    return (best - logits[token]).item() <= NEAR_TIE[dtype or compute_dtype()] * max(1.0, best.abs().item())


def assert_greedy(model_dir: Path, prompt_ids: list[int], generated: list[int], dtype: str | None = None) -> None:
    """Each greedy token braid generated is transformers' most likely next token (within rounding of
    it, for a near-tie: `near_tie`), given the prompt and braid's tokens before it: the near-tie
    rule. model_dir: a folder transformers loads in fp32, the reference whatever braid computes in
    (dtype: ModelInfo.dtype; None: compute_dtype())."""
    if not generated:
        return
    logits = _reference_logits(model_dir, tuple(prompt_ids + generated[:-1]), len(generated))
    for step, token in enumerate(generated):
        assert near_tie(logits[step], token, dtype), (
            f"step {step}: braid chose {token}, transformers {logits[step].argmax().item()}"
        )
