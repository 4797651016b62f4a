"""The model runner: rows of new tokens in, one forward pass, next token ids out.

It never sees a session, a queue, a socket or a protobuf: the engine decides what runs and builds
the rows (runner/rows.py); the runner packs them into tensors, runs the decoder over its KV cache
and samples. It also owns what depends on the hardware: the device, torch's threads, and how many
KV-cache pages fit.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections import Counter
from typing import Iterator, Sequence

import torch
from braid.server import resources
from braid.server.config import EngineConfig
from braid.server.model.loader import LoadedModel
from braid.server.model.weights import FLOAT_FORMATS
from braid.server.runner.families import attention_window, native_family
from braid.server.runner.kernels.pick import pick_ops
from braid.server.runner.kv_cache import KV_DTYPES, KVCache, fit_pages, kv_dtype_name
from braid.server.runner.lora import Adapter, LoraPass, read_peft
from braid.server.runner.lora_gguf import read_gguf_lora
from braid.server.runner.batch import DecodeRows, ForwardBatch, PrefillChunk
from braid.server.runner.decoder import Decoder
from braid.server.runner.masks import Masks
from braid.server.runner.precision import DTYPES, Precision
from braid.server.runner.rows import AdapterInfo, Pooling, Row, Sampled, Sampling
from braid.server.runner.sampler import random_state, sample, score, verify
from braid.server.runner.threads import ThreadGovernor
from braid.server.runner.transformers_decoder import TransformersDecoder

_LOGGER = logging.getLogger(__name__)


def pick_device(device: str, dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """The device, and the dtype activations and the KV cache are computed in: float32 on a CPU
    (whatever the weights' format), --dtype on CUDA (auto: bfloat16)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if dev.type != "cuda":
        return dev, torch.float32
    return dev, DTYPES.get(dtype, torch.bfloat16)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread while the weights are packed: hundreds of small copies, each a parallel
    region that waits for all of torch's threads. Beside a busy process, a thread that finds no free
    core stalls every region: packing the embedded model took 9 to 28 s on two shared cores, against
    0.3 to 1.7 s on one thread (0.3 s either way on quiet cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _spin_setting() -> str:
    """How long libgomp's idle threads spin before they sleep (cli.py bounds it before torch loads)."""
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        if name in os.environ:
            return f"{name}={os.environ[name]}"
    return "libgomp's default (GOMP_SPINCOUNT=300000)"


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        device: torch.device,
        dtype: torch.dtype,
        num_pages: int,
        max_seq_len: int,
        allow_kernels: bool = True,
        weight_dtype: str = "auto",
        quantization: str = "auto",
        page_size: int = 16,
        kv_dtype: torch.dtype | None = None,
        activations: str = "float32",
    ) -> None:
        self.device, self.dtype = device, dtype
        self.max_seq_len = max_seq_len
        self.threads = torch.get_num_threads()  # the CPU pools' size (ModelInfo.threads)
        self.governor: ThreadGovernor | None = None  # set by build: fewer threads while the cores are shared
        self.num_parameters = sum(p.numel() for p in model.hf_model.parameters())
        family, why_not = native_family(model.hf_model)
        if family is not None:
            _LOGGER.info("model path: braid's native decoder (%s)", type(model.hf_model).__name__)
            ops = pick_ops(device, dtype, allow_kernels, activations)
            with _one_thread():
                precision = Precision(model, weight_dtype, quantization)
                self.decoder: Decoder | TransformersDecoder = Decoder(
                    model.hf_model, max_seq_len, ops, precision, family
                )
            # kernels: the C kernels' instruction set, or torch's ops
            self.path, self.kernels, self.quantization = "braid", ops.isa or "torch", quantization
            self.activations = self.decoder.activations
            formats, ops_name = precision.formats, ops.name
        else:
            _LOGGER.info(
                "model path: transformers (%s runs through its own forward: %s)", type(model.hf_model).__name__, why_not
            )
            if quantization == "q8_0":
                _LOGGER.warning("--quantization q8_0: the transformers path serves the weights as they are")
            self.decoder = TransformersDecoder(model.hf_model, device, dtype)
            self.path, self.kernels, self.quantization = "transformers", "torch", "none"
            self.activations = "float32"
            formats = Counter(FLOAT_FORMATS.get(p.dtype, str(p.dtype)) for p in model.hf_model.parameters())
            ops_name = "torch, in the model's own modules"
        self.cache = KVCache(
            self.decoder.num_layers,
            num_pages,
            self.decoder.num_kv_heads,
            page_size,
            self.decoder.head_dim,
            kv_dtype or dtype,
            device,
        )
        self.vocab_size = self.decoder.vocab_size
        self.masks = Masks(self.vocab_size)
        self._adapters: dict[int, Adapter] = {}  # resident LoRA adapters by load id (Row.adapter)

        self.weight_formats = dict(formats)  # tensors served in each format
        self.weight_bytes = self.decoder.weight_bytes
        _LOGGER.info(
            "kernels: %s; weights: %s, %.0f MB",
            ops_name,
            ", ".join(f"{n} {fmt}" for fmt, n in formats.most_common()),
            self.weight_bytes / 1e6,
        )

    @classmethod
    def build(cls, config: EngineConfig, model: LoadedModel) -> ModelRunner:
        """The runner --device, --dtype, --quantization, --activations, --threads, --kernels,
        --max-seq-len, --kv-cache-memory, --kv-page-size and --kv-cache-dtype ask for."""
        device, dtype = pick_device(config.device, config.dtype)
        threads = resources.threads(config.threads)
        torch.set_num_threads(threads.count)
        _LOGGER.info("threads: %d (%s); OpenMP waits: %s", threads.count, threads.reason, _spin_setting())
        context = getattr(model.hf_model.config, "max_position_embeddings", None) or 2048
        family, _ = native_family(model.hf_model)
        window = attention_window(family, model.hf_model.config) if family else None
        max_seq_len = min(config.max_seq_len, context, window or context)
        kv_dtype = KV_DTYPES.get(config.kv_cache_dtype, dtype)  # auto: the compute dtype
        num_pages = fit_pages(config, model.hf_model.config, max_seq_len, device, kv_dtype)
        runner = cls(
            model,
            device,
            dtype,
            num_pages,
            max_seq_len,
            allow_kernels=config.kernels == "auto",
            weight_dtype=config.dtype,
            quantization=config.quantization,
            page_size=config.kv_page_size,
            kv_dtype=kv_dtype,
            activations=config.activations,
        )
        # Only braid's kernels, whose results do not depend on the thread count; not under --threads.
        if config.threads == 0 and threads.count > 1 and device.type == "cpu" and runner.kernels != "torch":
            runner.governor = ThreadGovernor(threads.count)
        return runner

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def kv_dtype_name(self) -> str:
        return kv_dtype_name(self.cache.dtype)

    @property
    def embedding_dimensions(self) -> int:
        """Embeddings' size: the hidden size, on braid's decoder; 0 on the transformers path."""
        return int(self.decoder.final_norm.shape[0]) if isinstance(self.decoder, Decoder) else 0

    @property
    def num_pages(self) -> int:
        return self.cache.num_pages

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    @staticmethod
    def random_state(sampling: Sampling, skip: int = 0) -> object:
        """A sequence's random state for Row.rng, made once per sequence; `skip` draws already
        taken (a resumed stream's tokens: the sampler draws one number per token)."""
        return random_state(sampling, skip)

    def load_adapter(self, adapter_id: int, name: str, path: str, max_rank: int) -> AdapterInfo:
        """Reads a LoRA adapter (a PEFT folder, or a GGUF file: a path ending in .gguf) and makes it
        resident as `adapter_id` (Row.adapter). Raises ValueError, one line naming what is wrong, for
        a folder or file that is not a LoRA adapter of this model. Any thread: a pass running meanwhile keeps the stack it started with."""
        if not isinstance(self.decoder, Decoder):
            raise ValueError("LoRA adapters need braid's native decoder; this model runs through transformers")
        read = read_gguf_lora if path.endswith(".gguf") else read_peft
        adapter = read(
            path,
            name,
            self.decoder.lora_base,
            max_rank,
            self.dtype,
            self.device,
            round_bf16=self.activations != "float32",
        )
        self._adapters = {**self._adapters, adapter_id: adapter}
        _LOGGER.info(
            "LoRA adapter %s loaded from %s: rank %d, scale %g, %s; %.1f MB, read in %s",
            name,
            path,
            adapter.info.rank,
            adapter.info.scale,
            ", ".join(adapter.info.target_modules),
            adapter.nbytes / 1e6,
            "bf16" if adapter.bf16 else "fp32",
        )
        return adapter.info

    def unload_adapter(self, adapter_id: int) -> None:
        """Frees an adapter no row will name again."""
        self._adapters = {i: a for i, a in self._adapters.items() if i != adapter_id}

    def run(self, rows: Sequence[Row]) -> list[Sampled | None]:
        """One forward pass. Returns, per row, the sampled token (with its log probability where the
        row asks) and its targets' log probabilities, or None for a row that neither samples nor
        scores (a prompt chunk that does not reach the end of its prompt)."""
        batch, sampled, scored = self._build(rows)
        first = dict(zip(sampled, itertools.accumulate((1 + rows[i].num_proposals for i in sampled), initial=0)))
        plain = [i for i in sampled if not rows[i].num_proposals]
        verified = [i for i in sampled if rows[i].num_proposals]
        constrained = [k for k, i in enumerate(plain) if rows[i].matcher is not None]  # among `plain`
        filling = self.masks.start([rows[plain[k]].matcher for k in constrained])  # during the pass
        walks = {
            i: self.masks.start_walk(rows[i].matcher, rows[i].token_ids[-rows[i].num_proposals :])
            for i in verified
            if rows[i].matcher is not None
        }
        logits = self._forward(batch)  # [L, V], in batch.logit_rows order
        out: list[Sampled | None] = [None] * len(rows)
        if batch.pools:  # embedding rows: their pooled hidden states, and nothing else
            assert batch.pooled is not None
            for (i, *_), vector in zip(batch.pools, batch.pooled.cpu().tolist()):
                out[i] = Sampled(None, pooled=vector)
        if scored:  # the targets' rows come first; the sampled rows' logits are the rest
            for i, (begin, end) in scored.items():
                out[i] = Sampled(
                    None, targets=tuple(score(logits[begin:end], rows[i].targets, rows[i].sampling.num_logprobs or 0))
                )
            logits = logits[max(end for _, end in scored.values()) :]
        allowed = (constrained, self.masks.allowed(filling)) if filling is not None else None
        for i, token in zip(
            plain, sample(logits[[first[i] for i in plain]] if verified else logits, [rows[i] for i in plain], allowed)
        ):
            out[i] = token._replace(targets=out[i].targets) if out[i] else token
        for i in verified:
            k = rows[i].num_proposals
            masks = walks[i].result() if i in walks else None
            out[i] = verify(logits[first[i] : first[i] + k + 1], rows[i], masks)
        return out

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The decoder's pass, on the thread count the governor picks; decode-only passes are what it
        measures (runner/threads.py)."""
        if self.governor is None:
            return self.decoder.forward(batch, self.cache)
        shape = len(batch.input_ids) if not batch.prefills else None  # decode rows
        count = self.governor.pick(shape, time.monotonic()) if shape else self.governor.current
        if count != torch.get_num_threads():
            torch.set_num_threads(count)
        start = time.perf_counter()
        logits = self.decoder.forward(batch, self.cache)
        if shape:
            switches = self.governor.num_switches
            self.governor.record(shape, count, time.perf_counter() - start)
            if self.governor.num_switches != switches:
                _LOGGER.debug(
                    "threads: %d of %d, the faster for decode passes now", self.governor.current, self.threads
                )
        return logits

    def _build(self, rows: Sequence[Row]) -> tuple[ForwardBatch, list[int], dict[int, tuple[int, int]]]:
        """Packs prompt chunks first (rows with proposals among them), then one token per decoding
        row. Returns the batch, the indices of the rows that sample in the order of their logit rows
        (1 + num_proposals each), and the logit rows [begin, end) of each row with targets, which
        come before all of those. The rows that pool are batch.pools'."""
        if self.path != "braid" and any(r.pool is not None for r in rows):
            raise ValueError("embeddings need braid's native decoder; this model runs through transformers")
        # a speculating row's tokens go as decode rows of their own on braid's decoder (its decode
        # attention, the same numbers as plain steps), as a chunk on the transformers path
        is_prefill = [
            r.is_prompt or (len(r.token_ids) > 1 and not (r.num_proposals and self.path == "braid")) for r in rows
        ]
        # grouped by LoRA adapter (stable: without adapters the order is the rows'), so that each
        # adapter's tokens are a run of the packed batch (runner/lora.py)
        prefills = sorted((i for i, r in enumerate(rows) if is_prefill[i]), key=lambda i: rows[i].adapter)
        decodes = sorted((i for i, r in enumerate(rows) if not is_prefill[i]), key=lambda i: rows[i].adapter)
        ids: list[int] = []
        positions: list[int] = []
        token_pages: list[int] = []  # the page each packed token's key and value go to
        chunks: list[PrefillChunk] = []
        logit_rows: list[int] = []
        sampled: list[int] = []
        scored: dict[int, tuple[int, int]] = {}
        sample_at: list[int] = []  # the packed token each sampling row's logits come from
        adapters: list[int] = []  # each packed token's adapter (Row.adapter)
        pools: list[tuple[int, int, int, bool]] = []  # embedding rows' spans (ForwardBatch.pools)
        dev, page_size = self.device, self.cache.page_size
        for i in prefills + decodes:
            r = rows[i]
            end = r.start + len(r.token_ids)
            if is_prefill[i]:
                table = torch.tensor(r.pages[: -(-end // page_size)], dtype=torch.long, device=dev)
                chunks.append(PrefillChunk(pages=table, start=r.start, length=len(r.token_ids), offset=len(ids)))
            if r.targets:
                scored[i] = (len(logit_rows), len(logit_rows) + len(r.targets))
                logit_rows += range(len(ids), len(ids) + len(r.targets))
            if r.pool is not None:
                pools.append((i, len(ids), len(r.token_ids), r.pool is Pooling.MEAN))
            ids += r.token_ids
            adapters += [r.adapter] * len(r.token_ids)
            positions += range(r.start, end)
            token_pages += [r.pages[p // page_size] for p in range(r.start, end)]
            if r.sample:  # a row with proposals samples after each of them too
                sample_at += range(len(ids) - 1 - r.num_proposals, len(ids))
                sampled.append(i)
        position_tensor = torch.tensor(positions, dtype=torch.long, device=dev)
        # [N * KVH]: the row of the cache viewed as [-1, D] each token's key of each head goes to
        offsets = (
            torch.tensor(token_pages, dtype=torch.long, device=dev) * self.decoder.num_kv_heads * page_size
            + position_tensor % page_size
        )
        heads = torch.arange(self.decoder.num_kv_heads, device=dev) * page_size
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=position_tensor,
            kv_index=(offsets.unsqueeze(1) + heads.unsqueeze(0)).flatten(),
            prefills=chunks,
            decode=self._decode_rows([rows[i] for i in decodes]) if decodes else None,
            logit_rows=torch.tensor(logit_rows + sample_at, dtype=torch.long, device=dev),
            lora=self._lora_pass(adapters),
            pools=pools,
        )
        return batch, sampled, scored

    def _lora_pass(self, adapters: list[int]) -> LoraPass | None:
        """The pass's LoRA deltas: each run of packed tokens with the same adapter (_build groups
        them), or None where no row runs with one."""
        if not any(adapters):
            return None
        resident = self._adapters  # a load or unload on another thread replaces it
        runs = []
        begin = 0
        for end in range(1, len(adapters) + 1):
            if end == len(adapters) or adapters[end] != adapters[begin]:
                if adapters[begin]:
                    adapter = resident.get(adapters[begin])
                    if adapter is None:  # the engine holds an adapter until its sessions end: a bug
                        raise RuntimeError(f"rows name a LoRA adapter that is not loaded: {adapters[begin]}")
                    runs.append((adapter, begin, end))
                begin = end
        return LoraPass(runs)

    def _decode_rows(self, decodes: list[Row]) -> DecodeRows:
        """One decode row per token: a speculating row's tokens each attend up to their own position."""
        lengths = [r.start + j + 1 for r in decodes for j in range(len(r.token_ids))]  # the new token included
        owners = [r for r in decodes for _ in r.token_ids]
        kv_len = max(lengths)
        width = -(-kv_len // self.cache.page_size)
        tables = torch.tensor(
            [list(r.pages[:width]) + [0] * (width - len(r.pages[:width])) for r in owners],
            dtype=torch.long,
            device=self.device,
        )
        mask = None
        if any(n != kv_len for n in lengths):
            mask = (
                torch.arange(kv_len, device=self.device).unsqueeze(0)
                < torch.tensor(lengths, device=self.device).unsqueeze(1)
            ).view(len(owners), 1, 1, kv_len)
        return DecodeRows(
            count=len(owners), tables=tables, kv_len=kv_len, mask=mask, speculative=len(owners) > len(decodes)
        )
