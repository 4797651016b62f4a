"""What ModelInfo says about the runner `braid serve` builds (cli.describe, then the edge's
conversion), here its threads: the CPUs the process may use, or --threads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from braid_testing.models import loaded, tiny_model

from braid.server import resources
from braid.server.cli import describe
from braid.server.config import EngineConfig
from braid.server.grpc.convert import model_info_to_pb
from braid.server.model.loader import LoadedModel
from braid.server.runner.model_runner import ModelRunner


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return loaded(tiny_model(vocab_size=512, max_position_embeddings=256))


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """build sets torch's threads for the whole process: put them back for the tests after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def info(config: EngineConfig, model: LoadedModel):
    runner = ModelRunner.build(config, model)
    tokenizer = SimpleNamespace(eos_token_ids=(2,), has_chat_template=False, template_takes_tools=True)
    return runner, model_info_to_pb(describe(config, runner, tokenizer, model.name, model.architecture))


def test_model_info_reports_the_threads_the_process_may_use(tiny):
    runner, pb = info(EngineConfig(device="cpu", kv_cache_memory="16MiB"), tiny)
    assert pb.threads == resources.threads().count > 0
    assert torch.get_num_threads() == pb.threads
    # the governor watches only braid's kernels, with more than one thread to choose from
    assert (runner.governor is not None) == (pb.threads > 1 and runner.kernels != "torch")


def test_threads_flag_is_reported_and_fixes_the_count(tiny):
    runner, pb = info(EngineConfig(device="cpu", kv_cache_memory="16MiB", threads=3), tiny)
    assert pb.threads == 3 and runner.governor is None


def test_model_info_reports_the_served_names_and_what_was_loaded(tiny):
    config = EngineConfig(device="cpu", kv_cache_memory="16MiB", served_model_name=["smol", "gpt-4o-mini"])
    runner = ModelRunner.build(config, tiny)
    tokenizer = SimpleNamespace(eos_token_ids=(2,), has_chat_template=False, template_takes_tools=True)
    pb = model_info_to_pb(describe(config, runner, tokenizer, tiny.name, tiny.architecture, "/models/tiny"))
    assert pb.model_name == "smol" and list(pb.served_model_names) == ["smol", "gpt-4o-mini"]
    assert pb.model_path == "/models/tiny"
    # without the flag: the loader's short name
    _, pb = info(EngineConfig(device="cpu", kv_cache_memory="16MiB"), tiny)
    assert pb.model_name == "tiny" and list(pb.served_model_names) == ["tiny"]


@pytest.mark.parametrize(
    ("head_dim", "flag", "reported"),
    [(16, "auto", "float16"), (32, "auto", "q8_0"), (32, "float32", "float32"), (16, "bfloat16", "bfloat16")],
)
def test_model_info_reports_the_kv_cache_dtype_auto_chose_or_the_flag_named(head_dim, flag, reported):
    """--kv-cache-dtype auto on a CPU: q8_0 where head_dim is whole q8_0 blocks, else float16; a
    named dtype as named. The cache's bytes are that dtype's."""
    model = loaded(tiny_model(vocab_size=512, max_position_embeddings=256, head_dim=head_dim))
    runner, pb = info(EngineConfig(device="cpu", kv_cache_memory="1MiB", kv_cache_dtype=flag), model)
    assert pb.kv_cache_dtype == runner.kv_dtype_name == reported
    per_token = {"float16": 2, "bfloat16": 2, "float32": 4, "q8_0": 34 / 32}[reported] * head_dim
    assert pb.kv_cache_bytes == runner.num_pages * 16 * 2 * 2 * 2 * per_token  # 2 layers, 2 KV heads, keys and values


def test_a_folder_is_served_under_its_own_name_not_its_path(tmp_path, monkeypatch):
    from braid.server.model.loader import resolve

    folder = tmp_path / "models" / "SmolLM2-360M"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    monkeypatch.chdir(tmp_path / "models")
    for given in (str(folder), f"{folder}/", "./SmolLM2-360M", "SmolLM2-360M/."):
        assert resolve(given, tmp_path)[0] == "SmolLM2-360M", given
