"""Settings: the engine's in parts (the model, the KV cache, the scheduler, constraints, speculative
decoding, LoRA adapters; EngineConfig is all of them), the server's and the logs', each part
validated on creation.

Every field is a `braid serve` flag (--max-batch-size) and an environment variable
(BRAID_MAX_BATCH_SIZE); the flag wins. cli.py builds the parser from these fields, so a setting is
declared once, here.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field
from pathlib import Path


class Mode(enum.Enum):
    """The scheduling modes (engine/scheduler.py says what each runs next)."""

    SEQUENTIAL = "sequential"
    INTERLEAVED = "interleaved"
    BATCHED = "batched"
    CONTINUOUS = "continuous"


DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = (*DTYPES, "q8_0")  # q8_0: llama.cpp's blocks of 32 int8 and an fp16 scale
QUANTIZATIONS = ("auto", "none", "q8_0")
ACTIVATIONS = ("auto", "int8", "bf16", "float32")
SPECULATIVE = ("none", "ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class SettingError(ValueError):
    """A setting braid cannot use, named by its flag: `--port 70000: must be in [0, 65535]`. cli.py
    names the environment variable instead where the value came from there."""

    def __init__(self, name: str, value: object, problem: str) -> None:
        self.name, self.value, self.problem = name, value, problem
        super().__init__(f"{flag(name)} {value}: {problem}")


def flag(name: str) -> str:
    """A setting's flag: max_batch_size -> --max-batch-size."""
    return "--" + name.replace("_", "-")


# The groups `braid serve --help` lists the flags in, in this order (as vLLM's and llama.cpp's help
# do): every field names its group, so a new flag lands where a user looks for it.
GROUPS = {
    "model": "what is served and how it runs: the model, its names, device, formats, threads, adapters, speculation",
    "serving": "where and how calls are served: the ports, the scheduling mode, batches and the KV cache",
    "limits": "bounds on requests, sessions and the memory they may take",
    "security": "TLS and the API key",
    "telemetry": "metrics, traces and logs",
    "cluster": "behind a load balancer: drains, hand-overs, keepalives and connection age",
}


def _opt(help_text: str, group: str | None = None, **kw: object) -> dict[str, object]:
    """A field's metadata: its flag's help, its --help group (one of GROUPS; tests/unit/test_cli.py
    checks that every field names one), and argparse's other options for it (choices, metavar)."""
    assert group is None or group in GROUPS, group
    return {"help": help_text, "group": group, **kw}


@dataclass
class ModelConfig:
    """What is loaded and how it runs: the model, the device, the formats of its weights and rows, the threads and kernels."""

    model: str | None = field(
        default=None,
        metadata=_opt(
            "model: a local Hugging Face folder, a hub id, or a .gguf file (default: the embedded "
            "SmolLM2-135M-Instruct)",
            group="model",
        ),
    )
    served_model_name: list[str] = field(
        default_factory=list,
        metadata=_opt(
            "the model's names in the API, one or more (BRAID_SERVED_MODEL_NAME: comma-separated): the first is "
            "the one /v1/models, responses' `model` and ModelInfo.model_name report, and requests may name any "
            "(default: the model's short name: HuggingFaceTB/SmolLM2-135M-Instruct for the embedded model, a "
            "folder's or a .gguf file's name, a hub id)",
            group="model",
            nargs="+",
            metavar="NAME",
        ),
    )
    device: str = field(
        default="auto", metadata=_opt("auto (CUDA where present, else the CPU), cpu, cuda or cuda:N", group="model")
    )
    dtype: str = field(
        default="auto",
        metadata=_opt(
            "dtype of the weights that are not quantized: auto (each tensor's own: a bf16 checkpoint stays bf16), "
            "float32, bfloat16 or float16. On the CPU activations and sums stay float32; on CUDA it is also the "
            "compute dtype (auto: bfloat16)",
            choices=list(DTYPES),
            group="model",
        ),
    )
    quantization: str = field(
        default="auto",
        metadata=_opt(
            "auto: every matrix in its own format (a GGUF's Q8_0/Q4_0/Q4_1 blocks, a checkpoint's dtype); none: "
            "dequantized to --dtype (--dtype float32 --quantization none is plain fp32); q8_0: float matrices "
            "quantized to Q8_0 blocks at load",
            choices=list(QUANTIZATIONS),
            group="model",
        ),
    )
    activations: str = field(
        default="auto",
        metadata=_opt(
            "what a matrix multiplies on the CPU: int8 (a quantized matrix's (Q8_0, Q4_0, Q4_1, Q6_K, Q4_K) rows "
            "quantized to 8 bits per block of 32, as llama.cpp does, and integer dot products), bf16 (a bf16 "
            "matrix's rows rounded to bf16, and AVX-512 BF16's dot products, where the CPU has them): faster, a "
            "row's result still independent of its batch; float32 (fp32 rows: transformers-level agreement) or "
            "auto (the fastest braid's kernels have: int8 for a quantized matrix, bf16 for a bf16 one, float32 "
            "rows elsewhere)",
            choices=list(ACTIVATIONS),
            group="model",
        ),
    )
    threads: int = field(
        default=0,
        metadata=_opt(
            "CPU threads of torch's and braid's kernels (0: the CPUs this process may use, its affinity mask cut by "
            "its cgroup's CPU quota, rounded down; decode passes then use fewer while other processes keep the "
            "cores busy, where that is faster)",
            group="model",
        ),
    )
    kernels: str = field(
        default="auto",
        metadata=_opt(
            "auto: braid's own kernels on a CPU with AVX-512 or AVX2 (BRAID_KERNELS_ISA=avx2 forces the AVX2 "
            "build), else torch's; torch: torch's always",
            choices=["auto", "torch"],
            group="model",
        ),
    )
    cache_dir: Path = field(
        default_factory=lambda: default_cache_dir(), metadata=_opt("where converted models are kept", group="model")
    )
    chat_template: Path | None = field(
        default=None,
        metadata=_opt(
            "a Jinja chat template file that replaces the model's own (for chats, tools included)", group="model"
        ),
    )

    def __post_init__(self) -> None:
        if not _DEVICE.fullmatch(self.device):
            raise SettingError("device", self.device, "expected auto, cpu, cuda or cuda:N")
        _one_of(self, "dtype", DTYPES)
        _one_of(self, "quantization", QUANTIZATIONS)
        _one_of(self, "activations", ACTIVATIONS)
        _one_of(self, "kernels", ("auto", "torch"))
        _not_negative(self, "threads")
        names = self.served_model_name
        self.served_model_name = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if any(not name for name in self.served_model_name):
            raise SettingError("served_model_name", ",".join(self.served_model_name), "a name is empty")
        if len(set(self.served_model_name)) < len(self.served_model_name):
            raise SettingError("served_model_name", ",".join(self.served_model_name), "a name is given twice")
        self.cache_dir = Path(self.cache_dir).expanduser()
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise SettingError("chat_template", self.chat_template, "no such file")


@dataclass
class CacheConfig:
    """The paged KV cache: its memory, pages and dtype, prefix sharing, and the longest sequence."""

    kv_cache_memory: str = field(
        default="auto",
        metadata=_opt(
            "KV cache budget: bytes with a unit (4GiB, 512MB), a fraction (0.5) of the memory this process may "
            "still take at start (what is left under its cgroup's memory limit, else the host's available "
            "memory), or auto: room for --max-sessions sessions of --max-seq-len but 16384 tokens at most (one "
            "session of --max-seq-len at least), and half that memory at most. "
            "Cut into pages; a session holds pages for the tokens it has, and is admitted while pages are free",
            group="serving",
        ),
    )
    kv_page_size: int = field(
        default=16,
        metadata=_opt(
            "tokens per KV-cache page, a multiple of 16: the unit of allocation and of prefix sharing", group="serving"
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_opt(
            "dtype of the KV cache: auto (on a CPU q8_0, float16 where head_dim is not a multiple of 32; "
            "on a GPU the compute dtype), float32, bfloat16 or float16 (half float32's memory, so twice "
            "the tokens, for a small loss of precision), or q8_0 (llama.cpp's -ctk/-ctv q8_0: 8-bit "
            "values with a scale per 32, 0.53x bfloat16's bytes; head_dim a multiple of 32)",
            choices=list(KV_CACHE_DTYPES),
            group="serving",
        ),
    )
    prefix_caching: str = field(
        default="on",
        metadata=_opt(
            "on: sessions with the same prompt prefix share its KV-cache pages, and a finished session's "
            "pages stay cached until the memory is needed; off: every prompt is computed",
            choices=["on", "off"],
            group="serving",
        ),
    )
    kv_events_buffer: int = field(
        default=65_536,
        metadata=_opt(
            "KV-cache events (SubscribeKvEvents: pages stored and evicted) kept for subscribers that resume "
            "from a sequence number; one further behind is told to resync",
            group="serving",
        ),
    )
    max_seq_len: int = field(
        default=4096,
        metadata=_opt(
            "most tokens (prompt + generated) per session, capped by the model's context length", group="limits"
        ),
    )

    def __post_init__(self) -> None:
        _one_of(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        _one_of(self, "prefix_caching", ("on", "off"))
        _positive(self, "max_seq_len")
        _positive(self, "kv_events_buffer")
        if self.kv_cache_memory != "auto":
            parse_memory(self.kv_cache_memory)
        if self.kv_page_size < 16 or self.kv_page_size % 16:
            raise SettingError("kv_page_size", self.kv_page_size, "expected a multiple of 16")


@dataclass
class SchedulerConfig:
    """What the scheduler may run: the mode, the batch and the sessions, the waits, the queue."""

    mode: Mode = field(
        default=Mode.CONTINUOUS, metadata=_opt("scheduling mode", choices=[m.value for m in Mode], group="serving")
    )
    max_batch_size: int = field(
        default=32, metadata=_opt("most sessions in one forward pass (batched mode: the batch size)", group="serving")
    )
    max_sessions: int = field(
        default=0,
        metadata=_opt("most sessions running at once (0: --max-batch-size); more are queued", group="serving"),
    )
    max_wait_ms: float = field(
        default=20.0,
        metadata=_opt("batched mode: longest a waiting session waits for its batch to fill", group="serving"),
    )
    prefill_chunk: int = field(
        default=512,
        metadata=_opt(
            "most prompt tokens prefilled per forward pass; longer prompts are prefilled in chunks", group="serving"
        ),
    )
    max_queued: int = field(
        default=256,
        metadata=_opt("most sessions waiting to be admitted; past it new calls get RESOURCE_EXHAUSTED", group="limits"),
    )
    batch_max_wait_ms: float = field(
        default=5000.0,
        metadata=_opt(
            "a batch-priority session that has waited this long is admitted before interactive ones", group="serving"
        ),
    )

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Mode):
            _one_of(self, "mode", tuple(m.value for m in Mode))
            self.mode = Mode(self.mode)
        self.max_sessions = self.max_sessions or self.max_batch_size
        _positive(self, "max_batch_size", "max_sessions", "prefill_chunk", "max_queued")
        _not_negative(self, "max_wait_ms", "batch_max_wait_ms")


@dataclass
class ConstraintConfig:
    """Requests' constraints: how long one may compile, and the memory the compiled ones keep."""

    constraint_compile_timeout: float = field(
        default=5.0,
        metadata=_opt(
            "seconds a request's constraint (GenerateRequest.constraint) may take to compile; past it the "
            "request gets INVALID_ARGUMENT",
            group="limits",
        ),
    )
    constraint_cache_memory: str = field(
        default="256MiB",
        metadata=_opt(
            "memory the compiled constraints kept for reuse may hold, as bytes with a unit (an entry holds from "
            "tens of KB to tens of MB); past it the least recently used are dropped",
            group="limits",
        ),
    )

    def __post_init__(self) -> None:
        _positive(self, "constraint_compile_timeout")
        if parse_memory(self.constraint_cache_memory, "constraint_cache_memory")[1]:
            raise SettingError("constraint_cache_memory", self.constraint_cache_memory, "expected bytes with a unit")


@dataclass
class SpeculationConfig:
    """Speculative decoding: the proposer and how many tokens it may propose."""

    speculative: str = field(
        default="none",
        metadata=_opt(
            "speculative decoding: none; ngram (proposals copied from where the last tokens occurred before, in the "
            "prompt or the output: no second model); draft (proposals of --draft-model, run greedily). Proposals "
            "are verified in the same packed passes: the tokens are exactly those of plain decoding, seeded or "
            "greedy",
            choices=list(SPECULATIVE),
            group="model",
        ),
    )
    # 5: K = 5 gained 7% over 8 on copy-heavy text when a verification's 7th row cost a third of a
    # pass more than its 6th; with the int8 tiles taking turns it costs about two rows' worth, and
    # K = 7 ran no faster than 5, which costs a loaded pass fewer rows (docs/benchmarks.md,
    # "What does speculative decoding gain?")
    speculative_tokens: int = field(
        default=5,
        metadata=_opt(
            f"most tokens proposed per session and forward pass, 1 to {MAX_SPECULATIVE_TOKENS}", group="model"
        ),
    )
    ngram_max: int = field(
        default=4,
        metadata=_opt(
            "--speculative ngram: the longest run of last tokens looked up in the sequence so far", group="model"
        ),
    )
    ngram_min: int = field(
        default=2,
        metadata=_opt(
            "--speculative ngram: the shortest run of last tokens that may propose (1 matches any repeated token)",
            group="model",
        ),
    )
    draft_model: str | None = field(
        default=None,
        metadata=_opt(
            "--speculative draft: the draft model (a folder, hub id or .gguf file braid can serve) with the "
            "model's vocabulary, on its own runner and KV cache (--kv-cache-memory each)",
            group="model",
        ),
    )

    def __post_init__(self) -> None:
        _one_of(self, "speculative", SPECULATIVE)
        if not 1 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise SettingError(
                "speculative_tokens", self.speculative_tokens, f"must be in [1, {MAX_SPECULATIVE_TOKENS}]"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SettingError("ngram_min", self.ngram_min, f"must be in [1, --ngram-max {self.ngram_max}]")
        if self.speculative == "draft" and self.draft_model is None:
            raise SettingError("speculative", self.speculative, "needs --draft-model")
        if self.draft_model is not None and self.speculative != "draft":
            raise SettingError("draft_model", self.draft_model, "needs --speculative draft")


@dataclass
class LoraConfig:
    """LoRA adapters: those loaded at start, and the bounds on them."""

    lora: list[str] = field(
        default_factory=list,
        metadata=_opt(
            "a LoRA adapter to load at start, NAME=PATH (a PEFT folder or a GGUF LoRA file); repeat the flag "
            "for more (BRAID_LORA: comma-separated). Requests name it in GenerateRequest.adapter (or the OpenAI "
            "`model`)",
            action="append",
            metavar="NAME=PATH",
            group="model",
        ),
    )
    max_loras: int = field(
        default=8,
        metadata=_opt(
            "most LoRA adapters loaded at once (--lora and LoadAdapter); a LoadAdapter past it gets RESOURCE_EXHAUSTED",
            group="model",
        ),
    )
    max_lora_rank: int = field(default=64, metadata=_opt("highest rank r of a LoRA adapter braid loads", group="model"))

    def __post_init__(self) -> None:
        _positive(self, "max_loras", "max_lora_rank")
        self.lora = self.lora.split(",") if isinstance(self.lora, str) else list(self.lora)
        names = [_lora_name(spec) for spec in self.lora]
        if len(set(names)) < len(names):
            raise SettingError("lora", ",".join(self.lora), "two adapters have the same name")
        if len(self.lora) > self.max_loras:
            raise SettingError(
                "lora", ",".join(self.lora), f"{len(self.lora)} adapters; --max-loras is {self.max_loras}"
            )


_PARTS = (ModelConfig, CacheConfig, SchedulerConfig, ConstraintConfig, SpeculationConfig, LoraConfig)


@dataclass
class EngineConfig(LoraConfig, SpeculationConfig, ConstraintConfig, SchedulerConfig, CacheConfig, ModelConfig):
    """Every engine setting, from its parts (their fields, and so their flags, in the parts' order):
    each part declares its own flags once and checks them, so a component can take only the part
    it needs (the scheduler a SchedulerConfig, say)."""

    def __post_init__(self) -> None:
        for part in _PARTS:
            part.__post_init__(self)


@dataclass
class ServerConfig:
    host: str = field(default="[::]", metadata=_opt("address to listen on", group="serving"))
    port: int = field(default=50051, metadata=_opt("port to listen on (0: any free port)", group="serving"))
    default_max_new_tokens: int = field(
        default=256, metadata=_opt("max_new_tokens of a request that leaves it at 0", group="serving")
    )
    grace_period: float = field(
        default=10.0, metadata=_opt("seconds in-flight streams get to finish after SIGTERM", group="cluster")
    )
    handover_grace: float = field(
        default=0.0,
        metadata=_opt(
            "seconds in-flight streams get after SIGTERM before those still running are handed over: ended "
            "UNAVAILABLE, for braid's clients to resume on another replica from the tokens they have (0: none; "
            "they get --grace-period, then end with a final CANCELLED message)",
            group="cluster",
        ),
    )
    tls_cert: Path | None = field(default=None, metadata=_opt("PEM certificate chain: serve TLS", group="security"))
    tls_key: Path | None = field(default=None, metadata=_opt("PEM private key of --tls-cert", group="security"))
    tls_client_ca: Path | None = field(
        default=None,
        metadata=_opt("PEM CA bundle: require client certificates signed by it (mutual TLS)", group="security"),
    )
    api_key: str | None = field(
        default=None,
        metadata=_opt(
            "require `authorization: Bearer <key>` metadata on every braid call (health stays open)", group="security"
        ),
    )
    max_message_bytes: int = field(
        default=4 * 1024 * 1024, metadata=_opt("largest request message accepted", group="limits")
    )
    max_concurrent_streams: int = field(
        default=1024,
        metadata=_opt(
            "most calls one client connection may have open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS). "
            "Calls past it are refused with UNAVAILABLE (RST_STREAM REFUSED_STREAM: never started, safe to retry; "
            "gRPC's clients do not reliably queue them). The work itself is bounded by --max-sessions and "
            "--max-queued, whose excess gets RESOURCE_EXHAUSTED",
            group="limits",
        ),
    )
    http_port: int = field(
        default=0,
        metadata=_opt(
            "also serve OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health) and "
            "Prometheus' /metrics on this port, on --host, from the same engine (0: off); --api-key guards it "
            "too",
            group="serving",
        ),
    )
    http_max_header_bytes: int = field(
        default=64 * 1024,
        metadata=_opt(
            "largest head (request line and headers) of an HTTP request; a bigger one gets 431 and the "
            "connection is closed",
            group="limits",
        ),
    )
    http_max_headers: int = field(
        default=100,
        metadata=_opt("most headers an HTTP request may have; past it: 431, the connection closed", group="limits"),
    )
    http_header_timeout: float = field(
        default=10.0,
        metadata=_opt(
            "seconds an HTTP request's head may take to arrive, from the connection's start or the request's "
            "first byte; a slower one gets 408 and the connection is closed",
            group="limits",
        ),
    )
    http_body_timeout: float = field(
        default=60.0,
        metadata=_opt(
            "seconds an HTTP request's body may take to arrive, in all, from the end of its head; a slower one "
            "gets 408 and the connection is closed",
            group="limits",
        ),
    )
    strict_request_fields: bool = field(
        default=False,
        metadata=_opt(
            "refuse an HTTP request with a field braid does not know (400 naming it); off: such a field is "
            "ignored, logged, and named in the response's braid-ignored-fields header",
            group="limits",
            nargs="?",
            const=True,
        ),
    )
    metrics_port: int = field(
        default=0,
        metadata=_opt(
            "serve Prometheus metrics on http://<metrics-host>:<port>/metrics (0: off); they need no API key",
            group="telemetry",
        ),
    )
    metrics_host: str | None = field(
        default=None,
        metadata=_opt(
            "address the metrics endpoint listens on (default: --host), e.g. 127.0.0.1 to keep it off the network",
            group="telemetry",
        ),
    )
    otlp_endpoint: str | None = field(
        default=None,
        metadata=_opt(
            "send traces and metrics over OTLP/gRPC to this collector, e.g. http://otel-collector:4317 "
            "(http:// plaintext, https:// TLS; unset: OTEL_EXPORTER_OTLP_ENDPOINT, else off)",
            group="telemetry",
        ),
    )
    keepalive_time_ms: int = field(
        default=30_000,
        metadata=_opt(
            "ping a client connection after this long without hearing from it, to find peers that vanished "
            "without closing it (their sessions are then cancelled); 0: gRPC's default, 2 hours",
            group="cluster",
        ),
    )
    keepalive_timeout_ms: int = field(
        default=10_000,
        metadata=_opt("close a connection whose keepalive ping is not answered within this long", group="cluster"),
    )
    keepalive_permit_without_calls: bool = field(
        default=True,
        metadata=_opt(
            "keepalive pings on connections with no call open: braid sends its own, and accepts a client's "
            "(a proxy's) every --min-ping-interval-ms; false: at most one every 2 hours, as gRPC's default",
            group="cluster",
        ),
    )
    min_ping_interval_ms: int = field(
        default=10_000,
        metadata=_opt(
            "shortest interval between a client's pings accepted while no data flows; a client pinging more "
            "often is sent GOAWAY too_many_pings after 2 strikes (gRPC's default: 300000)",
            group="cluster",
        ),
    )
    max_connection_age_ms: int = field(
        default=0,
        metadata=_opt(
            "send a client connection GOAWAY after this long (gRPC adds +-10%% jitter), so clients balancing over "
            "DNS find new replicas; calls in flight go on; 0: never",
            group="cluster",
        ),
    )
    max_connection_age_grace_ms: int = field(
        default=0,
        metadata=_opt(
            "after --max-connection-age-ms, how long calls in flight get before the connection is closed; "
            "0: as long as they run",
            group="cluster",
        ),
    )

    def __post_init__(self) -> None:
        _positive(self, "default_max_new_tokens", "max_message_bytes", "max_concurrent_streams")
        _positive(self, "http_max_header_bytes", "http_max_headers", "http_header_timeout", "http_body_timeout")
        self.metrics_host = self.metrics_host or self.host
        self.otlp_endpoint = self.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        for name in ("port", "http_port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise SettingError(name, getattr(self, name), "must be in [0, 65535]")
        _not_negative(self, "grace_period", "handover_grace")
        _positive(self, "keepalive_timeout_ms")
        _not_negative(
            self, "keepalive_time_ms", "min_ping_interval_ms", "max_connection_age_ms", "max_connection_age_grace_ms"
        )


@dataclass
class LogConfig:
    """How braid logs, for `braid serve` and `braid warmup` alike."""

    log_level: str = field(
        default="info", metadata=_opt("debug, info, warning or error", choices=list(LOG_LEVELS), group="telemetry")
    )
    log_format: str = field(
        default="text",
        metadata=_opt(
            "text: one line per record; json: one JSON object per record, every field of a request's line its own key",
            choices=list(LOG_FORMATS),
            group="telemetry",
        ),
    )

    def __post_init__(self) -> None:
        _one_of(self, "log_level", LOG_LEVELS)
        _one_of(self, "log_format", LOG_FORMATS)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(text: str, name: str = "kv_cache_memory") -> tuple[float, bool]:
    """'4GiB' -> (4 * 2**30, False); '0.5' -> (0.5, True): a fraction of free memory. name: the
    setting it is, for errors."""
    raw = text.strip().lower()
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :].strip()
    try:
        value = float(number)
    except ValueError:
        raise SettingError(name, text, "expected bytes with a unit or a fraction") from None
    if unit not in _UNITS or value <= 0:
        raise SettingError(name, text, "expected e.g. 4GiB, 512MB or 0.5")
    if not unit and value <= 1:
        return value, True
    return value * _UNITS[unit], False


def _lora_name(spec: str) -> str:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise SettingError("lora", spec, "expected NAME=PATH")
    return name


def lora_specs(specs: list[str]) -> list[tuple[str, str]]:
    """--lora's NAME=PATH values, as (name, path)."""
    return [(spec.partition("=")[0], spec.partition("=")[2]) for spec in specs]


def _one_of(config: object, name: str, choices: tuple[str, ...]) -> None:
    """Flags' choices are checked by argparse; this catches the same values given through the
    environment (BRAID_DTYPE) or in code."""
    if getattr(config, name) not in choices:
        raise SettingError(name, getattr(config, name), f"invalid choice (choose from {', '.join(choices)})")


def _positive(config: object, *names: str) -> None:
    for name in names:
        if getattr(config, name) <= 0:
            raise SettingError(name, getattr(config, name), "must be positive")


def _not_negative(config: object, *names: str) -> None:
    for name in names:
        if getattr(config, name) < 0:
            raise SettingError(name, getattr(config, name), "must be 0 or more")


def default_cache_dir() -> Path:
    """Where converted models are kept: $XDG_CACHE_HOME/braid (~/.cache/braid)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "braid"
