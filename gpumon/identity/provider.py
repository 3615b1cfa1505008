"""The one host identity provider: the only refresh of who this host is (IMDS compute metadata and the
Hyper-V KVP pool's physical host), on one thread, for the loop to stamp on every Snapshot.

Before, each consumer asked for itself (the OpenTelemetry and Azure Monitor sinks and the health
stage each on a thread of their own); now they read ``Snapshot.identity``. IMDS is asked through the
one shared client ``[azure]`` configures (:func:`gpumon.imds.configured`): its cache (re-read every
``[azure] compute_refresh``), its "not on Azure" memory, its throttling and its logged-once faults
are the same as ever, so the ``host_info`` collector asking it too costs no second request. The KVP
pool is read anew at every look (a live migration changes the physical host); a pool that cannot be
read gives no physical host (the ``host_info`` collector counts and logs that fault).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from gpumon import imds
from gpumon.config import Config
from gpumon.imds import ImdsClient, ImdsError
from gpumon.model import AzureInstance, HostIdentity
from gpumon.sources import kvp

log = logging.getLogger("gpumon.identity")

REFRESH = 60.0
"""Seconds between looks: IMDS answers from the shared client's cache (asked again every ``[azure]
compute_refresh``); the KVP pool is read anew (a live migration changes it)."""
ASK_AGAIN = 10.0
"""Seconds before the next look while IMDS failed without being "off Azure" and nothing is known (a
timeout at boot, a 5xx, a 429): one bad moment never leaves the host unknown for a whole REFRESH."""


def kvp_pool(config: Config | None) -> str:
    """The KVP pool the config in effect names (``[host_info] kvp_pool``; empty: not read): a
    simulated host's own pool, the real one otherwise."""
    section = config.sections.get("host_info") if config is not None else None
    return str(section.get("kvp_pool", kvp.DEFAULT_POOL)) if section is not None else kvp.DEFAULT_POOL


def physical_host(pool: str) -> str:
    """The physical host's name from the pool; empty where there is none or it cannot be read now."""
    if not pool:
        return ""
    try:
        return kvp.physical_host(kvp.read_pool(pool))
    except OSError:
        return ""


def azure_section(config: Config | None, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``[azure]`` as the config in effect sets it (a simulated host's own IMDS), with ``overrides``
    (a sink's deprecated IMDS keys) over it."""
    section = dict(config.sections.get("azure") or {}) if config is not None else {}
    return {**section, **(overrides or {})}


def azure_settings(config: Config | None, overrides: Mapping[str, Any] | None = None) -> imds.AzureSettings:
    """``[azure]``'s parsed settings (defaults where the section is absent), ``overrides`` over it."""
    return imds.OPTIONS.settings_of(azure_section(config, overrides))


class IdentityProvider:
    """Looks at the host's identity now and every :data:`REFRESH` seconds on its own thread
    ("host-identity"), until stopped; :meth:`current` is the latest look (``asked`` False before the
    first). ``on_change`` is told (from that thread) whenever the identity changed: the loop publishes
    a fresh snapshot then, so a sink waiting for the first identity does not wait a whole refresh."""

    def __init__(self, client: ImdsClient, pool: str, on_change: Callable[[], None] | None = None,
                 refresh: float = REFRESH, ask_again: float = ASK_AGAIN) -> None:
        self.client = client
        self.pool = pool
        self.on_change = on_change
        self.refresh_every = refresh
        self.ask_again = ask_again
        self._current = HostIdentity()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: Config, overrides: Mapping[str, Any] | None = None) -> IdentityProvider:
        """The provider for the config in effect: its ``[azure]`` IMDS (with a sink's deprecated
        ``overrides``) and its ``[host_info] kvp_pool``."""
        return cls(imds.configured(azure_section(config, overrides)), kvp_pool(config))

    def current(self) -> HostIdentity:
        with self._lock:
            return self._current

    def adopt(self, previous: IdentityProvider) -> None:
        """After a reload: start from what the running provider knew, so the new loop's first
        snapshots do not forget the host while this one takes its first look."""
        with self._lock:
            if not self._current.asked:
                self._current = previous.current()

    def look(self) -> HostIdentity:
        """One look now (IMDS from the shared client's cache where it is fresh), kept and returned.
        Never raises: IMDS faults are the client's, logged once."""
        instance: AzureInstance | None = None
        off_azure = False
        try:
            instance = self.client.instance()
        except ImdsError as exc:
            off_azure = exc.reason == "unreachable"  # nothing answers here: off Azure, for good
        except Exception:  # noqa: BLE001 - a bug here must not end the refresh
            log.debug("identity: asking IMDS failed", exc_info=True)
        found = HostIdentity(instance, physical_host(self.pool), asked=True, off_azure=off_azure)
        with self._lock:
            changed, self._current = found != self._current, found
        if changed and self.on_change is not None:
            self.on_change()
        return found

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="host-identity", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Ends the thread at its next wait (a look in progress is bounded by ``[azure] imds_timeout``)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            found = self.look()
            unknown = found.instance is None and not found.off_azure
            if self._stop.wait(self.ask_again if unknown else self.refresh_every):
                return
