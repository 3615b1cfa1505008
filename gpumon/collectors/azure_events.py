"""Azure Scheduled Events: maintenance the platform (or a user) has planned for this VM.

Polls IMDS ``/metadata/scheduledevents`` (every 10 s by default; the platform gives at least 15 minutes
notice of a Freeze or Reboot, 10 of a Redeploy, 30 s of a Preempt). Each event becomes one
``azure_scheduled_event`` Event when first seen and again on each status change (Scheduled, Started,
and Removed once it leaves the document: done or cancelled), and the pending ones are series. It
never acknowledges an event unless told to for its type: acknowledging starts the event now.

Off Azure the collector is unavailable after one short, cached IMDS probe (the shared client's).
A failed poll is counted by reason; the last good document's series stay for three intervals.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from gpumon import imds
from gpumon.catalogue.host import (
    SCHEDULED_EVENT as PENDING,
)
from gpumon.catalogue.host import (
    SCHEDULED_EVENT_NOT_BEFORE as NOT_BEFORE,
)
from gpumon.catalogue.host import (
    SCHEDULED_EVENTS_INCARNATION as INCARNATION,
)
from gpumon.collectors.base import Availability, Collector, Context
from gpumon.config import Option, Section, SectionSchema
from gpumon.imds import EVENT_TYPES, ImdsError, ScheduledEvent, ScheduledEvents
from gpumon.model import Collection, Event, MetricSpec, Severity, StateReason

log = logging.getLogger("gpumon.collectors.azure_events")

KIND = "azure_scheduled_event"
REMOVED = "Removed"
"""The status gpumon reports once an event has left the document (it ran, or was cancelled)."""
STALE_POLLS = 3
SEVERITY = {"Freeze": Severity.WARNING, "Reboot": Severity.ERROR, "Redeploy": Severity.ERROR,
            "Preempt": Severity.CRITICAL, "Terminate": Severity.CRITICAL}



@dataclass(frozen=True)
class AzureEventsSettings:
    interval: float
    timeout: float
    acknowledge: tuple[str, ...]


OPTIONS = SectionSchema(
    "azure_events",
    "Azure Scheduled Events (Freeze, Reboot, Redeploy, Preempt, Terminate) from IMDS.",
    (
        Option("interval", float, 10.0, "Seconds between polls (IMDS allows 5 requests a second; the "
               "shortest notice, a Preempt's, is 30 s).", min=1.0, max=3600.0),
        Option("timeout", float, 5.0, "Seconds one poll may wait for IMDS. The first poll enables the "
               "service and may take up to 2 minutes to answer: until a first answer, timeouts are "
               "expected and logged once.", min=0.1, max=60.0),
        Option("acknowledge", list, [],
               "Event types gpumon acknowledges (starts now) once per event, e.g. [\"Freeze\"]. Empty: "
               "never acknowledge, the platform starts each event at its NotBefore.", choices=EVENT_TYPES),
    ),
    AzureEventsSettings,
)


class AzureEventsCollector(Collector):
    name = "azure_events"
    description = "Azure Scheduled Events from IMDS: events per status change, pending events as series."
    options = OPTIONS
    settings: AzureEventsSettings

    def __init__(self, ctx: Context, cfg: Section | None = None) -> None:
        super().__init__(ctx, cfg)
        azure = ctx.config.sections.get("azure")
        self._client = imds.configured(azure)
        self._seen: dict[str, ScheduledEvent] = {}
        self._acked: set[str] = set()
        self._last: ScheduledEvents | None = None
        self._last_at = -float("inf")
        self._answered = False
        self._told_enabling = False

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        return (PENDING, NOT_BEFORE, INCARNATION)

    def interval(self, default: float) -> float:
        """Its own pace, whatever the daemon's: a Preempt gives only 30 s notice."""
        return self.settings.interval

    def probe(self) -> Availability:
        on, why = self._client.on_azure()
        return Availability(on, why, cause=StateReason.ERROR)  # off Azure (no IMDS answers)

    def check(self) -> Availability:
        """One poll, as the daemon's first: a refusal (403) would repeat on every poll."""
        try:
            self._client.scheduled_events(self.settings.timeout)
        except ImdsError as exc:
            if exc.reason in ("timeout", "throttled"):
                return Availability(False, f"IMDS {exc.reason} asking {imds.EVENTS_PATH.partition('?')[0]}: {exc.detail} (the first "
                                    "requests enable Scheduled Events, which can take up to 2 minutes)", retry=True)
            return Availability(False, imds.run_verdict(exc, imds.EVENTS_PATH, self.name))
        return Availability(True)

    def collect(self) -> Collection:
        coll = Collection()
        now = time.monotonic()
        try:
            doc = self._client.scheduled_events(self.settings.timeout)
        except ImdsError as exc:
            coll.count_error(f"imds_{exc.reason}")
            if not self._answered and exc.reason == "timeout" and not self._told_enabling:
                self._told_enabling = True
                log.info("Scheduled Events not answering yet: the first requests enable the service, "
                         "which can take up to 2 minutes")
            if self._last is not None and now - self._last_at < STALE_POLLS * self.interval(0):
                self._export(coll, self._last)
            return coll
        self._answered, self._last, self._last_at = True, doc, now
        coll.events.extend(self._changes(doc))
        self._acknowledge(coll, doc)
        self._export(coll, doc)
        return coll

    def _changes(self, doc: ScheduledEvents) -> list[Event]:
        """One Event per new event, per status change, and per event that left the document."""
        out = []
        current = {e.event_id: e for e in doc.events}
        for event in doc.events:
            before = self._seen.get(event.event_id)
            if before is None or before.status != event.status:
                out.append(_as_event(event, event.status, doc.incarnation))
        for event_id, before in self._seen.items():
            if event_id not in current:
                out.append(_as_event(before, REMOVED, doc.incarnation))
                self._acked.discard(event_id)
        self._seen = current
        return out

    def _acknowledge(self, coll: Collection, doc: ScheduledEvents) -> None:
        """POST a StartRequest once per Scheduled event of a listed type; a transient failure is
        retried on the next poll, a 400 (IMDS refuses the request) is not."""
        for event in doc.events:
            if event.status != "Scheduled" or event.event_type not in self.settings.acknowledge:
                continue
            if event.event_id in self._acked:
                continue
            try:
                self._client.acknowledge([event.event_id], self.settings.timeout)
            except ImdsError as exc:
                coll.count_error(f"acknowledge_{exc.reason}")
                if exc.status == 400:
                    self._acked.add(event.event_id)
                continue
            self._acked.add(event.event_id)
            log.warning("acknowledged Azure scheduled event %s (%s): it may start now",
                        event.event_id, event.event_type)

    @staticmethod
    def _export(coll: Collection, doc: ScheduledEvents) -> None:
        counts = Counter((e.event_type, e.source, e.status) for e in doc.events)
        coll.add(PENDING, (PENDING.sample(n, *key) for key, n in sorted(counts.items())))
        coll.add(NOT_BEFORE, (NOT_BEFORE.sample(e.not_before, e.event_id, e.event_type, e.source)
                              for e in doc.events if e.status == "Scheduled" and e.not_before is not None))
        coll.add(INCARNATION, (INCARNATION.sample(doc.incarnation),))


def _as_event(event: ScheduledEvent, status: str, incarnation: int) -> Event:
    severity = Severity.INFO if status == REMOVED else SEVERITY.get(event.event_type, Severity.WARNING)
    return Event(KIND, severity, {"event_id": event.event_id, "type": event.event_type},
                 _message(event, status), _attributes(event, status, incarnation))


def _message(event: ScheduledEvent, status: str) -> str:
    what = f"Azure {event.event_type} ({event.source or 'unknown source'})"
    if status == REMOVED:
        return f"{what} {event.event_id} is over (ran or was cancelled)"
    if status == "Started" or event.not_before is None:
        return f"{what} {event.event_id} has started: {event.description}".rstrip(": ")
    return f"{what} {event.event_id} scheduled, not before {event.not_before_text}: {event.description}".rstrip(
        ": ")


def _attributes(event: ScheduledEvent, status: str, incarnation: int) -> dict[str, Any]:
    return {
        "event_id": event.event_id, "type": event.event_type, "status": status, "source": event.source,
        "not_before": event.not_before_text, "not_before_timestamp": event.not_before,
        "duration_seconds": event.duration, "resource_type": event.resource_type,
        "resources": list(event.resources), "description": event.description,
        "document_incarnation": incarnation,
    }
