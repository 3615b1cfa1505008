"""Link-flap detection: pure logic fed by observations, shared by the IB collector and the state watcher.

Three signals can see one physical flap: the port state leaving ACTIVE/LinkUp and coming back (seen
only when the flap outlasts a poll), ``link_downed`` growing (sees any flap, but sticks at 255), and
the IPoIB netdev's ``carrier_changes`` growing by 2 per down/up cycle. Each signal reports "n flaps
happened in the time interval (a, b]"; a report matches flaps already recorded by *other* signals
whose intervals overlap it, so one flap seen three ways counts once, and a saturated ``link_downed``
simply stops reporting while the other signals carry on.

The flap window (wall-clock times of recent flaps) survives a restart: it is persisted as JSON,
written atomically, and a corrupt file is reported, set aside and replaced.

Both collectors call into one :class:`FlapDetector` from their own threads, so every public method
takes the detector's lock.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpumon.log_once import LogOnce
from gpumon.model import Event, Severity

log = logging.getLogger("gpumon.flaps")

STATE_ACTIVE = 4
PHYS_LINKUP = 5
PHYS_LINK_ERROR_RECOVERY = 6
MAX_WINDOW = 30 * 86400.0
"""The longest flap window the config allows: what is loaded before the configured one is known."""

SIGNAL_STATE = "state"
SIGNAL_LINK_DOWNED = "link_downed"
SIGNAL_CARRIER = "carrier_changes"
SIGNALS = (SIGNAL_STATE, SIGNAL_LINK_DOWNED, SIGNAL_CARRIER)

WINDOW_CAP = 100_000
"""Flaps of one report kept in the window: the largest flap threshold the config allows, so a counter
that jumps by millions costs no million entries and still makes the port flapping."""

STATE_FILE = "ib_flaps.json"
STATE_VERSION = 1

PortKey = tuple[str, str]
"""(device, port) as the labels carry them."""


def is_up(state: int | None, phys_state: int | None) -> bool | None:
    """ACTIVE and LinkUp, for flap purposes; an unreadable phys_state defers to state alone. None when
    state is unknown. ACTIVE during LinkErrorRecovery counts as up: a retrain that succeeds is
    ``link_error_recovery``, not a flap; one that fails takes the port out of ACTIVE."""
    if state is None:
        return None
    if phys_state is None:
        return state == STATE_ACTIVE
    return state == STATE_ACTIVE and phys_state in (PHYS_LINKUP, PHYS_LINK_ERROR_RECOVERY)


@dataclass
class _Flap:
    """One physical flap: it happened somewhere in (start, end] on the monotonic clock."""

    start: float
    end: float
    signals: set[str]
    count: int = 1
    """Flaps this record stands for: past ``max_recent`` in one report, the rest are one record
    (they can no longer be told apart, and matching them one by one would cost a loop per flap)."""


@dataclass
class _Port:
    up: bool | None = None
    last_up_sample: float | None = None
    down_since: float | None = None
    left_active_at: float | None = None
    """Monotonic time of the last up sample before a down seen by us; None if never seen leaving."""
    last_down_seconds: float | None = None
    baselines: dict[str, tuple[int, float]] = field(default_factory=dict)
    carrier_pending: int = 0
    carrier_pending_since: float = 0.0
    recent: deque[_Flap] = field(default_factory=deque)
    window: deque[float] = field(default_factory=deque)
    total: int = 0
    signal_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SIGNALS, 0))
    flapping: bool = False
    last_flap_wall: float | None = None
    saturated: bool = False
    identity: str | None = None
    """Name the window is persisted under: ``<node_guid>/<port>`` once known (device names can move
    between HCAs across a reboot), else ``<device>/<port>``."""


@dataclass(frozen=True)
class PortFlapStatus:
    """What the exporter shows for one port."""

    flaps_total: int
    window_flaps: int
    flapping: bool
    last_flap_timestamp: float | None
    down_seconds: float
    last_down_seconds: float | None
    signal_counts: dict[str, int]
    link_downed_saturated: bool


class FlapDetector:
    """Counts flaps per port from several signals, once each, and decides when a port is flapping.

    ``clock`` is monotonic (intervals, down durations); ``wall_clock`` stamps the window entries
    that must survive a restart. ``match_slack`` widens intervals when matching signals read by two
    threads at slightly different instants; ``match_horizon`` bounds how long a flap waits to be
    matched by a slower signal (the IB counter interval is 10 s by default).
    """

    def __init__(
        self,
        threshold: int = 5,
        window: float | None = 86400.0,
        state_path: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        match_slack: float = 2.0,
        match_horizon: float = 3600.0,
        max_recent: int = 4096,
    ) -> None:
        self.threshold = threshold
        self._provisional = window is None
        """No rule yet (the watcher configures it on its first run): keep, never announce, cut nothing."""
        self.window = MAX_WINDOW if window is None else window
        self.state_path = state_path
        self._clock = clock
        self._wall = wall_clock
        self.match_slack = match_slack
        self.match_horizon = match_horizon
        self.max_recent = max_recent
        self._ports: dict[PortKey, _Port] = {}
        self._events: list[Event] = []
        self._errors: dict[str, int] = {}
        self._log_once = LogOnce(log)
        self._lock = threading.Lock()
        self._dirty = False
        self._persisted: dict[str, list[float]] = {}
        """Windows loaded from the state file and not yet claimed by a port seen in this run."""
        if state_path is not None:
            self._load()

    # ----------------------------------------------------------------- configuration

    def configure(self, threshold: int, window: float) -> None:
        """Set the flapping rule (the watcher owns these options; the detector may predate it)."""
        with self._lock:
            if not self._provisional and (threshold, window) == (self.threshold, self.window):
                return
            self.threshold, self.window, self._provisional = threshold, window, False
            wall = self._wall()
            for key, port in self._ports.items():
                self._update_flapping(key, port, wall, announce=False)

    def identify(self, key: PortKey, node_guid: str) -> None:
        """Tie a port to its HCA's ``node_guid``, so its persisted window follows the HCA rather than
        the device name. A name now carried by another HCA starts that port afresh (no counter
        deltas across two HCAs), keeping only the exported totals, which must not go backwards."""
        name = f"{node_guid}/{key[1]}" if node_guid else f"{key[0]}/{key[1]}"
        with self._lock:
            port = self._ports.get(key)
            if port is not None and port.identity is not None and (port.identity == name or not node_guid):
                return  # the same HCA, or a GUID that could not be read this time: keep what we know
            for other_key, other in self._ports.items():
                if other_key != key and other.identity == name:
                    # Names swapped in a running process: that HCA's window moves with it to this name.
                    if other.window:
                        self._persisted[name] = sorted([*self._persisted.get(name, []), *other.window])
                    self._ports[other_key] = _Port(total=other.total, signal_counts=other.signal_counts)
                    break
            if port is not None and port.identity is not None:
                if port.window:
                    self._persisted[port.identity] = list(port.window)
                fresh = _Port(total=port.total, signal_counts=port.signal_counts)
                port = self._ports[key] = fresh
            elif port is None:
                port = self._ports[key] = _Port()
            port.identity = name
            times = self._persisted.pop(name, None)
            if times is None and name != f"{key[0]}/{key[1]}":
                times = self._persisted.pop(f"{key[0]}/{key[1]}", None)  # written before GUIDs were used
            if times:
                self._adopt_window(key, port, times)
                self._dirty = True  # rewritten under the GUID on the next save

    def _adopt_window(self, key: PortKey, port: _Port, times: list[float]) -> None:
        merged = sorted([*port.window, *times])
        port.window = deque(merged)
        port.last_flap_wall = max(merged[-1], port.last_flap_wall or merged[-1])
        self._update_flapping(key, port, self._wall(), announce=False)

    def _port(self, key: PortKey) -> _Port:
        """The port's record; one never identified claims a window persisted under its device name."""
        port = self._ports.get(key)
        if port is None:
            port = self._ports[key] = _Port()
            times = self._persisted.pop(f"{key[0]}/{key[1]}", None)
            if times:
                self._adopt_window(key, port, times)
        return port

    # ----------------------------------------------------------------- observations

    def observe(
        self,
        key: PortKey,
        at: float | None = None,
        *,
        state: int | None = None,
        phys_state: int | None = None,
        link_downed: int | None = None,
        link_downed_saturated: bool = False,
        carrier_changes: int | None = None,
    ) -> None:
        """Feed one pass of readings for one port, all taken at monotonic time ``at``.

        Pass only what was read successfully; every flap first seen in this pass becomes one
        ``ib_link_flap`` event naming every signal of this pass that saw it.
        """
        with self._lock:
            now = self._clock() if at is None else at
            wall = self._wall()
            port = self._port(key)
            new: list[_Flap] = []
            if link_downed is not None:
                port.saturated = link_downed_saturated
                self._observe_counter(key, port, SIGNAL_LINK_DOWNED, link_downed, now, wall, new)
            if carrier_changes is not None:
                self._observe_counter(key, port, SIGNAL_CARRIER, carrier_changes, now, wall, new)
            if state is not None:
                self._observe_state(key, port, state, phys_state, now, wall, new)
            # one event per set of signals, with the count: a counter that jumped by 250 (a port
            # bouncing between two reads) is one line saying 250, not 250 identical lines
            grouped: dict[tuple[str, ...], int] = {}
            for flap in new:
                signals = tuple(sorted(flap.signals))
                grouped[signals] = grouped.get(signals, 0) + flap.count
            for signals, count in grouped.items():
                what = "link flapped" if count == 1 else f"link flapped {count} times"
                self._events.append(Event(
                    "ib_link_flap", Severity.WARNING, _subject(key),
                    f"{key[0]} port {key[1]}: {what} (seen by {', '.join(signals)})",
                    {"signals": list(signals), "flaps": count},
                    time=wall,
                ))
            if new:
                self._update_flapping(key, port, wall, announce=True)
            self._prune(port, now)
            if self._dirty:
                self._save()

    def _observe_state(
        self, key: PortKey, port: _Port, state: int, phys: int | None, now: float, wall: float,
        new: list[_Flap],
    ) -> None:
        up = is_up(state, phys)
        if port.up is None:
            port.up = up
            if not up:
                port.down_since = now
        elif port.up and not up:
            port.up = False
            port.down_since = now
            port.left_active_at = port.last_up_sample if port.last_up_sample is not None else now
            self._events.append(Event(
                "ib_link_down", Severity.WARNING, _subject(key),
                f"{key[0]} port {key[1]}: link down (state {state}, phys_state {phys})",
                {"state": state, "phys_state": phys},
                time=wall,
            ))
        elif not port.up and up:
            port.up = True
            down_for = max(0.0, now - (port.down_since if port.down_since is not None else now))
            port.last_down_seconds = down_for
            port.down_since = None
            self._events.append(Event(
                "ib_link_up", Severity.INFO, _subject(key),
                f"{key[0]} port {key[1]}: link up after {down_for:.1f} s down",
                {"down_seconds": round(down_for, 3)},
                time=wall,
            ))
            if port.left_active_at is not None:
                self._record(key, port, SIGNAL_STATE, 1, port.left_active_at, now, wall, new)
                port.left_active_at = None
        if up:
            port.last_up_sample = now

    def _observe_counter(
        self, key: PortKey, port: _Port, signal: str, value: int, now: float, wall: float,
        new: list[_Flap],
    ) -> None:
        base = port.baselines.get(signal)
        port.baselines[signal] = (value, now)
        if base is None:
            return
        previous, since = base
        if value < previous:
            # An admin reset (perfquery -R) or a driver reload: start over, never assume a wrap.
            if signal == SIGNAL_CARRIER:
                port.carrier_pending = 0
            return
        delta = value - previous
        if delta == 0:
            return
        if signal == SIGNAL_CARRIER:
            # +1 per transition: a flap is a completed down/up pair, possibly split across reads.
            start = port.carrier_pending_since if port.carrier_pending else since
            total = port.carrier_pending + delta
            count, port.carrier_pending = divmod(total, 2)
            if port.carrier_pending:
                port.carrier_pending_since = start if count == 0 else since
            if count:
                self._record(key, port, signal, count, start, now, wall, new)
        else:
            self._record(key, port, signal, delta, since, now, wall, new)

    def _record(
        self, key: PortKey, port: _Port, signal: str, count: int, start: float, end: float, wall: float,
        new: list[_Flap],
    ) -> None:
        port.signal_counts[signal] = port.signal_counts.get(signal, 0) + count
        lo, hi = start - self.match_slack, end + self.match_slack
        remaining = count
        for flap in port.recent:
            if remaining == 0:
                break
            if signal not in flap.signals and flap.end >= lo and flap.start <= hi:
                flap.signals.add(signal)
                remaining -= 1
        if remaining:
            separate = min(remaining, self.max_recent)
            for _ in range(separate):
                flap = _Flap(start, end, {signal})
                port.recent.append(flap)
                new.append(flap)
            if remaining > separate:  # a counter that jumped absurdly far: the rest in one record
                new[-1].count += remaining - separate
            port.total += remaining
            port.window.extend([wall] * min(remaining, WINDOW_CAP))
            port.last_flap_wall = wall
            self._dirty = True
        while len(port.recent) > self.max_recent:
            port.recent.popleft()

    def _update_flapping(self, key: PortKey, port: _Port, wall: float, announce: bool) -> None:
        announce = announce and not self._provisional
        cutoff = wall - self.window
        while port.window and port.window[0] <= cutoff:
            port.window.popleft()
        flapping = len(port.window) >= self.threshold
        if flapping and not port.flapping and announce:
            self._events.append(Event(
                "ib_port_flapping", Severity.ERROR, _subject(key),
                f"{key[0]} port {key[1]}: {len(port.window)} flaps within {self.window:g} s "
                f"(threshold {self.threshold})",
                {"flaps": len(port.window), "window_seconds": self.window, "threshold": self.threshold},
                time=wall,
            ))
        port.flapping = flapping

    def _prune(self, port: _Port, now: float) -> None:
        """Forget flaps too old to be matched, except those a still-open outage may yet match: the
        state and carrier signals report an outage only when it ends, however long it lasts."""
        horizon = now - self.match_horizon
        if port.left_active_at is not None:
            horizon = min(horizon, port.left_active_at - self.match_slack)
        if port.carrier_pending:
            horizon = min(horizon, port.carrier_pending_since - self.match_slack)
        while port.recent and port.recent[0].end < horizon:
            port.recent.popleft()

    # ----------------------------------------------------------------- outputs

    def status(self, key: PortKey) -> PortFlapStatus:
        """The port's counts; a port never observed reads as all zeros."""
        with self._lock:
            port = self._ports.get(key)
            if port is None and f"{key[0]}/{key[1]}" in self._persisted:
                port = self._port(key)
            if port is None:
                return PortFlapStatus(0, 0, False, None, 0.0, None, dict.fromkeys(SIGNALS, 0), False)
            self._update_flapping(key, port, self._wall(), announce=True)
            down = 0.0
            if port.up is False and port.down_since is not None:
                down = max(0.0, self._clock() - port.down_since)
            return PortFlapStatus(
                flaps_total=port.total,
                window_flaps=len(port.window),
                flapping=port.flapping,
                last_flap_timestamp=port.last_flap_wall,
                down_seconds=down,
                last_down_seconds=port.last_down_seconds,
                signal_counts=dict(port.signal_counts),
                link_downed_saturated=port.saturated,
            )

    def drain_events(self) -> list[Event]:
        """Events since the last drain (the exporting collector hands them to the loop)."""
        with self._lock:
            events, self._events = self._events, []
            return events

    def drain_errors(self) -> dict[str, int]:
        """Persistence faults since the last drain, by reason, for ``Collection.count_error``."""
        with self._lock:
            errors, self._errors = self._errors, {}
            return errors

    # ----------------------------------------------------------------- persistence

    def _error(self, reason: str, message: str) -> None:
        self._errors[reason] = self._errors.get(reason, 0) + 1
        self._log_once.warning(reason, "%s (reported once)", message)

    def _load(self) -> None:
        assert self.state_path is not None
        try:
            with open(self.state_path, encoding="utf-8") as fh:
                text = fh.read()
        except FileNotFoundError:
            return
        except UnicodeDecodeError as exc:
            self._corrupt(f"corrupt flap state {self.state_path}: {exc}")
            return
        except OSError as exc:
            # Unreadable is not corrupt: leave the file alone, start empty, try to write later.
            self._error("state_read", f"cannot read flap state {self.state_path}: {exc}")
            return
        try:
            ports = _parse_state(text)
        except ValueError as exc:
            self._corrupt(f"corrupt flap state {self.state_path}: {exc}")
            return
        wall = self._wall()
        cutoff = wall - MAX_WINDOW  # the configured window is applied once known (configure)
        for name, times in ports.items():
            kept = sorted(t for t in times if cutoff < t <= wall + 300.0)
            if kept:
                self._persisted[name] = kept

    def _corrupt(self, message: str) -> None:
        """Report once, keep the bad file beside the good one for a person to read, start afresh."""
        self._error("state_corrupt", f"{message}; starting with an empty flap window")
        assert self.state_path is not None
        try:
            os.replace(self.state_path, self.state_path + ".corrupt")
        except OSError:
            pass
        self._dirty = True
        self._save()

    def _save(self) -> None:
        if self.state_path is None:
            self._dirty = False
            return
        wall = self._wall()
        cutoff = wall - self.window
        ports = {name: times for name, times in self._persisted.items() if times and times[-1] > cutoff}
        for key, port in sorted(self._ports.items()):
            if port.window:
                ports[port.identity or f"{key[0]}/{key[1]}"] = list(port.window)
        document = {
            "version": STATE_VERSION,
            "saved_at": wall,
            "window_seconds": self.window,
            "ports": ports,
        }
        directory = os.path.dirname(self.state_path) or "."
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".ib_flaps.", suffix=".tmp", dir=directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump(document, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, self.state_path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as exc:
            self._error("state_write", f"cannot write flap state {self.state_path}: {exc}")
            return
        self._dirty = False


def _parse_state(text: str) -> dict[str, list[float]]:
    """Validate the persisted document; any deviation is corruption."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("version") != STATE_VERSION:
        raise ValueError(f"not a version {STATE_VERSION} flap state document")
    ports = document.get("ports")
    if not isinstance(ports, dict):
        raise ValueError("'ports' is not an object")
    result: dict[str, list[float]] = {}
    for name, times in ports.items():
        if not isinstance(name, str) or "/" not in name:
            raise ValueError(f"bad port name {name!r}")
        if not isinstance(times, list) or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and t == t for t in times
        ):
            raise ValueError(f"bad flap times for {name}")
        result[name] = [float(t) for t in times]
    return result


def _subject(key: PortKey) -> dict[str, str]:
    return {"device": key[0], "port": key[1]}


def state_path(state_dir: str) -> str:
    return os.path.join(state_dir, STATE_FILE)


def shared_detector(ctx) -> FlapDetector:
    """The one detector of this daemon (``ctx`` is a collectors' Context): the IB collector feeds
    it ``link_downed``, the watcher feeds it states and ``carrier_changes`` and exports the result."""
    return ctx.get_shared("flaps", lambda: FlapDetector(window=None, state_path=state_path(ctx.state_dir)))
