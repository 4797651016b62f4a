"""Embeddings without a model: the vector's arithmetic, the engine core's embedding sessions over a
scripted runner (chunks pooled, in every mode, books balanced), the checks every front end shares,
and both front ends (the gRPC servicer in process, the HTTP app through Starlette's TestClient) over
a fake engine client: fields in, OpenAI's and braid's shapes out, every bad field named."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct

import grpc
import pytest
from starlette.testclient import TestClient
from test_servicer import INFO, FakeEngine, _served

from braid.server.config import ServerConfig
from braid.server.engine.books import Ticket
from braid.server.engine.embedding import Embedding, finish_vector
from braid.server.engine.handle import SessionHandle
from braid.server.engine.types import (
    EmbeddingRequest,
    Finished,
    FinishReason,
    InvalidArgument,
    Pooling,
    Timings,
)
from braid.server.frontend.embeddings import MAX_EMBED_INPUTS, check_embedding
from braid.server.http.app import OpenAIApi
from braid.server.runner.rows import Row, Sampled
from braid.v1 import generate_pb2 as pb
from tests.unit.engine_fakes import Harness, ScriptedRunner

# ---- the vector -----------------------------------------------------------------------------------


def test_a_vector_is_the_mean_cut_to_dimensions_then_unit_length():
    assert finish_vector([2.0, 4.0, 6.0], 2, 0, False) == [1.0, 2.0, 3.0]
    assert finish_vector([3.0, 4.0, 12.0], 1, 2, True) == [0.6, 0.8]
    assert finish_vector([0.0, 0.0], 1, 0, True) == [0.0, 0.0]  # a zero vector stays zero


def test_a_mean_starts_again_from_position_0_and_last_keeps_only_the_last_chunk():
    mean = Embedding(Pooling.MEAN, normalize=False)
    mean.add([10.0], 0, 4)
    mean.add([6.0], 4, 2)
    assert mean.vector() == [16.0 / 6]
    mean.add([3.0], 0, 3)  # preempted: its input computed again from the start
    mean.add([3.0], 3, 3)
    assert mean.vector() == [1.0]
    last = Embedding(Pooling.LAST, normalize=False)
    last.add([5.0, 1.0], 16, 8)
    assert last.vector() == [5.0, 1.0]


# ---- the engine core, over a runner that pools by arithmetic ----------------------------------------


class PoolingRunner(ScriptedRunner):
    """A pooling row gets, as its "hidden state", (sum of its ids, its length) for MEAN, (its last id,
    1) for LAST: so the engine's mean over chunks is (the input's mean id, 1)."""

    def run(self, rows):
        out = super().run(rows)
        return [Sampled(None, pooled=_pooled(r)) if r.pool is not None else sampled for r, sampled in zip(rows, out)]


def _pooled(row: Row) -> list[float]:
    if row.pool is Pooling.MEAN:
        return [float(sum(row.token_ids)), float(len(row.token_ids))]
    return [float(row.token_ids[-1]), 1.0]


def _embed(h: Harness, inputs, **fields):
    request = EmbeddingRequest(texts=(), token_ids=tuple(map(tuple, inputs)), request_id="e", **fields)
    handles = h.admission.embed(h.admission.admit_embedding(request), request, h.loop, Pooling.LAST)
    for handle in handles:
        h.events.setdefault(handle.session_id, [])
    return handles


@pytest.mark.parametrize("mode", ["sequential", "interleaved", "batched", "continuous"])
def test_each_input_is_a_prompt_only_session_pooled_over_its_chunks_in_every_mode(mode):
    inputs = [list(range(3, 40)), [7], list(range(100, 120))]
    with Harness(runner=PoolingRunner(), mode=mode, prefill_chunk=16) as h:
        [gen] = h.submit("5 6 7", max_new_tokens=5)
        means = _embed(h, inputs, pooling=Pooling.MEAN, normalize=False)
        lasts = _embed(h, inputs, normalize=False)  # the model's pooling: LAST
        h.run()
        assert len(h.tokens(gen)) == 5
        for ids, mean, last in zip(inputs, means, lasts):
            assert h.finished(mean).embedding == [sum(ids) / len(ids), 1.0]
            assert h.finished(last).embedding == [float(ids[-1]), 1.0]
            assert h.finished(mean).prompt_tokens == len(ids) and h.finished(mean).generated_tokens == 0
        if mode == "continuous":  # no pass holds more than one prompt chunk's tokens
            assert max(sum(len(r.token_ids) for r in rows if r.is_prompt) for rows in h.runner.passes) <= 16
        assert h.books.snapshot().sessions_active == 0


def test_truncate_input_tokens_keeps_the_last_ones_and_an_input_too_long_is_named():
    with Harness(runner=PoolingRunner(max_seq_len=64)) as h:
        [cut] = _embed(h, [list(range(3, 103))], truncate_input_tokens=10, pooling=Pooling.MEAN, normalize=False)
        h.run()
        finished = h.finished(cut)
        assert finished.prompt_tokens == 10 and finished.truncated_tokens == 90
        assert finished.embedding == [sum(range(93, 103)) / 10, 1.0]
        # exactly the context is fine (nothing is generated after it); one more is not
        [whole] = _embed(h, [list(range(3, 67))])
        with pytest.raises(InvalidArgument) as error:
            _embed(h, [[5], list(range(3, 68))])
        assert error.value.field == "token_ids[1]" and "65 tokens" in str(error.value)
        h.run()
        assert h.finished(whole).embedding is not None and h.core.books_balance() == (0, 0, 0)


def test_an_input_preempted_midway_is_pooled_again_from_its_start():
    """Its pages taken back for a generation that grows, it computes its input again from position
    0 once readmitted: the mean is of its tokens once each."""
    ids = list(range(3, 99))  # 96 tokens: 6 pages of 16
    with Harness(runner=PoolingRunner(num_pages=8), mode="continuous", prefill_chunk=4) as h:
        [gen] = h.submit(" ".join(map(str, range(500, 515))), max_new_tokens=40, ignore_eos=True)
        h.step()
        [embedding] = _embed(h, [ids], pooling=Pooling.MEAN, normalize=False)
        h.run()
        assert h.books.snapshot().preemptions >= 1 and len(h.tokens(gen)) == 40
        assert h.finished(embedding).embedding == [sum(ids) / len(ids), 1.0]


def test_a_cancelled_input_ends_without_a_vector_and_frees_its_pages():
    with Harness(runner=PoolingRunner(), prefill_chunk=16) as h:
        [handle] = _embed(h, [list(range(3, 60))])
        h.step()
        h.abort(handle, FinishReason.CANCELLED)
        h.step()
        assert h.finished(handle).embedding is None and h.core.pages.num_used == 0


def test_a_last_token_embedding_reads_the_prefix_cache_and_a_mean_does_not():
    ids = list(range(3, 60))
    with Harness(runner=PoolingRunner(), prefill_chunk=512) as h:
        _embed(h, [ids])
        h.run()
        [last], [mean] = _embed(h, [ids]), _embed(h, [ids], pooling=Pooling.MEAN, normalize=False)
        h.run()
        assert h.finished(last).cached_tokens == 48 and h.finished(mean).cached_tokens == 0
        assert h.finished(mean).embedding == [sum(ids) / len(ids), 1.0]


# ---- the checks ---------------------------------------------------------------------------------------

EMBED_INFO = INFO.__class__(**{**INFO.__dict__, "embedding_dimensions": 4})


def _request(**fields) -> EmbeddingRequest:
    return EmbeddingRequest(**{"texts": (), "token_ids": (), "request_id": "r", **fields})


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(), "texts"),
        (dict(texts=("a", "")), "texts[1]"),
        (dict(texts=("a",), token_ids=((1,),)), "token_ids"),
        (dict(token_ids=((1,), ())), "token_ids[1]"),
        (dict(token_ids=((1, 100),)), "token_ids[0][1]"),
        (dict(texts=("a",) * (MAX_EMBED_INPUTS + 1)), "texts"),
        (dict(texts=("a",), dimensions=5), "dimensions"),
        (dict(texts=("a",), truncate_input_tokens=-1), "truncate_input_tokens"),
        (dict(texts=("a",), request_id="\n"), "request_id"),
    ],
)
def test_every_limit_is_checked_naming_the_field(fields, named):
    with pytest.raises(InvalidArgument) as error:
        check_embedding(_request(**fields), EMBED_INFO)
    assert error.value.field == named


def test_a_model_without_embeddings_is_named():
    with pytest.raises(InvalidArgument) as error:
        check_embedding(_request(texts=("a",)), INFO)
    assert error.value.field == "model"


# ---- the front ends, over a fake engine client ------------------------------------------------------


class EmbedEngine(FakeEngine):
    """FakeEngine with embeddings: input i's vector is (len(input), i, 0, 0) cut to dimensions (and
    normalized where asked); `hold` keeps them waiting, for a cancel."""

    def __init__(self) -> None:
        super().__init__()
        self.info = EMBED_INFO
        self.embedded: list[EmbeddingRequest] = []
        self.cancelled: set[int] = set()  # sessions aborted (the engine ignores a second abort)

    def _abort(self, session_id, reason) -> None:
        if session_id not in self.cancelled:
            self.cancelled.add(session_id)
            super()._abort(session_id, reason)

    def admit_embedding(self, request):
        return Ticket(self.books, 0)

    def embed(self, ticket, request, loop):
        if any(len(item) > self.info.context_length for item in request.inputs):  # as the engine, once tokenized
            ticket.release()
            raise InvalidArgument("texts[0]" if request.texts else "token_ids[0]", "is too long")
        ticket.release(submitted=len(request.inputs))
        self.embedded.append(request)
        handles = []
        for i, item in enumerate(request.inputs):
            handle = SessionHandle(
                len(self.handles) + 1, request.request_id, 0, len(item), loop, self._abort, lambda: None
            )
            self.handles[handle.session_id] = handle
            handles.append(handle)
            if not self.hold:
                vector = finish_vector([float(len(item)), float(i), 0.0, 0.0], 1, request.dimensions, request.normalize)
                done = Finished(FinishReason.MAX_TOKENS, len(item), 0, Timings(1, 1, 1, 0), embedding=vector)
                self.books.finish(done.reason, active=0)
                loop.call_soon_threadsafe(handle.push, done)
        return handles


def _grpc(engine, request, **kw):
    async def go():
        async with _served(engine) as stub:
            return await stub.Embed(request, **kw)

    return asyncio.run(go())


def test_embed_answers_each_input_in_order_with_usage():
    engine = EmbedEngine()
    response = _grpc(engine, pb.EmbedRequest(texts=["ab", "cde"], normalize=False, request_id="x"))
    assert [list(e.values) for e in response.embeddings] == [[2, 0, 0, 0], [3, 1, 0, 0]]
    assert response.prompt_tokens == 5 and response.request_id == "x" and response.pooling == pb.POOLING_LAST
    ids = _grpc(engine, pb.EmbedRequest(token_ids=[pb.TokenIds(ids=[1, 2])], pooling=pb.POOLING_MEAN, dimensions=2))
    assert list(ids.embeddings[0].values) == [1.0, 0.0] and ids.pooling == pb.POOLING_MEAN
    assert engine.embedded[-1].pooling is Pooling.MEAN and engine.embedded[-1].token_ids == ((1, 2),)


@pytest.mark.parametrize(
    "request_kw, named",
    [
        (dict(texts=["a", ""]), "texts[1]"),
        (dict(token_ids=[pb.TokenIds(ids=[5, 100])]), "token_ids[0][1]"),
        (dict(texts=["a"], dimensions=9), "dimensions"),
        (dict(texts=["a"], pooling=7), "pooling"),
        (dict(), "texts"),
    ],
)
def test_embed_refuses_a_bad_field_naming_it(request_kw, named):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        _grpc(EmbedEngine(), pb.EmbedRequest(**request_kw))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details().startswith(named + ":")


def test_a_cancelled_embed_call_cancels_its_inputs():
    engine = EmbedEngine()
    engine.hold = True

    async def go():
        async with _served(engine) as stub:
            call = stub.Embed(pb.EmbedRequest(texts=["a", "b"]))
            while len(engine.handles) < 2:
                await asyncio.sleep(0.01)
            call.cancel()
            while len(engine.cancelled) < 2:
                await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(go(), 10))
    assert engine.cancelled == set(engine.handles) and engine.books.snapshot().finished[FinishReason.CANCELLED] == 2


def _http(**config) -> tuple[EmbedEngine, TestClient]:
    engine = EmbedEngine()
    return engine, TestClient(OpenAIApi(engine, ServerConfig(**config)).app)


@pytest.mark.parametrize(
    "value, inputs",
    [("hi", ("hi",)), (["a", "bc"], ("a", "bc")), ([5, 6, 7], ((5, 6, 7),)), ([[5], [6, 7]], ((5,), (6, 7)))],
)
def test_v1_embeddings_takes_openais_four_input_shapes(value, inputs):
    engine, http = _http()
    body = http.post("/v1/embeddings", json={"input": value, "model": "fake"}).json()
    assert engine.embedded[0].inputs == inputs
    assert [d["index"] for d in body["data"]] == list(range(len(inputs))) and body["object"] == "list"
    assert all(d["object"] == "embedding" and len(d["embedding"]) == 4 for d in body["data"])
    tokens = sum(len(i) for i in inputs)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens} and body["model"] == "fake"


def test_v1_embeddings_base64_is_little_endian_float32_and_dimensions_cut_and_renormalize():
    _, http = _http()
    body = http.post("/v1/embeddings", json={"input": ["abc", "de"], "encoding_format": "base64", "dimensions": 2})
    vectors = [struct.unpack("<2f", base64.b64decode(d["embedding"])) for d in body.json()["data"]]
    assert vectors[0] == (1.0, 0.0)
    assert math.isclose(vectors[1][0], 2 / math.sqrt(5), rel_tol=1e-6)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ["a", ""]}, "input[1]"),
        ({"input": [5, 100]}, "input[1]"),
        ({"input": [[5], [6, 100]]}, "input[1][1]"),
        ({"input": []}, "input"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": 5}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [[5] * 65]}, "input[0]"),  # the engine's own check, once tokenized
        ({"input": [5] * 65}, "input"),
    ],
)
def test_v1_embeddings_refuses_bad_input_in_openais_error_shape_naming_the_param(body, param):
    _, http = _http()
    response = http.post("/v1/embeddings", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param or error["param"].startswith(param), error


def test_v1_embeddings_is_behind_the_api_key():
    _, http = _http(api_key="k")
    assert http.post("/v1/embeddings", json={"input": "a"}).status_code == 401
    assert http.post("/v1/embeddings", json={"input": "a"}, headers={"Authorization": "Bearer k"}).status_code == 200


# ---- the model's own pooling ----------------------------------------------------------------------


def _gguf(path, pooling_type: int | None):
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "qwen3")
    writer.add_context_length(512)
    writer.add_token_list(["<a>", "b", "c"] * 1000)  # a string array, skipped by the header reader
    writer.add_array("qwen3.numbers", [1, 2, 3])
    if pooling_type is not None:
        writer.add_uint32("qwen3.pooling_type", pooling_type)
    writer.add_tensor("t", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize(
    "pooling_type, expected",
    [(1, ("mean", "gguf")), (3, ("last", "gguf")), (2, ("last", "default")), (None, ("last", "default"))],
)
def test_a_ggufs_pooling_type_names_the_models_pooling(tmp_path, pooling_type, expected):
    from types import SimpleNamespace

    from braid.server.model import gguf_config
    from braid.server.model.pooling import model_pooling

    path = _gguf(tmp_path / "m.gguf", pooling_type)
    config = SimpleNamespace()  # what the loader's reading of the file's keys leaves on the config
    gguf_config.restore(tmp_path / "m.gguf", config)
    assert model_pooling(path, config) == expected  # cls (2) is not braid's: the default, with a warning


@pytest.mark.parametrize("mode, expected", [("lasttoken", "last"), ("mean_tokens", "mean"), ("cls_token", "last")])
def test_a_sentence_transformers_folder_names_the_models_pooling(tmp_path, mode, expected):
    from braid.server.model.pooling import model_pooling

    (tmp_path / "1_Pooling").mkdir()
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    settings = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, f"pooling_mode_{mode}": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(settings))
    source = "default" if expected == "last" and mode == "cls_token" else "sentence-transformers"
    assert model_pooling(str(tmp_path)) == (expected, source)
    assert model_pooling(str(tmp_path / "nothing-here")) == ("last", "default")
