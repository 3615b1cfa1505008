"""The loop: every collector on its own thread, one composer that turns results into Snapshots.

Each :class:`CollectorRunner` calls its collector's ``collect()`` on the collector's interval and
hands the result to the :class:`Loop`. The loop's own thread wakes on every result (and four times a
second otherwise), marks down any collector whose run has outlived its deadline, composes an
immutable Snapshot of the latest good results, runs it through the stages the plan built (health,
attribution relabel, self-metrics: :mod:`gpumon.stages`), and publishes it to every sink. A hung or failing
collector therefore never stalls another collector, the loop, or a sink; and a down collector's
series are withdrawn rather than served stale.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from gpumon import attribution_labels, registry
from gpumon.collectors.base import Collector, CollectorUnavailable, Context
from gpumon.config import Config
from gpumon.daemon.plan import Plan, collector_deadline, make_stages
from gpumon.health.stage import HealthStage
from gpumon.identity import IdentityProvider
from gpumon.logs import log_event
from gpumon.model import (
    Collection,
    CollectorStatus,
    Event,
    HostIdentity,
    MetricFamily,
    Severity,
    Snapshot,
    StateReason,
)
from gpumon.sinks.base import Sink, SinkHealth
from gpumon.stages import Books, CollectorBook, run_stages

log = logging.getLogger("gpumon.daemon")
UNASKED = HostIdentity()
"""The identity of a loop with no provider (``gpumon once``): not asked, so nothing is known."""

__all__ = ["CollectorRunner", "Loop", "ReloadCounts", "log_event", "run_collect"]


@dataclass
class ReloadCounts:
    """The daemon's SIGHUP reloads: ``gpumon_config_reloads_total{result}`` and
    ``gpumon_config_last_reload_successful``. Owned by the Daemon, read by every Loop it starts."""

    success: int = 0
    failure: int = 0
    last_ok: bool = True

    def succeeded(self) -> None:
        self.success += 1
        self.last_ok = True

    def failed(self) -> None:
        self.failure += 1
        self.last_ok = False

    def as_dict(self) -> dict[str, int]:
        """The self-metrics' view (a copy, taken under the loop's lock)."""
        return {"success": self.success, "failure": self.failure, "last_ok": int(self.last_ok)}


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
            if duration > self.deadline:
                self.overran = True  # late, whether or not the loop noticed before the run ended
            self.started = None  # the run is over: time spent handing it to the loop is not the run's
            if self._stop.is_set():
                break
            try:
                self.loop.accept(self, result, failure, unavailable, duration)
            except Exception:  # never let bookkeeping kill the thread: its series would go stale
                log.exception("accepting a result of collector %s failed", self.name)
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


def run_collect(collector: Collector) -> tuple[Collection | None, str, StateReason | None]:
    """One ``collect()``: (result, failure, unavailable: why, or None when the source is there).
    Nothing a collector does escapes."""
    try:
        result = collector.collect()
    except CollectorUnavailable as exc:
        return None, str(exc) or "source unavailable", StateReason(getattr(exc, "cause", StateReason.ERROR))
    except BaseException as exc:  # noqa: BLE001 - a collector's bug is its own outage, not the daemon's
        log.debug("collector %s raised", collector.name, exc_info=True)
        return None, f"{type(exc).__name__}: {exc}", None
    if not isinstance(result, Collection) or not all(isinstance(e, Event) for e in result.events):
        return None, f"collect() returned {type(result).__name__}, not a Collection of Events", None
    return registry.screen(collector, result), "", None


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
    """Seconds after which a snapshot is published even without a new result: what only bookkeeping
    moved (run counts, durations, process metrics) reaches the page within this. A scraper that looks
    every 10 s or more sees nothing staler, and a watcher running every second does not cost a whole
    publish a second on a quiet host."""
    SOFT = 1.0
    """Seconds a publish may wait when a stage put work off (the health stage judges at most every
    second: see gpumon.stages.health)."""

    def __init__(self, config: Config, plan: Plan, ctx: Context, sinks: list[Sink],
                 reloads: ReloadCounts | None = None, health: HealthStage | None = None,
                 identity: IdentityProvider | None = None) -> None:
        self.config = config
        self.health = health
        self.stages = make_stages(config, health, self.REFRESH)
        """The steps after collection, run on every compose (outside the loop's lock)."""
        self.identity = identity
        """The host identity provider whose latest look every snapshot carries (None: ``gpumon
        once``, whose snapshots carry an identity not asked for)."""
        if identity is not None and identity.on_change is None:
            identity.on_change = self.poke
        self._owed = False
        """A stage put work off: the next publish comes within SOFT seconds."""
        self._shown: dict[str, tuple[tuple[MetricFamily, ...], tuple]] = {}
        self._placeholders: dict[tuple[str, str, bool], CollectorStatus] = {}
        self.reloads = reloads
        self.plan = plan
        self.ctx = ctx
        self.sinks = sinks
        self.host = ctx.hostname
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
        if self.identity is not None:
            self.identity.start()
        self.publish_now()  # sinks have a page (self-metrics) before the first collection ends
        self.thread.start()
        for runner in self.runners:
            runner.start()

    def stop(self, timeout: float = 5.0, keep: frozenset[str] = frozenset()) -> None:
        """Stop collectors and the loop, publish a last snapshot, then flush the sinks in time.

        Sinks named in ``keep`` stay running (a reload that did not change them)."""
        end = time.monotonic() + timeout
        if self.identity is not None:
            self.identity.stop()
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
        if self.identity is not None and previous.identity is not None:
            self.identity.adopt(previous.identity)
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
               unavailable: StateReason | None, duration: float) -> None:
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
                                          f"{runner.deadline:g} s deadline", duration,
                                          cause=StateReason.DEADLINE_EXCEEDED)
            else:
                book.count("unavailable" if unavailable is not None else "exception")
                to_log += self._mark_down(runner.name, slot, failure, duration, available=unavailable is None,
                                          cause=unavailable or StateReason.ERROR)
            news = bool(self._events) or self._differs(runner.name, slot)
        for event in to_log:
            log_event(event)
        if news:
            self._wake.set()  # else only bookkeeping moved: the loop publishes it within REFRESH s

    def _mark_down(self, name: str, slot: _Slot, error: str, duration: float,
                   available: bool = True, cause: StateReason = StateReason.ERROR) -> list[Event]:
        """Withdraw the collector's series and report it down once (called with the lock held).
        ``cause`` is the gpumon_collector_state reason. Returns the event to log once the lock is
        released."""
        slot.families = ()
        slot.status = CollectorStatus(name, False, duration, error, available)
        slot.book.up = False
        slot.book.set_state("down" if available else "unavailable", cause.value)
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
            events = self._mark_down(name, slot, error, duration, cause=StateReason.DEADLINE_EXCEEDED
                                     if reason == "deadline" else StateReason.ERROR)
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
        loop only then: a flap reaches the page within one watch run); when a health evaluation was
        put off, within SOFT seconds; otherwise (only bookkeeping moved) every REFRESH seconds."""
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
        with self._lock:  # only copies under the lock: collector threads wait on it in accept()
            families: list[MetricFamily] = []
            statuses = []
            for planned in self.plan.collectors:
                slot = self._slots.get(planned.name)
                if slot is None:
                    statuses.append(self._placeholder(planned.name, planned.reason, available=False))
                    continue
                families.extend(slot.families)
                self._shown[planned.name] = (slot.families, (slot.book.up, slot.book.state, slot.book.reason))
                statuses.append(slot.status or self._placeholder(planned.name, "no run yet"))
            books = Books({name: slot.book for name, slot in self._slots.items()},
                          runs=tuple(slot.book.runs for slot in self._slots.values()),
                          series=tuple(slot.families for slot in self._slots.values()),
                          reported=all(slot.status is not None for slot in self._slots.values()),
                          sinks=self._sink_health,
                          reloads=self.reloads.as_dict() if self.reloads is not None else None,
                          not_running={p.name: p.cause.value for p in self.plan.collectors
                                       if p.name not in self._slots})
            events, self._events = tuple(self._events), []
        identity = self.identity.current() if self.identity is not None else UNASKED
        # the stages (the health rules, a save of the verdicts to disk) run outside the lock
        draft = run_stages(self.stages, Snapshot(self.host, time.time(), tuple(families), events,
                                                 tuple(statuses), identity=identity), books)
        self._owed |= books.owed
        with self._lock:
            self._seq += 1
            snapshot = Snapshot(self.host, time.time(), _merged(draft.families), draft.events, draft.collectors,
                                self._seq, identity)
            self.latest = snapshot
            self.snapshot_ready.notify_all()
        return snapshot

    def _placeholder(self, name: str, reason: str, available: bool = True) -> CollectorStatus:
        """The status of a collector that has not run (or cannot): one object per name and reason, so
        a sink comparing statuses by identity sees no new run where there was none."""
        key = (name, reason, available)
        status = self._placeholders.get(key)
        if status is None:
            status = self._placeholders[key] = CollectorStatus(name, False, 0.0, reason, available=available)
        return status

    def publish_now(self) -> Snapshot:
        snapshot = self.compose()
        for sink in self.sinks:
            try:
                sink.publish(snapshot)
            except Exception:
                log.exception("sink %s failed to take a snapshot", sink.name)
        return snapshot


def _merged(families: tuple[MetricFamily, ...]) -> tuple[MetricFamily, ...]:
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
