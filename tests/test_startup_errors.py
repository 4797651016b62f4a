"""A start that cannot go on says why in one line and exits non-zero: a model, device or port braid
cannot use. Never a traceback. (Bad flags and environment variables, refused with `braid serve`'s
usage before anything starts, are checked in process: tests/unit/test_cli.py.)"""

from __future__ import annotations

import shutil
import socket
import subprocess

import pytest

from braid_testing.process import run_braid
from conftest import free_port


braid = run_braid


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def assert_one_line(out: subprocess.CompletedProcess, *wanted: str) -> str:
    """A start-up failure: exit 1, and one line on stderr holding every wanted piece."""
    assert out.returncode == 1, out.stderr
    assert len(lines(out.stderr)) == 1 and "Traceback" not in out.stderr, out.stderr
    line = lines(out.stderr)[0]
    assert line.startswith("braid: error: ") and all(w in line for w in wanted), line
    return line


def test_a_model_path_that_does_not_exist(tmp_path):
    assert_one_line(
        braid("serve", "--model", str(tmp_path / "nope")), f"--model {tmp_path / 'nope'}", "no such file or directory"
    )


def test_a_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    assert_one_line(braid("serve", "--model", str(tmp_path)), f"--model {tmp_path}", "not a model folder")


def test_a_checkpoint_missing_a_tensor(tiny_dir, tmp_path):
    """transformers loads it with the tensor at its random initial values, and a warning; braid
    refuses it in one line naming the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(tiny_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert_one_line(
        braid("serve", "--model", str(folder), "--port", "0"),
        "incomplete",
        "model.layers.1.mlp.down_proj.weight is not in the file",
    )


def _spoil(folder, how: str) -> None:
    """Damages a copy of the tiny model as a hostile or broken download would."""
    import json
    import struct

    if how == "tokenizer not UTF-8":
        (folder / "tokenizer.json").write_bytes(b'\xff\xfe{"version"')
    elif how == "config field of the wrong type":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    else:  # the weights: a tensor's shape past its bytes, or the file cut in half
        path = folder / "model.safetensors"
        data = path.read_bytes()
        if how == "weights truncated":
            path.write_bytes(data[: len(data) // 2])
            return
        size = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + size])
        name = next(k for k in header if k != "__metadata__")
        header[name]["shape"][0] *= 2
        raw = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size :])


@pytest.mark.parametrize(
    "how, file",
    [
        ("tokenizer not UTF-8", "tokenizer.json"),
        ("config field of the wrong type", "config.json"),
        ("weights shape past their bytes", "model.safetensors"),
        ("weights truncated", "model.safetensors"),
    ],
)
def test_a_damaged_model_file_is_named_in_the_one_line(tiny_dir, tmp_path, how, file):
    # These said a bare "UnicodeDecodeError: ..." or "SafetensorError: ...", naming no file.
    import shutil

    folder = tmp_path / "damaged"
    shutil.copytree(tiny_dir, folder)
    _spoil(folder, how)
    assert_one_line(braid("serve", "--model", str(folder), "--port", "0"), f"--model {folder}: cannot read", file)


def test_a_truncated_gguf_file_is_named_in_the_one_line(tmp_path):
    # It said "ValueError: cannot reshape array of size 1214336 into shape (49152,612)".
    from braid.server.model.loader import embedded_gguf

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(embedded_gguf().read_bytes()[:3_000_000])
    out = braid("serve", "--model", str(cut), "--port", "0", "--cache-dir", str(tmp_path / "cache"))
    # the log says the conversion began; the failure is the one line after it
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines(out.stderr)[-1].startswith(f"braid: error: --model {cut}: cannot read cut.gguf: "), out.stderr


def test_a_hub_id_the_hub_cannot_provide():
    closed = f"http://127.0.0.1:{free_port()}"
    hub = {"HF_ENDPOINT": closed, "HF_HOME": "/nonexistent-hf-home", "HF_HUB_OFFLINE": "0"}  # (conftest sets it)
    out = braid("serve", "--model", "someorg/somemodel", env=hub)
    assert_one_line(out, "--model someorg/somemodel", "hub cannot provide it", closed)


def test_a_device_this_machine_does_not_have():
    assert_one_line(braid("serve", "--device", "cuda:99"), "--device cuda:99")


def test_a_tls_file_that_does_not_exist(tiny_dir, tmp_path):
    missing = tmp_path / "cert.pem"
    assert_one_line(
        braid("serve", "--model", str(tiny_dir), "--port", "0", "--tls-cert", str(missing), "--tls-key", str(missing)),
        f"--tls-cert {missing}",
        "no such file",
    )


@pytest.fixture(scope="module")
def unloadable_dir(tiny_dir, tmp_path_factory):
    """The tiny model with weights no loader can read: a server that loads it fails saying so."""
    folder = tmp_path_factory.mktemp("unloadable")
    shutil.copytree(tiny_dir, folder, dirs_exist_ok=True)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    assert_one_line(braid("serve", "--model", str(folder), "--port", "0", "--threads", "1"), "model.safetensors")
    return folder


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--http-port"])
def test_a_port_in_use_fails_before_the_model_loads(unloadable_dir, flag):
    # The model's weights cannot be read, so the port's refusal shows the ports are bound before
    # the model loads (a bound on the time taken said so before, and failed on a loaded machine).
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        ports = {
            "--port": str(free_port()),
            "--metrics-port": str(free_port()),
            "--http-port": str(free_port()),
            flag: str(busy),
        }
        out = braid(
            "serve",
            "--model",
            str(unloadable_dir),
            "--host",
            "127.0.0.1",
            "--threads",
            "1",
            *[item for pair in ports.items() for item in pair],
        )
    assert_one_line(out, f"{flag} {busy}", f"127.0.0.1:{busy}", "address already in use")
