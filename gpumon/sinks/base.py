"""The contract between the loop and a sink.

``publish(snapshot)`` is called on the loop's thread after every change and must return at once: a
sink that needs I/O hands the snapshot to its own thread (or, like the Prometheus sink, swaps a
pre-rendered page). ``stop(timeout)`` flushes what can be flushed within the timeout.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gpumon.config import Config, Section, SectionSchema, parsed_section
from gpumon.model import Snapshot


class SinkDependencyMissing(Exception):
    """The sink's optional extra is not installed; the message says what to pip install."""


@dataclass(frozen=True)
class SinkHealth:
    up: bool
    exported: int = 0
    """Items delivered so far (scrapes served, data points or rows accepted)."""
    failed: int = 0
    """Deliveries that failed so far."""
    dropped: int = 0
    """Items given up on (spool overflow, rejected rows)."""
    detail: str = ""
    extra: dict[str, float] = field(default_factory=dict)
    """Sink-specific gauges for self-metrics, e.g. ``{"spool_bytes": 1234}``."""


@dataclass(frozen=True)
class CheckResult:
    """One line of ``gpumon check``: an item, a verdict, and a sentence."""

    item: str
    ok: bool
    message: str


@dataclass
class SinkContext:
    hostname: str
    state_dir: str
    version: str
    loop_alive: Callable[[], bool] = lambda: True
    """True while the collector loop is running; the Prometheus sink's /healthz reads it."""
    health_verdict: Callable[[], dict[str, Any] | None] | None = None
    """The node's latest health verdict as a dict (None before the first); unset when ``[health]`` is
    off. The Prometheus sink's /health serves it."""
    config: Config = field(default_factory=lambda: Config({}))
    """The one Config in effect (a simulated host's own ``[azure] imds_url`` and KVP pool in it); a
    Config with no sections for a sink built by hand. No sink asks IMDS: the host identity comes on
    each Snapshot (``Snapshot.identity``, from the one provider the daemon builds from this config)."""


class Sink:
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    options: ClassVar[SectionSchema[Any] | None] = None
    settings: Any
    """The section parsed once (``options.settings_of(cfg)``): the schema's frozen settings dataclass,
    or a :class:`Section` for a schema without one; a subclass narrows the type (``settings:
    OtelSettings``) and reads every option as ``self.settings.<key>``."""
    requires: ClassVar[tuple[str, ...]] = ()
    """Importable modules the sink needs beyond the core (checked before the SDK is imported)."""
    extra: ClassVar[str] = ""
    """The ``pip install 'gpumon-exporter[extra]'`` that provides ``requires``."""

    def __init__(self, ctx: SinkContext, cfg: Section | None = None) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.settings = parsed_section(self.name, self.options, cfg)

    @classmethod
    def missing_dependencies(cls) -> list[str]:
        missing = []
        for module in cls.requires:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                missing.append(module)
        return missing

    @classmethod
    def ensure_dependencies(cls) -> None:
        if cls.missing_dependencies():
            raise SinkDependencyMissing(f"sink '{cls.name}' needs: pip install 'gpumon-exporter[{cls.extra}]'")

    @classmethod
    def validate(cls, config: Config) -> None:
        """Raise ConfigError (exit 2, naming the key and its file) for settings that cannot work: called
        before the sink is built for ``run``, a reload or ``check``, so a mistake never reads as a failure."""

    def start(self) -> None:
        """Open sockets, start threads. Raise to fail start-up (exit 1)."""

    def publish(self, snapshot: Snapshot) -> None:
        raise NotImplementedError

    def listening(self) -> str | None:
        """``HOST:PORT`` this sink accepts connections on once started (the port the kernel chose
        for ``:0``); None for a sink that only sends."""
        return None

    def stop(self, timeout: float = 5.0) -> None:
        """Flush and release within ``timeout`` seconds."""

    def health(self) -> SinkHealth:
        return SinkHealth(up=True)

    def identity_overrides(self) -> Mapping[str, Any] | None:
        """Whether this sink reads ``Snapshot.identity`` (None: it does not, so no provider need run for
        it), and the ``[azure]`` keys its deprecated IMDS options set (honoured by the one provider)."""
        return None

    def check(self) -> list[CheckResult]:
        """Probe the endpoint and credentials for ``gpumon check`` without sending data."""
        return [CheckResult(self.name, True, "no check defined")]
