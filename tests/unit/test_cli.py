"""`braid serve` as a user meets it, in process: --help's groups, --served-model-name from the
command line and the environment, bad flags and variables refused in one line under the usage, and
the start-up line. (The refusals were checked in a forked `braid` each, tests/test_startup_errors.py:
the process added nothing to what they prove, since main() is what the command runs; the failures
past the flags, of the model, the device and the ports, are still checked there.)"""

from __future__ import annotations

import dataclasses
import re

import pytest
from test_servicer import INFO

from braid.server import cli
from braid.server.cli import _configs, build_parser, main
from braid.server.config import GROUPS, EngineConfig, LogConfig, ServerConfig
from braid.server.grpc.server import running


def _command(name: str = "serve"):
    return build_parser()._subparsers._group_actions[0].choices[name]


def _help(capsys, command: str = "serve") -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return capsys.readouterr().out


def test_serve_help_lists_its_flags_in_groups_in_order_with_model_first(capsys):
    text = _help(capsys)
    titles = re.findall(r"^(\w+) flags:$", text, re.M)
    assert titles == ["model", "serving", "limits", "security", "telemetry", "cluster"] == list(GROUPS)
    first = re.search(r"^model flags:\n.*?\n\n  (--[\w-]+)", text, re.M | re.S)[1]
    assert first == "--model"
    # every flag is in one of them: none left under argparse's own "options"
    options = _command()._action_groups[1]
    assert [a.option_strings for a in options._group_actions] == [["-h", "--help"]]


def test_every_setting_names_its_group():
    for config_type in (ServerConfig, EngineConfig, LogConfig):
        for f in dataclasses.fields(config_type):
            assert f.metadata["group"] in GROUPS, f"{f.name} names no --help group (config.GROUPS)"


def test_each_group_holds_the_flags_a_user_looks_for_there():
    groups = {g.title: {a.dest for a in g._group_actions} for g in _command()._action_groups}
    assert {"model", "served_model_name", "device", "quantization", "activations", "lora"} <= groups["model flags"]
    assert {"host", "port", "http_port", "mode", "kv_cache_memory"} <= groups["serving flags"]
    assert {"max_seq_len", "max_queued", "max_message_bytes"} <= groups["limits flags"]
    assert {"api_key", "tls_cert", "tls_key", "tls_client_ca"} == groups["security flags"]
    assert {"metrics_port", "metrics_host", "otlp_endpoint", "log_level", "log_format"} <= groups["telemetry flags"]
    assert {"grace_period", "handover_grace", "keepalive_time_ms"} <= groups["cluster flags"]


def test_warmup_help_has_only_the_groups_of_its_flags(capsys):
    assert re.findall(r"^(\w+) flags:$", _help(capsys, "warmup"), re.M) == [
        "model",
        "serving",
        "limits",
        "telemetry",
    ]


def _engine_config(argv: list[str]) -> EngineConfig:
    args = build_parser().parse_args(["serve", *argv])
    return _configs(args.command_parser, args, (EngineConfig,))[EngineConfig]


def test_served_model_name_takes_one_or_more_names(monkeypatch):
    monkeypatch.delenv("BRAID_SERVED_MODEL_NAME", raising=False)
    assert _engine_config([]).served_model_name == []
    assert _engine_config(["--served-model-name", "smol"]).served_model_name == ["smol"]
    assert _engine_config(["--served-model-name", "smol", "gpt-4o-mini"]).served_model_name == ["smol", "gpt-4o-mini"]
    monkeypatch.setenv("BRAID_SERVED_MODEL_NAME", "smol, HuggingFaceTB/SmolLM2-135M-Instruct")
    assert _engine_config([]).served_model_name == ["smol", "HuggingFaceTB/SmolLM2-135M-Instruct"]


@pytest.mark.parametrize("names, wanted", [(["a", "a"], "given twice"), (["a", ""], "empty")])
def test_served_model_names_given_twice_or_empty_are_refused_naming_the_flag(names, wanted, capsys):
    with pytest.raises(SystemExit):
        _engine_config(["--served-model-name", *names])
    assert f"--served-model-name {','.join(names)}: a name" in capsys.readouterr().err


def test_the_start_up_line_says_what_runs_not_just_the_compute_dtype():
    """`(cpu, continuous mode, float32)` hid the int8 rows and the KV cache: the line names them."""
    info = dataclasses.replace(
        INFO,
        weight_formats={"f32": 61, "q4_1": 210, "q8_0": 1},
        weight_bytes=97_000_000,
        kernels="avx2",
        activations="int8",
        kv_cache_bytes=720 * 2**20,
    )
    assert running(info) == (
        "cpu, avx2 kernels, weights 210 q4_1 + 61 f32 + 1 q8_0 (97 MB), int8 rows, KV cache float32 720 MiB, "
        "continuous mode"
    )
    on_gpu = dataclasses.replace(info, device="cuda:0", kernels="torch", dtype="bfloat16", weight_formats={"bf16": 3})
    assert running(on_gpu).startswith("cuda:0, torch's ops, weights 3 bf16 (97 MB), bfloat16 compute, KV cache")


def _braid(monkeypatch, capsys, *argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`braid <argv>` in process, with env's variables set: its exit code, output and errors. A start
    that goes on past its flags fails the test (with exit 1) instead of starting a server here."""
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)

    def no_start(*args):
        raise AssertionError("the flags were accepted: the start went on")

    monkeypatch.setattr(cli, "_run", no_start)
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(result: tuple[int, str, str], *wanted: str) -> str:
    """A bad flag or variable: exit 2, `braid serve`'s usage, then one line holding every wanted piece."""
    code, _, err = result
    assert code == 2, err
    usage, line = [line for line in err.splitlines() if line.strip()]
    assert usage.startswith("usage: braid serve"), err
    assert line.startswith("braid serve: error: ") and all(w in line for w in wanted), line
    return line


@pytest.mark.parametrize(
    "args, wanted",
    [
        (["--port", "70000"], ["--port 70000", "[0, 65535]"]),
        (["--http-port", "70000"], ["--http-port 70000", "[0, 65535]"]),
        (["--chat-template", "/no/such.jinja"], ["--chat-template /no/such.jinja", "no such file"]),
        (["--kv-cache-memory", "4XB"], ["--kv-cache-memory 4XB"]),
        (["--log-level", "verbose"], ["--log-level", "verbose"]),
        (["--device", "gpu"], ["--device gpu", "cuda:N"]),
        (["--mode", "fast"], ["--mode", "fast", "continuous"]),
    ],
)
def test_a_bad_flag_is_one_line_under_braid_serves_usage(monkeypatch, capsys, args, wanted):
    assert_usage_error(_braid(monkeypatch, capsys, "serve", *args), *wanted)


@pytest.mark.parametrize(
    "variable, value, wanted",
    [
        ("BRAID_MODE", "fast", "invalid choice"),
        ("BRAID_PORT", "abc", "invalid int value"),
        ("BRAID_PORT", "70000", "[0, 65535]"),
        ("BRAID_LOG_FORMAT", "xml", "invalid choice"),
    ],
)
def test_a_bad_environment_variable_is_named(monkeypatch, capsys, variable, value, wanted):
    result = _braid(monkeypatch, capsys, "serve", env={variable: value})
    assert_usage_error(result, f"{variable}={value}", wanted)


def test_help_works_whatever_the_environment_holds(monkeypatch, capsys):
    code, out, err = _braid(monkeypatch, capsys, "serve", "--help", env={"BRAID_PORT": "abc", "BRAID_MODE": "fast"})
    assert code == 0, err
    assert "--port" in out and "BRAID_PORT" in out


def test_version(monkeypatch, capsys):
    code, out, _ = _braid(monkeypatch, capsys, "--version")
    assert code == 0 and out.startswith("braid ") and out.split()[1][0].isdigit(), out


@pytest.mark.parametrize("value", ["ture", "2", "yes please", ""])
def test_a_boolean_that_is_not_one_is_refused_naming_it(monkeypatch, capsys, value):
    # BRAID_KEEPALIVE_PERMIT_WITHOUT_CALLS=ture was read as false, silently.
    result = _braid(monkeypatch, capsys, "serve", env={"BRAID_KEEPALIVE_PERMIT_WITHOUT_CALLS": value})
    assert_usage_error(
        result,
        f"BRAID_KEEPALIVE_PERMIT_WITHOUT_CALLS={value}",
        "--keepalive-permit-without-calls",
        "invalid boolean value",
    )
    monkeypatch.delenv("BRAID_KEEPALIVE_PERMIT_WITHOUT_CALLS")
    result = _braid(monkeypatch, capsys, "serve", "--keepalive-permit-without-calls", value or "''")
    assert_usage_error(result, "--keepalive-permit-without-calls", "invalid boolean value")


@pytest.mark.parametrize("value", ["0.5", "lots"])
def test_a_constraint_cache_size_that_is_not_bytes_is_refused(monkeypatch, capsys, value):
    assert_usage_error(
        _braid(monkeypatch, capsys, "serve", "--constraint-cache-memory", value), "--constraint-cache-memory"
    )
