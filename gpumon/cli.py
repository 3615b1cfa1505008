"""The face: parse arguments and config, then run the daemon, collect once, or check.

Exit codes (the interface contract): 0 ok; 1 a requested collector or sink failed; 2 bad usage or
bad config, with a message naming the key and the file.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gpumon import __version__, daemon, imds, logs, placeholders, registry, report, sdnotify
from gpumon.config import DAEMON, Config, ConfigError, SectionSchema, load
from gpumon.daemon.listen_file import ListenFiles
from gpumon.health.settings import HEALTH
from gpumon.health.settings import check_config as check_health_config
from gpumon.sinks.azure_identity import CREDENTIALS

if TYPE_CHECKING:
    from gpumon.collectors.base import Collector
    from gpumon.sinks.base import Sink

log = logging.getLogger("gpumon")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def schemas() -> list[SectionSchema]:
    """The [daemon] section plus the section each installed collector and sink declares."""
    found = [DAEMON, HEALTH, imds.OPTIONS]
    plugins: list[tuple[str, Callable[[str], type[Collector] | type[Sink]]]] = [
        (name, registry.collector_class) for name in registry.available_collectors()]
    plugins += [(name, registry.sink_class) for name in registry.available_sinks()]
    for name, lookup in plugins:
        try:
            options = lookup(name).options
        except registry.BrokenPlugin as exc:  # one broken plugin must not take the others down
            print(f"gpumon: warning: plugin '{name}' cannot be loaded: {exc}", file=sys.stderr)
            continue
        if options is not None:
            found.append(options)
    return found


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


def load_config(args: argparse.Namespace) -> Config:
    flags = {key: getattr(args, key, None) for key in
             ("collectors", "sinks", "interval", "sysfs_root", "simulate", "log_level", "log_format", "listen",
              "state_dir")}
    config = load(schemas(), args.config, os.environ, flags)
    _check_names(config, "collectors", registry.available_collectors() + ["auto"])
    _check_names(config, "sinks", registry.available_sinks())
    check_health_config(config)
    return config


def _check_names(config: Config, key: str, known: list[str]) -> None:
    where = config.origin("daemon", key)
    for name in config.daemon[key]:
        if name not in known:
            raise ConfigError(where, f"[daemon] {key}", f"unknown name {name!r} (known: {', '.join(known)})")
    names = list(config.daemon[key])
    if len(set(names)) != len(names):
        raise ConfigError(where, f"[daemon] {key}", f"names a plugin twice: {', '.join(names)}")


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


MAIN_WAKE = 5.0
"""Longest sleep of the main thread with nothing to do (no signal, no watchdog ping due)."""
MAIN_WAKE_MIN = 0.5
"""Shortest: a watchdog ping overdue because the loop is wedged is not retried in a spin."""


def cmd_run(args: argparse.Namespace, config: Config) -> int:
    stop = threading.Event()
    reload = threading.Event()
    wake = threading.Event()
    """Set with either: the main thread sleeps until a signal or a watchdog ping is due."""

    def on_stop(signum: int, _frame: Any) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()
        wake.set()

    def on_reload(_signum: int, _frame: Any) -> None:
        reload.set()
        wake.set()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, on_reload)
    runner = daemon.Daemon(config)
    runner.on_simulated_reboot = lambda: on_reload(signal.SIGHUP, None)  # a simulated reboot starts over
    listen_files = ListenFiles(args.listen_file)

    def write_listen_files(address: str | None) -> None:
        try:
            listen_files.update(address, runner.config.daemon.state_dir)
        except OSError as exc:
            listen_files.remove()
            raise daemon.StartupError(f"cannot write the listen address to {args.listen_file}: "
                                      f"{exc.strerror or exc}") from exc

    # written as soon as the endpoint is bound, while the collectors are still probed
    runner.on_listening = write_listen_files
    try:
        runner.start()
    except BaseException:
        listen_files.remove()
        raise
    try:
        write_listen_files(runner.listening())
    except daemon.StartupError:
        runner.stop(timeout=4.5)
        raise
    sdnotify.notify("READY=1")  # the port is bound: `systemctl start` may return
    watchdog = sdnotify.Watchdog.from_environ()
    while not stop.is_set():
        due = watchdog.next_due()
        wake.wait(MAIN_WAKE if due is None else min(MAIN_WAKE, max(due, MAIN_WAKE_MIN)))
        wake.clear()
        if stop.is_set():
            break
        if runner.loop is not None and runner.loop.alive():
            watchdog.tick()  # a wedged loop stops the pings and systemd restarts the service
        if reload.is_set():
            reload.clear()
            sdnotify.reloading()
            _reload(args, runner)
            _report_listen(listen_files, runner)
            sdnotify.notify("READY=1")
    sdnotify.notify("STOPPING=1")
    runner.stop(timeout=4.5)
    listen_files.remove()
    return EXIT_OK


def _report_listen(listen_files: ListenFiles, runner: daemon.Daemon) -> None:
    """After a reload: the endpoint may have moved (a new ``listen``, a new port for ``:0``)."""
    try:
        listen_files.update(runner.listening(), runner.config.daemon.state_dir)
    except OSError as exc:
        log.error("cannot write the listen address to %s: %s", listen_files.explicit, exc.strerror or exc)


def _reload(args: argparse.Namespace, runner: daemon.Daemon) -> None:
    log.info("SIGHUP: reloading configuration")
    try:
        new = load_config(args)
    except ConfigError as exc:
        log.error("new configuration rejected, keeping the running one: %s", exc)
        runner.reload_rejected()
        return
    except Exception as exc:  # noqa: BLE001 - a plugin's schema bug must not take the running daemon down
        log.error("new configuration rejected, keeping the running one: %s: %s", type(exc).__name__, exc,
                  exc_info=log.isEnabledFor(logging.DEBUG))
        runner.reload_rejected()
        return
    runner.reload(new)
    logs.setup(runner.config.daemon.log_level, runner.config.daemon.log_format)


def _once_context(config: Config, consume: bool = False, host: bool = False):
    """``once`` never leaves a simulated tree behind: it simulates in a temporary directory. With a
    state directory given (``host``, or always for ``health``), the simulated host there lends its
    faults, boot id and saved state; ``consume`` (``once``) applies the control files waiting there."""
    if not config.daemon.simulate:
        ctx = daemon.make_context(config)
        ctx.persist_state = False  # a one-shot run leaves the daemon's saved state (read positions) alone
        return ctx, None
    home = daemon.simulation_dir(config) if host or "daemon.state_dir" in config.origins else None
    tmp = tempfile.mkdtemp(prefix="gpumon-once-")
    try:
        return daemon.make_context(config.replace("daemon", state_dir=tmp), simulation_home=home,
                                   consume=consume and home is not None), tmp
    except BaseException:  # an unknown profile: nothing of it may stay behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cmd_once(args: argparse.Namespace, config: Config) -> int:
    ctx, tmp = _once_context(config, consume=True)
    try:
        config = ctx.config  # the one config in effect: ``--simulate`` applied at load
        plan = daemon.plan_collectors(config, ctx)
        snapshot = daemon.collect_once(config, plan, ctx, health=daemon.health_stage(config, ctx, persist=False))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    render = {"table": report.as_table, "json": report.as_json, "prometheus": report.as_prometheus}[args.format]
    sys.stdout.write(render(snapshot))
    if args.format == "json":
        sys.stdout.write("\n")
    problems = plan.problems() + [f"collector '{c.name}' failed: {c.error}" for c in snapshot.collectors
                                  if not c.ok and c.available]
    for problem in problems:
        print(f"gpumon: {problem}", file=sys.stderr)
    return EXIT_FAILED if problems else EXIT_OK


def cmd_health(args: argparse.Namespace, config: Config) -> int:
    """The verdict a running daemon would give now: saved sticky verdicts plus this moment's signals."""
    if args.action == "clear":
        return _health_clear(args, config)
    if args.rule or args.all:
        print("gpumon: error: a rule or --all goes with 'health clear'", file=sys.stderr)
        return EXIT_USAGE
    ctx, tmp = _once_context(config, host=True)
    try:
        stage = daemon.health_stage(ctx.config, ctx, persist=False, state_dir=daemon.host_state_dir(config))
        if stage is None:
            print("gpumon: error: [health] enabled = false: no verdict", file=sys.stderr)
            return EXIT_USAGE
        daemon.collect_once(ctx.config, daemon.plan_collectors(ctx.config, ctx), ctx, health=stage)
        verdict = stage.verdict()
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.format == "nhc":
        sys.stdout.write(report.health_nhc(verdict, daemon.hostname(config).split(".")[0]))
    else:
        sys.stdout.write(report.health_json(verdict) if args.format == "json" else report.health_table(verdict))
    return EXIT_OK if verdict.level == 0 else EXIT_FAILED


def _health_clear(args: argparse.Namespace, config: Config) -> int:
    from gpumon.health.state import clear

    if bool(args.rule) == bool(args.all):
        print("gpumon: error: 'health clear' takes a rule id or --all", file=sys.stderr)
        return EXIT_USAGE
    try:
        gone = clear(daemon.host_state_dir(config), None if args.all else args.rule)
    except OSError as exc:
        print(f"gpumon: error: cannot clear the health state in {daemon.host_state_dir(config)}: {exc}",
              file=sys.stderr)
        return EXIT_FAILED
    print(f"cleared {len(gone)} verdict(s){': ' if gone else ''}{', '.join(gone)}")
    if gone:
        print("the flaps or errors counted towards them are forgotten (only new ones count); a condition "
              "still present (a lost GPU, a port down) is found again at the next evaluation")
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace, config: Config) -> int:
    """Write one control file for the simulated host a daemon with this config runs."""
    import time

    from gpumon.simulate import HOSTS, control
    from gpumon.simulate.actions import check, parse_assignments

    profile = config.daemon.simulate or _the_simulated_host(config.daemon.state_dir)
    if not profile:
        return EXIT_USAGE
    if profile not in HOSTS:
        print(f"gpumon: error: unknown simulation profile {profile!r} (known: {', '.join(sorted(HOSTS))})",
              file=sys.stderr)
        return EXIT_USAGE
    host = HOSTS[profile]
    try:
        command = parse_assignments(args.sim_action, args.assignments)
        check(command, gpu=host.gpu_count > 0, ib=host.ib_profile is not None)
    except ValueError as exc:
        print(f"gpumon: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    home = daemon.simulation_dir(config.replace("daemon", simulate=profile))
    try:
        path = control(home, command)
    except OSError as exc:
        print(f"gpumon: error: cannot write a control file in {home}/control: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"wrote {path}")
    deadline = time.monotonic() + args.wait
    while args.wait > 0 and os.path.exists(path):
        if time.monotonic() >= deadline:
            print(f"gpumon: nothing took it in {args.wait:g} s: is 'gpumon run --simulate {profile} --state-dir "
                  f"{config.daemon.state_dir}' running? (the file waits for it)", file=sys.stderr)
            return EXIT_FAILED
        time.sleep(0.05)
    if args.wait > 0:
        print("taken by the simulated host (its log says whether it applied)")
    return EXIT_OK


def _the_simulated_host(state_dir: str) -> str:
    """The one profile simulated under ``state_dir`` when none is named ("" and a message otherwise)."""
    try:
        found = sorted(name for name in os.listdir(os.path.join(state_dir, "simulate"))
                       if os.path.isdir(os.path.join(state_dir, "simulate", name, "control")))
    except OSError:
        found = []
    if len(found) == 1:
        return found[0]
    which = f"one of {', '.join(found)}" if found else "no simulated host is there yet"
    print(f"gpumon: error: which simulated host? give --simulate PROFILE (state directory {state_dir}: {which})",
          file=sys.stderr)
    return ""


def _check_health_actions(config: Config) -> bool:
    """The health actions that are on: each one's problems (scontrol missing, no node name, ...)."""
    from gpumon.health.settings import action_settings, actions_on

    section = config.sections.get("health")
    if section is None or not section["enabled"]:
        return False
    settings = daemon.with_imds(action_settings(section), config)
    if not actions_on(settings):
        return False
    from gpumon.health.actions import check

    problems = check(settings)
    for problem in problems:
        print(f"health    {'actions':<28} FAIL  {problem}")
    if not problems:
        on = [name for name, flag in (("slurm", settings.slurm), ("kubernetes", settings.kubernetes),
                                      ("hook", bool(settings.hook)), ("azure_ghr", settings.azure_ghr)) if flag]
        print(f"health    {'actions':<28} ok    {', '.join(on)}")
    return bool(problems)


def _trial(collector: Collector, found: str) -> tuple[str, str]:
    """``check``'s verdict on a collector whose source exists: what its runs will meet."""
    try:
        trial = collector.check()
    except Exception as exc:  # a check must not raise; if it does, the daemon's runs would too
        return "FAIL", f"check raised {type(exc).__name__}: {exc}"
    if trial.available:
        return "ok", found
    if trial.retry:
        return "wait", f"{trial.reason} (gpumon run keeps retrying)"
    return "FAIL", trial.reason


def _placeholders_in_use(config: Config) -> list[placeholders.Placeholder]:
    """The stand-ins of the shipped examples left in what this config uses: a sink's section only
    when the sink is enabled, the Azure identity variables only when a sink that reads them is."""
    sinks = set(config.daemon.sinks)
    idle = set(registry.available_sinks()) - sinks
    identity = bool(sinks & set(placeholders.AZURE_IDENTITY_SINKS))
    return [p for p in placeholders.find(config.sections, config.origin, os.environ)
            if (p.section and p.section not in idle) or (not p.section and identity)]


def cmd_check(args: argparse.Namespace, config: Config) -> int:
    if args.config_only:  # load_config has validated it and named every deprecated key
        print(f"config    {config.source}: ok")
        return 0
    ctx, tmp = _once_context(config)
    failed = False
    try:
        plan = daemon.plan_collectors(ctx.config, ctx)
        for planned in plan.collectors:
            if planned.available and planned.collector is not None:
                verdict, detail = _trial(planned.collector, planned.reason or "source found")
                failed |= verdict == "FAIL"
            elif planned.explicit:
                verdict, detail, failed = "FAIL", planned.reason, True
            elif planned.waiting:
                verdict, detail = "wait", f"{planned.reason} (gpumon run keeps retrying)"
            else:
                verdict, detail = "skip", planned.reason
            print(f"collector {planned.name:<28} {verdict:<5} {detail}")
            if planned.collector is not None:
                planned.collector.close()
        stand_ins = _placeholders_in_use(config)
        for found in stand_ins:
            print(f"config    {found.where:<28} FAIL  {found.origin}: {found.what}")
            failed = True
        sctx = daemon.sink_context(config)
        for name in config.daemon.sinks:
            held = [p.where for p in stand_ins
                    if p.section == name or (not p.section and name in placeholders.AZURE_IDENTITY_SINKS)]
            if held:
                print(f"sink      {name:<28} FAIL  not probed: {', '.join(held)} still a placeholder (see above)")
                continue
            try:
                sink = daemon.make_sinks(config.replace("daemon", sinks=[name]), sctx)[0]
                results = sink.check()
            except daemon.StartupError as exc:
                print(f"sink      {name:<28} FAIL  {exc}")
                failed = True
                continue
            for result in results:
                failed |= not result.ok
                print(f"sink      {result.item:<28} {'ok' if result.ok else 'FAIL':<5} {result.message}")
        failed |= _check_health_actions(config)
        for conflict in registry.conflicts():  # a plugin that took a built-in's name is ignored: say so
            print(f"plugin    {'entry points':<28} FAIL  {conflict}")
            failed = True
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return EXIT_FAILED if failed else EXIT_OK


def cmd_job(args: argparse.Namespace) -> int:
    """``gpumon job``: exit 0 shown; 1 the server could not answer (unreachable, refused, rules not
    loaded); 2 bad usage or a job no GPU is held by."""
    from gpumon.fleet import job as fleet_job
    from gpumon.fleet.promql import AZURE_AUDIENCE, Auth, Client
    from gpumon.report import jobs as job_report

    logs.setup("warning", "text")
    problem = ("give a JOB_ID or --list, not both" if bool(args.job_id) == bool(args.list) else
               "--prometheus URL (or $GPUMON_PROMETHEUS_URL) is required" if not args.prometheus else
               "--bearer-token-file is required with --auth bearer"
               if args.auth == "bearer" and not args.bearer_token_file else
               "--interval must be at least 0.1 s" if args.interval < 0.1 else "")
    if problem:
        print(f"gpumon: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    auth = Auth(args.auth, args.bearer_token_file, args.credential, args.client_id, args.tenant_id,
                os.environ.get("GPUMON_JOB_CLIENT_SECRET", ""), args.audience or AZURE_AUDIENCE)
    try:
        view = fleet_job.JobView(Client(args.prometheus, auth, args.timeout, args.ca_file))
    except ConfigError as exc:   # the credential's settings, named by the flag that gives each
        flag = "$GPUMON_JOB_CLIENT_SECRET" if exc.key == "client_secret" else "--" + exc.key.replace("_", "-")
        print(f"gpumon: error: gpumon job: {flag}: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, OSError, ImportError) as exc:   # bad URL or CA file, no azure-identity
        print(f"gpumon: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    def render() -> str:
        if args.list:
            jobs = view.jobs()
            return job_report.jobs_json(jobs) if args.format == "json" else job_report.jobs_table(jobs)
        rows = view.rows(args.job_id)
        return job_report.job_json(rows) if args.format == "json" else job_report.job_table(args.job_id, rows)

    try:
        return _show(args, render, view.client.shown)
    except KeyboardInterrupt:   # Ctrl-C ends --watch (or a slow query)
        return EXIT_OK


def _show(args: argparse.Namespace, render: Callable[[], str], url: str) -> int:
    """Print once, or (``--watch``) redraw every ``--interval`` seconds, errors included, like top."""
    from gpumon.fleet.job import UnknownJob
    from gpumon.fleet.promql import QueryFailed

    done = 0
    while True:
        try:
            text, code = render(), EXIT_OK
        except UnknownJob as exc:
            text, code = f"gpumon: error: {exc}\n", EXIT_USAGE
        except QueryFailed as exc:
            text, code = f"gpumon: error: {exc}\n", EXIT_FAILED
        except ConfigError as exc:
            text, code = f"gpumon: error: {exc}\n", EXIT_USAGE
        if not args.watch:
            (sys.stdout if code == EXIT_OK else sys.stderr).write(text)
            return code
        if args.format == "table":   # like top: home, clear, redraw
            sys.stdout.write(f"\x1b[H\x1b[2J{url}  every {args.interval:g} s  {_clock()}\n{text}")
        else:
            sys.stdout.write(text)
        sys.stdout.flush()
        done += 1
        if args.iterations and done >= args.iterations:
            return code
        threading.Event().wait(args.interval)


def _clock() -> str:
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc).strftime("%H:%M:%S UTC")
