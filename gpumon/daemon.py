"""The loop: every collector on its own thread, one composer that turns results into Snapshots.

Each :class:`CollectorRunner` calls its collector's ``collect()`` on the collector's interval and
hands the result to the :class:`Loop`. The loop's own thread wakes on every result (and four times a
second otherwise), marks down any collector whose run has outlived its deadline, composes an
immutable Snapshot of the latest good results, and publishes it to every sink. A hung or failing
collector therefore never stalls another collector, the loop, or a sink; and a down collector's
series are withdrawn rather than served stale.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpumon import __version__, attribution_labels, registry, statelock
from gpumon.collectors.base import Collector, CollectorUnavailable, Context
from gpumon.config import Config, ConfigError
from gpumon.health.settings import action_settings, actions_on, health_settings
from gpumon.health.stage import HealthStage
from gpumon.model import Collection, CollectorStatus, Event, MetricFamily, Severity, Snapshot
from gpumon.selfmetrics import CollectorBook, SelfMetrics, reason_code
from gpumon.sinks.base import Sink, SinkContext, SinkHealth

log = logging.getLogger("gpumon.daemon")
event_log = logging.getLogger("gpumon.event")


CARRIED_ACROSS_RELOAD = ("flaps", "xid_ledger")
"""Shared collector state a reload keeps when the host view (sysfs root, state dir) is unchanged."""


class StartupError(Exception):
    """A collector or sink that was asked for cannot run: ``gpumon run`` exits 1 with this message."""


@dataclass
class PlannedCollector:
    name: str
    collector: Collector | None
    explicit: bool
    available: bool
    reason: str = ""
    #: Not available yet but its source is on this host (driver loading): ``run`` starts it anyway,
    #: reported down until its source is ready.
    waiting: bool = False


@dataclass
class Plan:
    """Which collectors run, decided from the config and each collector's probe."""

    collectors: list[PlannedCollector] = field(default_factory=list)

    @property
    def running(self) -> list[PlannedCollector]:
        return [p for p in self.collectors if p.available or p.waiting]

    def problems(self) -> list[str]:
        return [f"collector '{p.name}' is unavailable: {p.reason}"
                for p in self.collectors if p.explicit and not p.available]


def hostname(config: Config) -> str:
    return config.daemon.hostname or socket.gethostname()


def make_context(config: Config) -> Context:
    """The collectors' view of the host; with ``simulate`` set, a simulated host under state_dir.
    Raises ConfigError for a sysfs root that was given and does not exist, or an unknown profile."""
    d = config.daemon
    ctx = Context(hostname=hostname(config), sysfs_root=d.sysfs_root, state_dir=d.state_dir, config=config)
    if d.simulate:
        from gpumon.simulate import Simulation, UnknownProfile, host_profile

        try:
            host_profile(d.simulate)
        except UnknownProfile as exc:
            raise ConfigError(config.origin("daemon", "simulate"), "[daemon] simulate", str(exc)) from None
        base = d.state_dir
        if not _writable(base):
            base = tempfile.mkdtemp(prefix="gpumon-simulate-")
        simulation = Simulation(d.simulate, os.path.join(base, "simulate", d.simulate), hostname=ctx.hostname)
        ctx.simulation = simulation
        ctx.config = _simulated_azure(config, simulation)
        ctx.sysfs_root = simulation.sysfs_root
        ctx.state_dir = os.path.join(simulation.workdir, "state")
        ctx.nvml = simulation.nvml
        os.makedirs(ctx.state_dir, exist_ok=True)
    else:
        _check_sysfs_root(config)
    return ctx


def _simulated_azure(config: Config, simulation) -> Config:
    """A simulated host's IMDS and KVP pool, where the config does not name others."""
    out = config
    if "azure" in config.sections and "azure.imds_url" not in config.origins:
        out = out.replace("azure", imds_url=simulation.azure.imds_url)
    if "host_info" in config.sections and "host_info.kvp_pool" not in config.origins:
        out = out.replace("host_info", kvp_pool=simulation.azure.kvp_pool)
    return out


def host_state_dir(config: Config) -> str:
    """Where ``gpumon run`` keeps this host's state: the state directory, or a simulated host's own
    under it (what ``gpumon health`` reads and ``gpumon health clear`` changes)."""
    d = config.daemon
    return os.path.join(d.state_dir, "simulate", d.simulate, "state") if d.simulate else d.state_dir


def _check_sysfs_root(config: Config) -> None:
    """A root that was asked for and is not there is a mistake (a missing ``/host/sys`` mount), not
    a host without InfiniBand; the default ``/sys`` is always accepted."""
    where = config.origins.get("daemon.sysfs_root")
    root = config.daemon.sysfs_root
    if where is not None and not os.path.isdir(root):
        problem = "no such directory" if not os.path.exists(root) else "not a directory"
        raise ConfigError(where, "[daemon] sysfs_root", f"{root}: {problem}")


def _writable(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


def plan_collectors(config: Config, ctx: Context) -> Plan:
    """Resolve ``auto``, explicit names and implied collectors, then probe each."""
    wanted = list(config.daemon.collectors)
    auto = "auto" in wanted
    explicit = [n for n in wanted if n != "auto"]
    known = registry.available_collectors()
    for name in explicit:
        if name not in known:
            raise StartupError(f"unknown collector '{name}' (known: {', '.join(known)})")
    names = list(dict.fromkeys((known if auto else []) + explicit))
    classes: dict[str, type[Collector] | str] = {}
    i = 0
    while i < len(names):  # implied collectors join the run, after the one that implies them
        try:
            cls = classes[names[i]] = registry.collector_class(names[i])
        except registry.BrokenPlugin as exc:
            classes[names[i]] = f"cannot be loaded: {exc}"
        else:
            names.extend(n for n in cls.implies if n not in names and n in known)
        i += 1
    plan = Plan()
    for name in names:
        found = classes[name]
        if isinstance(found, str):
            plan.collectors.append(PlannedCollector(name, None, name in explicit, False, found))
            continue
        # the context's config is the one in effect (a simulated host points [azure] at its own IMDS)
        collector = found(ctx, (ctx.config or config).sections.get(name))
        available, reason, finished, retry = _probe(collector, collector_deadline(config, collector))
        waiting = not available and finished and retry
        if not (available or waiting) and finished:
            collector.close()  # a probe still hanging in a library call keeps its collector
        plan.collectors.append(PlannedCollector(name, collector if available or waiting else None,
                                                name in explicit, available, reason, waiting))
    return plan


def collector_deadline(config: Config, collector: Collector) -> float:
    """``[daemon] deadline``, or the collector's interval (at least 1 s)."""
    interval = collector.interval(float(config.daemon.interval))
    return float(config.daemon.deadline) or max(interval, 1.0)


def _probe(collector: Collector, deadline: float) -> tuple[bool, str, bool, bool]:
    """Probe on a thread of its own: a library that hangs at init (nvmlInit on a wedged GPU) must
    not keep the daemon from binding its port. Returns (available, reason, finished, retry)."""
    answer: list[tuple[bool, str, bool]] = []

    def probe() -> None:
        try:
            availability = collector.probe()
            answer.append((bool(availability.available), availability.reason, bool(availability.retry)))
        except Exception as exc:  # a probe must not raise; if it does, it is this collector's problem
            log.debug("probe of collector %s raised", collector.name, exc_info=True)
            answer.append((False, f"probe failed: {type(exc).__name__}: {exc}", False))

    thread = threading.Thread(target=probe, name=f"probe-{collector.name}", daemon=True)
    thread.start()
    thread.join(deadline)
    if not answer:
        return False, f"probe did not answer within {deadline:g} s", False, False
    available, reason, retry = answer[0]
    return available, reason, True, retry


def make_sinks(config: Config, ctx: SinkContext) -> list[Sink]:
    sinks = []
    for name in config.daemon.sinks:
        try:
            cls = registry.sink_class(name)
        except registry.UnknownPlugin:
            raise StartupError(f"unknown sink '{name}' (known: {', '.join(registry.available_sinks())})") from None
        except registry.BrokenPlugin as exc:
            raise StartupError(f"sink '{name}' cannot be loaded: {exc}") from None
        if cls.missing_dependencies():
            raise StartupError(f"sink '{name}' needs: pip install 'gpumon-exporter[{cls.extra}]'")
        cls.validate(config)
        sinks.append(cls(ctx, config.sections.get(name)))
    return sinks


def log_event(event: Event) -> None:
    """Every event is also one structured log line (``extra`` carries the fields for JSON logs)."""
    level = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING,
             Severity.ERROR: logging.ERROR, Severity.CRITICAL: logging.CRITICAL}[event.severity]
    subject = " ".join(f"{k}={v}" for k, v in event.subject.items())
    event_log.log(level, "%s %s: %s", event.kind, subject, event.message, extra={"event": event.as_dict()})


class CollectorRunner:
    """One collector's thread. Results go to ``loop.accept``; the loop enforces the deadline."""

    def __init__(self, loop: Loop, collector: Collector, interval: float, deadline: float) -> None:
        self.loop = loop
        self.collector = collector
        self.name = collector.name
        self.interval = interval
        self.deadline = deadline
        self.started: float | None = None
        self.overran = False
        self.dead = False
        self._stop = threading.Event()
        self._soon = threading.Event()
        collector._run_soon = self.run_soon
        self.thread = threading.Thread(target=self._run, name=f"collector-{self.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._soon.set()

    def run_soon(self) -> None:
        """The collector has news: run it now (runs stay at least MIN_GAP apart)."""
        self._soon.set()

    MIN_GAP = 0.2

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        next_run = time.monotonic()
        while not self._stop.is_set():
            self.started = t0 = time.monotonic()
            self.overran = False
            result, failure, unavailable = run_collect(self.collector)
            duration = time.monotonic() - t0
            if self._stop.is_set():
                break
            try:
                self.loop.accept(self, result, failure, unavailable, duration)
            except Exception:  # never let bookkeeping kill the thread: its series would go stale
                log.exception("accepting a result of collector %s failed", self.name)
            finally:
                self.started = None
            next_run += self.interval
            now = time.monotonic()
            if next_run < now:  # a slow run: skip the missed ticks rather than bunching runs up
                next_run = now + self.interval - ((now - next_run) % self.interval)
            if self._soon.wait(next_run - now) and not self._stop.is_set():
                self._soon.clear()
                self._stop.wait(self.MIN_GAP)  # a burst of news is one run, not one each
                next_run = time.monotonic()
        try:
            self.collector.close()
        except Exception:
            log.debug("closing collector %s failed", self.name, exc_info=True)


def run_collect(collector: Collector) -> tuple[Collection | None, str, bool]:
    """One ``collect()``: (result, failure, unavailable). Nothing a collector does escapes."""
    try:
        result = collector.collect()
    except CollectorUnavailable as exc:
        return None, str(exc) or "source unavailable", True
    except BaseException as exc:  # noqa: BLE001 - a collector's bug is its own outage, not the daemon's
        log.debug("collector %s raised", collector.name, exc_info=True)
        return None, f"{type(exc).__name__}: {exc}", False
    if not isinstance(result, Collection) or not all(isinstance(e, Event) for e in result.events):
        return None, f"collect() returned {type(result).__name__}, not a Collection of Events", False
    return registry.screen(collector, result), "", False


@dataclass
class _Slot:
    """What the loop knows about one collector."""

    book: CollectorBook
    families: tuple[MetricFamily, ...] = ()
    status: CollectorStatus | None = None
    down_reported: bool = False


class Loop:
    """Composes snapshots from collector results and publishes them to the sinks."""

    TICK = 1.0
    """Longest sleep between deadline checks; a collector whose deadline is shorter shortens it, so
    a run is marked down at its deadline (a running one wakes the loop just past it)."""
    REFRESH = 5.0
    """Seconds after which a snapshot is published even without a new result (process metrics)."""
    SOFT = 1.0
    """Seconds a publish may wait when only bookkeeping moved (run counts, durations)."""
    HEALTH_EVERY = 1.0
    """Seconds between health evaluations when a collector's series changed (the watch interval), so
    a fast collector does not pay the rules on every run; runs that changed nothing are judged every
    REFRESH seconds (the rules' windows and hold times move on)."""

    def __init__(self, config: Config, plan: Plan, ctx: Context, sinks: list[Sink],
                 reloads: dict[str, int] | None = None, health: HealthStage | None = None) -> None:
        self.config = config
        self.health = health
        attribution = config.sections.get("attribution")
        self._relabel = bool(attribution is not None and attribution.get("labels"))
        """``[attribution] labels``: every per-GPU series also carries its holders' labels."""
        self._health_seen: tuple[int, ...] | None = None
        self._health_out: tuple[tuple[MetricFamily, ...], tuple[Event, ...]] = ((), ())
        self._health_at = -self.REFRESH
        self._health_series: tuple[tuple[MetricFamily, ...], ...] = ()
        self._owed = False
        """Bookkeeping (run counts, durations, a health evaluation) waits for a publish."""
        self._shown: dict[str, tuple[tuple[MetricFamily, ...], tuple]] = {}
        self.reloads = reloads
        self.plan = plan
        self.ctx = ctx
        self.sinks = sinks
        self.host = ctx.hostname
        self.self_metrics = SelfMetrics()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._dirty = False
        self._events: list[Event] = []
        self._slots: dict[str, _Slot] = {}
        self._seq = 0
        self.heartbeat = time.monotonic()
        self.latest: Snapshot | None = None
        self.snapshot_ready = threading.Condition(self._lock)
        default_interval = float(config.daemon.interval)
        self.runners: list[CollectorRunner] = []
        for planned in plan.running:
            assert planned.collector is not None
            interval = planned.collector.interval(default_interval)
            deadline = collector_deadline(config, planned.collector)
            self.runners.append(CollectorRunner(self, planned.collector, interval, deadline))
            self._slots[planned.name] = _Slot(CollectorBook())
        self._tick = min([self.TICK] + [runner.deadline for runner in self.runners])
        self.thread = threading.Thread(target=self._run, name="loop", daemon=True)
        self._sink_health: dict[str, SinkHealth] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.publish_now()  # sinks have a page (self-metrics) before the first collection ends
        self.thread.start()
        for runner in self.runners:
            runner.start()

    def stop(self, timeout: float = 5.0, keep: frozenset[str] = frozenset()) -> None:
        """Stop collectors and the loop, publish a last snapshot, then flush the sinks in time.

        Sinks named in ``keep`` stay running (a reload that did not change them)."""
        end = time.monotonic() + timeout
        for runner in self.runners:
            runner.stop()
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout=max(0.0, (end - time.monotonic()) / 2))  # its last publish, then flush
        for runner in self.runners:
            runner.thread.join(timeout=max(0.0, min(0.5, end - time.monotonic())))
        for sink in self.sinks:
            if sink.name in keep:
                continue
            try:
                sink.stop(max(0.1, end - time.monotonic()))
            except Exception:
                log.exception("stopping sink %s failed", sink.name)

    def carry_over(self, previous: Loop) -> None:
        """After a reload: keep the running totals and latest series of collectors that still run,
        so counters do not reset and the page does not shrink until their first new run."""
        with previous._lock:
            for name in self._slots:
                old = previous._slots.get(name)
                if old is not None:
                    self._slots[name] = _Slot(old.book, old.families, old.status, old.down_reported)
        before = {r.name: r.collector for r in previous.runners}
        for runner in self.runners:
            old_collector = before.get(runner.name)
            if old_collector is not None and type(old_collector) is type(runner.collector):
                try:
                    runner.collector.inherit(old_collector)
                except Exception:  # losing a total is better than losing the reload
                    log.exception("collector %s could not take over its predecessor's totals", runner.name)

    def alive(self) -> bool:
        return self.thread.is_alive() and time.monotonic() - self.heartbeat < 30.0

    # -- results -----------------------------------------------------------------------------
    def _attributed(self, events: list[Event]) -> list[Event]:
        """GPU events name the pod, container or job holding the GPU (in their attributes and their
        log line), from the attribution collector's latest run. Called with the lock held."""
        slot = self._slots.get("attribution")
        if not events or slot is None:
            return events
        allocation = next((f for f in slot.families if f.name == attribution_labels.ALLOCATION_FAMILY), None)
        return list(attribution_labels.enrich(events, allocation)) if allocation is not None else events

    def accept(self, runner: CollectorRunner, result: Collection | None, failure: str,
               unavailable: bool, duration: float) -> None:
        """Take one run's outcome. A run that finished after its deadline does not bring the
        collector back up (it keeps flapping otherwise); its events still count."""
        to_log: list[Event] = []
        with self._lock:
            slot = self._slots[runner.name]
            book = slot.book
            book.runs += 1
            book.duration = duration
            if result is not None:
                for reason, n in result.errors.items():
                    book.count(str(reason), int(n))
                events = self._attributed(result.events)
                self._events.extend(events)
                to_log.extend(events)
            if result is not None and not runner.overran:
                slot.families = self._same_as_shown(runner.name, tuple(result.families))
                slot.status = CollectorStatus(runner.name, True, duration)
                if not book.up and slot.down_reported:
                    log.info("collector %s is up again", runner.name)
                book.up, slot.down_reported = True, False
                book.set_state("ok")
            elif result is not None:
                to_log += self._mark_down(runner.name, slot, f"run took {duration:.3g} s, over its "
                                          f"{runner.deadline:g} s deadline", duration, cause="deadline_exceeded")
            else:
                book.count("unavailable" if unavailable else "exception")
                to_log += self._mark_down(runner.name, slot, failure, duration, available=not unavailable,
                                          cause=reason_code(failure) if unavailable else "error")
            news = bool(self._events) or self._differs(runner.name, slot)
            self._owed = True
        for event in to_log:
            log_event(event)
        if news:
            self._wake.set()  # else only bookkeeping moved: the loop publishes it within SOFT s

    def _mark_down(self, name: str, slot: _Slot, error: str, duration: float,
                   available: bool = True, cause: str = "error") -> list[Event]:
        """Withdraw the collector's series and report it down once (called with the lock held).
        ``cause`` is the gpumon_collector_state reason. Returns the event to log once the lock is
        released."""
        slot.families = ()
        slot.status = CollectorStatus(name, False, duration, error, available)
        slot.book.up = False
        slot.book.set_state("down" if available else "unavailable", cause)
        if slot.down_reported:
            return []
        slot.down_reported = True
        event = Event("collector_down", Severity.ERROR, {"collector": name},
                      f"collector {name} is down: {error}", {"error": error})
        self._events.append(event)
        return [event]

    def mark_down(self, name: str, error: str, duration: float, reason: str) -> None:
        with self._lock:
            slot = self._slots[name]
            slot.book.count(reason)
            events = self._mark_down(name, slot, error, duration,
                                     cause="deadline_exceeded" if reason == "deadline" else "error")
        for event in events:
            log_event(event)
        self._wake.set()

    def poke(self) -> None:
        """Publish a fresh snapshot soon (from any thread; the loop thread does the work)."""
        self._dirty = True
        self._wake.set()

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for runner in self.runners:
            started = runner.started
            if started is not None and not runner.overran and now - started > runner.deadline:
                runner.overran = True
                self.mark_down(runner.name, f"run exceeded its {runner.deadline:g} s deadline", now - started,
                               "deadline")
            elif (not runner.thread.is_alive() and runner.thread.ident is not None and not runner.dead
                  and not runner.stopping):  # a runner told to stop has not died: no collector_down
                runner.dead = True
                self.mark_down(runner.name, "collector thread died", 0.0, "exception")

    # -- composing ---------------------------------------------------------------------------
    def _run(self) -> None:
        """Publish at once when a collector's series, state or events changed (``accept`` wakes the
        loop only then: a flap reaches the page within one watch run); when only bookkeeping moved
        (run counts, durations), within SOFT seconds; with nothing new, every REFRESH seconds."""
        last = time.monotonic()
        while not self._stop.is_set():
            self.heartbeat = time.monotonic()
            woken = self._wake.wait(self._sleep_for(last))
            self._wake.clear()
            self._check_deadlines()
            if self._stop.is_set():
                break
            now = time.monotonic()
            if not (woken or self._dirty) and now - last < (self.SOFT if self._owed else self.REFRESH):
                continue  # nothing new: keep the page (and its cached gzip body) as it is
            self._dirty = self._owed = False
            last = now
            try:
                self.publish_now()
            except Exception:  # a sink bug must not kill the loop; /healthz would go red
                log.exception("publishing a snapshot failed")
        try:
            self.publish_now()
        except Exception:
            log.exception("publishing the last snapshot failed")

    def _sleep_for(self, last: float) -> float:
        """Until the first running collector's deadline, owed bookkeeping, or TICK, whichever is first:
        a run is marked down just past its deadline, not up to a TICK later."""
        now = time.monotonic()
        wait = min(self._tick, last + self.SOFT - now) if self._owed else self._tick
        for runner in self.runners:
            started = runner.started
            if started is not None and not runner.overran:
                wait = min(wait, started + runner.deadline - now + 0.005)
        return max(0.0, wait)

    def _same_as_shown(self, name: str, families: tuple[MetricFamily, ...]) -> tuple[MetricFamily, ...]:
        """The tuple last shown when a run brought the same series again (called with the lock held),
        so the renderer and the next comparison see the very same object."""
        shown = self._shown.get(name)
        return shown[0] if shown is not None and families == shown[0] else families

    def _differs(self, name: str, slot: _Slot) -> bool:
        """Whether a collector's series or state differ from the last snapshot (lock held)."""
        shown = self._shown.get(name)
        return (shown is None or slot.families is not shown[0]
                or (slot.book.up, slot.book.state, slot.book.reason) != shown[1])

    def compose(self) -> Snapshot:
        for sink in self.sinks:
            try:
                self._sink_health[sink.name] = sink.health()
            except Exception as exc:
                self._sink_health[sink.name] = SinkHealth(up=False, detail=str(exc))
        with self._lock:
            families: list[MetricFamily] = []
            statuses = []
            for planned in self.plan.collectors:
                slot = self._slots.get(planned.name)
                if slot is None:
                    statuses.append(CollectorStatus(planned.name, False, 0.0, planned.reason, available=False))
                    continue
                families.extend(slot.families)
                self._shown[planned.name] = (slot.families, (slot.book.up, slot.book.state, slot.book.reason))
                statuses.append(slot.status or CollectorStatus(planned.name, False, 0.0, "no run yet"))
            books = {name: slot.book for name, slot in self._slots.items()}
            reloads = None
            if self.reloads is not None:
                reloads = {k: v for k, v in self.reloads.items() if k != "last_ok"}
                reloads["last_ok"] = self.reloads["last_ok"]
            not_running = {p.name: p.reason for p in self.plan.collectors if p.name not in self._slots}
            events, self._events = tuple(self._events), []
            allocation = next((f for f in families if f.name == attribution_labels.ALLOCATION_FAMILY), None)
            health_families, health_events = self._judge(families, events, statuses)
            families.extend(health_families)
            events += health_events
            if allocation is not None and self._relabel:
                families = list(attribution_labels.relabel(families, allocation))
            families.extend(self.self_metrics.families(books, self._sink_health, reloads, not_running))
            self._seq += 1
            snapshot = Snapshot(self.host, time.time(), _merged(families), events, tuple(statuses), self._seq)
            self.latest = snapshot
            self.snapshot_ready.notify_all()
        return snapshot

    def _judge(self, families: list[MetricFamily], events: tuple[Event, ...],
               statuses: list[CollectorStatus]) -> tuple[tuple[MetricFamily, ...], tuple[Event, ...]]:
        """The health stage's view of the collectors' latest results: evaluated only when a collector
        brought a new run (a status object is replaced per run), its series kept between."""
        if self.health is None:
            return (), ()
        if any(slot.status is None for slot in self._slots.values()):
            return (), ()  # no verdict before every collector has reported once
        seen = tuple(slot.book.runs for slot in self._slots.values())
        if seen == self._health_seen:
            return self._health_out[0], ()
        now = time.monotonic()
        series = tuple(slot.families for slot in self._slots.values())
        same = len(series) == len(self._health_series) and all(
            a is b for a, b in zip(series, self._health_series))  # unchanged runs keep the shown tuple
        if now - self._health_at < (self.REFRESH if same else self.HEALTH_EVERY):
            self._owed = True  # judged on a later publish (see _run)
            return self._health_out[0], ()
        self._health_seen, self._health_at, self._health_series = seen, now, series
        try:
            result = self.health.update(Snapshot(self.host, time.time(), tuple(families), events,
                                                 tuple(statuses)))
        except Exception:  # a rule bug must not stop the loop: the verdict goes stale, counted in the log
            log.exception("health: evaluating the rules failed")
            return self._health_out[0], ()
        for event in result.events:
            log_event(event)
        self._health_out = (result.families, result.events)
        return result.families, result.events

    def publish_now(self) -> Snapshot:
        snapshot = self.compose()
        for sink in self.sinks:
            try:
                sink.publish(snapshot)
            except Exception:
                log.exception("sink %s failed to take a snapshot", sink.name)
        return snapshot


def health_stage(config: Config, ctx: Context, persist: bool = True, act: bool = False,
                 state_dir: str | None = None) -> HealthStage | None:
    """The health stage ``[health]`` asks for (None when disabled); with ``act``, the health actions
    it turns on (Slurm drain, NodeConditions, a hook) run on its verdicts."""
    section = config.sections.get("health")
    if section is None or not section["enabled"]:
        return None
    stage = HealthStage(state_dir or ctx.state_dir, health_settings(section), vm_size=_vm_size_of(ctx),
                        persist=persist)
    settings = action_settings(section)
    if act and actions_on(settings):
        from gpumon.health.actions import HealthActions

        stage.attach(HealthActions(settings, ctx.state_dir))
    return stage


def collect_once(config: Config, plan: Plan, ctx: Context, timeout: float | None = None,
                 health: HealthStage | None = None) -> Snapshot:
    """``gpumon once``: every running collector once, in parallel, each bounded by its deadline."""
    loop = Loop(config, plan, ctx, [], health=health)
    threads = []
    start = time.monotonic()
    for runner in loop.runners:
        def run(r: CollectorRunner = runner) -> None:
            t0 = time.monotonic()
            result, failure, unavailable = run_collect(r.collector)
            loop.accept(r, result, failure, unavailable, time.monotonic() - t0)

        thread = threading.Thread(target=run, name=f"once-{runner.name}", daemon=True)
        thread.start()
        threads.append((runner, thread))
    for runner, thread in threads:  # deadlines run from the common start, not one after another
        limit = timeout if timeout is not None else runner.deadline
        thread.join(max(0.0, start + limit - time.monotonic()))
        if thread.is_alive():
            runner.overran = True
            loop.mark_down(runner.name, f"run exceeded its {limit:g} s deadline", limit, "deadline")
    snapshot = loop.compose()
    for runner, thread in threads:
        if not thread.is_alive():
            runner.collector.close()
    return snapshot


def sink_context(config: Config, loop_alive=lambda: True, simulation=None) -> SinkContext:
    """``config``: the one in effect, ``make_context``'s (a simulated host's IMDS and KVP pool)."""
    return SinkContext(hostname=hostname(config), state_dir=config.daemon.state_dir, version=__version__,
                       loop_alive=loop_alive, simulation=simulation, config=config)


@dataclass
class _Build:
    """A validated, probed, not yet running set-up for one config."""

    config: Config
    ctx: Context
    plan: Plan
    sinks: list[Sink]
    fresh: list[Sink]
    holder: dict[str, Loop]
    health: HealthStage | None = None


class Daemon:
    """``gpumon run``: builds the loop from a Config, and rebuilds it on reload.

    A set-up is built (config validated, collectors probed, sinks constructed) before anything
    running is touched, so a reload with a config that cannot work leaves the running one alone."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.loop: Loop | None = None
        self.ctx: Context | None = None
        self.reloads = {"success": 0, "failure": 0, "last_ok": 1}
        self._fingerprints: dict[str, dict | None] = {}
        self._state_lock: statelock.StateLock | None = None
        self._health_key: tuple | None = None

    def _build(self, config: Config, kept: dict[str, Sink]) -> _Build:
        ctx = make_context(config)
        if self.ctx is not None and (self.ctx.sysfs_root, self.ctx.state_dir) == (ctx.sysfs_root, ctx.state_dir):
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
            holder: dict[str, Loop] = {}
            sctx = sink_context(ctx.config, lambda: holder["loop"].alive() if "loop" in holder else True,
                                ctx.simulation)
            section = config.sections.get("health")
            if section is not None and section["enabled"]:
                sctx.health_verdict = lambda: _verdict_of(holder.get("loop"))
            fresh = make_sinks(config.replace("daemon", sinks=[n for n in config.daemon.sinks if n not in kept]),
                               sctx)
            pending = list(fresh)
            sinks = [kept[name] if name in kept else pending.pop(0) for name in config.daemon.sinks]
            for sink in kept.values():
                sink.ctx.loop_alive = sctx.loop_alive
                sink.ctx.health_verdict = sctx.health_verdict
        except BaseException:
            _close_plan(plan)
            raise
        return _Build(config, ctx, plan, sinks, fresh, holder, self._health_for(config, ctx))

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
                _close_plan(build.plan)
                reason = _start_failure(build.config, sink, exc)
                raise StartupError(f"sink '{sink.name}' failed to start: {reason}") from exc
            started.append(sink)
        loop = Loop(build.config, build.plan, build.ctx, build.sinks, self.reloads, build.health)
        if previous is not None:
            loop.carry_over(previous)
        build.holder["loop"] = loop
        if build.ctx.simulation is not None:
            build.ctx.simulation.start()
        loop.start()
        self.config, self.loop, self.ctx = build.config, loop, build.ctx
        # taken now: comparing two configs later would stat the same (already changed) files twice
        self._fingerprints = {sink.name: _fingerprint(build.config, sink.name) for sink in build.sinks}
        log.info("gpumon %s running collectors: %s; sinks: %s", __version__,
                 ", ".join(p.name for p in build.plan.running) or "none",
                 ", ".join(s.name for s in build.sinks))

    def _health_for(self, config: Config, ctx: Context) -> HealthStage | None:
        """The health stage; a reload that changes neither ``[health]`` nor the state directory keeps
        the running one (its memory of counters and of the last verdict)."""
        section = config.sections.get("health")
        if section is None or not section["enabled"]:
            return None
        key = (dict(section), ctx.state_dir)
        running = self.loop.health if self.loop is not None else None
        if running is not None and self._health_key == key:
            return running
        self._health_key = key
        return health_stage(config, ctx, act=True)

    def start(self) -> Plan:
        """Lock the state directory, probe, start sinks, start collectors. Raises StartupError for
        exit 1, ConfigError for 2 (a bad config, or a state directory another gpumon holds)."""
        self._state_lock = statelock.acquire(self.config)
        try:
            build = self._build(self.config, {})
            self._launch(build)
        except BaseException:
            self._state_lock.release()
            raise
        return build.plan

    def stop(self, timeout: float = 5.0) -> None:
        """Stop everything and give the state directory up for the next instance."""
        health = self.loop.health if self.loop is not None else None
        self._halt(timeout)
        if health is not None:
            health.close()
        if self._state_lock is not None:
            self._state_lock.release()

    def _halt(self, timeout: float = 5.0, keep: frozenset[str] = frozenset()) -> None:
        end = time.monotonic() + timeout
        if self.ctx is not None and self.ctx.simulation is not None:
            self.ctx.simulation.stop()
        if self.loop is not None:
            self.loop.stop(max(0.5, end - time.monotonic()), keep)
            self.loop = None

    def reload(self, new_config: Config) -> None:
        """Swap in a new config. Sinks whose settings (and the files they name) did not change keep
        running, so the endpoint answers throughout. A config that cannot be built is rejected before
        anything stops; one whose new sink fails to start brings the previous config back."""
        old = self.config
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
            self._launch(build, previous)
        except StartupError as exc:
            log.error("reload failed (%s); going back to the previous configuration", exc)
            if new_lock is not None:
                new_lock.release()
            self.reload_rejected()
            self._launch(self._build(old, kept), previous)  # it worked before; if not, exit 1
            return
        if previous is not None and previous.health is not None and previous.health is not build.health:
            previous.health.close()  # its actions: the new stage has its own
        if new_lock is not None and self._state_lock is not None:
            self._state_lock.release()  # the state directory moved: the old one is free now
            self._state_lock = new_lock
        self.reloads["success"] += 1
        self.reloads["last_ok"] = 1

    def _lock_for(self, config: Config) -> statelock.StateLock | None:
        """A lock on the new state directory when a reload moves it; None when it stays (or when
        the daemon was started without one, as tests that drive a Daemon directly do)."""
        if self._state_lock is None or config.daemon.state_dir == self._state_lock.state_dir:
            return None
        return statelock.acquire(config)

    def reload_rejected(self) -> None:
        self.reloads["failure"] += 1
        self.reloads["last_ok"] = 0
        if self.loop is not None:
            self.loop.poke()


def _merged(families: list[MetricFamily]) -> tuple[MetricFamily, ...]:
    """One family per name: two collectors emitting the same metric must not produce two HELP/TYPE
    blocks, which is not a valid exposition."""
    index: dict[str, int] = {}
    out: list[MetricFamily] = []
    for fam in families:
        at = index.get(fam.name)
        if at is None:
            index[fam.name] = len(out)
            out.append(fam)
        else:
            out[at] = MetricFamily(out[at].spec, out[at].samples + fam.samples)
    return tuple(out)


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


def _close_plan(plan: Plan) -> None:
    for planned in plan.collectors:
        if planned.collector is not None:
            planned.collector.close()


def _vm_size_of(ctx: Context) -> Callable[[], str | None]:
    """Where the health stage learns the VM size: IMDS's ``vmSize`` (a simulated host serves its
    profile's), asked on a thread of its own so the loop never waits on IMDS; None until IMDS has
    answered or is known absent (then "")."""
    from gpumon import imds

    azure = ctx.config.sections.get("azure") if ctx.config is not None else None
    found: list[str] = []
    asked = threading.Event()

    def ask() -> None:
        try:
            found.append(imds.configured(azure).instance().vm_size)
        except imds.ImdsError:
            found.append("")  # off Azure: the health stage holds the node to its baseline

    def vm_size() -> str | None:
        if not asked.is_set():
            asked.set()
            threading.Thread(target=ask, name="health-imds", daemon=True).start()
        return found[0] if found else None

    return vm_size


def _verdict_of(loop: Loop | None) -> dict | None:
    """The running loop's health verdict for the endpoint (None before its first evaluation)."""
    if loop is None or loop.health is None:
        return None
    verdict = loop.health.verdict()
    return verdict.as_dict() if verdict.time else None
