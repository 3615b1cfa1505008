"""A core/v1 Event on the node for each change of the verdict, what ``kubectl describe node`` shows.

Events are aggregated as client-go's event correlator does for the kubelet, so a finding that
comes and goes does not flood the API server: a repeat of the same type, reason and message bumps
``count`` and ``lastTimestamp`` of the Event already posted (a strategic-merge PATCH) instead of
creating another; more than ten different messages under one reason within ten minutes become one
Event whose message starts ``(combined from similar events):`` (client-go tools/record
events_cache.go: defaultAggregateMaxEvents 10, defaultAggregateIntervalInSeconds 600). An Event the
API server has expired (its TTL is one hour by default) answers 404 to the PATCH and is posted anew.

``involvedObject.uid`` is the node's name, as the kubelet and node-problem-detector set it: it is
what ``kubectl describe node`` searches for (``ref.UID = types.UID(ref.Name)`` in kubectl's node
describer), and it spares gpumon the RBAC to read the Node.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpumon.health.actions.kubeapi import STRATEGIC_MERGE, KubeApi, KubeApiError
from gpumon.health.actions.kubernetes import rfc3339
from gpumon.health.actions.settings import ActionSettings
from gpumon.health.catalogue import Level
from gpumon.health.stage import Verdict

NAMESPACE = "default"  # where the kubelet puts a Node's events (a Node has no namespace)
COMPONENT = "gpumon"
AGGREGATE_MAX = 10
AGGREGATE_WINDOW = 600.0
COMBINED = "(combined from similar events): "
MESSAGE_MAX = 1024
KEPT = 256  # Events remembered for aggregation (client-go keeps 4096 for every object of a kubelet)
REASONS = {Level.OK: "GpumonHealthy", Level.DEGRADED: "GpumonDegraded", Level.UNHEALTHY: "GpumonUnhealthy"}


@dataclass
class Posted:
    name: str
    count: int
    first: str


def describe(verdict: Verdict) -> tuple[str, str, str]:
    """(type, reason, message) of the Event for ``verdict``."""
    if verdict.level is Level.OK:
        return "Normal", REASONS[Level.OK], "gpumon: every health rule is ok"
    found = "; ".join(f"{f.get('rule')}: {f.get('reason')}" for f in verdict.findings)
    return "Warning", REASONS[verdict.level], f"action {verdict.action}: {found}"[:MESSAGE_MAX]


class KubeEventsAction:
    kind = "kube_events"

    def __init__(self, settings: ActionSettings, clock: Callable[[], float] | None = None) -> None:
        self.api = KubeApi(settings)
        self._clock = clock or time.time
        self._posted: collections.OrderedDict[tuple[str, str, str], Posted] = collections.OrderedDict()
        self._messages: dict[tuple[str, str], dict[str, float]] = {}

    def act(self, verdict: Verdict) -> None:
        self.api.ready()
        now = self._clock()
        etype, reason, message = describe(verdict)
        key = (etype, reason, message)
        if self._combined(etype, reason, message, now):
            key, message = (etype, reason, COMBINED), (COMBINED + message)[:MESSAGE_MAX]
        stamp = rfc3339(now)
        posted = self._posted.get(key)
        if posted is not None:
            patch: dict[str, object] = {"count": posted.count + 1, "lastTimestamp": stamp}
            if key[2] == COMBINED:
                patch["message"] = message  # the combined Event shows the latest message
            try:
                self.api.call("PATCH", f"/api/v1/namespaces/{NAMESPACE}/events/{posted.name}", patch,
                              STRATEGIC_MERGE)
            except KubeApiError as exc:
                if exc.code != 404:
                    raise
                del self._posted[key]  # expired on the server: post it anew
            else:
                posted.count += 1
                self._posted.move_to_end(key)
                return
        name = f"{self.api.node}.{time.time_ns():x}"  # the kubelet's naming: <object>.<hex nanoseconds>
        self.api.call("POST", f"/api/v1/namespaces/{NAMESPACE}/events", {
            "apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": NAMESPACE},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.api.node, "uid": self.api.node},
            "reason": reason, "message": message, "type": etype,
            "source": {"component": COMPONENT, "host": self.api.node},
            "reportingComponent": COMPONENT, "reportingInstance": self.api.node,
            "count": 1, "firstTimestamp": stamp, "lastTimestamp": stamp})
        self._posted[key] = Posted(name, 1, stamp)
        while len(self._posted) > KEPT:
            self._posted.popitem(last=False)

    def _combined(self, etype: str, reason: str, message: str, now: float) -> bool:
        """Whether this reason has had more than AGGREGATE_MAX different messages within
        AGGREGATE_WINDOW seconds: its Events are then one combined Event."""
        seen = self._messages.setdefault((etype, reason), {})
        for old in [m for m, t in seen.items() if now - t > AGGREGATE_WINDOW]:
            del seen[old]
        seen[message] = now
        return len(seen) > AGGREGATE_MAX
