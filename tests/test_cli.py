"""The `verl-prm` dispatcher: every command resolves to a callable, unknown commands fail with usage."""

from __future__ import annotations

import importlib

import pytest

from verl_prm import cli


@pytest.mark.parametrize("words", list(cli.COMMANDS))
def test_every_command_resolves_to_a_main_function(words):
    module_name, function_name = cli.COMMANDS[words][0].split(":")
    assert callable(getattr(importlib.import_module(module_name), function_name))


def test_unknown_command_prints_usage_and_fails(capsys):
    assert cli.main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for words in cli.COMMANDS:
        assert " ".join(words) in out
