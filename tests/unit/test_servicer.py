"""The gRPC servicer (grpc/servicer.py) on an in-process grpc.aio server over a fake engine client
(engine/client.py's port): protobuf in, statuses and messages out, with no model and no process.
What a real server adds (signals, TLS, HTTP/2 abuse) is tested end to end elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import AsyncIterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from braid.server.config import ServerConfig
from braid.server.grpc.errors import ErrorInterceptor
from braid.server.grpc.servicer import GenerateServicer
from braid.server.engine.adapters import Adapters
from braid.server.engine.books import Books, Ticket
from braid.server.engine.handle import SessionHandle
from braid.server.engine.types import Delta, FinishReason, Finished, ModelInfo, Mode, Timings
from braid.server.runner.rows import AdapterInfo
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc as pb_grpc


INFO = ModelInfo(
    model_name="fake",
    architecture="Fake",
    context_length=64,
    vocab_size=100,
    dtype="float32",
    device="cpu",
    mode=Mode.CONTINUOUS,
    max_batch_size=4,
    eos_token_ids=(2,),
    has_chat_template=False,
    parameters=1,
    weight_formats={"f32": 1},
    weight_bytes=4,
    quantization="auto",
    kernels="torch",
)


class FakeAdapterRunner:
    """The runner's side of LoRA adapters: a path "bad..." is not an adapter, any other has rank 8."""

    def __init__(self) -> None:
        self.resident: set[int] = set()

    def load_adapter(self, adapter_id, name, path, max_rank):
        if path.startswith("bad"):
            raise ValueError("layers.0.self_attn.q_proj.lora_A.weight: shape [8, 32], but this model needs [8, 64]")
        self.resident.add(adapter_id)
        return AdapterInfo(name, path, 8, 16.0, 2.0, ("q_proj", "v_proj"))

    def unload_adapter(self, adapter_id):
        self.resident.remove(adapter_id)


class FakeEngine:
    """The EngineClient port, scripted: every session streams `tokens` (token t as text " t", or
    as `texts` has it) and ends with `finish` (and `error`, `error_field`); aborted sessions end CANCELLED."""

    def __init__(self, max_queued: int = 8, max_loras: int = 2) -> None:
        self.info, self.started_at, self.max_sessions = INFO, time.monotonic(), 4
        self.books = Books(max_queued)
        self.tokens = [5, 6, 7]
        self.texts: list[str] | None = None  # each token's text, instead of " t"
        self.submitted: list = []  # the engine's requests, as submitted
        self.tokenized: list = []  # tokenize's (prompt, messages, tools, template_kwargs), as called
        self.finish, self.error, self.error_field = FinishReason.MAX_TOKENS, None, None
        self.hold = False  # sessions wait (for Abort) instead of streaming
        self.handles: dict[int, SessionHandle] = {}
        self.adapters = Adapters(FakeAdapterRunner(), max_loras=max_loras, max_rank=16, model_names=("fake",))

    def load_lora(self, name, path):
        return self.adapters.load(name, path)

    def unload_lora(self, name):
        return self.adapters.unload(name)

    def keep_lora(self, name, waited):
        self.adapters.keep(name, waited)

    def loras(self):
        return self.adapters.list()

    def admit(self, prompt, messages, for_session=True, truncated=False, token_ids=()) -> Ticket:
        return Ticket(self.books, len(prompt or "") + len(token_ids))

    def compile(self, request):
        return None

    def submit(self, ticket, request, loop, matcher=None):
        try:
            self.adapters.acquire(request.adapter)
        except Exception:
            ticket.release()
            raise
        ticket.release(submitted=request.n)
        self.submitted.append(request)
        handles = []
        for _ in range(request.n):
            handle = SessionHandle(len(self.handles) + 1, request.request_id, 7, 3, loop, self._abort, lambda: None)
            self.handles[handle.session_id] = handle
            handles.append(handle)
            if not self.hold:
                for i, t in enumerate(self.tokens):
                    text = self.texts[i] if self.texts is not None else f" {t}"
                    loop.call_soon_threadsafe(handle.push, Delta(text, [t]))
                self._end(handle, self.finish, self.error, self.error_field)
        return handles

    def _end(self, handle, reason, error=None, field=None) -> None:
        done = Finished(
            reason=reason,
            prompt_tokens=3,
            generated_tokens=len(self.tokens),
            timings=Timings(1.0, 2.0, 3.0, 4.0),
            error=error,
            error_field=field,
        )
        self.books.finish(reason, active=0)
        handle.loop.call_soon_threadsafe(handle.push, done)

    def _abort(self, session_id, reason) -> None:
        self._end(self.handles[session_id], reason)

    def tokenize(self, ticket, prompt, messages, offsets=False, tools="", template_kwargs=""):
        self.tokenized.append((prompt, messages, tools, template_kwargs))
        ticket.release()
        return [1, 2], ["a", "b"], [(0, 1), (1, 2)] if offsets else []

    def detokenize(self, ticket, token_ids):
        ticket.release()
        return "".join(f" {t}" for t in token_ids), 0

    def stats(self):
        return self.books.snapshot()

    @property
    def is_idle(self) -> bool:
        return self.books.is_idle


@contextlib.asynccontextmanager
async def _served(engine: FakeEngine) -> AsyncIterator[pb_grpc.GenerateStub]:
    """A stub of a fresh in-process server over `engine`, for the calls of one test."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    pb_grpc.add_GenerateServicer_to_server(GenerateServicer(engine, ServerConfig()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.GenerateStub(channel)
    finally:
        await server.stop(0)


@pytest.fixture
def call():
    """call(engine, method, request, **kw): runs one call against a fresh in-process server."""

    def run(engine: FakeEngine, method: str, request, **kw):
        async def go():
            async with _served(engine) as stub:
                if method == "Stream":
                    rpc = stub.Stream(request, **kw)
                    return [m async for m in rpc], await rpc.trailing_metadata()
                if method == "StreamAndAbort":
                    rpc = stub.Stream(request, **kw)
                    await rpc.initial_metadata()
                    aborted = await stub.Abort(pb.AbortRequest(request_ids=[request.request_id]))
                    return [m async for m in rpc], aborted
                return await getattr(stub, method)(request, **kw)

        return asyncio.run(go())

    return run


def test_a_stream_sends_its_tokens_then_one_final_message_and_trailers(call):
    messages, trailers = call(FakeEngine(), "Stream", pb.GenerateRequest(prompt="hi", max_new_tokens=3))
    assert "".join(m.text for m in messages) == " 5 6 7"
    assert [t for m in messages for t in m.token_ids] == [5, 6, 7]
    final = messages[-1]
    assert final.finish_reason == pb.FINISH_REASON_MAX_TOKENS and final.usage.generated_tokens == 3
    assert final.seed == 7 and final.request_id
    keys = dict(trailers)
    # (the ORCA report, endpoint-load-metrics-bin, is taken by gRPC's own client: tests/test_orca.py reads it)
    assert keys["braid-cached-tokens"] == "0" and keys["braid-total-ms"] == "3.000", sorted(keys)


@pytest.mark.parametrize(
    "field, request_kw", [("temperature", dict(temperature=-1.0)), ("prompt", dict()), ("n", dict(n=99))]
)
def test_a_bad_field_is_invalid_argument_naming_it(call, field, request_kw):
    request = pb.GenerateRequest(**({"prompt": "hi"} if field != "prompt" else {}), **request_kw)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(FakeEngine(), "Stream", request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field)


def test_a_full_queue_is_resource_exhausted_with_a_retry_delay(call):
    engine = FakeEngine(max_queued=1)
    engine.books.reserve()  # the one place is taken
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(engine, "Stream", pb.GenerateRequest(prompt="hi"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_details_pb2.RetryInfo()
    rpc_status.from_call(err.value).details[0].Unpack(info)
    assert info.retry_delay.ToMilliseconds() > 0


def test_an_engine_error_is_internal_with_its_own_message(call):
    engine = FakeEngine()
    engine.finish, engine.error = FinishReason.ERROR, "forward pass failed: boom"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(engine, "Stream", pb.GenerateRequest(prompt="hi"))
    assert err.value.code() == grpc.StatusCode.INTERNAL and err.value.details() == "forward pass failed: boom"


def test_a_request_found_invalid_mid_stream_is_invalid_argument_naming_the_field(call):
    engine = FakeEngine()
    engine.finish, engine.error, engine.error_field = FinishReason.INVALID_REQUEST, "x" * 50_000, "constraint.regex"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(engine, "Stream", pb.GenerateRequest(prompt="hi"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("constraint.regex: ") and len(err.value.details()) <= 1000


def test_abort_ends_the_callers_stream_with_a_final_cancelled_message(call):
    engine = FakeEngine()
    engine.hold = True
    messages, aborted = call(engine, "StreamAndAbort", pb.GenerateRequest(prompt="hi", request_id="job-1"))
    assert list(aborted.aborted) == ["job-1"]
    assert messages[-1].finish_reason == pb.FINISH_REASON_CANCELLED


def test_tokenize_and_model_info_answer_from_the_engine(call):
    engine = FakeEngine()
    assert list(call(engine, "Tokenize", pb.TokenizeRequest(text="ab")).pieces) == ["a", "b"]
    assert call(engine, "ModelInfo", pb.ModelInfoRequest()).model_name == "fake"


def _code(call, engine, method, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(engine, method, request)
    return err.value.code(), err.value.details()


def test_adapters_load_list_and_unload_and_each_mistake_has_its_status(call):
    engine = FakeEngine()
    loaded = call(engine, "LoadAdapter", pb.LoadAdapterRequest(name="sql", path="/adapters/sql"))
    assert (
        loaded.adapter.name == "sql"
        and loaded.adapter.rank == 8
        and list(loaded.adapter.target_modules) == ["q_proj", "v_proj"]
    )
    info = call(engine, "ModelInfo", pb.ModelInfoRequest())
    assert [a.name for a in info.adapters] == ["sql"]
    assert call(engine, "Stream", pb.GenerateRequest(prompt="hi", adapter="sql"))[0][-1].finish_reason

    code, details = _code(call, engine, "Stream", pb.GenerateRequest(prompt="hi", adapter="nope"))
    assert code == grpc.StatusCode.NOT_FOUND and "'nope'" in details
    code, details = _code(call, engine, "LoadAdapter", pb.LoadAdapterRequest(name="sql", path="/adapters/sql"))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "'sql'" in details
    code, details = _code(call, engine, "LoadAdapter", pb.LoadAdapterRequest(name="x", path="bad/one"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "q_proj.lora_A.weight" in details
    assert "\n" not in details
    for name in ("", "a b", "fake", "x" * 129):  # empty, a space, the model's own name, too long
        code, details = _code(call, engine, "LoadAdapter", pb.LoadAdapterRequest(name=name, path="/a"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("name"), name
    call(engine, "LoadAdapter", pb.LoadAdapterRequest(name="chat", path="/adapters/chat"))
    code, details = _code(call, engine, "LoadAdapter", pb.LoadAdapterRequest(name="third", path="/adapters/c"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-loras" in details

    # the first Stream's session still holds "sql" (the fake never gives its hold back): an unload
    # that cannot wait for it fails clearly, and the adapter stays
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(engine, "UnloadAdapter", pb.UnloadAdapterRequest(name="sql"), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "still used by 1" in err.value.details()
    assert [a.name for a in call(engine, "ModelInfo", pb.ModelInfoRequest()).adapters] == ["chat", "sql"]
    engine.adapters.release(1)
    call(engine, "UnloadAdapter", pb.UnloadAdapterRequest(name="sql"))
    assert [a.name for a in call(engine, "ModelInfo", pb.ModelInfoRequest()).adapters] == ["chat"]
    assert len(engine.adapters._runner.resident) == 1  # sql's matrices are freed
    code, details = _code(call, engine, "UnloadAdapter", pb.UnloadAdapterRequest(name="sql"))
    assert code == grpc.StatusCode.NOT_FOUND and "'sql'" in details


def test_unloads_waiting_for_busy_adapters_hold_no_thread_a_load_needs():
    """Issue 39 item 20: a LoadAdapter waited 44 s behind six UnloadAdapter calls that were waiting
    for busy adapters, as each wait held one of the six threads of asyncio's default pool (on 2
    cores). With more unloads waiting than that pool has threads, on as many busy adapters, a load
    of another completes while every unload still waits; then the sessions end and every unload
    succeeds."""
    pool = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor's threads
    busy = [f"busy{i}" for i in range(pool + 1)]
    engine = FakeEngine(max_loras=len(busy) + 1)
    for name in busy:
        engine.adapters.load(name, f"/adapters/{name}")
        engine.adapters.acquire(name)  # a session runs with it

    async def scenario():
        async with _served(engine) as stub:
            unloads = [
                asyncio.ensure_future(stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=60))
                for name in busy
            ]
            # until every unload has begun and waits (or, where they wait on threads, some have given up)
            while engine.adapters.list() and not any(u.done() for u in unloads):
                await asyncio.sleep(0.01)
            loaded = await stub.LoadAdapter(pb.LoadAdapterRequest(name="new", path="/adapters/new"))
            waiting = sum(not u.done() for u in unloads)
            for adapter_id in range(1, len(busy) + 1):
                engine.adapters.release(adapter_id)  # the sessions end
            return loaded, waiting, await asyncio.gather(*unloads, return_exceptions=True)

    loaded, waiting, unloaded = asyncio.run(scenario())
    assert loaded.adapter.name == "new" and waiting == len(busy)
    assert all(isinstance(u, pb.UnloadAdapterResponse) for u in unloaded), unloaded
    assert [a.name for a in engine.adapters.list()] == ["new"]
    assert engine.adapters._runner.resident == {len(busy) + 1}  # every busy one freed, the new one there
