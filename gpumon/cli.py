"""The face: parse arguments and config, then run the daemon, collect once, or check.

Exit codes (the interface contract): 0 ok; 1 a requested collector or sink failed; 2 bad usage or
bad config, with a message naming the key and the file. The subcommands' bodies are in
``cli_commands`` (and ``cli_job``), the config they load in ``cli_config``.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Sequence
from typing import Any

from gpumon import __version__, daemon, logs, registry
from gpumon.cli_commands import (
    EXIT_FAILED,
    EXIT_USAGE,
    cmd_check,
    cmd_health,
    cmd_once,
    cmd_run,
    cmd_simulate,
)
from gpumon.cli_config import load_config, schemas
from gpumon.cli_job import cmd_job
from gpumon.config import Config, ConfigError
from gpumon.sinks.azure_identity import CREDENTIALS

__all__ = ["build_parser", "load_config", "main", "schemas", "simulated_profiles", "unrecognized"]


class _Parser(argparse.ArgumentParser):
    """An unknown flag is reported by the subcommand it was given to, with that subcommand's usage
    and the closest flag it has: ``gpumon run --intreval 5`` -> "did you mean --interval?". It is
    looked for before parsing, so that its value is not first taken for a positional argument."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.subcommands: dict[str, argparse.ArgumentParser] = {}
        """The subcommands' parsers by name (set by :func:`build_parser` on the top-level one)."""

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        command = next((arg for arg in argv if not arg.startswith("-")), None)
        sub = self.subcommands.get(command or "")
        if command is not None and sub is None and self.subcommands:
            close = difflib.get_close_matches(command, list(self.subcommands), n=1, cutoff=0.6)
            self.error(f"unknown command {command!r} (choose from {', '.join(self.subcommands)})"
                       + (f"; did you mean {close[0]}?" if close else ""))
        if sub is not None:
            rest = argv[argv.index(command) + 1:]
            rest = rest[:rest.index("--")] if "--" in rest else rest
            unknown = [arg for arg in rest if arg.startswith("--") and not _known_flag(sub, arg.split("=", 1)[0])]
            if unknown:
                sub.error(unrecognized(sub, unknown))
        parsed, extras = self.parse_known_args(argv, namespace)
        if extras:
            self_or_sub = self.subcommands.get(getattr(parsed, "command", None) or "", self)
            self_or_sub.error(unrecognized(self_or_sub, extras))
        return parsed


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]


def _known_flag(parser: argparse.ArgumentParser, name: str) -> bool:
    """``name`` is a flag of ``parser`` or a prefix of one (argparse takes an abbreviation, and
    names the candidates of an ambiguous one itself)."""
    return any(flag.startswith(name) for flag in _flags(parser))


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """The error for arguments ``parser`` does not take, naming the closest flag to the first."""
    message = f"unrecognized arguments: {' '.join(extras)}"
    first = next((arg.split("=", 1)[0] for arg in extras if arg.startswith("-")), None)
    close = difflib.get_close_matches(first, _flags(parser), n=1, cutoff=0.6) if first else []
    return message + (f" (did you mean {close[0]}?)" if close else "")


def _common(parser: argparse.ArgumentParser) -> None:
    """The flags every subcommand takes: where the config is, what to collect and from where, logging."""
    parser.add_argument("--config", metavar="FILE",
                        help="TOML config file (default /etc/gpumon/gpumon.toml when present)")
    parser.add_argument("--collectors", metavar="LIST",
                        help=f"comma-separated collectors, or 'auto' (built in: {', '.join(registry.BUILTIN_COLLECTORS)})")
    parser.add_argument("--interval", metavar="SECONDS", help="default collection interval")
    parser.add_argument("--sysfs-root", metavar="DIR", help="directory holding class/infiniband (default /sys)")
    parser.add_argument("--simulate", metavar="PROFILE",
                        help=f"serve a simulated host: {', '.join(simulated_profiles())}")
    parser.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning or error")
    parser.add_argument("--log-format", metavar="FORMAT", help="text or json")
    _state_dir(parser)


def _state_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", metavar="DIR",
                        help="state directory (default /var/lib/gpumon); with --simulate, the simulated host "
                        "lives in DIR/simulate/PROFILE (once and check use a temporary one unless it is given)")


def _sink_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the subcommands that start or probe sinks (``run``, ``check``)."""
    parser.add_argument("--sinks", metavar="LIST",
                        help=f"comma-separated sinks (built in: {', '.join(registry.BUILTIN_SINKS)})")
    parser.add_argument("--listen", metavar="HOST:PORT",
                        help="Prometheus endpoint address (default 0.0.0.0:9470); port 0: one the kernel picks")


def simulated_profiles() -> list[str]:
    from gpumon.simulate import HOSTS

    return list(HOSTS)


def build_parser() -> _Parser:
    parser = _Parser(prog="gpumon", description="GPU and InfiniBand telemetry exporter.")
    parser.add_argument("--version", action="version", version=f"gpumon {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="the daemon: collectors on their own threads, sinks fed every snapshot",
                         description=(
        "Run the daemon: every collector on its own interval, every sink fed (the Prometheus endpoint, "
        "OTLP, remote write, Azure Monitor). SIGHUP reloads the config, SIGTERM stops."))
    _common(run)
    _sink_flags(run)
    run.add_argument("--listen-file", metavar="PATH", help=(
        "write the address the endpoint got (HOST:PORT, one line) to PATH once it is bound, as "
        "<state_dir>/listen always is; removed on a clean stop"))
    once = sub.add_parser("once", help="one collection, printed (table, json or prometheus)", description=(
        "Run every enabled collector once and print what it found; exit 1 when a requested collector "
        "failed. Nothing is sent to a sink."))
    _common(once)
    once.add_argument("--format", choices=("table", "json", "prometheus"), default="table",
                      help="table for people (default), json (the schema in docs/architecture.md), "
                           "prometheus (the /metrics text)")
    check = sub.add_parser("check", help="probe every enabled collector and sink and print a verdict", description=(
        "Probe every enabled collector and sink (sources found, endpoints reachable, credentials "
        "accepted, the listen address free) without sending data; exit 1 when one that is needed fails."))
    _common(check)
    _sink_flags(check)
    check.add_argument("--config-only", action="store_true",
                       help="only read and validate the configuration (deprecated keys named with their "
                            "new names); probe nothing. The Debian package runs this on upgrade")
    health = sub.add_parser("health", help="the node's health verdict; 'health clear' clears sticky verdicts",
                            description=(
        "Print the verdict a running daemon would give now: the saved sticky verdicts plus this "
        "moment's signals; exit 0 healthy, 1 degraded or unhealthy. 'health clear RULE' or "
        "'health clear --all' clears sticky verdicts (after a repair)."))
    _common(health)
    health.add_argument("--format", choices=("table", "json", "nhc"), default="table",
                        help="table for people (default), json, or nhc: NHC's own lines ('<host> | Healthy' or "
                        "'ERROR:  nhc:  Health check failed: ... FaultCode: NHCxxxx')")
    health.add_argument("action", nargs="?", choices=("clear",), help="clear sticky verdicts")
    health.add_argument("rule", nargs="?", help="the rule id (or rule|subject key) to clear")
    health.add_argument("--all", action="store_true", help="with clear: every sticky verdict")
    _simulate_parser(sub)
    _job_parser(sub)
    parser.subcommands = dict(sub.choices)
    return parser


def _simulate_parser(sub: Any) -> None:
    from gpumon.simulate.actions import ACTIONS, example_args

    examples = "\n".join(f"  gpumon simulate {example_args(a)}" for a in ACTIONS.values())
    simulate = sub.add_parser(
        "simulate", help="inject a fault into a simulated host (writes a control file; docs/simulate.md)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Drop a control file into the simulated host's control directory "
        "(STATE_DIR/simulate/PROFILE/control/): a running 'gpumon run --simulate PROFILE' applies it within "
        "a second, 'gpumon once --simulate PROFILE --state-dir STATE_DIR' at its start. STATE_DIR and "
        "PROFILE come from the flags, the environment or the config, as for the daemon; without a profile, "
        "the one simulated host under STATE_DIR is meant.",
        epilog=f"actions (docs/simulate.md says what each does):\n{examples}")
    simulate.add_argument("sim_action", metavar="ACTION", help=f"one of: {', '.join(ACTIONS)}")
    simulate.add_argument("assignments", nargs="*", metavar="KEY=VALUE",
                          help="the action's keys; a dotted key nests (health.route_unhealthy=true)")
    simulate.add_argument("--config", metavar="FILE",
                          help="TOML config file (default /etc/gpumon/gpumon.toml when present)")
    simulate.add_argument("--simulate", metavar="PROFILE", help="the simulated host's profile, e.g. nd-h100-v5")
    _state_dir(simulate)
    simulate.add_argument("--wait", metavar="SECONDS", type=float, default=0.0,
                          help="wait until a daemon takes the file (exit 1 if none does in time)")


def _job_parser(sub: Any) -> None:
    job = sub.add_parser("job", help="one job's GPUs ranked by straggler score, from Prometheus "
                         "(--list: every job)", description=(
        "Ask a Prometheus-compatible query API (Prometheus, Azure Managed Prometheus, Thanos, Mimir) that "
        "loads deploy/prometheus/job-rules.yaml for one job's hosts and GPUs, ranked worst first: verdict, "
        "straggler score and its signal, activity, power, clocks, IB rate and flaps (docs/job-health.md). "
        "Exit 1 when the API cannot be reached or the rules are missing, 2 for bad usage or an unknown job."))
    job.add_argument("job_id", nargs="?", metavar="JOB_ID", help="the job_id of the job's GPUs")
    job.add_argument("--list", action="store_true", help="list the jobs holding GPUs, worst first")
    job.add_argument("--prometheus", metavar="URL", default=os.environ.get("GPUMON_PROMETHEUS_URL", ""),
                     help="Prometheus-compatible query API (default $GPUMON_PROMETHEUS_URL)")
    job.add_argument("--auth", choices=("none", "bearer", "azure"), default="none",
                     help="bearer: --bearer-token-file; azure: an Entra ID token (Azure Managed Prometheus)")
    job.add_argument("--bearer-token-file", metavar="FILE", default="",
                     help="with --auth bearer: the file holding the token (re-read on each query)")
    job.add_argument("--credential", choices=CREDENTIALS, default="default",
                     help="with --auth azure, as [remote_write] credential (secret: $GPUMON_JOB_CLIENT_SECRET)")
    job.add_argument("--client-id", default="", help="with --auth azure: the managed identity's or app's client id")
    job.add_argument("--tenant-id", default="", help="with --auth azure and a client secret: the tenant id")
    job.add_argument("--audience", default="", help="token audience with --auth azure (default "
                     "https://prometheus.monitor.azure.com)")
    job.add_argument("--ca-file", metavar="FILE", default="", help="CAs that verify an https:// URL")
    job.add_argument("--timeout", type=float, default=10.0, help="seconds each query may take")
    job.add_argument("--format", choices=("table", "json"), default="table",
                     help="table for people (default) or json (a list of rows, worst first)")
    job.add_argument("--watch", action="store_true", help="refresh in place, like top (Ctrl-C ends)")
    job.add_argument("--interval", type=float, default=5.0, help="seconds between --watch refreshes")
    job.add_argument("--iterations", type=int, default=0, metavar="N", help="with --watch: stop after N")



def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "job":   # asks Prometheus: no daemon configuration to load
        return cmd_job(args)
    try:
        config = load_config(args)
    except ConfigError as exc:
        print(f"gpumon: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logs.setup(_log_level(args, config), config.daemon.log_format)
    command = {"run": cmd_run, "once": cmd_once, "check": cmd_check, "health": cmd_health,
               "simulate": cmd_simulate}[args.command]
    try:
        return command(args, config)
    except daemon.StartupError as exc:
        print(f"gpumon: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ConfigError as exc:  # files named by the config (web config, credentials) are config too
        print(f"gpumon: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _log_level(args: argparse.Namespace, config: Config) -> str:
    """``once`` and ``check`` print their answer; the daemon's INFO lines (NVML initialised, serving
    on ...) only clutter it. They log warnings and worse unless a level is asked for by flag or
    environment (a config file's ``log_level`` is the daemon's)."""
    origin = config.origin("daemon", "log_level")
    if args.command == "run" or origin.startswith(("flag ", "environment ")):
        return config.daemon.log_level
    return "warning"

