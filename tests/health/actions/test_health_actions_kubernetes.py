"""The Kubernetes action against a loopback API-server stand-in (tests/fakes/kube_api.py) that
checks every PATCH against the Kubernetes schema and merges conditions by type: AKS's GPU and
InfiniBand condition types follow the verdict, the kubelet's stay, the rotating token is read
again each time, and a 403 or a hung server is retried with backoff, counted and logged once."""

from __future__ import annotations

import json
import logging
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from gpumon.health.actions import ActionSettings, HealthActions
from gpumon.health.actions.kubernetes import CONDITION_TYPES
from gpumon.health.rules import Thresholds
from gpumon.health.stage import HealthSettings, HealthStage
from tests.conftest import clean_env, wait_for
from tests.fakes.kube_api import NODE, KubeApiServer, action_settings, serving
from tests.fakes.simulated_host import SimulatedHost
from tests.support.health_verdicts import verdict

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def api(tmp_path):
    yield from serving(tmp_path)


def runner(tmp_path, api: KubeApiServer, **settings) -> HealthActions:
    return HealthActions(action_settings(tmp_path, api, **{"kubernetes": True, **settings}), str(tmp_path / "state"))


def statuses(api: KubeApiServer) -> dict[str, str]:
    return {t: c["status"] for t, c in api.conditions(NODE).items()}


def patched(api: KubeApiServer, n: int) -> None:
    wait_for(lambda: len([r for r in api.requests if r["method"] == "PATCH"]) >= n, timeout=10)


def test_an_xid_79_sets_gpu_missing_and_xid_errors_and_the_kubelets_conditions_stay(tmp_path, api) -> None:
    host = SimulatedHost(str(tmp_path / "host"))
    stage = HealthStage(str(tmp_path / "hs"), HealthSettings(Thresholds(), 300.0, "Standard_ND96isr_H100_v5"),
                        boot="boot-1")
    a = runner(tmp_path, api)
    try:
        a.on_verdict(stage.update(host.snapshot()).verdict)
        wait_for(lambda: a.stats()["kubernetes"]["runs"] == 1)
        assert statuses(api) == {"Ready": "True", **{t: "False" for t in CONDITION_TYPES}}
        healthy = api.conditions(NODE)

        host.sim.apply({"action": "xid", "gpu": 2, "xid": 79})
        # the XID arrives through NVML's event thread: collect until the verdict has it (the GPU's
        # loss can show a run earlier), then hand that verdict over once
        verdict = wait_for(lambda: (lambda v: v if any(f["rule"] == "gpu.xid.79" for f in v.findings) else None)(
            stage.update(host.snapshot()).verdict), timeout=10)
        a.on_verdict(verdict)
        wait_for(lambda: a.stats()["kubernetes"]["runs"] == 2)
        now = api.conditions(NODE)
        assert {t for t, c in now.items() if c["status"] == "True"} == {"Ready", "GPUMissing", "XIDErrors"}
        assert now["GPUMissing"]["reason"] == "GpuLost" and "GPU 2 fell off the bus" in now["GPUMissing"]["message"]
        assert now["XIDErrors"]["reason"] == "GpuXid79"
        assert now["Ready"] == healthy["Ready"]  # the kubelet's condition is not ours to touch
        assert now["IBLinkFlapping"]["lastTransitionTime"] == healthy["IBLinkFlapping"]["lastTransitionTime"]

        request = [r for r in api.requests if r["method"] == "PATCH"][-1]
        assert request["path"] == f"/api/v1/nodes/{NODE}/status"
        assert request["headers"]["content-type"] == "application/strategic-merge-patch+json"
        body = json.loads(request["body"])
        assert list(body) == ["status"] and list(body["status"]) == ["conditions"]
        assert a.stats()["kubernetes"] == {"runs": 2, "failures": 0, "retries": 0}
    finally:
        a.close()
        host.close()


def test_every_rule_lands_on_one_owned_type_and_clears_to_false(tmp_path, api) -> None:
    a = runner(tmp_path, api)
    try:
        a.on_verdict(verdict("unhealthy", ("gpu.xid.74", "check_fabric"), ("ib.port.down", "check_fabric")))
        patched(api, 1)
        a.on_verdict(verdict("degraded", ("gpu.thermal_slowdown", "none"), ("ib.port.flapping", "check_fabric"),
                             ("gpu.ecc.uncorrectable", "reset_gpu")))
        patched(api, 2)
        wait_for(lambda: statuses(api)["GpumonDegraded"] == "True")
        s = statuses(api)
        assert {t for t in CONDITION_TYPES if s[t] == "True"} == {"GPUClockThrottling", "IBLinkFlapping",
                                                                  "GpumonDegraded"}
        first = [json.loads(r["body"]) for r in api.requests if r["method"] == "PATCH"][0]
        by_type = {c["type"]: c for c in first["status"]["conditions"]}
        assert by_type["NVLinkStatusInactive"]["status"] == "True"  # XID 74 is an NVLink error
        assert by_type["GpumonUnhealthy"]["reason"] == "IbPortDown"
        a.on_verdict(verdict("ok"))
        patched(api, 3)
        wait_for(lambda: all(statuses(api)[t] == "False" for t in CONDITION_TYPES))
        assert api.conditions(NODE)["GpumonDegraded"]["reason"] == "NoGpumonDegraded"
    finally:
        a.close()


def test_the_service_account_token_is_read_again_for_each_request(tmp_path, api) -> None:
    a = runner(tmp_path, api)
    try:
        a.on_verdict(verdict("ok"))
        wait_for(lambda: a.stats()["kubernetes"]["runs"] == 1)
        api.token = "token-2"  # the kubelet rotated the projected token
        (tmp_path / "token").write_text("token-2\n")
        a.on_verdict(verdict("unhealthy", ("gpu.xid.48", "reset_gpu")))
        wait_for(lambda: statuses(api)["XIDErrors"] == "True")
        assert a.stats()["kubernetes"]["failures"] == 0
        assert [r["headers"]["authorization"] for r in api.requests] == ["Bearer token-1", "Bearer token-2"]
    finally:
        a.close()


def test_a_403_is_retried_with_backoff_counted_and_logged_once(tmp_path, api, caplog) -> None:
    caplog.set_level(logging.WARNING, "gpumon.health.actions")
    api.fault = "forbidden"  # RBAC not applied yet
    a = runner(tmp_path, api)
    try:
        a.on_verdict(verdict("unhealthy", ("gpu.xid.48", "reset_gpu")))
        wait_for(lambda: a.stats()["kubernetes"]["failures"] >= 3)
        api.fault = None
        wait_for(lambda: statuses(api).get("XIDErrors") == "True")
        # the worker counts the success just after the PATCH the stand-in has seen
        wait_for(lambda: a.stats()["kubernetes"]["runs"] > a.stats()["kubernetes"]["failures"])
        stats = a.stats()["kubernetes"]
        assert stats["runs"] == stats["failures"] + 1 and stats["retries"] == stats["failures"]
        logged = [r.getMessage() for r in caplog.records if "health action kubernetes failed" in r.getMessage()]
        assert len(logged) == 1 and "HTTP 403" in logged[0] and "nodes/status" in logged[0]
    finally:
        a.close()


def test_a_hung_api_server_is_cut_at_the_timeout_and_never_delays_the_caller(tmp_path, api) -> None:
    api.fault = "hang"
    a = runner(tmp_path, api, timeout=0.5)
    try:
        started = time.monotonic()
        a.on_verdict(verdict("unhealthy", ("gpu.lost", "reboot")))
        assert time.monotonic() - started < 0.05
        wait_for(lambda: a.stats()["kubernetes"]["failures"] >= 1, timeout=5)
        api.fault = None
        api.release.set()
        wait_for(lambda: statuses(api).get("GPUMissing") == "True", timeout=10)
    finally:
        a.close()


def test_the_stand_in_rejects_what_the_real_api_server_would(tmp_path, api) -> None:
    """The checks above mean something only if the stand-in refuses a bad patch."""
    context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))

    def patch(body: dict) -> int:
        request = urllib.request.Request(f"{api.url}/api/v1/nodes/{NODE}/status", method="PATCH",
                                         data=json.dumps(body).encode(),
                                         headers={"Authorization": "Bearer token-1",
                                                  "Content-Type": "application/strategic-merge-patch+json"})
        try:
            with urllib.request.urlopen(request, timeout=5, context=context) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    good = {"type": "XIDErrors", "status": "True", "reason": "GpuXid48", "message": "m",
            "lastHeartbeatTime": "2025-01-01T00:00:00Z", "lastTransitionTime": "2025-01-01T00:00:00Z"}
    assert patch({"status": {"conditions": [good]}}) == 200
    assert patch({"status": {"conditions": [{**good, "severity": "high"}]}}) == 422  # not a NodeCondition field
    assert patch({"status": {"conditions": [{**good, "status": 1}]}}) == 422
    assert patch({"status": {"conditions": [{**good, "lastHeartbeatTime": "yesterday"}]}}) == 422
    assert patch({"status": {"conditions": [{"status": "True"}]}}) == 422  # type is required


def test_an_api_server_with_another_ca_is_refused(tmp_path, api) -> None:
    import trustme

    trustme.CA().cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    a = runner(tmp_path, api)
    try:
        a.on_verdict(verdict("unhealthy", ("gpu.lost", "reboot")))
        wait_for(lambda: a.stats()["kubernetes"]["failures"] >= 1)
        assert [r for r in api.requests if r["method"] == "PATCH"] == []
    finally:
        a.close()


def test_a_plain_http_kube_api_is_refused_unless_allowed_and_then_warned_about(tmp_path, caplog) -> None:
    config = tmp_path / "gpumon.toml"
    config.write_text('[health]\nkubernetes = true\nkube_api = "http://10.0.0.1:8080"\n')
    refused = subprocess.run([sys.executable, "-m", "gpumon", "check", "--config", str(config)],
                             env=clean_env(), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert f"{config}: [health] kube_api: http://10.0.0.1:8080 is plain http" in refused.stderr
    assert "kube_api_allow_http" in refused.stderr
    from gpumon.config import ConfigError, load
    from gpumon.health.settings import HEALTH, check_config

    allowed = load([HEALTH], None, {"GPUMON_HEALTH_KUBE_API": "http://127.0.0.1:8001",
                                    "GPUMON_HEALTH_KUBE_API_ALLOW_HTTP": "true"}, {})
    check_config(allowed)                                   # the opt-in is accepted ...
    from gpumon.health.actions.kubernetes import KubernetesAction

    KubernetesAction(ActionSettings(kubernetes=True, node_name=NODE, kube_api="http://127.0.0.1:8001"))
    assert "sent in cleartext" in caplog.text               # ... and said out loud
    with pytest.raises(ConfigError, match="must be an https:// URL"):
        load([HEALTH], None, {"GPUMON_HEALTH_KUBE_API": "ftp://x"}, {})
