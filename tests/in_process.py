"""The in-process tier: braid's engine core over a real model runner and tokenizer, in the test's own
process, with no server and no channel. It is for what the engine and the model decide together but
the edge never touches: a mode's schedule, speculation's verification, adapters in a shared pass.

A server start costs 3-4 s of CPU and the suite starts over a hundred. A test here pays for loading
its model once per module. Every mode then runs on the same runner, one engine core at a time
(tests/unit/engine_fakes.py's Harness, with sessions made by the real admission). The end-to-end
tests keep what needs a process and a channel: the request fields on the wire, the statuses and the
final messages."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from braid.server.config import EngineConfig
from braid.server.engine.tokenizer import Tokenizer
from braid.server.engine.types import Delta, EngineStats, Finished, Message
from braid.server.model.loader import LoadedModel, load
from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import TokenLogprob
from unit.engine_fakes import Harness


@dataclass
class Model:
    """A model loaded once: its runner (run by one engine core at a time) and its tokenizer."""

    runner: ModelRunner
    tokenizer: Tokenizer
    path: str


def load_model(path: Path | str | None, cache_dir: Path, loaded: LoadedModel | None = None, **config) -> Model:
    """The runner `braid serve --model path` builds (None: the embedded model), on one thread, with
    a 128 MiB KV cache; config: other EngineConfig fields (kernels, activations, kv_cache_memory, ...).
    loaded: the model at path, already loaded (another runner's, for braid's native decoder only).
    The device is pytest's --device, as for the servers the tests start: left to --device auto, a
    machine with a GPU built these runners on CUDA under plain `make test` (four of
    test_precision's tests failed so on an H200's host, each reading CUDA's bf16 and torch kernels)."""
    import conftest

    name = None if path is None else str(path)
    model = loaded or load(name, cache_dir)
    defaults = {"model": name, "device": conftest.DEVICE, "threads": 1, "kv_cache_memory": "128MiB"}
    engine_config = EngineConfig(**{**defaults, **config})
    runner = ModelRunner.build(engine_config, model)
    return Model(runner, Tokenizer(model.hf_tokenizer, model.eos_token_ids), name or model.name)


@dataclass
class Outcome:
    """What one request generated (with its logprobs, where it asked for them), and its final event."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    final: Finished


def generate(model: Model, requests: list[dict], draft: Model | None = None, adapters=(), **config) -> list[Outcome]:
    """Every request submitted at once, as a client's concurrent calls arrive, then steps until all
    have finished. A request: Harness.submit's arguments, with `messages` as (role, text) pairs.
    config: EngineConfig fields (mode, speculative, max_batch_size, ...); adapters: (name, path)
    pairs loaded first (--lora). After the run no session is left and no page is held."""
    return run(model, requests, draft, adapters, **config)[0]


def run(
    model: Model, requests: list[dict], draft: Model | None = None, adapters=(), **config
) -> tuple[list[Outcome], EngineStats]:
    """generate's outcomes, and the engine's books after the run (ServerStatus's counts)."""
    harness = Harness(model.runner, draft.runner if draft else None, tokenizer=model.tokenizer, **config)
    try:
        for name, path in adapters:
            harness.adapters.load(name, str(path))
        handles = []
        for r in requests:
            r = dict(r)
            messages = tuple(Message(role, text) for role, text in r.pop("messages", ()))
            handles += harness.submit(r.pop("prompt", ""), messages=messages, **r)
        harness.run()
        assert harness.core.pages.num_used == 0 and not harness.core.sessions
        assert not any(harness.core.kept().values()), harness.core.kept()  # every session's state freed
        outcomes = []
        for h in handles:
            events = harness.events[h.session_id]
            (final,) = [e for e in events if isinstance(e, Finished)]
            logprobs = [lp for e in events if isinstance(e, Delta) for lp in e.logprobs]
            outcomes.append(Outcome(harness.tokens(h), logprobs, final))
        return outcomes, harness.books.snapshot()
    finally:
        for info in harness.adapters.list():  # the runner outlives this engine
            harness.adapters.unload(info.name)  # none holds it: freed at once
        harness.close()
