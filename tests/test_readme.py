"""The README stays true: every `braid serve` flag and its environment variable are documented."""

from __future__ import annotations

import re

from braid.server.cli import build_parser, env_name
from conftest import REPO


def _serve_flags() -> list[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return [a.option_strings[0] for a in serve._actions if a.option_strings and a.option_strings[0] != "-h"]


def test_every_serve_flag_and_env_var_is_in_the_readme():
    readme = (REPO / "README.md").read_text()
    documented = set(re.findall(r"`(--[a-z-]+)`", readme))
    for flag in _serve_flags():
        assert flag in documented, f"{flag} is missing from the README's flag table"
        assert env_name(flag[2:].replace("-", "_")) in readme, f"{flag}'s environment variable is missing"


def test_the_readme_names_the_two_commands():
    readme = (REPO / "README.md").read_text()
    assert "make serve" in readme and "make test" in readme
