"""The model loop hands the heap's freed pages back to the system once it has run no pass for
RELEASE_AFTER_IDLE_S (engine/engine.py, resources.release_freed_heap): a burst's prompt chunks
freed their activations into glibc's heaps, which kept them resident while the server sat idle
(issue 40: 25-58 MiB at the 1B shape after 16 prompts at once, benchmarks/memory_steps.py). Once after passes,
never between them, never again while it stays idle."""

from __future__ import annotations

import asyncio
import threading
import time

from engine_fakes import INFO, NumberTokenizer, ScriptedRunner

from braid.server import resources
from braid.server.config import EngineConfig
from braid.server.engine import engine as engine_module
from braid.server.engine.engine import Engine
from braid.server.engine.types import GenerationRequest, SamplingParams

IDLE_S = 0.05  # RELEASE_AFTER_IDLE_S here
WAIT_S = 10.0  # the most the test waits for what it expects (never a bound it asserts)


def _wait_for(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_loop_releases_the_heap_once_idle_after_passes_and_not_before(monkeypatch):
    released: list[float] = []  # when, by the loop's clock
    passes: list[float] = []  # when each pass ended
    monkeypatch.setattr(resources, "release_freed_heap", lambda: released.append(time.monotonic()) or True)
    monkeypatch.setattr(engine_module, "RELEASE_AFTER_IDLE_S", IDLE_S)
    runner = ScriptedRunner()
    run = runner.run
    runner.run = lambda *args, **kwargs: (run(*args, **kwargs), passes.append(time.monotonic()))[0]  # type: ignore[method-assign]
    engine = Engine(EngineConfig(max_wait_ms=0), runner, NumberTokenizer(), INFO, grammars=None)
    loop = asyncio.new_event_loop()  # the handles' loop: never run, the events are not read
    thread = threading.Thread(target=engine.run, name="model loop")
    thread.start()
    try:
        time.sleep(5 * IDLE_S)  # idle from the start: nothing was freed by a pass
        assert released == []
        for _ in range(2):  # a request, released after; another, released after it again
            before = len(released)
            request = GenerationRequest(
                prompt="5 6 7", messages=(), params=SamplingParams(max_new_tokens=20), request_id="r"
            )
            engine.client.submit(engine.client.admit(request.prompt, ()), request, loop)
            _wait_for(lambda: len(released) > before)
            assert len(passes) >= 20 and len(released) == before + 1
            assert released[-1] - passes[-1] >= IDLE_S  # after the last pass, not between passes
            time.sleep(5 * IDLE_S)
            assert len(released) == before + 1  # once, however long it stays idle
    finally:
        engine.client.stop()
        thread.join(WAIT_S)
        loop.close()
