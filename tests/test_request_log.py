"""What braid logs, read as an operator reads it: one line per finished request, lines at start-up
saying what is on, the shutdown signals, how long a model took to convert and load; as text or as
JSON. Never a prompt or a generated text."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from braid_testing import zygote
from braid_testing.process import BRAID, run_braid
from conftest import LONG, SLOW, free_port, tiny_server, wait_for


def request_lines(log: Path) -> dict[str, str]:
    """The request log's lines by request id."""
    found = {}
    for line in log.read_text().splitlines():
        if " Stream request_id=" in line:
            fields = dict(item.split("=", 1) for item in line.split(" Stream ", 1)[1].split())
            found[fields["request_id"]] = fields
    return found


@pytest.fixture(scope="module")
def logged(tiny_dir, tmp_path_factory):
    """A server whose output goes to `logged.log_file`, with metrics, a KV cache size and an API key
    set (what its start-up lines say), shared by the module's tests of one server's log."""
    log, metrics_port = tmp_path_factory.mktemp("logged") / "server.log", free_port()
    server = tiny_server(
        tiny_dir,
        "--mode",
        "continuous",
        "--metrics-port",
        str(metrics_port),
        "--kv-cache-memory",
        "64MiB",
        log_path=log,
        env={**SLOW, "BRAID_API_KEY": "k"},
    )
    server.log_file, server.metrics_port = log, metrics_port
    yield server
    server.stop()


def test_the_start_says_what_is_on(logged):
    # (the lines after "braid serving" may follow the health check's SERVING by a moment)
    text = wait_for(lambda: "API key: " in (t := logged.log_file.read_text()) and t)
    assert f"metrics: on, http://127.0.0.1:{logged.metrics_port}/metrics" in text
    assert "OTLP: off" in text and "TLS: off" in text and "API key: on" in text
    assert "KV cache: " in text and " pages of 16 tokens (" in text
    assert "loaded " in text


def test_every_finished_stream_is_one_line_with_its_figures_never_its_text(logged):
    """(Its last check reads the whole log once the server has stopped: so it stops the module's server.)"""
    log = logged.log_file
    try:
        with logged.client() as client:
            done = client.generate("secret-marker-4711", max_new_tokens=8, ignore_eos=True)
            with pytest.raises(grpc.RpcError):
                list(client.stream("secret-marker-4712", top_p=7.0, request_id="refused"))
            held = client.stream("secret-marker-4713", request_id="walked-away", **LONG)
            next(iter(held))
            held.cancel()
            wait_for(lambda: "walked-away" in request_lines(log))
    finally:
        logged.stop()
    lines = request_lines(log)
    ok = lines[done.final.request_id]  # named by the server, logged under the same id
    assert ok["peer"].startswith("ipv4:127.0.0.1:") and ok["mode"] == "continuous"
    assert (ok["status"], ok["finish"], ok["generated_tokens"]) == ("OK", "max_tokens", "8")
    assert ok["prompt_tokens"] == str(done.usage.prompt_tokens) and ok["cached_tokens"] == "0"
    assert all(float(ok[k]) > 0 for k in ("ttft_ms", "tok_s", "total_ms")) and float(ok["queue_ms"]) >= 0
    assert (lines["refused"]["status"], lines["refused"]["finish"]) == ("INVALID_ARGUMENT", "-")
    assert lines["walked-away"]["status"] == "CANCELLED" and int(lines["walked-away"]["generated_tokens"]) > 0
    text = log.read_text()
    assert "braid serving" in text and "braid stopped" in text
    assert "secret-marker" not in text and done.text not in text


def test_json_log_lines_carry_the_request_figures_as_numbers(tiny_dir, tmp_path):
    log = tmp_path / "server.log"
    server = tiny_server(tiny_dir, log_path=log, env={"BRAID_LOG_FORMAT": "json"})
    try:
        with server.client() as client:
            samples = client.stream("hello", max_new_tokens=4, ignore_eos=True, n=2)
            list(samples)
    finally:
        server.stop()
    records = [json.loads(line) for line in log.read_text().splitlines()]  # every line is JSON
    assert {"time", "level", "logger", "message"} <= set(records[0])
    request = next(r for r in records if r.get("request_id") == samples.request_id)
    assert request["level"] == "INFO" and request["status"] == "OK" and request["samples"] == 2
    assert request["generated_tokens"] == 8 and isinstance(request["tok_s"], float)


def test_sigterm_is_logged_and_a_second_signal_exits_at_once(tiny_dir, tmp_path):
    log = tmp_path / "server.log"
    server = tiny_server(tiny_dir, "--grace-period", "60", log_path=log, env=SLOW)
    client = server.client()
    try:
        stream = client.stream("hold", **LONG)
        next(iter(stream))
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "SIGTERM received: draining, 1 sessions in flight" in log.read_text())
        server.proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        assert server.proc.wait(timeout=10) == 128 + signal.SIGINT
        assert time.monotonic() - started < 5  # not the 60 s grace period
        assert "SIGINT received again: exiting now" in log.read_text()
    finally:
        client.close()
        server.stop()


# ---- converting and loading a model ----------------------------------------------------------------


def tiny_gguf(path: Path, layers: int = 2, hidden: int = 64) -> Path:
    """A GGUF file of a tiny random Llama (Q8_0 matrices) with a 261-token byte-level vocabulary:
    converted in seconds, where the embedded model takes a minute. 4 heads, 2 KV heads, an MLP
    twice the hidden size."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "Ġt", "he"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(hidden // 4)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def matrix(name: str, rows: int, cols: int) -> None:
        values = (rng.standard_normal((rows, cols)) * 0.3).astype(np.float32)
        writer.add_tensor(name, quants.quantize(values, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)

    matrix("token_embd.weight", len(tokens), hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, rows, cols in (
            ("attn_q", hidden, hidden),
            ("attn_k", hidden // 2, hidden),
            ("attn_v", hidden // 2, hidden),
            ("attn_output", hidden, hidden),
            ("ffn_gate", 2 * hidden, hidden),
            ("ffn_up", 2 * hidden, hidden),
            ("ffn_down", hidden, 2 * hidden),
        ):
            matrix(f"blk.{i}.{name}.weight", rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def warmup_args(gguf_file: Path, cache: Path) -> list[str]:
    return ["warmup", "--model", str(gguf_file), "--cache-dir", str(cache)]


def test_in_a_log_a_conversion_is_lines_not_bars(gguf_file, tmp_path):
    out = run_braid(*warmup_args(gguf_file, tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr
    assert "\r" not in out.stderr and "it/s" not in out.stderr, out.stderr  # no tqdm bar, braid's or a library's
    assert "converted tiny.gguf in " in out.stderr and "loaded tiny in " in out.stderr, out.stderr


def test_on_a_terminal_a_conversion_has_one_bar_across_its_steps(gguf_file, tmp_path):
    main, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a width to draw in
    argv = warmup_args(gguf_file, tmp_path)
    with open(os.devnull, "wb") as devnull:  # forked from the zygote where it can be, as the servers are
        proc = zygote.spawn(argv, dict(os.environ), devnull.fileno(), terminal) or subprocess.Popen(
            [str(BRAID), *argv], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=terminal
        )
    os.close(terminal)
    shown = b""
    while chunk := _read(main):
        shown += chunk
    assert proc.wait(timeout=300) == 0, shown
    text = shown.decode(errors="replace")
    assert "converting tiny.gguf (tokenizer)" in text and "converting tiny.gguf (weights)" in text, text
    assert "Converting and de-quantizing" not in text and "Loading weights" not in text, text  # transformers' own
    assert "converted tiny.gguf in " in text


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except OSError:  # the terminal's other end closed
        return b""
