"""The contract between a collector and the loop.

A collector is a class with a ``name``, its own config section (``options``), and three calls:
``probe()`` says whether this host has the source, ``collect()`` returns one :class:`Collection`,
``close()`` releases what it holds. The loop calls ``collect()`` from one thread per collector, so a
collector needs no locking of its own state; state shared between two collectors (the link-flap
detector fed by both the IB counters and the fast state watcher) goes through
:meth:`Context.get_shared`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from gpumon.config import Config, Section, SectionSchema, parsed_section
from gpumon.model import Collection, MetricSpec, Snapshot, StateReason
from gpumon.table import Table

T = TypeVar("T")


@dataclass(frozen=True)
class Availability:
    """Whether a collector's source exists on this host, and if not, the reason a person reads."""

    available: bool
    reason: str = ""
    #: The source is on this host but not ready (a driver still loading or being updated): ``gpumon
    #: run`` starts the collector anyway, reported down, so it comes up without a restart.
    retry: bool = False
    #: Why, from the fixed vocabulary of ``gpumon_collector_state``'s ``reason`` label.
    cause: StateReason = StateReason.ERROR


class CollectorUnavailable(Exception):
    """Raised by ``collect()`` when the source went away (driver unloaded, tree removed).

    The loop reports the collector unavailable with this message rather than failed, and ``cause``
    as the ``reason`` of ``gpumon_collector_state``.
    """

    def __init__(self, message: str = "", cause: StateReason = StateReason.ERROR) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass
class Context:
    """What the daemon gives every collector: where the sources are, and a place to share state."""

    hostname: str
    sysfs_root: str = "/sys"
    state_dir: str = "/var/lib/gpumon"
    simulation: Any = None
    """A :class:`gpumon.simulate.Simulation` when ``--simulate`` is set, else None."""
    nvml: Any = None
    """The ``pynvml`` module to use; None means import the real one. Simulation puts its double here."""
    config: Config = field(default_factory=lambda: Config({}))
    """The one Config in effect (``daemon.make_context`` applies ``--simulate`` to it once, at load: a
    simulated host's own IMDS, KVP pool and kernel log); a Config with no sections where a collector is
    built alone. For a section two collectors share, as the linkflap watcher reads [infiniband]'s device
    filter and read mode."""
    persist_state: bool = True
    """False for one-shot commands (``once``, ``check``, ``health``): a collector reads what it saved
    under ``state_dir`` (such as a read position) but writes nothing there, leaving the daemon's alone."""
    _shared: dict[str, Any] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def adopt_shared(self, previous: Context, key: str) -> None:
        """Take ``previous``'s shared object under ``key`` (a reload keeps state such as the flap
        detector's totals and open outages, which no source could give back)."""
        with previous._lock:
            if key not in previous._shared:
                return
            value = previous._shared[key]
        with self._lock:
            self._shared[key] = value

    def get_shared(self, key: str, factory: Callable[[], T]) -> T:
        """One object per key for all collectors of this daemon, created on first use."""
        with self._lock:
            if key not in self._shared:
                self._shared[key] = factory()
            return self._shared[key]


class Collector:
    """Base class; subclasses set the class attributes and implement ``collect``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    options: ClassVar[SectionSchema[Any] | None] = None
    """The collector's own config section, named like the collector. An ``interval`` option, if
    declared, overrides ``[daemon] interval`` for this collector (0 = use the daemon's)."""
    settings: Any
    """The section parsed once (``options.settings_of(cfg)``): the schema's frozen settings dataclass,
    or a :class:`Section` for a schema without one; a subclass narrows the type (``settings:
    AerSettings``) and reads every option as ``self.settings.<key>``."""
    implies: ClassVar[tuple[str, ...]] = ()
    """Collectors that run whenever this one runs (``infiniband`` implies ``linkflap``)."""

    def __init__(self, ctx: Context, cfg: Section | None = None) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.settings = parsed_section(self.name, self.options, cfg)

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        """Every metric this collector can produce, for the docs and the cardinality check."""
        return ()

    @classmethod
    def summarize(cls, snapshot: Snapshot) -> Table | None:
        """A plugin collector's part of the terminal table, built from the snapshot alone (None: no
        section). The built-in collectors define none: their sections are the report's
        (:mod:`gpumon.report.tables`), which asks this hook only for a collector it has no table for."""
        return None

    def interval(self, default: float) -> float:
        own = getattr(self.settings, "interval", 0) if self.settings is not None else 0
        return float(own) if own else default

    def probe(self) -> Availability:
        """Cheap check that the source exists; must not raise."""
        return Availability(True)

    def check(self) -> Availability:
        """For ``gpumon check``, after a successful probe: ask the source once as a run would and say
        what the daemon will meet (unavailable with the reason: every run will fail that way; ``retry``:
        not answering yet). A probe only asks whether the source exists; a source can exist and refuse
        every request (IMDS answering 403). Default: the probe said it all."""
        return Availability(True)

    def run_soon(self) -> None:
        """Ask for a run now rather than at the next interval: a collector whose source pushes
        (the XID event thread) calls this when something arrived. The loop sets the real hook;
        before it (``gpumon once``, tests) it does nothing."""
        hook = self._run_soon
        if hook is not None:
            hook()

    _run_soon: Callable[[], None] | None = None

    def collect(self) -> Collection:
        raise NotImplementedError

    def inherit(self, previous: Collector) -> None:
        """After a reload: take over what ``previous`` (the stopped instance of this collector that
        this one replaces) counted itself, such as event totals, so no counter resets. Default: none."""

    def close(self) -> None:
        """Release file descriptors, threads, library handles."""

