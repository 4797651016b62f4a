"""`braid serve` and `braid warmup`: flags built from the config dataclasses, each also read from
BRAID_<NAME> in the environment."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
from pathlib import Path

from braid.server.config import EngineConfig, ServerConfig

ENV_PREFIX = "BRAID_"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _add_fields(parser: argparse.ArgumentParser, config_type: type) -> None:
    hints = typing.get_type_hints(config_type)
    for f in dataclasses.fields(config_type):
        kind = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        env = os.environ.get(env_name(f.name))
        convert = _converter(kind)
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        shown = getattr(default, "value", default)
        parser.add_argument(
            "--" + f.name.replace("_", "-"), dest=f.name, type=convert,
            default=convert(env) if env is not None else default,
            help=f"{help_text} [env {env_name(f.name)}; default {shown}]", **meta)


def _converter(kind):
    if kind in (int, float, Path):
        return kind
    if kind is bool:
        return lambda v: str(v).lower() in ("1", "true", "yes", "on")
    return str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="braid", description="braid: LLM text generation over gRPC")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the gRPC server")
    _add_fields(serve, ServerConfig)
    _add_fields(serve, EngineConfig)
    warmup = commands.add_parser("warmup", help="load (and convert, once) the model, then exit")
    _add_fields(warmup, EngineConfig)
    warmup.add_argument("--log-level", default=os.environ.get("BRAID_LOG_LEVEL", "info"))
    return parser


def _pick(config_type: type, args: argparse.Namespace):
    names = {f.name for f in dataclasses.fields(config_type)}
    return config_type(**{k: v for k, v in vars(args).items() if k in names})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_config = _pick(EngineConfig, args)
        server_config = _pick(ServerConfig, args) if args.command == "serve" else None
    except ValueError as exc:
        parser.error(str(exc))
    if args.command == "warmup":
        from braid.server.model.loader import load

        load(engine_config.model, engine_config.cache_dir)
        return 0
    from braid.server.edge.server import serve

    return serve(server_config, build_engine(engine_config))


def build_engine(config: EngineConfig, model=None):
    """The composition root: loads --model (unless given it loaded), builds the runner the config
    asks for and the engine over it. Only here do the layers meet, so none has to import another's
    construction."""
    from braid.server.engine.engine import Engine
    from braid.server.engine.tokenizer import Tokenizer
    from braid.server.model.loader import load
    from braid.server.runner.model_runner import ModelRunner

    model = model or load(config.model, config.cache_dir)
    runner = ModelRunner.build(config, model)
    return Engine(config, runner, Tokenizer(model.hf_tokenizer, model.eos_token_ids), model.name, model.architecture)


if __name__ == "__main__":
    sys.exit(main())
