"""What sampling a step's rows costs, on the embedded model's real next-token logits, in process: the
sampler as it is (each row drawn from its 256 most likely tokens where its cut ends there) against
every row sorted whole (what it did before 293ebe0), interleaved, medians.

    .venv/bin/python benchmarks/sampling.py [--rows 16 32] [--repeats 12] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from braid.server.model.loader import default_cache_dir, load
from braid.server.runner import sampler
from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import Row, Sampling, prompt_row

SETTINGS = {
    "T 0.8, top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "T 0.7, top_p 0.9, top_k 50": dict(temperature=0.7, top_p=0.9, top_k=50),
    "T 1.0": dict(temperature=1.0),
    "greedy": dict(),
}


def real_logits(count: int) -> torch.Tensor:
    """[count, V]: the embedded model's logits at the first positions of tests/data/perplexity.txt."""
    from pathlib import Path

    model = load(None, default_cache_dir())
    text = (Path(__file__).parent.parent / "tests" / "data" / "perplexity.txt").read_text()
    ids = model.hf_tokenizer(text)["input_ids"][:count]
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, num_pages=64, max_seq_len=2048)
    batch = runner.pack([prompt_row(ids)]).batch
    batch.logit_rows = torch.arange(count)
    with torch.no_grad():
        return runner.decoder.forward(batch, runner.cache).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[16, 32])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = real_logits(max(args.rows))
    candidates = sampler.CANDIDATES
    print(f"{args.threads} threads; ms per sample() call, medians of {args.repeats}, interleaved")
    print("| setting | rows | every row sorted whole | as it is | whole / as it is |")
    print("|---|---:|---:|---:|---:|")
    for name, params in SETTINGS.items():
        for rows in args.rows:
            times: dict[int, list[float]] = {logits.shape[1]: [], candidates: []}
            for _ in range(args.repeats):
                for count in times:
                    sampler.CANDIDATES = count
                    seeded = [Sampling(seed=seed, **params) for seed in range(rows)]
                    batch = [
                        Row(pages=[0], start=0, token_ids=[1], sample=True, sampling=s, rng=sampler.random_state(s))
                        for s in seeded
                    ]
                    start = time.perf_counter()
                    sampler.sample(logits[:rows].clone(), batch)
                    times[count].append(time.perf_counter() - start)
            sampler.CANDIDATES = candidates
            whole, now = (statistics.median(t) * 1e3 for t in times.values())
            print(f"| {name} | {rows} | {whole:.1f} | {now:.1f} | {whole / now:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
