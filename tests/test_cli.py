"""The command line a new user meets: `asyncllm --version`, `--help` naming every command, every
flag with its help and default, and a benchmark that says what it is."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from asyncllm import EngineArgs, cli, serve
from asyncllm.server.args import ServerArgs


def run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    out, err = capsys.readouterr()
    return exited.value.code or 0, out, err


def test_version(capsys) -> None:
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out.startswith("asyncllm ")


def test_help_lists_every_command(capsys) -> None:
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for command in ("serve", "chat", "bench throughput", "bench serve"):
        assert f"    {command}" in out


def test_an_unknown_command_is_an_error(capsys) -> None:
    code, _, err = run(["serv"], capsys)
    assert code == 2 and "invalid choice: 'serv'" in err


def test_every_engine_and_server_flag_has_its_own_help() -> None:
    assert {f.name for f in dataclasses.fields(EngineArgs)} == serve.ENGINE_FLAG_HELP.keys()
    assert {f.name for f in dataclasses.fields(ServerArgs)} == serve.SERVER_FLAG_HELP.keys()


def test_every_serve_flag_has_help_and_shows_its_default() -> None:
    parser = serve.make_parser("asyncllm serve")
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, action.option_strings
        assert "default" in formatter._get_help_string(action), action.option_strings


def test_serve_help_never_shows_the_api_key(monkeypatch, capsys) -> None:
    monkeypatch.setenv("ASYNCLLM_API_KEY", "s3cret")
    with pytest.raises(SystemExit):
        serve.main(["--help"])
    assert "s3cret" not in capsys.readouterr().out


@pytest.mark.parametrize("name", ["throughput", "serve"])
def test_bench_names_itself_and_documents_its_flags(name: str, capsys) -> None:
    code, out, err = run(["bench", name, "--help"], capsys)
    assert code == 0 and f"asyncllm bench {name}" in err
    assert "--disable-tqdm" in out and "(default: " in out
