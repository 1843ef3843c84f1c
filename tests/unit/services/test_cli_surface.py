"""What an operator reads of the command line: `pdserve --version`, and `pdserve up --help`
giving every flag a help text that says its default (never a bare "None")."""

from __future__ import annotations

import argparse
import re
from importlib.metadata import version

import pytest

from services.cli import build_parser, main


def test_version_names_pdserve_torch_and_python(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"pdserve {re.escape(version('pdserve'))} \(torch {re.escape(version('torch'))}, "
                        r"Python 3\.\d+\.\d+\)", out), out


def _up() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    up: argparse.ArgumentParser = sub.choices["up"]
    return up


def test_every_up_flag_has_help_with_its_default() -> None:
    up = _up()
    formatter = up._get_formatter()
    for action in up._actions:
        if not action.option_strings or action.default is argparse.SUPPRESS:
            continue
        assert action.help, f"{action.option_strings[0]} has no help"
        text = formatter._expand_help(action)
        assert "default" in text and "(default: None)" not in text, (action.option_strings[0], text)
    assert "(default: 8000)" in up.format_help().replace("\n", " ")
