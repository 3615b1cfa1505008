"""The subcommands' bodies: ``run`` (the daemon), ``once``, ``health``, ``simulate`` and ``check``.

Each returns its exit code (the interface contract): 0 ok; 1 a requested collector or sink failed;
2 bad usage or bad config.
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
from typing import TYPE_CHECKING, Any

from gpumon import daemon, logs, placeholders, registry, report, sdnotify
from gpumon.cli_config import load_config
from gpumon.config import Config, ConfigError
from gpumon.daemon.listen_file import ListenFiles

if TYPE_CHECKING:
    from gpumon.collectors.base import Collector

log = logging.getLogger("gpumon")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


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
