"""`braid serve` and `braid warmup`: flags built from the config dataclasses, each also read from
BRAID_<NAME> in the environment.

A start that cannot go on ends with one line on stderr and a non-zero exit, never a traceback: a
bad flag or variable (exit 2, with the command's usage), or a model, device or port braid cannot
use (exit 1). `--log-level debug` adds the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import typing
from typing import Any, Protocol
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from braid.server import logs, resources
from braid.server.config import (
    GROUPS,
    EngineConfig,
    LogConfig,
    ServerConfig,
    SettingError,
    flag,
    lora_specs,
    parse_memory,
)

ENV_PREFIX = "BRAID_"
_LOGGER = logging.getLogger(__name__)
_COMMANDS = {"serve": (ServerConfig, EngineConfig, LogConfig), "warmup": (EngineConfig, LogConfig)}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _add_fields(parser: argparse.ArgumentParser, config_types: tuple[type, ...]) -> None:
    """One flag per field, in the argument group its field names (config.GROUPS, in that order; a
    group with no flag of this command is left out). A flag left out is absent from the parsed
    namespace (SUPPRESS), so the environment is read only after parsing: `--help` works whatever the
    environment holds."""
    hints = {t: typing.get_type_hints(t) for t in config_types}  # once a type: 0.1 s of a start, once a field
    fields = [(f, hints[t][f.name]) for t in config_types for f in dataclasses.fields(t)]
    for group_name, description in GROUPS.items():
        members = [(f, hint) for f, hint in fields if (f.metadata["group"] or "serving") == group_name]
        if members:
            _add_group(parser.add_argument_group(f"{group_name} flags", description), members)


def _add_group(group: argparse._ArgumentGroup, members: list[tuple[dataclasses.Field[Any], Any]]) -> None:
    for f, hint in members:
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        meta.pop("group")
        shown = getattr(default, "value", default)
        if isinstance(default, list):
            shown = ",".join(default) or "none"
        # a help that says its default itself (--model's, --served-model-name's) is not told None
        where = f"env {env_name(f.name)}" + ("" if "(default" in help_text else f"; default {shown}")
        group.add_argument(
            flag(f.name),
            dest=f.name,
            type=_converter(hint),
            default=argparse.SUPPRESS,
            help=f"{help_text} [{where}]",
            **meta,
        )


def _converter(kind):
    if kind in (int, float, Path):
        return kind
    if kind is bool:
        return boolean
    return str


_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def boolean(text: str) -> bool:
    """true/false, 1/0, yes/no, on/off (any case); anything else is an error naming the flag or
    variable, never a silent false (BRAID_KEEPALIVE_PERMIT_WITHOUT_CALLS=ture was read as false)."""
    try:
        return _BOOLEANS[str(text).strip().lower()]
    except KeyError:
        raise ValueError(text) from None


def _version() -> str:
    try:
        return version("braid-llm-server")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="braid", description="braid: LLM text generation over gRPC")
    parser.add_argument("--version", action="version", version=f"braid {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    helps = {"serve": "start the gRPC server", "warmup": "load (and convert, once) the model, then exit"}
    for name, config_types in _COMMANDS.items():
        # A short usage: an error's line is not lost under thirty flags (--help lists them).
        command = commands.add_parser(name, help=helps[name], usage=f"braid {name} [--flag VALUE ...]")
        command.set_defaults(command_parser=command)  # its errors print its usage, not braid's
        _add_fields(command, config_types)
    return parser


def _configs(command: argparse.ArgumentParser, args: argparse.Namespace, config_types) -> dict[type, object]:
    """Each config from its flags, else their environment variables, else its defaults. A bad value
    ends the start with the command's usage and one line naming the flag or the variable."""
    given = vars(args)
    from_env: dict[str, str] = {}
    actions = {a.dest: a for a in command._actions}
    for config_type in config_types:
        for f in dataclasses.fields(config_type):
            raw = os.environ.get(env_name(f.name))
            if f.name not in given and raw is not None:
                from_env[f.name] = raw
                given[f.name] = _env_value(command, actions[f.name], raw)
    try:
        return {t: t(**{f.name: given[f.name] for f in dataclasses.fields(t) if f.name in given}) for t in config_types}
    except SettingError as exc:
        if exc.name in from_env:
            command.error(f"{env_name(exc.name)}={from_env[exc.name]} ({flag(exc.name)}): {exc.problem}")
        command.error(str(exc))
    except ValueError as exc:
        command.error(str(exc))


def _env_value(command: argparse.ArgumentParser, action: argparse.Action, raw: str):
    """An environment variable's value, converted and checked as its flag's would be."""
    where = f"{env_name(action.dest)}={raw} ({action.option_strings[0]})"
    try:
        value = action.type(raw)
    except ValueError:
        command.error(f"{where}: invalid {getattr(action.type, '__name__', 'value')} value")
    if action.choices is not None and value not in action.choices:
        command.error(f"{where}: invalid choice (choose from {', '.join(map(str, action.choices))})")
    return value


class Ports(Protocol):
    """What may be wrapped around the engine's ports as they are built: the tests' fault injection
    (tests/support/braid_testing/faults.py) wraps the runner, the tokenizer and the constraint
    compiler through this; `braid serve` itself wraps nothing."""

    def runner(self, runner: Any) -> Any: ...

    def tokenizer(self, tokenizer: Any) -> Any: ...

    def grammars(self, grammars: Any) -> Any: ...


def main(argv: list[str] | None = None, ports: Ports | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configs = _configs(args.command_parser, args, _COMMANDS[args.command])
    log_config: LogConfig = configs[LogConfig]
    logs.setup(log_config.log_level, log_config.log_format)
    resources.bound_spinning()  # before torch loads libgomp, which reads it once
    try:
        return _run(args.command, configs, ports)
    except KeyboardInterrupt:
        print("braid: interrupted while starting", file=sys.stderr)
        return 128 + signal.SIGINT
    except Exception as exc:
        _LOGGER.debug("the start failed", exc_info=True)
        print(f"braid: error: {_one_line(exc)}", file=sys.stderr)
        return 1


def _run(command: str, configs: dict[type, object], ports: Ports | None = None) -> int:
    engine_config: EngineConfig = configs[EngineConfig]
    if command == "warmup":
        from braid.server.model.loader import load

        load(engine_config.model, engine_config.cache_dir)
        return 0
    from braid.server.app import serve

    server_config: ServerConfig = configs[ServerConfig]
    return serve(server_config, lambda: build_engine(engine_config, ports=ports))


def _one_line(exc: BaseException) -> str:
    """A failure as one line: braid's own messages as they are, anything else with its type and a
    pointer to the traceback."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if isinstance(exc, (SettingError, FileNotFoundError)) and lines:
        return lines[0]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return f"{text} (--log-level debug shows the traceback)"


def build_engine(config: EngineConfig, model=None, ports: Ports | None = None):
    """The composition root: loads --model (unless given it loaded), builds the runner the config
    asks for and the engine over it, its ports wrapped by `ports` where given. Only here do the
    layers meet, so none has to import another's construction."""
    from braid.server.engine.engine import Engine
    from braid.server.engine.grammars import Grammars
    from braid.server.engine.tokenizer import Tokenizer
    from braid.server.model.loader import load
    from braid.server.runner.model_runner import ModelRunner

    _check_device(config.device)  # before the model loads: a missing device fails at once
    model = model or load(config.model, config.cache_dir)
    runner = ModelRunner.build(config, model)
    draft = _draft_runner(config, runner) if config.speculative == "draft" else None
    if config.chat_template is not None:
        model.hf_tokenizer.chat_template = Path(config.chat_template).read_text()
    tokenizer = Tokenizer(model.hf_tokenizer, model.eos_token_ids)
    grammars = Grammars(
        tokenizer.hf_tokenizer,
        tokenizer.eos_token_ids,
        runner.vocab_size,
        config.constraint_compile_timeout,
        int(parse_memory(config.constraint_cache_memory, "constraint_cache_memory")[0]),
    )
    info = describe(config, runner, tokenizer, model.name, model.architecture, model.path, model.hf_model.config)
    if ports is not None:
        runner, tokenizer, grammars = ports.runner(runner), ports.tokenizer(tokenizer), ports.grammars(grammars)
    engine = Engine(config, runner, tokenizer, info, grammars, draft)
    _load_loras(engine, config)
    return engine


def _load_loras(engine, config: EngineConfig) -> None:
    """--lora's adapters; one that cannot be loaded ends the start with one line naming it."""
    from braid.server.engine.types import InvalidArgument

    for name, path in lora_specs(config.lora):
        try:
            engine.client.load_lora(name, path)
        except InvalidArgument as exc:
            raise SettingError("lora", f"{name}={path}", exc.description) from None


def _draft_runner(config: EngineConfig, target):
    """--draft-model on a runner of its own, as --model's is built; its vocabulary must be the model's."""
    from braid.server.model.loader import load
    from braid.server.runner.model_runner import ModelRunner

    try:
        model = load(config.draft_model, config.cache_dir)
    except SettingError as exc:  # the loader names --model: here it is the draft's
        raise SettingError("draft_model", exc.value, exc.problem) from None
    draft = ModelRunner.build(dataclasses.replace(config, model=config.draft_model), model)
    if draft.vocab_size != target.vocab_size:
        raise SettingError(
            "draft_model",
            config.draft_model,
            f"its vocabulary has {draft.vocab_size} tokens, the model's {target.vocab_size}",
        )
    _LOGGER.info(
        "draft model: %s (%d parameters), up to %d tokens proposed per pass",
        config.draft_model,
        draft.num_parameters,
        config.speculative_tokens,
    )
    return draft


def describe(
    config: EngineConfig,
    runner,
    tokenizer,
    model_name: str,
    architecture: str,
    model_path: str = "",
    model_config: object = None,
):
    """What ModelInfo reports: the model, the runner that runs it, and the settings in force.
    model_name: the loader's short name, served unless --served-model-name says otherwise;
    model_config: transformers' config of the loaded model (a GGUF file's names its pooling)."""
    from braid.server.engine.types import ModelInfo, Pooling
    from braid.server.model.pooling import model_pooling

    names = tuple(config.served_model_name) or (model_name,)
    pooling, pooling_source = model_pooling(model_path, model_config)
    return ModelInfo(
        model_name=names[0],
        served_model_names=names,
        model_path=model_path,
        kv_cache_bytes=runner.cache.nbytes,
        architecture=architecture,
        context_length=runner.max_seq_len,
        vocab_size=runner.vocab_size,
        dtype=runner.dtype_name,
        device=str(runner.device),
        mode=config.mode,
        max_batch_size=min(config.max_batch_size, config.max_sessions),
        eos_token_ids=tokenizer.eos_token_ids,
        has_chat_template=tokenizer.has_chat_template,
        chat_template_takes_tools=tokenizer.template_takes_tools,
        parameters=runner.num_parameters,
        weight_formats=runner.weight_formats,
        weight_bytes=runner.weight_bytes,
        quantization=runner.quantization,
        kernels=runner.kernels,
        kv_cache_dtype=runner.kv_dtype_name,
        prefix_caching=config.prefix_caching == "on",
        runner=runner.path,
        activations=runner.activations,
        threads=runner.threads,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        speculative=config.speculative,
        speculative_tokens=config.speculative_tokens if config.speculative != "none" else 0,
        draft_model=config.draft_model or "",
        embedding_dimensions=getattr(runner, "embedding_dimensions", 0),
        embedding_pooling=Pooling[pooling.upper()],
        embedding_pooling_source=pooling_source,
    )


def _check_device(device: str) -> None:
    import torch

    from braid.server.runner.model_runner import pick_device

    try:
        picked, _ = pick_device(device)
    except ValueError as exc:
        raise SettingError("device", device, str(exc).split(": ", 1)[-1]) from None
    if picked.type == "cuda" and (picked.index or 0) >= torch.cuda.device_count():
        raise SettingError("device", device, f"this machine has {torch.cuda.device_count()} CUDA device(s)")


if __name__ == "__main__":
    sys.exit(main())
