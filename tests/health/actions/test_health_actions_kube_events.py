"""Kubernetes Events on the node against the loopback API-server stand-in (tests/fakes/kube_api.py),
which validates each Event against the strict core/v1 schema and the API server's Event rules: a
change of the verdict posts one Event, a repeat bumps its count with a PATCH instead of another
Event (as the kubelet aggregates), many different messages under one reason become one combined
Event, and an Event the server expired is posted anew."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import pytest

from gpumon.health.actions import ActionSettings, HealthActions
from gpumon.health.actions.kube_events import COMBINED, KubeEventsAction
from tests.conftest import wait_for
from tests.fakes.kube_api import NODE, KubeApiServer, action_settings, serving
from tests.support.health_verdicts import verdict

EVENTS = "/api/v1/namespaces/default/events"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def api(tmp_path):
    yield from serving(tmp_path)


def settings(tmp_path, api: KubeApiServer) -> ActionSettings:
    return action_settings(tmp_path, api, kube_events=True)


class Clock:
    def __init__(self) -> None:
        self.now = 1_750_000_000.0

    def __call__(self) -> float:
        self.now += 61.0
        return self.now


def test_a_change_posts_a_warning_event_on_the_node_in_the_shape_kubectl_describe_finds(tmp_path, api) -> None:
    action = KubeEventsAction(settings(tmp_path, api))
    action.act(verdict("unhealthy", ("gpu.xid.48", "reset_gpu")))
    (request,) = api.requests
    assert (request["method"], request["path"]) == ("POST", EVENTS)
    assert request["headers"]["content-type"] == "application/json"
    (event,) = api.events.values()
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
    assert event["metadata"]["name"].startswith(NODE + ".")
    assert (event["type"], event["reason"]) == ("Warning", "GpumonUnhealthy")
    assert event["message"] == "action reset_gpu: gpu.xid.48: XID 48 (double-bit ECC) on GPU 0"
    assert event["source"] == {"component": "gpumon", "host": NODE} and event["count"] == 1
    assert event["firstTimestamp"] == event["lastTimestamp"]

    action.act(verdict("ok"))
    normal = [e for e in api.events.values() if e["type"] == "Normal"]
    assert [e["reason"] for e in normal] == ["GpumonHealthy"]


def test_a_flapping_finding_bumps_two_events_instead_of_posting_one_per_change(tmp_path, api) -> None:
    action = KubeEventsAction(settings(tmp_path, api), clock=Clock())
    for _ in range(15):
        action.act(verdict("degraded", ("ib.port.flapping", "check_fabric")))
        action.act(verdict("ok"))
    assert len(api.events) == 2
    counts = {e["reason"]: e["count"] for e in api.events.values()}
    assert counts == {"GpumonDegraded": 15, "GpumonHealthy": 15}
    assert [r["method"] for r in api.requests].count("POST") == 2
    patches = [r for r in api.requests if r["method"] == "PATCH"]
    assert len(patches) == 28 and all(r["headers"]["content-type"] == "application/strategic-merge-patch+json"
                                      for r in patches)
    assert set(json.loads(patches[-1]["body"])) == {"count", "lastTimestamp"}
    degraded = next(e for e in api.events.values() if e["reason"] == "GpumonDegraded")
    assert degraded["lastTimestamp"] > degraded["firstTimestamp"]


def test_more_than_ten_messages_under_one_reason_become_one_combined_event(tmp_path, api) -> None:
    action = KubeEventsAction(settings(tmp_path, api), clock=lambda: 1_750_000_000.0)
    for gpu in range(14):
        action.act(verdict("unhealthy", ("gpu.row_remap.failure", "replace_hardware"), gpu=str(gpu)))
    warnings = [e for e in api.events.values() if e["type"] == "Warning"]
    assert len(warnings) == 11  # ten of their own, then one combined for the rest
    (combined,) = [e for e in warnings if e["message"].startswith(COMBINED)]
    assert combined["count"] == 4 and "GPU 13" in combined["message"]


def test_an_event_the_server_expired_is_posted_again(tmp_path, api) -> None:
    action = KubeEventsAction(settings(tmp_path, api), clock=Clock())
    action.act(verdict("unhealthy", ("gpu.lost", "reboot")))
    api.events.clear()  # the API server's event TTL (one hour by default) passed
    action.act(verdict("unhealthy", ("gpu.lost", "reboot")))
    assert [r["method"] for r in api.requests] == ["POST", "PATCH", "POST"]
    (event,) = api.events.values()
    assert event["count"] == 1


def test_the_runner_posts_nothing_for_a_healthy_start_and_counts_its_runs(tmp_path, api) -> None:
    runner = HealthActions(settings(tmp_path, api), str(tmp_path / "state"))
    try:
        runner.on_verdict(verdict("ok"))
        runner.on_verdict(verdict("unhealthy", ("gpu.lost", "reboot")))
        wait_for(lambda: runner.stats()["kube_events"]["runs"] == 1)
        assert [e["reason"] for e in api.events.values()] == ["GpumonUnhealthy"]
    finally:
        runner.close()


def test_the_stand_in_rejects_the_events_the_real_api_server_would(tmp_path, api) -> None:
    context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))

    def post(event: dict) -> int:
        request = urllib.request.Request(api.url + EVENTS, method="POST", data=json.dumps(event).encode(),
                                         headers={"Authorization": "Bearer token-1",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5, context=context) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    good = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "n.1", "namespace": "default"},
            "involvedObject": {"kind": "Node", "name": NODE, "uid": NODE}, "reason": "R", "message": "m",
            "type": "Warning", "source": {"component": "gpumon"}, "count": 1,
            "firstTimestamp": "2025-01-01T00:00:00Z", "lastTimestamp": "2025-01-01T00:00:00Z"}
    assert post(good) == 201
    assert post(good) == 409  # the name is taken
    assert post({**good, "metadata": {"name": "n.2"}, "type": "Error"}) == 422
    assert post({**good, "metadata": {"name": "n.3"}, "involvedObject": {"kind": "Node", "name": NODE}}) == 422
    assert post({**good, "metadata": {"name": "n.4", "namespace": "gpumon"}}) == 422
    assert post({**good, "metadata": {"name": "n.5"}, "severity": "high"}) == 422  # not an Event field
    assert post({**good, "metadata": {"name": "n.6"}, "lastTimestamp": "now"}) == 422


def test_a_403_on_events_is_retried_counted_and_logged_once_and_check_names_the_missing_node(
        tmp_path, api, caplog, monkeypatch) -> None:
    import logging

    from gpumon.health.actions import check
    from gpumon.health.settings import HEALTH, action_settings, actions_on

    assert actions_on(action_settings(HEALTH.values({"kube_events": True})))
    monkeypatch.delenv("NODE_NAME", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    problems = check(ActionSettings(kube_events=True, kube_taint=True))
    assert any("no node name" in p for p in problems) and any("no API server" in p for p in problems)

    caplog.set_level(logging.WARNING, "gpumon.health.actions")
    api.fault = "forbidden"  # the node-events component not applied
    runner = HealthActions(settings(tmp_path, api), str(tmp_path / "state"))
    try:
        runner.on_verdict(verdict("unhealthy", ("gpu.lost", "reboot")))
        wait_for(lambda: runner.stats()["kube_events"]["failures"] >= 3)
        api.fault = None
        wait_for(lambda: len(api.events) == 1)
        logged = [r.getMessage() for r in caplog.records if "health action kube_events failed" in r.getMessage()]
        assert len(logged) == 1 and "HTTP 403" in logged[0]
    finally:
        runner.close()
