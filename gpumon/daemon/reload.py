"""``gpumon run``: the Daemon builds a set-up (context, plan, sinks, health stage) from a Config,
launches it, and on SIGHUP builds the next one before it touches the running one."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpumon import __version__, statelock
from gpumon.collectors.base import Context
from gpumon.config import Config, ConfigError
from gpumon.daemon.context import make_context, sink_context
from gpumon.daemon.health import endpoint_verdict, health_stage
from gpumon.daemon.identity import identity_provider
from gpumon.daemon.loop import Loop, ReloadCounts
from gpumon.daemon.plan import Plan, StartupError, close_plan, make_sinks, plan_collectors
from gpumon.health.stage import HealthStage
from gpumon.identity import IdentityProvider
from gpumon.sinks.base import Sink

log = logging.getLogger("gpumon.daemon")


CARRIED_ACROSS_RELOAD = ("flaps", "xid_ledger")
"""Shared collector state a reload keeps when the host view (sysfs root, state dir) is unchanged."""


@dataclass
class LoopHolder:
    """The loop a set-up's sinks ask about: built before it (so they can be started first), they
    learn it once it is launched. Until then the loop counts as alive and there is no verdict."""

    loop: Loop | None = None

    def alive(self) -> bool:
        return self.loop.alive() if self.loop is not None else True

    def verdict(self) -> dict | None:
        return endpoint_verdict(self.loop)


@dataclass
class _Build:
    """A validated, probed, not yet running set-up for one config."""

    config: Config
    ctx: Context
    plan: Plan
    sinks: list[Sink]
    fresh: list[Sink]
    holder: LoopHolder
    health: HealthStage | None = None
    health_key: tuple | None = None
    identity: IdentityProvider | None = None


class Daemon:
    """``gpumon run``: builds the loop from a Config, and rebuilds it on reload.

    A set-up is built (config validated, collectors probed, sinks constructed) before anything
    running is touched, so a reload with a config that cannot work leaves the running one alone."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.loop: Loop | None = None
        self.ctx: Context | None = None
        self.reloads = ReloadCounts()
        self._fingerprints: dict[str, dict | None] = {}
        self._state_lock: statelock.StateLock | None = None
        self._health_key: tuple | None = None
        #: what ``gpumon run`` does when its simulated host reboots: reload, so the collectors start
        #: over on the rebooted host as a restarted daemon would on a real one (None: nothing)
        self.on_simulated_reboot: Callable[[], None] | None = None
        self.on_listening: Callable[[str], None] | None = None
        """Told ``HOST:PORT`` as soon as the endpoint is bound at start, before the collectors are
        probed (``gpumon run`` writes its listen files there); may raise OSError to stop the start."""
        #: the next reload starts over (the simulated host rebooted): no series, totals or shared
        #: collector state carried from the running loop, which knew the host before the reboot
        self._start_over = False

    def _build(self, config: Config, kept: dict[str, Sink], running_health: HealthStage | None = None,
               ctx: Context | None = None) -> _Build:
        """``running_health``: the health stage to keep when ``[health]`` did not change (the running
        loop's, or the previous loop's for a rollback after a failed reload). ``ctx``: the context
        already made for ``config`` (at start, before the endpoint opened)."""
        if running_health is None and self.loop is not None:
            running_health = self.loop.health
        ctx = ctx if ctx is not None else make_context(config)
        config = ctx.config  # the one config in effect from here on (``--simulate`` applied at load)
        if self.ctx is not None and not self._start_over and (
                (self.ctx.sysfs_root, self.ctx.state_dir) == (ctx.sysfs_root, ctx.state_dir)):
            for key in CARRIED_ACROSS_RELOAD:
                ctx.adopt_shared(self.ctx, key)
        plan = plan_collectors(config, ctx)
        try:
            for planned in plan.collectors:
                if planned.waiting and not planned.explicit:
                    log.warning("collector %s not ready: %s; running it, reported down until it is",
                                planned.name, planned.reason)
                elif not planned.available:
                    (log.error if planned.explicit else log.info)(
                        "collector %s unavailable: %s", planned.name, planned.reason)
            problems = plan.problems()
            if problems:
                raise StartupError("; ".join(problems))
            holder = LoopHolder()
            sctx = sink_context(config, holder.alive)
            section = config.sections.get("health")
            if section is not None and section["enabled"]:
                sctx.health_verdict = holder.verdict
            fresh = make_sinks(config.replace("daemon", sinks=[n for n in config.daemon.sinks if n not in kept]),
                               sctx)
            pending = list(fresh)
            sinks = [kept[name] if name in kept else pending.pop(0) for name in config.daemon.sinks]
            for sink in kept.values():
                sink.ctx.loop_alive = sctx.loop_alive
                sink.ctx.health_verdict = sctx.health_verdict
        except BaseException:
            close_plan(plan)
            if ctx.simulation is not None:
                ctx.simulation.stop()  # and its temporary directory, if it made one
            raise
        health, health_key = self._health_for(config, ctx, running_health)
        identity = identity_provider(config, (p.name for p in plan.running), sinks)
        return _Build(config, ctx, plan, sinks, fresh, holder, health, health_key, identity)

    def _launch(self, build: _Build, previous: Loop | None = None) -> None:
        """Start the new sinks (binding ports), then the loop. On a sink failure nothing is left
        running but the kept sinks, which the caller still owns."""
        started: list[Sink] = []
        for sink in build.fresh:
            try:
                sink.start()
            except Exception as exc:
                for done in started:
                    done.stop(1.0)
                close_plan(build.plan)
                if build.ctx.simulation is not None:
                    build.ctx.simulation.stop()
                if isinstance(exc, ConfigError):  # a directory it cannot use, a spool another gpumon
                    raise                         # holds: bad usage, exit 2, naming the key
                reason = _start_failure(build.config, sink, exc)
                raise StartupError(f"sink '{sink.name}' failed to start: {reason}") from exc
            started.append(sink)
        loop = Loop(build.config, build.plan, build.ctx, build.sinks, self.reloads, build.health, build.identity)
        if previous is not None:
            loop.carry_over(previous)
        build.holder.loop = loop
        if build.ctx.simulation is not None:
            build.ctx.simulation.on_reboot = self._simulated_reboot
            build.ctx.simulation.start()
        loop.start()
        self.config, self.loop, self.ctx = build.config, loop, build.ctx
        self._health_key = build.health_key
        # taken now: comparing two configs later would stat the same (already changed) files twice
        self._fingerprints = {sink.name: _fingerprint(build.config, sink.name) for sink in build.sinks}
        log.info("gpumon %s running collectors: %s; sinks: %s", __version__,
                 ", ".join(p.name for p in build.plan.running) or "none",
                 ", ".join(s.name for s in build.sinks))

    def _health_for(self, config: Config, ctx: Context,
                    running: HealthStage | None) -> tuple[HealthStage | None, tuple | None]:
        """The health stage and its key; a reload that changes neither ``[health]`` nor the state
        directory keeps the running one (its memory of counters and of the last verdict). The key is
        the daemon's only once the set-up launched (``_launch``). A simulated host that rebooted gets
        a new stage, which clears the verdicts of the boot before, as a real reboot's new daemon does."""
        section = config.sections.get("health")
        if section is None or not section["enabled"]:
            return None, None
        key = (dict(section), ctx.state_dir, ctx.simulation.boot_id if ctx.simulation is not None else None)
        if running is not None and self._health_key == key:
            return running, key
        return health_stage(config, ctx, act=True), key

    def start(self) -> Plan:
        """Lock the state directory, open the endpoint, probe, start the other sinks, start
        collectors. Raises StartupError for exit 1, ConfigError for 2 (a bad config, or a state
        directory another gpumon holds)."""
        self._state_lock = statelock.acquire(self.config)
        early: dict[str, Sink] = {}
        ctx: Context | None = None
        try:
            ctx = make_context(self.config)  # a bad sysfs_root or profile is exit 2 before any port opens
            early = self._serve_first(ctx.config)
            address = next((a for a in (_listening(sink) for sink in early.values()) if a), None)
            if address is not None and self.on_listening is not None:
                self.on_listening(address)
            build = self._build(self.config, early, ctx=ctx)
            ctx = None  # the build owns it now (and stops its simulation when it fails)
            self._launch(build)
        except BaseException:
            for sink in early.values():
                sink.stop(1.0)
            if ctx is not None and ctx.simulation is not None:
                ctx.simulation.stop()
            self._state_lock.release()
            raise
        return build.plan

    def listening(self) -> str | None:
        """``HOST:PORT`` the running sinks accept connections on (the Prometheus endpoint), as bound."""
        for sink in self.loop.sinks if self.loop is not None else ():
            address = _listening(sink)
            if address is not None:
                return address
        return None

    @staticmethod
    def _serve_first(config: Config) -> dict[str, Sink]:
        """Start the endpoint before the collectors are probed: a probe may wait (on IMDS, on a wedged
        GPU driver) for as long as its deadline, and the port must be open, saying "not ready yet"
        (``/metrics`` 503 until the first snapshot), rather than closed meanwhile. The set-up built
        next takes it as a sink it keeps, as a reload does."""
        if "prometheus" not in config.daemon.sinks:
            return {}
        holder = LoopHolder()
        (sink,) = make_sinks(config.replace("daemon", sinks=["prometheus"]), sink_context(config, holder.alive))
        try:
            sink.start()
        except ConfigError:
            raise
        except Exception as exc:
            raise StartupError(f"sink '{sink.name}' failed to start: {_start_failure(config, sink, exc)}") from exc
        return {sink.name: sink}

    def stop(self, timeout: float = 5.0) -> None:
        """Stop everything and give the state directory up for the next instance."""
        health = self.loop.health if self.loop is not None else None
        self._halt(timeout)
        if health is not None:
            health.close()
        if self._state_lock is not None:
            self._state_lock.release()

    def _halt(self, timeout: float = 5.0, keep: frozenset[str] = frozenset()) -> None:
        """The loop first, then the simulated host it reads: a collector or the health stage still
        writing under a simulation's temporary directory would leave it behind once removed."""
        end = time.monotonic() + timeout
        if self.loop is not None:
            self.loop.stop(max(0.5, end - time.monotonic()), keep)
            self.loop = None
        if self.ctx is not None and self.ctx.simulation is not None:
            self.ctx.simulation.stop()

    def reload(self, new_config: Config) -> None:
        """Swap in a new config. Sinks whose settings (and the files they name) did not change keep
        running, so the endpoint answers throughout. A config that cannot be built is rejected before
        anything stops; one whose new sink fails to start brings the previous config back."""
        old = self.config
        start_over = self._start_over
        running = {sink.name: sink for sink in self.loop.sinks} if self.loop is not None else {}
        kept = {name: sink for name, sink in running.items()
                if name in new_config.daemon.sinks and self._fingerprints.get(name) == _fingerprint(new_config, name)}
        for sink in kept.values():  # files a kept sink names (a certificate renewed in place) are re-read now
            refresh = getattr(sink, "refresh", None)
            if callable(refresh):
                refresh()
        new_lock = None
        try:
            new_lock = self._lock_for(new_config)
            build = self._build(new_config, kept)
            self._start_over = False
        except Exception as exc:
            log.error("new configuration rejected, keeping the running one: %s", exc)
            if new_lock is not None:
                new_lock.release()
            self.reload_rejected()
            return
        previous = self.loop
        self._halt(timeout=3.0, keep=frozenset(running))
        for name, sink in running.items():
            if name not in kept:
                sink.stop(1.0)
        try:
            self._launch(build, None if start_over else previous)
        except (StartupError, ConfigError) as exc:
            log.error("reload failed (%s); going back to the previous configuration", exc)
            if new_lock is not None:
                new_lock.release()
            if build.health is not None and (previous is None or build.health is not previous.health):
                build.health.close()  # the rejected set-up's actions stop with it
            self.reload_rejected()
            rollback = self._build(old, kept, previous.health if previous is not None else None)
            self._launch(rollback, previous)  # it worked before; if not, exit 1
            return
        if previous is not None and previous.health is not None and previous.health is not build.health:
            previous.health.close()  # its actions: the new stage has its own
        if new_lock is not None and self._state_lock is not None:
            self._state_lock.release()  # the state directory moved: the old one is free now
            self._state_lock = new_lock
        self.reloads.succeeded()

    def _simulated_reboot(self) -> None:
        if self.on_simulated_reboot is not None:
            self._start_over = True
            log.info("simulate: the host rebooted; the collectors start over on it (a reload)")
            self.on_simulated_reboot()

    def _lock_for(self, config: Config) -> statelock.StateLock | None:
        """A lock on the new state directory when a reload moves it; None when it stays (or when
        the daemon was started without one, as tests that drive a Daemon directly do)."""
        if self._state_lock is None or config.daemon.state_dir == self._state_lock.state_dir:
            return None
        return statelock.acquire(config)

    def reload_rejected(self) -> None:
        self.reloads.failed()
        if self.loop is not None:
            self.loop.poke()


def _fingerprint(config: Config, name: str) -> dict | None:
    """A sink's settings plus the identity of every file they name (certificates, web config), so
    a reload picks up a rotated certificate or a changed password file."""
    section = config.sections.get(name)
    if section is None:
        return None
    values: dict = dict(section)
    for key, value in section.items():
        if isinstance(value, str) and value and os.path.isfile(value):
            st = os.stat(value)
            values[f"{key}@file"] = (st.st_mtime_ns, st.st_size, st.st_ino)
    return values


def _start_failure(config: Config, sink: Sink, exc: Exception) -> str:
    """Why a sink did not start. A bind error says nothing of the address (``Address already in
    use``), so the sink's ``listen`` value and where it came from are added."""
    section = config.sections.get(sink.name)
    listen = section.get("listen") if section is not None else None
    if isinstance(exc, OSError) and listen:
        return f"cannot listen on {listen} ({config.origin(sink.name, 'listen')}): {exc.strerror or exc}"
    return str(exc)


def _listening(sink: object) -> str | None:
    """``HOST:PORT`` a sink accepts connections on, or None (a plugin's sink need not derive from Sink)."""
    listening = getattr(sink, "listening", None)
    address = listening() if callable(listening) else None
    return address if isinstance(address, str) else None
