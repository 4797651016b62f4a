"""The model runner: rows of new tokens in, one forward pass, next token ids out.

It never sees a session, a queue, a socket or a protobuf: the engine decides what runs and builds
the rows (runner/rows.py); each pass, the runner packs them into tensors (runner/batch.py), runs the
decoder over its KV cache and samples (runner/results.py). It also owns what depends on the
hardware: the decoder (runner/paths.py), the device, torch's threads, and how many KV-cache pages
fit; and the resident LoRA adapters.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Sequence

import torch
from braid.server import resources
from braid.server.config import EngineConfig
from braid.server.model.loader import LoadedModel
from braid.server.runner.batch import ForwardBatch, Packed, pack
from braid.server.runner.decoder import Decoder
from braid.server.runner.families import attention_window, native_family
from braid.server.runner.kv_cache import KV_DTYPES, KVCache, auto_dtype, fit_pages, head_dim, kv_dtype_name
from braid.server.runner.lora import Adapter, read_peft
from braid.server.runner.lora_gguf import read_gguf_lora
from braid.server.runner.masks import Masks
from braid.server.runner.paths import pick_path
from braid.server.runner.precision import DTYPES
from braid.server.runner.results import sample_rows
from braid.server.runner.rows import AdapterInfo, Row, Sampled, Sampling
from braid.server.runner.sampler import random_state
from braid.server.runner.threads import ThreadGovernor

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
        chosen = pick_path(model, device, dtype, max_seq_len, allow_kernels, weight_dtype, quantization, activations)
        self.decoder = chosen.decoder
        # kernels: the C kernels' instruction set, or torch's ops
        self.path, self.kernels, self.quantization = chosen.path, chosen.kernels, chosen.quantization
        self.activations = chosen.activations
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

        self.weight_formats = dict(chosen.formats)  # tensors served in each format
        self.weight_bytes = self.decoder.weight_bytes
        _LOGGER.info(
            "kernels: %s; weights: %s, %.0f MB (%.0f MB of them in huge pages)",
            chosen.ops,
            ", ".join(f"{n} {fmt}" for fmt, n in chosen.formats.most_common()),
            self.weight_bytes / 1e6,
            self.decoder.huge_page_bytes / 1e6,
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
        kv_dtype = KV_DTYPES.get(config.kv_cache_dtype) or auto_dtype(device, dtype, head_dim(model.hf_model.config))
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
        row asks) and its targets' log probabilities, or its pooled vector, or None for a row that
        neither samples, scores nor pools (a prompt chunk that does not reach the end of its prompt)."""
        packed = self.pack(rows)
        masks = self.masks.start_pass(rows, packed.sampled)  # the constrained rows', filled during the pass
        logits = self._forward(packed.batch)  # [L, V], in batch.logit_rows order
        return sample_rows(rows, packed, logits, masks)

    def pack(self, rows: Sequence[Row]) -> Packed:
        """The rows as one packed batch over this runner's cache and adapters (runner/batch.py)."""
        return pack(rows, self.cache, self._adapters, native=self.path == "braid")

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
