"""Bad usage is answered by the subcommand that was asked: its usage line, the closest flag, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpumon import cli
from tests.conftest import clean_env


def gpumon(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumon", *args], env=clean_env(), capture_output=True,
                          text=True, timeout=30)


def test_a_typo_d_flag_names_the_closest_one_with_the_subcommand_s_usage():
    result = gpumon("run", "--intreval", "5")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: gpumon run ")
    assert "gpumon run: error: unrecognized arguments: --intreval (did you mean --interval?)" in result.stderr


@pytest.mark.parametrize(("argv", "suggestion"), [
    (["once", "--fromat", "json"], "--format"),
    (["check", "--snks=otel"], "--sinks"),
    (["health", "--colectors", "nvml"], "--collectors"),
])
def test_each_subcommand_suggests_from_its_own_flags(argv, suggestion, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: gpumon {argv[0]} ") and f"(did you mean {suggestion}?)" in err


def test_nothing_close_gets_no_guess(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "--zzzzzz"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


@pytest.mark.parametrize("command", ["once", "health"])
@pytest.mark.parametrize("flag", ["--listen=127.0.0.1:0", "--sinks=otel"])
def test_commands_that_start_no_sink_take_no_sink_flags(command, flag, capsys):
    """``once`` and ``health`` collect and print; a sink or listen address would be silently unused."""
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args([command, flag])
    assert exit_.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "check"])
def test_run_and_check_take_the_sink_flags(command):
    args = cli.build_parser().parse_args([command, "--sinks", "prometheus", "--listen", "127.0.0.1:0"])
    assert (args.sinks, args.listen) == ("prometheus", "127.0.0.1:0")


def test_every_subcommand_has_a_description_and_every_flag_help():
    for name, parser in cli.build_parser().subcommands.items():
        assert parser.description, f"gpumon {name} has no description"
        for action in parser._actions:
            assert action.help, f"gpumon {name} {'/'.join(action.option_strings) or action.dest} has no help"


def test_help_names_every_built_in_sink_and_simulated_profile():
    from gpumon.registry import BUILTIN_SINKS
    from gpumon.simulate import HOSTS

    text = " ".join(cli.build_parser().subcommands["run"].format_help().split())
    assert all(name in text for name in BUILTIN_SINKS) and "remote_write" in text
    assert all(profile in text for profile in HOSTS)


def test_a_typo_d_command_names_the_closest_one(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["helth"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: gpumon ")
    assert "unknown command 'helth' (choose from run, once, check, health, simulate, job); did you mean health?" in err
