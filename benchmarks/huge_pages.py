"""A token's matmuls with the packed weights in transparent huge pages against 4 KiB pages.

The matrices of a Q4_K_M file of the 1B (or another benchmarks/format_models.py) shape, each its own
copy so that every token reads them from memory as a decode step does; the same packed bytes twice:
as PackedLinear keeps them (packing.in_huge_pages: a huge-page boundary, the whole huge pages advised
and collapsed) and as a plain torch copy (4 KiB pages where the system's THP setting is "madvise" or
"never"). The two sets take turns; medians of --repeats, and the outputs compared bit for bit.

    .venv/bin/python benchmarks/huge_pages.py [--shape 1b|3b|8b|qwen3-1.7b] [--threads 2] [--rows 1] [--repeats 11]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from braid.server.resources import huge_page_size
from braid.server.runner.kernels import extension, pick
from format_models import SHAPES
from gemm_formats import matrix


def token_matrices(shape: str) -> list[tuple[str, int, int, int]]:
    """(format, in, out, how many): the matrices a token of the shape's Q4_K_M file reads, the head last,
    with llama-quantize's choice for Q4_K_M: Q4_K, but the head and the v and down projections of the
    layers its use_more_bits picks (the first and last eighth, and every third between) in Q6_K."""
    sizes = SHAPES[shape].sizes
    hidden, layers = sizes["hidden_size"], sizes["num_hidden_layers"]
    d = sizes.get("head_dim", hidden // sizes["num_attention_heads"])
    q, kv, inter = sizes["num_attention_heads"] * d, sizes["num_key_value_heads"] * d, sizes["intermediate_size"]
    more = sum(i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2 for i in range(layers))
    rows = [
        ("q4_k", hidden, q + kv, layers),  # q and k
        ("q6_k", hidden, kv, more),  # v
        ("q4_k", hidden, kv, layers - more),
        ("q4_k", q, hidden, layers),  # o
        ("q4_k", hidden, 2 * inter, layers),  # gate and up
        ("q6_k", inter, hidden, more),  # down
        ("q4_k", inter, hidden, layers - more),
        ("q6_k", hidden, sizes["vocab_size"], 1),  # the head
    ]
    return [row for row in rows if row[3]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="1b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = pick.pick_ops(torch.device("cpu"), torch.float32, activations="int8")
    sets: dict[str, list] = {"huge pages": [], "4 KiB pages": []}
    for fmt, k, n, count in token_matrices(args.shape):
        weight = matrix(fmt, k, n)
        for _ in range(count):
            layer = ops.linear(weight, None)
            sets["huge pages"].append((k, n, layer.code, layer.weight, layer.huge_bytes))
            sets["4 KiB pages"].append((k, n, layer.code, layer.weight.clone(), 0))
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"THP: {thp.read_text().strip() if thp.exists() else 'none'}; huge page {huge_page_size() >> 20} MiB")
    for name, layers in sets.items():
        held, total = sum(m[4] for m in layers), sum(m[3].nbytes for m in layers)
        print(f"{name}: {total / 1e6:.0f} MB, {held / 1e6:.0f} MB of them in huge pages as counted")
    xs = {k: torch.randn(args.rows, k) for k in {m[0] for m in sets["huge pages"]}}
    ys = {name: [torch.empty(args.rows, m[1]) for m in layers] for name, layers in sets.items()}
    times: dict[str, list[float]] = {name: [] for name in sets}
    for repeat in range(args.repeats + 1):
        for name, layers in sets.items():
            start = time.perf_counter()
            for (k, n, code, weight, _), y in zip(layers, ys[name]):
                x = xs[k]
                extension._cpu_kernels.gemm(
                    x.data_ptr(), k, weight.data_ptr(), code, y.data_ptr(), n, args.rows, k, n, 0, None, args.threads
                )
            if repeat:  # the first turn warms up
                times[name].append(time.perf_counter() - start)
    total = sum(m[3].nbytes for m in sets["huge pages"])
    for name in sets:
        median = statistics.median(times[name])
        print(f"{name}: {median * 1e3:.1f} ms a token ({total / median / 1e9:.1f} GB/s)")
    same = all(torch.equal(a, b) for a, b in zip(*ys.values()))
    ratio = statistics.median(times["huge pages"]) / statistics.median(times["4 KiB pages"])
    print(f"huge / 4 KiB pages: {ratio:.3f}x; outputs {'the same bits' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
