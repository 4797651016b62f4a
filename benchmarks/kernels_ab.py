"""Two builds of braid's C kernels against each other in one process: the embedded model's own packed
matrices (layer 0's and the LM head), each matmul at every --rows, then whole passes of one
sequence with k proposals (ModelRunner.run), the two builds taken in turns. One thread by default,
timed as the calling thread's CPU time: what neighbours on a shared machine change least. Each output
of a matmul is compared between the builds (the kernel contract: the same bits).

    cp server/braid/server/runner/_cpu_kernels*.so /tmp/before.so   # the build to compare against
    (change the kernels, build again)
    .venv/bin/python benchmarks/kernels_ab.py --before /tmp/before.so [--rows 1,2,6] [--passes]

--model (a GGUF file or folder) times another model's matrices and passes; --threads N > 1 times
them on N threads by the wall clock (the calling thread's CPU time no longer counts the work).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import time

import torch

from braid.server.config import EngineConfig
from braid.server.model.loader import default_cache_dir, load
from braid.server.runner.kernels import packing, step
from braid.server.runner.model_runner import ModelRunner
from proposal_rows import prefilled, verification

CLOCK = time.thread_time  # time.perf_counter with --threads above 1
THREADS = 1  # --threads


def load_build(name: str, path: str):
    """The extension module at path, under its own name: a second copy beside the imported one."""
    loader = importlib.machinery.ExtensionFileLoader(f"{name}._cpu_kernels", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(loader.name, path, loader=loader))
    loader.exec_module(module)
    return module


def gemm(build, linear, x: torch.Tensor, y: torch.Tensor) -> None:
    """y = x @ W by the given build: a matrix of parts (PackedParts: a Q4_K_M q/k/v) part by part."""
    for part, columns in linear.by_part(y):
        bias = None if part.bias is None else part.bias.data_ptr()
        build.gemm(
            x.data_ptr(),
            x.stride(0),
            part.weight.data_ptr(),
            part.code,
            columns.data_ptr(),
            columns.stride(0),
            x.shape[0],
            part.in_features,
            part.out_features,
            0,
            bias,
            THREADS,
        )


def matmuls(builds: dict, runner: ModelRunner, rows: list[int], repeats: int) -> None:
    layer, decoder = runner.decoder.layers[0], runner.decoder
    print("| matrix | rows | before, us | after, us | after / before | bits |")
    print("|---|---:|---:|---:|---:|---|")
    for name, linear in (
        ("qkv", layer.qkv),
        ("o", layer.o),
        ("gate_up", layer.gate_up),
        ("down", layer.down),
        ("lm_head", decoder.lm_head),
    ):
        for m in rows:
            x = torch.randn(m, linear.in_features)
            ys = {side: torch.empty(m, linear.out_features) for side in builds}
            start = CLOCK()
            gemm(builds["after"], linear, x, ys["after"])
            calls = max(3, int(0.05 / max(CLOCK() - start, 1e-6)))
            times = {side: [] for side in builds}
            for _ in range(repeats):
                for side, build in builds.items():
                    start = CLOCK()
                    for _ in range(calls):
                        gemm(build, linear, x, ys[side])
                    times[side].append((CLOCK() - start) / calls)
            before, after = (statistics.median(times[side]) * 1e6 for side in ("before", "after"))
            same = "same" if torch.equal(ys["before"], ys["after"]) else "DIFFER"
            shape = f"{linear.in_features}x{linear.out_features}"
            print(f"| {name} {shape} | {m} | {before:.1f} | {after:.1f} | {after / before:.3f} | {same} |", flush=True)


def passes(builds: dict, runner: ModelRunner, contexts: list[int], ks: list[int], repeats: int) -> None:
    imported = packing._cpu_kernels
    print("\n| context | k | before, ms | / its k = 0 | after, ms | / its k = 0 | after / before |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in contexts:
        context, pages = prefilled(runner, n, max(ks))
        rows = {k: verification(context, pages, k) for k in ks}
        times = {(side, k): [] for side in builds for k in ks}
        for turn in range(repeats + 2):  # the first two turns warm up
            for side, build in builds.items():
                step._cpu_kernels = packing._cpu_kernels = build
                for k in ks:
                    start = CLOCK()
                    runner.run([rows[k]])
                    if turn >= 2:
                        times[side, k].append(CLOCK() - start)
        step._cpu_kernels = packing._cpu_kernels = imported
        ms = {key: statistics.median(value) * 1e3 for key, value in times.items()}
        for k in ks:
            before, after = ms["before", k], ms["after", k]
            print(
                f"| {n} | {k} | {before:.2f} | {before / ms['before', ks[0]]:.2f} | {after:.2f} | "
                f"{after / ms['after', ks[0]]:.2f} | {after / before:.3f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the build to compare against (an _cpu_kernels .so)")
    parser.add_argument("--after", help="the other build (default: the one braid imports)")
    parser.add_argument("--rows", default="1,2,3,6,16", help="rows of each matmul")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--passes", action="store_true", help="whole passes too")
    parser.add_argument("--context", default="150,600", help="positions in the cache before a pass")
    parser.add_argument("--proposals", default="0,5", help="values of k (the first is the ratios' base)")
    parser.add_argument("--model", help="a GGUF file or folder (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=1, help="above 1: timed by the wall clock")
    args = parser.parse_args()
    global CLOCK, THREADS
    THREADS, CLOCK = args.threads, time.thread_time if args.threads == 1 else time.perf_counter
    torch.set_num_threads(THREADS)
    runner = ModelRunner.build(EngineConfig(threads=THREADS), load(args.model, default_cache_dir()))
    runner.governor = None  # the same threads throughout
    isa = packing._cpu_kernels.isa()
    after = load_build("after", args.after) if args.after else packing._cpu_kernels
    builds = {"before": load_build("before", args.before), "after": after}
    for build in builds.values():
        build.select_isa(isa)
    clock = "1 thread, CPU time" if THREADS == 1 else f"{THREADS} threads, wall time"
    print(f"{isa} build, {clock}, medians of {args.repeats}, the builds in turns\n")
    matmuls(builds, runner, [int(r) for r in args.rows.split(",")], args.repeats)
    if args.passes:
        contexts = [int(c) for c in args.context.split(",")]
        passes(builds, runner, contexts, [int(k) for k in args.proposals.split(",")], args.repeats)


if __name__ == "__main__":
    main()
