"""make gpu-check's benchmark (issue 18): braid's bf16 CUDA path on a randomly initialised model of
Llama-3.2-1B's shape, against the issue's two CUDA targets, in its own section of docs/benchmarks.md:

- one stream decodes at least 50% as fast as memory bandwidth allows: 1 / TPOT against the GPU's
  bandwidth over the bytes a decode step reads (every weight once, and the KV cache so far);
- 64 streams at once give at least 5x one stream's output tok/s.

One `braid serve --mode continuous --device cuda` (bf16 by default) runs one stream, the benchmark's
targets workload (16 at once, for the record) and 64 at once, as bench.py measures them (greedy,
ignore_eos, 64 new tokens, from the gRPC client). The model is built in a temporary folder, in bf16,
with the embedded SmolLM2's tokenizer: its 49,152 ids are all rows of the model's 128,256-row
embedding, so only the vocabulary's size differs, and the output head reads all 128,256 rows.

    .venv/bin/python benchmarks/gpu_check.py                        # after the tests, in make gpu-check
    .venv/bin/python benchmarks/gpu_check.py --bandwidth-gbs 1555   # a GPU the table below lacks
    .venv/bin/python benchmarks/gpu_check.py --device cpu --shape tiny --output /tmp/gpu.md --repeats 1

`--device cpu --shape tiny` runs the whole flow on a CPU (a 2-layer Llama of the same vocabulary and
RoPE; the bound from the measured read bandwidth) and judges nothing: it checks the script, not braid.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import bench
import braid_server
import drive
import format_models
import formats_report
import machine
import report
import workloads

STREAMS = 64
SYSTEM = report.braid("continuous")
HEADING = report.GPU_CHECK_HEADING
# Llama-3.2-1B's config: format_models' shape with the real vocabulary and llama3 RoPE scaling.
LLAMA_3_2_1B = {
    **format_models.LLAMA_1B_SHAPE,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
SHAPES = {
    "llama-3.2-1b": LLAMA_3_2_1B,
    "tiny": {
        **LLAMA_3_2_1B,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
}
# Memory bandwidth in GB/s by a part of torch.cuda.get_device_name(), from the vendors' datasheets; the
# first match counts, so a name that contains another comes first (L40S before L4, A100 before A10).
BANDWIDTH_GBS = (
    ("H200", 4800),
    ("H100 NVL", 3900),
    ("H100 PCIe", 2000),
    ("H100", 3350),
    ("A100-SXM4-80GB", 2039),
    ("A100 80GB PCIe", 1935),
    ("A100", 1555),
    ("L40S", 864),
    ("L40", 864),
    ("L4", 300),
    ("A10G", 600),
    ("A10", 600),
    ("T4", 320),
    ("V100", 900),
    ("RTX 4090", 1008),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="braid serve --device: cuda, cuda:N, or cpu (the flow only)")
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b", help="the model's shape")
    parser.add_argument(
        "--bandwidth-gbs",
        type=float,
        help="the device's memory bandwidth (default: the GPU's from a table; a CPU's, measured)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each workload (the median counts)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the server's CPU threads")
    parser.add_argument(
        "--output",
        type=Path,
        help=f"the page whose section {HEADING!r} is written (default on CUDA: docs/benchmarks.md; on a CPU: none)",
    )
    parser.add_argument("--check-device", action="store_true", help="only check that --device is there")
    return parser.parse_args(argv)


def cuda_missing(device: str) -> str | None:
    """Why `device` cannot run on this machine, in one line; None where it can."""
    import torch

    if not device.startswith("cuda") or torch.cuda.is_available():
        return None
    gpu_here = any(Path("/dev").glob("nvidia[0-9]*"))
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build" + (
            "; this machine has an NVIDIA GPU: `make clean install` takes torch's CUDA build from PyPI"
            if gpu_here
            else ", and no NVIDIA GPU is visible here (no /dev/nvidia*)"
        )
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU (nvidia-smi says why)"


def build_model(folder: Path, shape: str, device: str) -> dict:
    """A random model of `shape` (fixed seed) saved in bf16 into folder with the embedded model's
    tokenizer; its config as a dict. Initialised on `device`: seconds on a GPU, minutes on a CPU."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(format_models.SEED)
    config = LlamaConfig(**SHAPES[shape], architectures=["LlamaForCausalLM"])
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(folder)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the server needs the memory, not this process
    tokenizer_folder = format_models.smollm_fp32_folder()
    for name in format_models.TOKENIZER_FILES:
        if (tokenizer_folder / name).is_file():
            (folder / name).write_bytes((tokenizer_folder / name).read_bytes())
    size = len(AutoTokenizer.from_pretrained(folder))
    if size > config.vocab_size:
        raise SystemExit(f"the tokenizer has {size} tokens, more than the model's {config.vocab_size} rows")
    return config.to_dict()


def gpu_name(device: str) -> str:
    """ "NVIDIA H100 80GB HBM3, 79.1 GiB, CUDA 12.8"; "none" for the CPU."""
    if device == "cpu":
        return "none"
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    return f"{props.name}, {props.total_memory / 2**30:.1f} GiB, CUDA {torch.version.cuda}"


def bandwidth(args) -> tuple[float | None, str]:
    """The device's memory bandwidth in GB/s, and where the figure comes from."""
    if args.bandwidth_gbs:
        return args.bandwidth_gbs, "--bandwidth-gbs"
    if args.device == "cpu":
        return machine.read_bandwidth_gbs(args.threads), f"measured, {args.threads} threads reading"
    name = gpu_name(args.device).split(",")[0]
    known = next((gbs for part, gbs in BANDWIDTH_GBS if part in name), None)
    return known, f"{name}'s datasheet" if known else f"{name} is not in gpu_check.py's table: give --bandwidth-gbs"


def select(tokenizer, repeats: int) -> list[workloads.Workload]:
    """One stream, the benchmark's targets workload, and STREAMS streams at once."""
    standard = workloads.build(tokenizer, repeats=repeats)
    many = workloads.PromptMaker(tokenizer, seed=workloads.SEED + STREAMS).batch(STREAMS, 30, 60)
    return [
        standard["single"],
        standard["targets"],
        workloads.Workload(
            f"streams-{STREAMS}", f"{STREAMS} at once, prompts 30-60 tokens", many, STREAMS, repeats=repeats
        ),
    ]


async def measure(args, model_dir: Path, results: report.Results) -> dict:
    """Runs every workload against one server; returns its ModelInfo's figures."""
    from transformers import AutoTokenizer

    selected = select(AutoTokenizer.from_pretrained(model_dir), args.repeats)
    results.titles = {w.name: w.title for w in selected}
    log_path = Path(tempfile.gettempdir()) / "braid-gpu-check.log"
    bench.log(f"{SYSTEM}: starting the server on {args.device} (log: {log_path})")
    async with braid_server.running(
        "continuous",
        threads=args.threads,
        max_batch_size=STREAMS,
        log_path=log_path,
        extra_args=["--model", str(model_dir), "--device", args.device, "--kv-cache-memory", "2GiB"],
    ) as (client, pid):
        info = await client.model_info()
        send = braid_server.sender(client)
        for workload in reversed(selected):  # every batch size's first-call costs (allocation, kernels)
            await braid_server.warm_up(send, workload.requests)
        for workload in selected:
            results.add(await bench.measure(SYSTEM, workload, lambda w=workload: drive.run(w, send), [pid]))
    return {
        "dtype": info.dtype,
        "kv_cache_dtype": info.kv_cache_dtype,
        "kernels": info.kernels,
        "device": info.device,
        "parameters": info.parameters,
    }


def targets(
    results: report.Results, config: dict, bandwidth_gbs: float | None, judged: bool
) -> tuple[list[report.Ratio], str]:
    """The two targets as report.Ratio rows, and how the bound was reached."""
    import torch

    from braid.server.runner.kv_cache import KVCache

    single, many = results.find(SYSTEM, "single"), results.find(SYSTEM, f"streams-{STREAMS}")
    decode_tok_s = 1000 / single.tpot_p50_ms
    # A decode step reads every weight once and the KV cache of the positions before it: on average
    # the prompt and half the new tokens.
    context = single.prompt_tokens + workloads.NEW_TOKENS / 2
    kv_bytes = context * KVCache.bytes_per_token(
        config["num_hidden_layers"],
        config["num_key_value_heads"],
        config["head_dim"],
        getattr(torch, results.settings["kv_cache_dtype"]),
    )
    step_bytes = results.settings["weight_bytes"] + kv_bytes
    bound = formats_report.bound_tok_s(bandwidth_gbs, step_bytes) if bandwidth_gbs else None
    share = decode_tok_s / bound if bound else None
    ratio = many.tokens_per_s / single.tokens_per_s
    rows = [
        report.Ratio(
            "one stream: decode tok/s (1 / TPOT p50) ÷ the bandwidth bound",
            share,
            "≥ 0.5",
            share >= 0.5 if judged and share is not None else None,
        ),
        report.Ratio(f"{STREAMS} streams ÷ one stream, output tok/s", ratio, "≥ 5", ratio >= 5 if judged else None),
    ]
    how = (
        f"One stream decodes {decode_tok_s:,.1f} tok/s. A step reads {step_bytes / 1e9:.3f} GB: "
        f"{results.settings['weight_bytes'] / 1e9:.3f} GB of weights and {kv_bytes / 1e6:.1f} MB of KV cache "
        f"(the mean context, {context:.0f} tokens); at {results.machine['bandwidth']} that bounds one stream at "
        + (f"{bound:,.1f} tok/s." if bound else "(unknown: no bandwidth).")
    )
    return rows, how


def describe(config: dict, parameters: int) -> str:
    """The model's shape in a few words: "16 layers, hidden 2048, 32 query and 8 KV heads of 64, ..."."""
    c = config
    rope = (c.get("rope_parameters") or {}).get("rope_type", "default")
    return (
        f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} query and "
        f"{c['num_key_value_heads']} KV heads of {c['head_dim']}, MLP {c['intermediate_size']}, vocabulary "
        f"{c['vocab_size']:,}, {'tied' if c['tie_word_embeddings'] else 'untied'} embeddings, {rope} RoPE: "
        f"{parameters / 1e6:,.0f} M parameters"
    )


def markdown(results: report.Results, config: dict, rows: list[report.Ratio], how: str, judged: bool) -> str:
    s = results.settings
    verdict = (
        ""
        if judged
        else ("\n\nA run on a CPU (`--device cpu`): it checks gpu_check.py's flow, and its figures judge nothing.")
    )
    return f"""{HEADING}

Written by `make gpu-check` (the parity and mode tests on `--device cuda`, then benchmarks/gpu_check.py;
`GPU_CHECK_ARGS="--bandwidth-gbs N"` for a GPU its table lacks) on {results.started}, braid
`{results.machine["braid_commit"]}`. `braid serve --mode continuous --device {s["device"]}` ({s["dtype"]},
KV cache {s["kv_cache_dtype"]}, kernels: {s["kernels"]}) serves a random model of the shape
`{s["shape"]}` ({describe(config, s["parameters"])}), saved in bf16, with SmolLM2's tokenizer. braid's gRPC
client drives it: greedy, ignore_eos, {workloads.NEW_TOKENS} new tokens per request; a workload's figures are
{"one run's" if s["repeats"] == 1 else f"the median of {s['repeats']} runs"}.{verdict}

{report.ratio_table(rows, issue=18)}

{how}

{report.tables(results)}

{report.machine_table(results.machine)}
"""


def run(args) -> tuple[report.Results, dict, float | None]:
    """Builds the model, measures it; the results, the model's config and the bandwidth."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    results = report.Results(
        machine.describe(args.threads).as_dict(), {"device": args.device, "shape": args.shape, "repeats": args.repeats}
    )
    results.machine["GPU"] = gpu_name(args.device)
    bandwidth_gbs, source = bandwidth(args)
    results.machine["bandwidth"] = f"{bandwidth_gbs:,.0f} GB/s ({source})" if bandwidth_gbs else source
    with tempfile.TemporaryDirectory(prefix="braid-gpu-check-") as folder:
        bench.log(f"building a random {args.shape} model in {folder}")
        config = build_model(Path(folder), args.shape, args.device)
        results.settings["weight_bytes"] = format_models.weight_bytes(Path(folder))
        results.settings |= asyncio.run(measure(args, Path(folder), results))
    results.save(bench.RESULTS_DIR / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return results, config, bandwidth_gbs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if why := cuda_missing(args.device):
        sys.exit(f"make gpu-check needs a CUDA device: {why}")
    if args.check_device:
        return 0
    started = time.monotonic()
    judged = args.device != "cpu"
    results, config, bandwidth_gbs = run(args)
    rows, how = targets(results, config, bandwidth_gbs, judged)
    text = markdown(results, config, rows, how, judged)
    print("\n" + text)
    output = args.output or (bench.DOCS / "benchmarks.md" if judged else None)
    if output is not None:
        report.write_section(output, HEADING, text)
        bench.log(f"wrote the section {HEADING!r} of {output}")
    missed = [r.label for r in rows if r.met is not True]
    bench.log(
        f"gpu-check took {time.monotonic() - started:.0f} s; "
        + (
            "the figures judge nothing on a CPU"
            if not judged
            else f"targets not met: {'; '.join(missed)}"
            if missed
            else "both CUDA targets are met"
        )
    )
    return 1 if judged and missed else 0


if __name__ == "__main__":
    sys.exit(main())
