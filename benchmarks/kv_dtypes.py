"""What each KV-cache dtype (--kv-cache-dtype) costs and gives, on the embedded model, in process:

- quality: mean KL divergence and same-top-token rate of each dtype's logits against float32 rows
  with an fp32 cache, over the first 512 positions of tests/data/perplexity.txt (one prompt pass
  each; as llama.cpp's `llama-perplexity --kl-divergence` measures a quantized model against its
  F32), under float32 rows (only the cache differs: its own cost) and int8 rows (the server's
  default rows: with q8_0, the default as a whole);
- bytes per token of the cache;
- decode speed: the median time of a decode pass of 1 and 16 rows over a shared context of 1,024 and
  4,096 tokens (one prompt prefilled once, its pages shared by every row as prefix sharing does, each
  row's new token in a page of its own; runner.run, no engine and no gRPC), the dtypes timed in
  turn, a pass each, so that a shared machine's slow spells fall on all alike.

    .venv/bin/python benchmarks/kv_dtypes.py                 # both parts
    .venv/bin/python benchmarks/kv_dtypes.py --skip-speed    # quality and bytes only

docs/benchmarks.md ("The KV cache's dtype") quotes it; it chose --kv-cache-dtype auto's q8_0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

from braid.server.model.loader import default_cache_dir, load  # noqa: E402
from braid.server.runner.kv_cache import KV_DTYPES, KVCache  # noqa: E402
from braid.server.runner.model_runner import ModelRunner  # noqa: E402
from braid.server.runner.rows import Row, Sampling  # noqa: E402
from braid_testing.perplexity import divergence, prompt_logits  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16", "q8_0")


def runner(model, dtype: str, activations: str, num_pages: int, max_seq_len: int) -> ModelRunner:
    return ModelRunner(
        model,
        torch.device("cpu"),
        torch.float32,
        num_pages=num_pages,
        max_seq_len=max_seq_len,
        kv_dtype=KV_DTYPES[dtype],
        activations=activations,
    )


def quality(model) -> None:
    """Each rows' and cache's logits against float32 rows with an fp32 cache: the base llama.cpp's
    `--kl-divergence` measures a quantized file against (its F32). With float32 rows only the cache
    differs; with int8 rows (the default) the line is what the server's default costs in all."""
    ids = model.hf_tokenizer((REPO / "tests" / "data" / "perplexity.txt").read_text())["input_ids"][:512]
    base = prompt_logits(runner(model, "float32", "float32", 64, 2048), ids)
    for activations in ("float32", "int8"):
        for dtype in DTYPES[activations == "float32" :]:
            kld, top = divergence(base, prompt_logits(runner(model, dtype, activations, 64, 2048), ids))
            print(
                f"{activations} rows, {dtype} KV against float32 rows, float32 KV: mean KLD {kld:.6f}, same top {top:.2%}"
            )


def speed(model, dtypes: tuple[str, ...], passes: int) -> None:
    """Decode passes of each dtype in turn, one pass each per round, so that a busy machine's
    slow spells fall on every dtype alike; the median of `passes` rounds."""
    runners = {d: runner(model, d, "auto", 600, 8192) for d in dtypes}
    page_size = next(iter(runners.values())).page_size
    for context in (1024, 4096):
        shared = list(range(context // page_size))
        ids = [(i * 7919) % 40000 + 100 for i in range(context)]
        for r in runners.values():
            r.run(
                [Row(pages=shared, start=0, token_ids=ids, sample=False, sampling=Sampling(), rng=None, is_prompt=True)]
            )
        for rows in (1, 16):
            batch = [
                Row(
                    pages=[*shared, 550 + b],
                    start=context,
                    token_ids=[42 + b],
                    sample=True,
                    sampling=Sampling(),
                    rng=None,
                )
                for b in range(rows)
            ]
            times: dict[str, list[float]] = {d: [] for d in dtypes}
            for r in runners.values():
                r.run(batch)  # warm
            for _ in range(passes):
                for dtype, r in runners.items():
                    started = time.perf_counter()
                    r.run(batch)
                    times[dtype].append(time.perf_counter() - started)
            base = statistics.median(times[dtypes[0]])
            for dtype in dtypes:
                median = statistics.median(times[dtype])
                print(
                    f"{dtype:8s} KV, context {context:5d}, {rows:2d} rows: {median * 1e3:7.2f} ms a pass, "
                    f"{rows / median:6.1f} tok/s, {base / median:.2f}x {dtypes[0]}'s"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-speed", action="store_true", help="quality and bytes only")
    parser.add_argument("--skip-quality", action="store_true", help="bytes and speed only")
    parser.add_argument(
        "--speed-dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="the caches timed, in turn"
    )
    parser.add_argument("--passes", type=int, default=15, help="decode passes timed per case (the median is shown)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load(None, default_cache_dir())
    decoder = runner(model, "float32", "auto", 4, 64).decoder
    for dtype in DTYPES:
        size = KVCache.bytes_per_token(decoder.num_layers, decoder.num_kv_heads, decoder.head_dim, KV_DTYPES[dtype])
        print(f"{dtype:8s} KV: {size} bytes a token")
    if not args.skip_quality:
        quality(model)
    if not args.skip_speed:
        speed(model, tuple(args.speed_dtypes), args.passes)


if __name__ == "__main__":
    main()
