"""A GGUF file's quantized matrices are kept once, as its blocks (issue 40): its converted folder holds
no fp32 copy of them (an 8B Q4_K_M file's held 32 GB), the loaded transformers model holds none
(they are on the meta device), and every path that needs one in float dequantizes it from its blocks
to the values transformers reads from the file. The tokens are those of the fp32 copy braid held
before, in every configuration."""

from __future__ import annotations

import pytest
import torch
from test_request_log import tiny_gguf  # a tiny Llama's GGUF file, every matrix Q8_0

from braid.server.config import SettingError
from braid.server.model import conversion
from braid.server.model.loader import LoadedModel, default_cache_dir, float_model, load
from braid.server.model.tensor_file import TensorReader, TensorWriter
from conftest import _reference_model
from in_process import generate, load_model


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_a_converted_folder_holds_each_block_matrix_once_as_its_blocks(gguf, tmp_path):
    folder = conversion.converted(gguf, tmp_path)
    floats = TensorReader(folder / conversion.WEIGHTS_FILE).keys()
    blocks = set(conversion.BlockFile(folder / conversion.BLOCKS_FILE))
    assert blocks and not floats & blocks  # before: every matrix in both files
    assert floats and all(name.endswith("norm.weight") for name in floats), floats
    assert not (folder / "model.safetensors").exists()  # transformers refuses the folder, never loads it half random


def _formats_gguf(folder, formats: str):
    """A tiny Llama's GGUF file with its layers' matrices in `formats` (its embedding in Q8_0)."""
    from gguf import GGMLQuantizationType
    from gguf_files import write_gguf
    from test_architectures import _tiny_for_gguf

    shape = dict(hidden_size=256, intermediate_size=512) if "k" in formats else {}  # K-quants: rows of 256
    model, vocab = _tiny_for_gguf("llama", **shape)
    layers = tuple(GGMLQuantizationType[f.upper()] for f in formats.split("+"))
    return write_gguf(model, folder / "tiny.gguf", vocab, layer_formats=layers)


def test_the_blocks_file_holds_the_gguf_files_own_bytes(tmp_path):
    """Q8_0, Q4_0 and Q4_1 blocks at rest take the file's bytes, no more (4-bit quants two to a byte)."""
    from gguf import GGUFReader

    gguf = _formats_gguf(tmp_path, "q4_0+q4_1")
    folder = conversion.converted(gguf, tmp_path)
    reader = TensorReader(folder / conversion.BLOCKS_FILE)
    held = sum(reader.get(name).nbytes for name in reader.keys())
    assert held == sum(
        int(t.n_bytes) for t in GGUFReader(gguf).tensors if t.tensor_type.name in ("Q8_0", "Q4_0", "Q4_1")
    )


@pytest.mark.parametrize("formats", ["q8_0", "q4_0+q4_1", "q4_k+q6_k"])
def test_a_loaded_gguf_holds_no_float_copy_of_its_block_matrices(gguf, tmp_path, formats):
    """The block matrices are on the meta device (no memory, never initialised); float_model fills
    them with exactly the values transformers' own GGUF loading gives."""
    from transformers import AutoModelForCausalLM

    if formats != "q8_0":
        gguf = _formats_gguf(tmp_path, formats)
    model = load(str(gguf), tmp_path)
    assert set(model.blocks) and {model.formats[n] for n in model.blocks} == set(formats.split("+")) | {"q8_0"}
    params = dict(model.hf_model.named_parameters())
    assert {n for n, p in params.items() if p.is_meta} == set(model.blocks)
    assert all(not p.is_meta for n, p in params.items() if n not in model.blocks)
    dense = float_model(model)
    assert not any(p.is_meta for p in dense.parameters())
    assert any(p.is_meta for p in model.hf_model.parameters())  # a copy: the loaded model keeps none
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    expected = reference.state_dict()
    for name, value in dense.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_a_converted_folder_missing_a_tensor_is_refused_in_one_line(gguf, tmp_path):
    """A tensor in neither file (a damaged folder) is refused as a checkpoint's is, never left
    on the meta device or at random values."""
    folder = conversion.converted(gguf, tmp_path)
    floats = folder / conversion.WEIGHTS_FILE
    reader = TensorReader(floats)
    kept = {n: reader.get(n) for n in reader.keys() if n != "model.layers.1.post_attention_layernorm.weight"}
    writer = TensorWriter(floats, len(kept))
    for name, tensor in kept.items():
        writer.add(name, tensor)
    writer.close()
    with pytest.raises(SettingError, match="incomplete: model.layers.1.post_attention_layernorm.weight is not in"):
        load(str(gguf), tmp_path)


# the configurations whose tokens must not change: the default (int8 rows, the q8_0 KV cache),
# float32 rows, and plain fp32 (every matrix dequantized)
CONFIGS = {
    "default": {},
    "float32 rows": {"activations": "float32"},
    "plain fp32": {"dtype": "float32", "quantization": "none", "activations": "float32"},
}
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def embedded() -> LoadedModel:
    return load(None, default_cache_dir())


@pytest.fixture(scope="module")
def held(embedded, smol_dir) -> LoadedModel:
    """The embedded model with every block matrix also held in fp32, as braid loaded it before: its
    blocks and formats, and transformers' model of the same folder with them dequantized (float_model;
    the session's reference, conftest._reference_model, made once)."""
    return LoadedModel(**{**vars(embedded), "hf_model": _reference_model(smol_dir)})


@pytest.mark.parametrize("config", CONFIGS)
def test_the_embedded_models_tokens_are_those_of_its_fp32_copy(embedded, held, config):
    """Greedy tokens of the embedded model as loaded (block matrices only in their blocks) against
    the same model with every block matrix also held in fp32, as braid loaded it before: identical."""
    assert not any(p.is_meta for p in held.hf_model.parameters())
    requests = [dict(prompt=p, max_new_tokens=16, ignore_eos=True) for p in PROMPTS]
    now = generate(load_model(None, default_cache_dir(), loaded=embedded, **CONFIGS[config]), requests)
    before = generate(load_model(None, default_cache_dir(), loaded=held, **CONFIGS[config]), requests)
    assert [o.token_ids for o in now] == [o.token_ids for o in before]
    assert all(len(o.token_ids) == 16 for o in now)
