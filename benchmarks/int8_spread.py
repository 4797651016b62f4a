"""How much int8 rows' quality figure moves under last-bit changes (issue 40), on the embedded model,
in process, one thread:

- the spread: tests/test_precision.py's measure (mean KL divergence and same-top-token rate of int8
  rows against float32 rows, fp32 cache, over the first 512 positions of tests/data/perplexity.txt),
  for int8 rows as they are and for `--draws` passes whose embeddings were each moved by one ulp
  (every element, up or down at random, a seed a pass: a change as small as another build's or
  another attention kernel's last bits), with an fp32 and with a q8_0 KV cache (the default);
- the cascade (--cascade): for one such nudge, layer by layer, how many of the int8 quants of each
  layer's q/k/v input round differently from the unnudged pass's, and in how many rows.

    .venv/bin/python benchmarks/int8_spread.py --draws 40   # ~3 s a pass
    .venv/bin/python benchmarks/int8_spread.py --draws 0 --cascade

docs/benchmarks.md ("int8 rows' figure is one draw") quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

from braid.server.model.loader import default_cache_dir, load  # noqa: E402
from braid.server.runner.kernels.step import DecodeStep  # noqa: E402
from braid.server.runner.model_runner import ModelRunner  # noqa: E402
from braid.server.runner.rows import prompt_row  # noqa: E402
from braid_testing.perplexity import divergence, nudge_, nudged_logits, prompt_logits  # noqa: E402
from kv_dtypes import runner as kv_runner  # noqa: E402  (this folder's)

POSITIONS = 512
BOUND = {"kld": 0.0045, "same_top": 0.945}  # tests/test_precision.py's LLAMA_CPP_Q4_1


def runner(model, activations: str, kv_dtype: str = "float32") -> ModelRunner:
    """A CPU runner for one prompt pass of POSITIONS tokens (kv_dtypes.py's)."""
    return kv_runner(model, kv_dtype, activations, POSITIONS // 16, POSITIONS)


def spread(model, ids: list[int], draws: int) -> None:
    base = prompt_logits(runner(model, "float32"), ids)
    for kv_dtype in ("float32", "q8_0"):
        r = runner(model, "int8", kv_dtype)
        kld, top = divergence(base, prompt_logits(r, ids))
        print(f"int8 rows, {kv_dtype} KV, as they are: mean KLD {kld:.5f}, same top {top:.2%}")
        if not draws:
            continue
        figures = [divergence(base, nudged_logits(r, ids, seed)) for seed in range(draws)]
        klds, tops = sorted(k for k, _ in figures), sorted(t for _, t in figures)
        at = lambda v, q: v[round(q * (len(v) - 1))]  # noqa: E731
        print(
            f"  {draws} nudged: mean KLD min {klds[0]:.5f}, p10 {at(klds, 0.1):.5f}, median {statistics.median(klds):.5f}, "
            f"p90 {at(klds, 0.9):.5f}, max {klds[-1]:.5f} (sd {statistics.stdev(klds) if draws > 1 else 0:.5f}); "
            f"same top min {tops[0]:.2%}, median {statistics.median(tops):.2%}, max {tops[-1]:.2%}; "
            f"over the KLD bound {sum(k > BOUND['kld'] for k in klds)}, under the same-top bound "
            f"{sum(t < BOUND['same_top'] for t in tops)}, below as they are {sum(k < kld for k in klds)}"
        )


def layer_inputs(r: ModelRunner, ids: list[int], seed: int | None) -> list[torch.Tensor]:
    """Each layer's q/k/v input (its input norm's rows) over a prompt pass run one layer a C call (the
    same bits as the pass in one call), the embeddings nudged by seed (None: as they are)."""
    dec = r.decoder
    batch = r.pack([prompt_row(ids, page_size=r.page_size)]).batch
    tables, shared = batch.row_tables()
    x = dec._embed(batch.input_ids).contiguous()
    if seed is not None:
        nudge_(x, seed)
    inputs = []
    for i, w in enumerate(dec.layers):
        inputs.append(dec.ops.rms_norm(x, w.input_norm, dec.eps))
        k, v = r.cache.k[i : i + 1], r.cache.v[i : i + 1]
        step = DecodeStep(
            [w], dec.rope, dec.num_heads, dec.num_kv_heads, dec.head_dim, dec.eps, dec.scale, None, dec.activation, k, v
        )
        step(x, batch.positions, tables, None, shared)
    return inputs


def quants(h: torch.Tensor) -> torch.Tensor:
    """h [N, K]'s int8 quants as csrc/int8.c rounds them: per block of 32, round(x * 127 / max|x|)."""
    blocks = h.view(h.shape[0], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    return torch.round(blocks * torch.where(top > 0, 127.0 / top, 0.0)).view_as(h)


def cascade(model, ids: list[int]) -> None:
    r = runner(model, "int8")
    plain, nudged = layer_inputs(r, ids, None), layer_inputs(r, ids, 0)
    print(
        "one nudge (seed 0): int8 quants of each layer's q/k/v input that round differently, and the rows they are in"
    )
    for i, (a, b) in enumerate(zip(plain, nudged)):
        flipped = quants(a) != quants(b)
        share = flipped.float().mean().item()
        print(
            f"  layer {i:2d}: {int(flipped.sum()):7d} of {flipped.numel()} ({share:6.2%}) in {int(flipped.any(1).sum())} rows"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--draws", type=int, default=20, help="nudged passes per cache (0: only the figures as they are)"
    )
    parser.add_argument("--cascade", action="store_true", help="the flips layer by layer for one nudge")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load(None, default_cache_dir())
    ids = model.hf_tokenizer((REPO / "tests" / "data" / "perplexity.txt").read_text())["input_ids"][:POSITIONS]
    with torch.no_grad():
        spread(model, ids, args.draws)
        if args.cascade:
            cascade(model, ids)


if __name__ == "__main__":
    main()
