"""The face: parse arguments and config, then run the daemon, collect once, or check.

Exit codes (the interface contract): 0 ok; 1 a requested collector or sink failed; 2 bad usage or
bad config, with a message naming the key and the file.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gpumon import __version__, daemon, imds, logs, registry, report, sdnotify
from gpumon.config import DAEMON, Config, ConfigError, SectionSchema, load
from gpumon.health.settings import HEALTH
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


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="TOML config file (default /etc/gpumon/gpumon.toml when present)")
    parser.add_argument("--collectors", metavar="LIST", help="comma-separated collectors, or 'auto'")
    parser.add_argument("--sinks", metavar="LIST", help="comma-separated sinks (prometheus,otel,azure_monitor)")
    parser.add_argument("--listen", metavar="HOST:PORT", help="Prometheus endpoint address (default 0.0.0.0:9470)")
    parser.add_argument("--interval", metavar="SECONDS", help="default collection interval")
    parser.add_argument("--sysfs-root", metavar="DIR", help="directory holding class/infiniband (default /sys)")
    parser.add_argument("--simulate", metavar="PROFILE", help="serve a simulated host, e.g. nd-h100-v5")
    parser.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning or error")
    parser.add_argument("--log-format", metavar="FORMAT", help="text or json")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpumon", description="GPU and InfiniBand telemetry exporter.")
    parser.add_argument("--version", action="version", version=f"gpumon {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="run the daemon")
    _common(run)
    once = sub.add_parser("once", help="collect once and print")
    _common(once)
    once.add_argument("--format", choices=("table", "json", "prometheus"), default="table")
    check = sub.add_parser("check", help="probe every enabled collector and sink and print a verdict")
    _common(check)
    health = sub.add_parser("health", help="the node's health verdict (exit 0 healthy, 1 degraded or "
                            "unhealthy); 'health clear RULE|--all' clears sticky verdicts")
    _common(health)
    health.add_argument("--format", choices=("table", "json"), default="table")
    health.add_argument("action", nargs="?", choices=("clear",), help="clear sticky verdicts")
    health.add_argument("rule", nargs="?", help="the rule id (or rule|subject key) to clear")
    health.add_argument("--all", action="store_true", help="with clear: every sticky verdict")
    _job_parser(sub)
    return parser


def _job_parser(sub: Any) -> None:
    job = sub.add_parser("job", help="one job's GPUs ranked by straggler score, from Prometheus "
                         "(--list: every job)")
    job.add_argument("job_id", nargs="?", metavar="JOB_ID", help="the job_id of the job's GPUs")
    job.add_argument("--list", action="store_true", help="list the jobs holding GPUs, worst first")
    job.add_argument("--prometheus", metavar="URL", default=os.environ.get("GPUMON_PROMETHEUS_URL", ""),
                     help="Prometheus-compatible query API (default $GPUMON_PROMETHEUS_URL)")
    job.add_argument("--auth", choices=("none", "bearer", "azure"), default="none",
                     help="bearer: --bearer-token-file; azure: an Entra ID token (Azure Managed Prometheus)")
    job.add_argument("--bearer-token-file", metavar="FILE", default="")
    job.add_argument("--credential", choices=CREDENTIALS, default="default",
                     help="with --auth azure, as [remote_write] credential (secret: $GPUMON_JOB_CLIENT_SECRET)")
    job.add_argument("--client-id", default="")
    job.add_argument("--tenant-id", default="")
    job.add_argument("--audience", default="", help="token audience with --auth azure (default "
                     "https://prometheus.monitor.azure.com)")
    job.add_argument("--ca-file", metavar="FILE", default="", help="CAs that verify an https:// URL")
    job.add_argument("--timeout", type=float, default=10.0, help="seconds each query may take")
    job.add_argument("--format", choices=("table", "json"), default="table")
    job.add_argument("--watch", action="store_true", help="refresh in place, like top (Ctrl-C ends)")
    job.add_argument("--interval", type=float, default=5.0, help="seconds between --watch refreshes")
    job.add_argument("--iterations", type=int, default=0, metavar="N", help="with --watch: stop after N")


def load_config(args: argparse.Namespace) -> Config:
    flags = {key: getattr(args, key) for key in
             ("collectors", "sinks", "interval", "sysfs_root", "simulate", "log_level", "log_format", "listen")}
    config = load(schemas(), args.config, os.environ, flags)
    _check_names(config, "collectors", registry.available_collectors() + ["auto"])
    _check_names(config, "sinks", registry.available_sinks())
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
    command = {"run": cmd_run, "once": cmd_once, "check": cmd_check, "health": cmd_health}[args.command]
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
    runner.start()
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
            sdnotify.notify("READY=1")
    sdnotify.notify("STOPPING=1")
    runner.stop(timeout=4.5)
    return EXIT_OK


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


def _once_context(config: Config):
    """``once`` never leaves a simulated tree behind: it simulates in a temporary directory."""
    if not config.daemon.simulate:
        ctx = daemon.make_context(config)
        ctx.persist_state = False  # a one-shot run leaves the daemon's saved state (read positions) alone
        return ctx, None
    tmp = tempfile.mkdtemp(prefix="gpumon-once-")
    try:
        return daemon.make_context(config.replace("daemon", state_dir=tmp)), tmp
    except BaseException:  # an unknown profile: nothing of it may stay behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cmd_once(args: argparse.Namespace, config: Config) -> int:
    ctx, tmp = _once_context(config)
    try:
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
    ctx, tmp = _once_context(config)
    try:
        stage = daemon.health_stage(config, ctx, persist=False, state_dir=daemon.host_state_dir(config))
        if stage is None:
            print("gpumon: error: [health] enabled = false: no verdict", file=sys.stderr)
            return EXIT_USAGE
        daemon.collect_once(config, daemon.plan_collectors(config, ctx), ctx, health=stage)
        verdict = stage.verdict()
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
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
    return EXIT_OK


def _check_health_actions(config: Config) -> bool:
    """The health actions that are on: each one's problems (scontrol missing, no node name, ...)."""
    from gpumon.health.settings import action_settings, actions_on

    section = config.sections.get("health")
    if section is None or not section["enabled"]:
        return False
    settings = action_settings(section)
    if not actions_on(settings):
        return False
    from gpumon.health.actions import check

    problems = check(settings)
    for problem in problems:
        print(f"health    {'actions':<28} FAIL  {problem}")
    if not problems:
        on = [name for name, flag in (("slurm", settings.slurm), ("kubernetes", settings.kubernetes),
                                      ("hook", bool(settings.hook))) if flag]
        print(f"health    {'actions':<28} ok    {', '.join(on)}")
    return bool(problems)


def cmd_check(args: argparse.Namespace, config: Config) -> int:
    ctx, tmp = _once_context(config)
    failed = False
    try:
        plan = daemon.plan_collectors(config, ctx)
        for planned in plan.collectors:
            if planned.available:
                verdict, detail = "ok", planned.reason or "source found"
            elif planned.explicit:
                verdict, detail, failed = "FAIL", planned.reason, True
            elif planned.waiting:
                verdict, detail = "wait", f"{planned.reason} (gpumon run keeps retrying)"
            else:
                verdict, detail = "skip", planned.reason
            print(f"collector {planned.name:<28} {verdict:<5} {detail}")
            if planned.collector is not None:
                planned.collector.close()
        sctx = daemon.sink_context(config)
        for name in config.daemon.sinks:
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
