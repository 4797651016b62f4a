"""End to end with the embedded SmolLM2-135M-Instruct, served with no --model at all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from braid.v1 import generate_pb2 as pb
from conftest import DEVICE, compute_dtype

CLIENT = str(Path(sys.executable).parent / "braid-client")


def test_a_greedy_chat_answers_in_text(smol):
    """By default (--activations auto: int8 rows for the Q4_1/Q8_0 matrices) the answer to "What is
    the capital of France?" starts at a near-tie: float32 rows rank "The" at 25.33 and "L" at 25.24
    (0.3% apart), and int8 rows the other way round, so the default answers "L'Étoile, ..." where
    float32 rows answer Paris (tests/test_precision.py checks that one, with --activations float32)."""
    with smol.client() as client:
        done = client.generate(messages=[("user", "What is the capital of France?")], max_new_tokens=24)
        info = client.model_info()
    assert len(done.text.split()) >= 3
    assert done.finish_reason in ("EOS", "MAX_TOKENS")
    assert info.model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"  # its hub id (--served-model-name)
    assert info.architecture == "LlamaForCausalLM"
    assert info.vocab_size == 49152 and info.context_length >= 2048
    assert info.dtype == compute_dtype() and info.device == DEVICE
    assert info.mode == pb.SCHEDULING_MODE_CONTINUOUS and info.has_chat_template


def test_repetition_penalty_stops_a_loop(smol):
    prompt = "apple, apple, apple, apple, apple, apple,"
    with smol.client() as client:
        plain = client.generate(prompt, max_new_tokens=8, ignore_eos=True)
        penalised = client.generate(prompt, max_new_tokens=8, ignore_eos=True, repetition_penalty=3.0)
    assert "apple" in plain.text
    assert "apple" not in penalised.text


def test_presence_and_frequency_penalties_break_a_loop(smol):
    """OpenAI's penalties count generated tokens only: the model falls into a loop on its own output,
    and the penalties pull it out."""
    prompt = "apple, apple, apple, apple, apple, apple,"
    with smol.client() as client:
        plain = client.generate(prompt, max_new_tokens=16, ignore_eos=True)
        penalised = client.generate(
            prompt, max_new_tokens=16, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0
        )
    most = lambda ids: max(ids.count(t) for t in ids)  # noqa: E731
    assert most(penalised.token_ids) < most(plain.token_ids)


def test_cli_streams_a_chat_answer(smol):
    out = subprocess.run(
        [CLIENT, "--target", smol.target, "--chat", "--max-new-tokens", "48", "--stats", "Write a haiku about the sea"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) >= 5
    assert "finish_reason" in out.stderr
