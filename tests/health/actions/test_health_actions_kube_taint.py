"""The node taint against the loopback API-server stand-in (tests/fakes/kube_api.py): read the Node,
write ``spec.taints`` back with only gpumon's taint changed (the list has no merge key, so a patch
replaces it whole) under the resourceVersion read, and retry a 409 Conflict from a fresh read."""

from __future__ import annotations

import json

import pytest

from gpumon.health.actions import ActionSettings, HealthActions
from gpumon.health.actions.kube_taint import KubeTaintAction
from gpumon.health.actions.process import ActionError
from tests.conftest import wait_for
from tests.fakes.kube_api import NODE, KubeApiServer, action_settings, serving
from tests.support.health_verdicts import verdict

THEIRS = {"key": "sku", "value": "gpu", "effect": "NoSchedule"}
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def api(tmp_path):
    yield from serving(tmp_path)


def settings(tmp_path, api: KubeApiServer) -> ActionSettings:
    return action_settings(tmp_path, api, kube_taint=True)


def test_an_unhealthy_verdict_taints_the_node_and_keeps_the_other_taints(tmp_path, api) -> None:
    action = KubeTaintAction(settings(tmp_path, api))
    action.act(verdict("unhealthy", ("gpu.xid.79", "reboot"), ("ib.port.down", "check_fabric")))
    assert api.taints(NODE) == [THEIRS, {"key": "gpumon.io/unhealthy", "value": "gpu.xid.79",
                                         "effect": "NoSchedule"}]
    get, patch = api.requests
    assert (get["method"], get["path"]) == ("GET", f"/api/v1/nodes/{NODE}")
    assert (patch["method"], patch["path"]) == ("PATCH", f"/api/v1/nodes/{NODE}")
    assert patch["headers"]["content-type"] == "application/strategic-merge-patch+json"
    assert json.loads(patch["body"])["metadata"] == {"resourceVersion": "1"}

    action.act(verdict("unhealthy", ("ib.port.down", "check_fabric")))  # another rule: the value follows
    assert [t["value"] for t in api.taints(NODE)] == ["gpu", "ib.port.down"]
    action.act(verdict("degraded", ("gpu.thermal_slowdown", "none")))  # not unhealthy: untainted
    assert api.taints(NODE) == [THEIRS]
    before = len(api.requests)
    action.act(verdict("ok"))
    assert [r["method"] for r in api.requests[before:]] == ["GET"]  # nothing to change, nothing written


def test_a_node_changed_between_read_and_write_is_read_again_never_overwritten(tmp_path, api) -> None:
    action = KubeTaintAction(settings(tmp_path, api))
    call = action.api.call

    def racing(method: str, path: str, *args):
        answer = call(method, path, *args)
        if method == "GET":
            with api._lock:  # another writer (an operator's kubectl taint) lands in between
                api.nodes[NODE]["spec"]["taints"].append({"key": "maintenance", "effect": "NoSchedule"})
            api.touch(NODE)
        return answer

    action.api.call = racing  # type: ignore[method-assign]
    with pytest.raises(ActionError, match="409"):
        action.act(verdict("unhealthy", ("gpu.lost", "reboot")))
    action.api.call = call  # type: ignore[method-assign]
    action.act(verdict("unhealthy", ("gpu.lost", "reboot")))
    assert [t["key"] for t in api.taints(NODE)] == ["sku", "maintenance", "gpumon.io/unhealthy"]


def test_the_runner_reconciles_a_stale_taint_at_start_and_counts_its_runs(tmp_path, api) -> None:
    with api._lock:  # left by a gpumon that stopped while the node was unhealthy
        api.nodes[NODE]["spec"]["taints"].append({"key": "gpumon.io/unhealthy", "value": "gpu.lost",
                                                  "effect": "NoSchedule"})
    runner = HealthActions(settings(tmp_path, api), str(tmp_path / "state"))
    try:
        runner.on_verdict(verdict("ok"))
        wait_for(lambda: runner.stats()["kube_taint"]["runs"] == 1)
        assert api.taints(NODE) == [THEIRS]
    finally:
        runner.close()


def test_the_stand_in_refuses_a_stale_version_and_a_bad_taint(tmp_path, api) -> None:
    ok, _ = api.handle("PATCH", f"/api/v1/nodes/{NODE}", {"authorization": "Bearer token-1",
                       "content-type": "application/strategic-merge-patch+json"},
                       json.dumps({"metadata": {"resourceVersion": "0"}, "spec": {"taints": []}}).encode())
    assert ok == 409
    bad, _ = api.handle("PATCH", f"/api/v1/nodes/{NODE}", {"authorization": "Bearer token-1",
                        "content-type": "application/strategic-merge-patch+json"},
                        json.dumps({"spec": {"taints": [{"key": "k", "effect": "Sometimes"}]}}).encode())
    assert bad == 422
    wrong, _ = api.handle("PATCH", f"/api/v1/nodes/{NODE}", {"authorization": "Bearer token-1",
                          "content-type": "application/json"}, b'{"spec": {"taints": []}}')
    assert wrong == 415
