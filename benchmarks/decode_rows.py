"""One decode pass of the embedded model in process, at 16 rows and at 1, for each --activations
and plain fp32 weights: the median and the best of --passes, without gRPC or the engine, so that
a shared machine's noise shows less than in an end-to-end run. Ratios are against the first side.

    .venv/bin/python benchmarks/decode_rows.py [--rows 16 1] [--passes 40] [--threads 2]
    .venv/bin/python benchmarks/decode_rows.py --sides bf16-rows bf16 fp32    # bf16 weights: bf16 rows or fp32
    .venv/bin/python benchmarks/decode_rows.py --model 1b --sides q8_0-int8 q8_0 bf16-rows bf16 --rows 16 1

--model 1b is format_models.py's random model of Llama-3.2-1B's shape (bf16; made once, ~2.5 GB).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from braid.server.model.loader import default_cache_dir, load
from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import Row, Sampling

SIDES = {
    "int8": dict(activations="int8"),
    "float32": dict(activations="float32"),
    "fp32": dict(activations="float32", quantization="none"),
    "bf16-rows": dict(activations="bf16", weight_dtype="bfloat16", quantization="none"),
    "bf16": dict(activations="float32", weight_dtype="bfloat16", quantization="none"),
    "q8_0-int8": dict(activations="int8", quantization="q8_0"),
    "q8_0": dict(activations="float32", quantization="q8_0"),
}
PAGES = 8  # pages of 16 per row: room for a 40-token prompt and the passes


def prefill(runner: ModelRunner, rows: int) -> list[list[int]]:
    """Each row's 40-token prompt in its own pages; returns the rows' page tables."""
    tables = [list(range(b * PAGES, (b + 1) * PAGES)) for b in range(rows)]
    for b, table in enumerate(tables):
        runner.run(
            [
                Row(
                    pages=table,
                    start=0,
                    token_ids=[(13 * i + b) % 1000 + 5 for i in range(40)],
                    sample=False,
                    sampling=Sampling(),
                    rng=None,
                    is_prompt=True,
                )
            ]
        )
    return tables


def one_pass(runner: ModelRunner, tables: list[list[int]], step: int) -> float:
    """Seconds of the step-th decode pass of the rows prefill made (step < 88: the rows' pages)."""
    batch = runner.pack(
        [
            Row(pages=table, start=40 + step, token_ids=[100 + step], sample=True, sampling=Sampling(), rng=None)
            for table in tables
        ]
    ).batch
    start = time.perf_counter()
    runner.decoder.forward(batch, runner.cache)
    return time.perf_counter() - start


def pass_times(runner: ModelRunner, rows: int, passes: int) -> list[float]:
    tables = prefill(runner, rows)
    return [one_pass(runner, tables, step) for step in range(passes)]


def model_path(name: str) -> str | None:
    """--model's path for load: None for the embedded model."""
    if name == "embedded":
        return None
    if name == "1b":
        import format_models

        return str(format_models.llama_1b_folder(format_models.smollm_fp32_folder()))
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[16, 1])
    parser.add_argument("--passes", type=int, default=40)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=list(SIDES),
        default=["int8", "float32", "fp32"],
        help="int8 / float32: the model's own formats on int8 or float32 rows; fp32: fp32 weights; "
        "bf16-rows / bf16: bf16 weights on bf16 or float32 rows; q8_0-int8 / q8_0: weights "
        "quantized to Q8_0 at load, on int8 or float32 rows",
    )
    parser.add_argument("--model", default="embedded", help="embedded, 1b (the random 1B shape) or a folder")
    args = parser.parse_args()
    sides = {side: SIDES[side] for side in args.sides}
    first = args.sides[0]
    torch.set_num_threads(args.threads)
    model = load(model_path(args.model), default_cache_dir())
    print(
        f"{args.threads} threads; ms per decode pass, median (best) of {args.passes}, the sides' passes taken in turn"
    )
    others = args.sides[1:]
    print("| rows | " + " | ".join(sides) + "".join(f" | {side} / {first}" for side in others) + " |")
    print("|---:|" + "---:|" * (len(sides) + len(others)))
    runners = {
        side: ModelRunner(
            model, torch.device("cpu"), torch.float32, num_pages=PAGES * max(args.rows), max_seq_len=2048, **flags
        )
        for side, flags in sides.items()
    }
    for rows in args.rows:
        tables = {side: prefill(runner, rows) for side, runner in runners.items()}
        times: dict[str, list[float]] = {side: [] for side in sides}
        for step in range(args.passes):  # in turn, so that a noisy moment costs every side alike
            for side, runner in runners.items():
                times[side].append(one_pass(runner, tables[side], step))
        median = {side: statistics.median(t) for side, t in times.items()}
        cells = [f"{median[side] * 1e3:.1f} ({min(times[side]) * 1e3:.1f})" for side in sides]
        print(
            f"| {rows} | "
            + " | ".join(cells)
            + "".join(f" | {median[side] / median[first]:.2f}" for side in others)
            + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
