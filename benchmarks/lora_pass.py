"""One decode pass with LoRA adapters, in process (issue 30): where benchmarks/lora.py's ratios come
from, without a server, a client or the scheduler between the passes. The embedded model (Q4_1) on
braid's C kernels, --activations int8, four random rank-16 adapters made by PEFT on every projection.

For 1 row (one adapter) and 16 rows (4 per adapter), each pass timed, the kinds in turn:
- base, one C call: no adapter, every layer in one call (csrc/decode_step.c);
- base, layer by layer: no adapter, a Python call per kernel;
- adapters, layer by layer: the deltas as torch matmuls per run of rows (the path before the one
  call took them);
- adapters, one C call: the deltas inside the decode step.
It first checks that both adapter paths give the same greedy tokens. Besides each pass's wall time, the
process's CPU time in it (every thread's): on a machine shared with other jobs, a pass's wall time
takes in the slices those jobs ran, its CPU time only what it did (and its threads' spinning at the
barriers); with --threads 1 the CPU time is the work, whatever the load. --one-call leaves out the
layer-by-layer kinds.

    .venv/bin/python benchmarks/lora_pass.py [--threads 2] [--repeats 30] [--one-call] [--adapter-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from braid.server.model.loader import default_cache_dir, load, resolve
from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import Row, Sampling

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / d) for d in ("tests", "tests/support")]
from lora_files import make_adapter  # noqa: E402

PROMPT = list(range(100, 140))
PAGES = 8  # a row's pages


def rows(n: int, adapters: list[int], decode: bool) -> list[Row]:
    """n rows, row b in pages of its own with adapters[b % len(adapters)]: the prompt, or one token after it."""
    return [
        Row(
            pages=list(range(b * PAGES, (b + 1) * PAGES)),
            start=len(PROMPT) if decode else 0,
            token_ids=[7 + b] if decode else PROMPT,
            sample=True,
            sampling=Sampling(),
            rng=None,
            is_prompt=not decode,
            adapter=adapters[b % len(adapters)],
        )
        for b in range(n)
    ]


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    base = Path(resolve(None, default_cache_dir())[1])
    runner = ModelRunner(
        load(None, default_cache_dir()),
        torch.device("cpu"),
        torch.float32,
        num_pages=16 * PAGES,
        max_seq_len=2048,
        activations="int8",
    )
    decoder = runner.decoder
    with tempfile.TemporaryDirectory(prefix="braid-lora-pass-") as root:
        for i in range(4):
            folder = make_adapter(base, Path(root) / f"a{i}", rank=16, seed=i, spread=0.02, dtype=args.adapter_dtype)
            runner.load_adapter(i + 1, f"a{i}", str(folder), 64)

    def forward(batch_rows: list[Row], one_call: bool) -> tuple[torch.Tensor, float, float]:
        batch = runner.pack(batch_rows).batch
        decoder.one_call = one_call
        try:
            start, cpu = time.perf_counter(), time.process_time()
            logits = decoder.forward(batch, runner.cache)
            return logits, time.perf_counter() - start, time.process_time() - cpu
        finally:
            decoder.one_call = True

    forward(rows(16, [0], False), True)  # the prompts into the cache
    kinds = {}
    for n, adapters in ((1, [1]), (16, [1, 2, 3, 4])):
        same = torch.equal(
            forward(rows(n, adapters, True), False)[0].argmax(-1), forward(rows(n, adapters, True), True)[0].argmax(-1)
        )
        print(f"{n} rows: the same greedy tokens on both adapter paths: {same}")
        kinds |= {
            (n, "base, one C call"): (rows(n, [0], True), True),
            (n, "base, layer by layer"): (rows(n, [0], True), False),
            (n, "adapters, layer by layer"): (rows(n, adapters, True), False),
            (n, "adapters, one C call"): (rows(n, adapters, True), True),
        }
    if args.one_call:
        kinds = {kind: value for kind, value in kinds.items() if value[1]}
    times: dict[tuple[int, str], list[float]] = {kind: [] for kind in kinds}
    cpu: dict[tuple[int, str], list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.repeats):
        for kind, (batch_rows, one_call) in kinds.items():
            _, wall, used = forward(batch_rows, one_call)
            times[kind].append(wall)
            cpu[kind].append(used)
    print(f"{args.threads} threads; ms a pass, median (best) of {args.repeats}; CPU ms in it, median:")
    for (n, kind), values in times.items():
        print(
            f"  {n:2d} rows, {kind}: {statistics.median(values) * 1e3:.2f} ({min(values) * 1e3:.2f}); "
            f"CPU {statistics.median(cpu[n, kind]) * 1e3:.2f}"
        )
    for n in (1, 16):
        for name, values in (("wall", times), ("CPU", cpu)):
            base = statistics.median(values[n, "base, one C call"])
            ratios = [
                f"adapters {how} {base / statistics.median(values[n, f'adapters, {how}']):.3f}x"
                for how in ("layer by layer", "one C call")
                if (n, f"adapters, {how}") in values
            ]
            print(f"  {n:2d} rows, speed against the base's one call ({name} medians): {', '.join(ratios)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--one-call", action="store_true", help="only the one-C-call kinds")
    parser.add_argument(
        "--adapter-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the dtype the adapters are saved in (bfloat16: the C step reads them in half the bytes)",
    )
    main(parser.parse_args())
