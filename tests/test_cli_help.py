"""What the command line tells a person: help texts written for users, and errors that point to the fix."""

from __future__ import annotations

import pytest

from kvstore.cli import SUBCOMMAND_MODULES, build_parser, main


def _commands() -> list[str]:
    parser = build_parser(SUBCOMMAND_MODULES)
    action = next(a for a in parser._actions if a.dest == "command")  # argparse keeps its subparsers here
    return sorted(action.choices)


@pytest.mark.parametrize("command", _commands())
def test_every_help_is_written_for_users(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text and ":class:" not in text, text[:600]  # no docstring markup
    assert "Importing this module" not in text  # kvstore demo --help printed its module's docstring


def test_the_demo_says_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    assert "(TTFT)" in text and "examples:" in text and "kvstore demo --target" in text


@pytest.mark.parametrize("flag", [["--tls-ca", "ca.crt"], ["--tls-cert", "node.crt"], ["--token-file", "t"]])
def test_serve_given_a_clients_tls_or_token_flag_points_to_the_security_settings(
        flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", *flag])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {' '.join(flag)}" in err
    assert "security.* settings" in err and "KVSTORE_SECURITY__TLS_CERT_FILE" in err and "--config" in err
