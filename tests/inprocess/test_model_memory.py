"""What a model costs in memory on its way in (issue 40: the 1B shape's first start held 6.9 GB, its
later starts peaked at 2.7 GB for a server that then holds 1.6): a GGUF file's conversion holds
about one tensor in fp32 at a time, not the model; a start holds each quantized matrix from the
converted folder only while the runner packs it; and the files both write are plain safetensors.
Memory is counted deterministically (traced allocations, live tensors), never timed."""

from __future__ import annotations

import gc
import tracemalloc
import weakref

import pytest
import torch
from gguf import GGUFReader
from safetensors.torch import load_file
from test_request_log import tiny_gguf  # a tiny Llama's GGUF file: layers and width as asked

from braid.server import resources
from braid.server.config import EngineConfig, SettingError
from braid.server.model import conversion, tensor_file
from braid.server.model.loader import load
from braid.server.runner import decoder
from braid.server.runner.model_runner import ModelRunner

LAYERS, HIDDEN = 16, 256  # 38 MB of fp32 weights; its largest tensor 0.5 MB


@pytest.fixture(scope="module")
def deep_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deep")
    # one conversion first, of another file: the libraries it imports are not counted below
    conversion.converted(tiny_gguf(folder / "tiny.gguf"), folder / "warm")
    return tiny_gguf(folder / "deep.gguf", layers=LAYERS, hidden=HIDDEN)


def test_a_conversion_holds_about_one_tensor_in_fp32_not_the_model(deep_gguf, tmp_path):
    sizes = [4 * int(t.n_elements) for t in GGUFReader(deep_gguf).tensors]  # each tensor in fp32
    tracemalloc.start()
    try:
        folder = conversion.converted(deep_gguf, tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # numpy's arrays (gguf-py's dequantizing, transformers' tensor processor) are traced; before,
    # transformers kept every tensor's fp32 copy until the model was built: peak > sum(sizes)
    assert peak < sum(sizes) / 4, (peak, sum(sizes))
    assert peak < 12 * max(sizes), (peak, max(sizes))
    # and what it wrote is plain safetensors: the norms in fp32, the matrices only as their blocks
    weights = load_file(str(folder / conversion.WEIGHTS_FILE))
    norms = [4 * int(t.n_elements) for t in GGUFReader(deep_gguf).tensors if t.name.endswith("norm.weight")]
    assert sum(t.nbytes for t in weights.values()) == sum(norms)


def test_a_start_holds_each_quantized_matrix_only_while_the_runner_packs_it_then_trims_the_heap(
    deep_gguf, tmp_path, monkeypatch
):
    model = load(str(deep_gguf), tmp_path)
    assert isinstance(model.blocks, conversion.BlockFile)
    total = sum(b.q.nbytes for b in (model.blocks[n] for n in model.blocks))
    alive, most = [0], [0]
    read = conversion.BlockFile.__getitem__

    def counted(blocks, name):
        b = read(blocks, name)
        alive[0] += b.q.nbytes
        most[0] = max(most[0], alive[0])
        weakref.finalize(b.q, lambda n=b.q.nbytes: alive.__setitem__(0, alive[0] - n))
        return b

    monkeypatch.setattr(conversion.BlockFile, "__getitem__", counted)
    released = []  # the heap's freed pages handed back: when no matrix from the file is left
    monkeypatch.setattr(decoder, "release_freed_heap", lambda: released.append(alive[0]) or resources._malloc_trim())
    config = EngineConfig(model=str(deep_gguf), cache_dir=tmp_path, device="cpu", kv_cache_memory="4MiB", threads=1)
    runner = ModelRunner.build(config, model)
    gc.collect()
    assert runner.weight_bytes > 0 and most[0] > 0
    # a layer's matrices at most (q, k and v fused; gate and up), never the model's, while `model` lives
    assert most[0] <= total / 4, (most[0], total)
    assert alive[0] == 0  # none left once packed
    assert released == [0]
    assert resources.release_freed_heap()  # glibc's malloc_trim, on this Linux


def test_a_file_written_tensor_by_tensor_is_safetensors_own(tmp_path):
    tensors = {
        "scales": torch.randn(3, 5).half(),  # 30 bytes: the next float32 needs padding
        "w": torch.randn(4, 7),
        "q": torch.arange(-5, 6, dtype=torch.int8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "bf16": torch.randn(6).bfloat16(),
    }
    for room_for in (len(tensors), 0):  # the header in the room left for it, or moved in front after
        path = tmp_path / f"t{room_for}.safetensors"
        writer = tensor_file.TensorWriter(path, room_for)
        for name, t in tensors.items():
            writer.add(name, t)
        writer.close({"blocks": "x" * 5000 if room_for == 0 else "{}"})
        read, reader = load_file(str(path)), tensor_file.TensorReader(path)
        assert reader.keys() == set(tensors)  # padding is not a tensor
        assert set(read) - set(tensors) <= {k for k in read if k.startswith(tensor_file.PADDING)}
        for name, t in tensors.items():
            assert read[name].dtype == reader.get(name).dtype == t.dtype
            assert torch.equal(read[name], t) and torch.equal(reader.get(name), t), name
        assert reader.metadata["blocks"].startswith("x" if room_for == 0 else "{")


def test_a_cut_blocks_file_fails_the_start_naming_it(tmp_path):
    gguf = tiny_gguf(tmp_path / "tiny.gguf")
    folder = conversion.converted(gguf, tmp_path)
    blocks = folder / conversion.BLOCKS_FILE
    blocks.write_bytes(blocks.read_bytes()[:-100])
    with pytest.raises(SettingError, match=f"cannot read {conversion.BLOCKS_FILE}: ValueError: .* cut short"):
        load(str(gguf), tmp_path)


def test_a_conversion_removes_the_folders_of_a_file_that_changed_or_is_gone(tmp_path):
    """Each reinstall of a model's package (a new venv, a fresh clone) converted its file into one
    more folder of the cache and left the last one: 660 MB for the embedded model every time."""
    models = tmp_path / "cache" / "models"
    for name in "abc":
        (tmp_path / name).mkdir()
    first = conversion.converted(tiny_gguf(tmp_path / "a" / "tiny.gguf"), tmp_path / "cache")
    other = conversion.converted(tiny_gguf(tmp_path / "b" / "other.gguf"), tmp_path / "cache")
    kept = conversion.converted(tiny_gguf(tmp_path / "c" / "kept.gguf"), tmp_path / "cache")
    unknown = models / "made-by-an-older-braid-0123456789ab"  # records no source: never judged
    unknown.mkdir()
    (tmp_path / "b" / "other.gguf").unlink()  # its package uninstalled
    again = tiny_gguf(tmp_path / "a" / "tiny.gguf")  # the same path, written again: a new key
    second = conversion.converted(again, tmp_path / "cache")
    assert second != first and (second / "config.json").is_file()
    assert sorted(p.name for p in models.iterdir()) == sorted([second.name, kept.name, unknown.name])
    assert not other.exists()
    assert conversion.converted(again, tmp_path / "cache") == second  # read, not made again
