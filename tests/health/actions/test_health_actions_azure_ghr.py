"""The azure_ghr action against a loopback ARM (real HTTPS, every body validated against the Impact
Reporting spec) and a loopback IMDS issuing managed-identity tokens: one report per new unhealthy
finding, idempotent across re-evaluations and restarts, rate-limited per category, and each fault
(401, 403, 409, 429, 500, a hang, a schema error, no VM to report on) handled as the docs say."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest

from gpumon.health.actions import ActionSettings, HealthActions, check
from gpumon.health.actions.azure_ghr import GuestHealthReportAction, report_name
from gpumon.health.catalogue import Level
from gpumon.health.stage import Verdict
from gpumon.health.state import Active
from tests.conftest import clean_env, wait_for
from tests.fakes.arm import ArmImpactServer
from tests.fakes.imds import ImdsServer

pytestmark = pytest.mark.timeout(60)

SUB = "0d045314-435a-41da-b0a4-2ca7e9f87d12"
VM_ID = "6c1f3c4e-0000-4000-8000-000000000001"
RESOURCE = f"/subscriptions/{SUB}/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/gpu-node-0"
CLIENT_ID = "11111111-2222-3333-4444-555555555555"
COMPUTE = {"vmId": VM_ID, "vmSize": "Standard_ND96isr_H100_v5", "location": "eastus2", "name": "gpu-node-0",
           "subscriptionId": SUB, "resourceGroupName": "rg", "resourceId": RESOURCE}
FACTS = {"gpus": {"3": {"uuid": "GPU-3", "serial": "1652823054321", "pci_bus_id": "00000000:9D:00.0"}},
         "physical_host": "GGBB90904476"}


def finding(rule: str, reason: str, subject: dict[str, str], since: float = 1_732_467_600.0,
            level: Level = Level.UNHEALTHY) -> dict:
    return Active(rule, [list(p) for p in subject.items()], int(level), "reboot", reason, True, since,
                  since).as_dict()


XID79 = finding("gpu.xid.79", "GPU 3: XID 79", {"gpu": "3"})
FLAP = finding("ib.port.flapping", "mlx5_ib0/1 flapped 5 times in 24 h", {"device": "mlx5_ib0", "port": "1"})


def verdict(*findings: dict) -> Verdict:
    level = Level.UNHEALTHY if findings else Level.OK
    return Verdict(level, "reboot" if findings else "none", tuple(findings), "ND H100 v5", 1_732_467_601.0, facts=FACTS)


@pytest.fixture
def arm(tmp_path, monkeypatch):
    server = ArmImpactServer()
    monkeypatch.setenv("SSL_CERT_FILE", server.ca_file(str(tmp_path / "arm-ca.pem")))
    yield server
    server.close()


@pytest.fixture
def imds(monkeypatch):
    server = ImdsServer(dict(COMPUTE), client_ids=(CLIENT_ID,))
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", server.url)  # azure-identity's IMDS address
    for var in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER", "MSI_ENDPOINT", "MSI_SECRET", "AZURE_FEDERATED_TOKEN_FILE",
                "IMDS_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    yield server
    server.close()


def settings(arm, imds, **extra) -> ActionSettings:
    options = {"azure_ghr": True, "azure_ghr_arm": arm.url, "azure_ghr_client_id": CLIENT_ID,
               "imds_url": imds.url, "timeout": 2.0, "backoff_initial": 0.05, "backoff_max": 0.2, **extra}
    return ActionSettings(**options)


def credential(client_id: str = CLIENT_ID):
    from azure.identity import ManagedIdentityCredential

    return ManagedIdentityCredential(client_id=client_id)


def action(tmp_path, arm, imds, **extra) -> GuestHealthReportAction:
    return GuestHealthReportAction(settings(arm, imds, **extra), str(tmp_path / "state"), credential())


def runner(tmp_path, arm, imds, **extra) -> HealthActions:
    return HealthActions(settings(arm, imds, **extra), str(tmp_path / "state"), credential())


def test_a_spent_remediation_budget_files_nothing_more(tmp_path, arm, imds, caplog) -> None:
    a = action(tmp_path, arm, imds)
    budget = finding("node.remediation_budget", "6 remediations in 7 days", {})
    a.act(verdict(XID79, budget))
    a.act(verdict(XID79, FLAP, budget))
    assert arm.puts() == []
    assert sum("remediation budget is spent" in r.getMessage() for r in caplog.records) == 1  # logged once
    a.act(verdict(XID79))  # the budget cleared (hardware replaced): reports are filed again
    assert len(arm.puts()) == 1


def test_one_report_per_finding_with_the_spec_body_never_filed_twice(tmp_path, arm, imds) -> None:
    a = action(tmp_path, arm, imds)
    degraded = finding("gpu.xid.94", "GPU 1: XID 94", {"gpu": "1"}, level=Level.DEGRADED)
    no_code = finding("collector.down", "collector nvml is down", {"collector": "nvml"})
    a.act(verdict(XID79, FLAP, degraded, no_code))
    puts = arm.puts()
    assert len(puts) == 2  # unhealthy with an impact category only
    assert set(arm.impacts) == {report_name(VM_ID, XID79), report_name(VM_ID, FLAP)}
    body = arm.impacts[report_name(VM_ID, XID79)]["properties"]
    assert body["impactedResourceId"] == RESOURCE and body["startDateTime"] == "2024-11-24T17:00:00.000Z"
    assert body["impactCategory"] == "Resource.Hpc.Unhealthy.XID79FallenOffBus"
    assert "GPU 3: XID 79" in body["impactDescription"] and "NHC2013" in body["impactDescription"]
    assert body["additionalProperties"] == {
        "VmUniqueId": VM_ID, "PhysicalHostName": "GGBB90904476", "SerialNumber": "1652823054321",
        "PciBusId": "00000000:9D:00.0", "GpuUuid": "GPU-3", "FaultCode": "NHC2013", "Rule": "gpu.xid.79",
        "LogLine": "ERROR:  nhc:  Health check failed:  gpu.xid.79: GPU 3: XID 79. FaultCode: NHC2013"}
    assert puts[0]["path"].startswith(f"/subscriptions/{SUB}/providers/Microsoft.Impact/workloadImpacts/gpumon-")
    assert imds.token_requests >= 1 and a.counts["filed"] == 2
    a.act(verdict(XID79, FLAP))  # a re-evaluation
    restarted = action(tmp_path, arm, imds)
    restarted.act(verdict(XID79, FLAP))  # a restart with the same sticky findings
    assert len(arm.puts()) == 2
    again = finding("gpu.xid.79", "GPU 3: XID 79", {"gpu": "3"}, since=1_732_500_000.0)
    restarted.act(verdict(again))  # the same rule on the same GPU later on is a new finding
    assert len(arm.puts()) == 3


def test_an_unknown_user_assigned_identity_gets_no_token_and_is_retried(tmp_path, arm, imds) -> None:
    a = GuestHealthReportAction(settings(arm, imds), str(tmp_path / "state"),
                                credential("99999999-2222-3333-4444-555555555555"))
    with pytest.raises(Exception, match="cannot get a token"):
        a.act(verdict(XID79))
    assert arm.puts() == []


def test_409_means_arm_has_it_already(tmp_path, arm, imds) -> None:
    arm.faults = [(409, {})]
    a = action(tmp_path, arm, imds)
    a.act(verdict(XID79))
    a.act(verdict(XID79))
    assert len(arm.puts()) == 1 and a.counts["already_filed"] == 1


@pytest.mark.parametrize("status", [401, 500])
def test_401_and_500_are_retried_with_backoff_until_filed(tmp_path, arm, imds, status) -> None:
    arm.faults = [(status, {}), (status, {})]
    r = runner(tmp_path, arm, imds)
    try:
        r.on_verdict(verdict(XID79))
        wait_for(lambda: len(arm.impacts) == 1, timeout=10)
        wait_for(lambda: r.stats()["azure_ghr"]["runs"] == 3)
        assert r.stats()["azure_ghr"]["failures"] == 2 and len(arm.puts()) == 3
    finally:
        r.close()


def test_403_not_onboarded_is_counted_logged_once_and_the_action_fails(tmp_path, arm, imds, caplog) -> None:
    caplog.set_level(logging.WARNING)
    arm.faults = [(403, {})] * 4
    r = runner(tmp_path, arm, imds)
    try:
        v = verdict(XID79)
        r.on_verdict(v)
        wait_for(lambda: len(arm.puts()) >= 4)
        wait_for(lambda: len(arm.impacts) == 1, timeout=10)  # onboarded at last
        assert r.stats()["azure_ghr"]["failures"] == 4
        action = r._workers["azure_ghr"].action
        assert action.counts["not_onboarded"] == 4
        assert v.level is Level.UNHEALTHY  # the verdict is the node's, whatever Azure answers
    finally:
        r.close()
    lines = [rec.getMessage() for rec in caplog.records if "Impact Reporter" in rec.getMessage()]
    assert len(lines) == 1 and "AuthorizationFailed" in lines[0]


def test_429_waits_for_retry_after(tmp_path, arm, imds) -> None:
    arm.faults = [(429, {"Retry-After": "1"})]
    r = runner(tmp_path, arm, imds, backoff_max=5.0)  # Retry-After is honoured up to backoff_max
    try:
        r.on_verdict(verdict(XID79))
        wait_for(lambda: len(arm.impacts) == 1, timeout=10)
        first, second = arm.puts()
        assert second["time"] - first["time"] >= 0.9  # the backoff alone would wait 0.05 s
    finally:
        r.close()


def test_a_hung_arm_times_out_and_is_retried(tmp_path, arm, imds) -> None:
    arm.faults = ["hang"]
    r = runner(tmp_path, arm, imds, timeout=0.5)
    try:
        r.on_verdict(verdict(XID79))
        wait_for(lambda: len(arm.impacts) == 1, timeout=10)
        assert r.stats()["azure_ghr"]["failures"] == 1
    finally:
        arm.release.set()
        r.close()


def test_a_schema_error_is_logged_with_its_field_and_not_retried(tmp_path, arm, imds, caplog) -> None:
    arm.categories = {"Resource.Hpc.Unhealthy.IBPortFlapping"}  # the service does not know XID79 here
    a = action(tmp_path, arm, imds)
    a.act(verdict(XID79, FLAP))
    assert len(arm.puts()) == 2 and list(arm.impacts) == [report_name(VM_ID, FLAP)]
    assert any("properties.impactCategory" in r.getMessage() and "HTTP 400" in r.getMessage()
               for r in caplog.records)
    a.act(verdict(XID79, FLAP))
    assert len(arm.puts()) == 2 and a.counts["rejected"] == 1


def test_a_verdict_that_clears_while_the_report_is_in_flight_files_once(tmp_path, arm, imds, caplog) -> None:
    caplog.set_level(logging.INFO, logger="gpumon.health.actions.azure_ghr")
    arm.block.clear()
    r = runner(tmp_path, arm, imds)
    try:
        r.on_verdict(verdict(XID79))
        wait_for(lambda: len(arm.puts()) == 1)
        r.on_verdict(verdict())  # cleared (an operator's `gpumon health clear`) while ARM has not answered
        arm.block.set()
        wait_for(lambda: any("cleared" in rec.getMessage() for rec in caplog.records))
        r.on_verdict(verdict(XID79))  # back again with the same start: the same report
        wait_for(lambda: r.stats()["azure_ghr"]["runs"] == 3)
    finally:
        r.close()
    assert len(arm.puts()) == 1 and len(arm.impacts) == 1
    assert any("stays filed (no second report)" in rec.getMessage() for rec in caplog.records)


def test_reports_are_rate_limited_per_category(tmp_path, arm, imds, caplog) -> None:
    a = action(tmp_path, arm, imds, azure_ghr_rate_limit=1)
    other = finding("gpu.xid.79", "GPU 5: XID 79", {"gpu": "5"})
    a.act(verdict(XID79, other, FLAP))
    assert len(arm.puts()) == 2  # one XID79FallenOffBus, one IBPortFlapping
    assert a.counts["rate_limited"] == 1
    assert any("XID79FallenOffBus" in r.getMessage() and "not filed" in r.getMessage() for r in caplog.records)


def test_dry_run_logs_the_request_and_sends_nothing(tmp_path, arm, imds, caplog) -> None:
    a = action(tmp_path, arm, imds, azure_ghr_dry_run=True)
    a.act(verdict(XID79))
    a.act(verdict(XID79))
    assert arm.puts() == []
    (line,) = [r.getMessage() for r in caplog.records if "dry run" in r.getMessage()]
    assert f"PUT {arm.url}/subscriptions/{SUB}/providers/Microsoft.Impact/workloadImpacts/gpumon-" in line
    assert '"impactCategory": "Resource.Hpc.Unhealthy.XID79FallenOffBus"' in line


def test_not_a_vm_disables_the_action_with_a_clear_message(tmp_path, arm, imds, caplog) -> None:
    imds.compute = {k: v for k, v in COMPUTE.items() if k not in ("subscriptionId", "resourceId")}
    s = settings(arm, imds)
    a = GuestHealthReportAction(s, str(tmp_path / "state"), credential())
    a.act(verdict(XID79))
    a.act(verdict(XID79, FLAP))
    assert arm.puts() == [] and "not an Azure VM" in a.disabled
    assert [r.levelname for r in caplog.records if "disabled" in r.getMessage()] == ["ERROR"]
    assert any("not an Azure VM" in p for p in check(dataclasses.replace(s, imds_url=imds.url)))


@pytest.mark.parametrize(("key", "value"), [("azure_ghr_arm", '"http://management.azure.com"'),
                                            ("azure_ghr_client_id", '"my-identity"'),
                                            ("azure_ghr_rate_limit", "0"), ("azure_ghr", '"yes"')])
def test_a_malformed_azure_ghr_setting_is_exit_2_naming_key_and_file(tmp_path, key, value) -> None:
    config = tmp_path / "gpumon.toml"
    config.write_text(f"[health]\n{key} = {value}\n")
    result = subprocess.run([sys.executable, "-m", "gpumon", "check", "--config", str(config)],
                            env=clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert key in result.stderr and str(config) in result.stderr


def test_the_daemon_builds_the_action_with_the_managed_identity_and_azure_imds(tmp_path, arm, imds) -> None:
    from gpumon.cli import schemas
    from gpumon.config import load
    from gpumon.daemon.health import _ghr_credential, with_imds
    from gpumon.health.settings import action_settings

    config_file = tmp_path / "gpumon.toml"
    config_file.write_text(f'[azure]\nimds_url = "{imds.url}"\n[health]\nazure_ghr = true\n'
                           f'azure_ghr_client_id = "{CLIENT_ID}"\nazure_ghr_arm = "{arm.url}"\n')
    config = load(schemas(), str(config_file), {})
    s = with_imds(action_settings(config.sections["health"]), config)
    assert s.imds_url == imds.url and s.azure_ghr
    a = GuestHealthReportAction(s, str(tmp_path / "state"), _ghr_credential(s))
    a.act(verdict(XID79))
    assert len(arm.impacts) == 1
    assert os.path.exists(tmp_path / "state" / "azure-ghr.json")
    assert json.loads((tmp_path / "state" / "azure-ghr.json").read_text())["filed"]


def test_an_xid_79_on_a_simulated_host_is_reported_with_its_gpu_serial_and_counted(tmp_path, arm, imds) -> None:
    from tests.support.health_stage import Clock, Host, stage, until

    host = Host(tmp_path)
    s = stage(tmp_path, Clock())
    r = runner(tmp_path, arm, imds)
    s.attach(r)
    try:
        healthy = s.update(host.snapshot())
        assert healthy.verdict.level is Level.OK
        info = next(f for f in host.snapshot().families if f.name == "gpumon_gpu_info")
        gpu3 = next(x for x in info.samples if x.label("gpu") == "3")
        host.sim.apply({"action": "xid", "gpu": 3, "xid": 79})  # GPU 3 leaves NVML's answers: its facts stay
        until(s, host, lambda res: any(f["rule"] == "gpu.xid.79" for f in res.verdict.findings))
        wait_for(lambda: r.stats()["azure_ghr"]["runs"] >= 1 and not r._workers["azure_ghr"]._pending, timeout=10)
        # gpu.lost and gpu.xid.79 on GPU 3 are one XID79FallenOffBus; the missing GPU is HpcMissingGpu
        wait_for(lambda: sorted(d["properties"]["impactCategory"] for d in arm.impacts.values()) == [
            "Resource.Hpc.Unhealthy.HpcMissingGpu", "Resource.Hpc.Unhealthy.XID79FallenOffBus"], timeout=10)
        extra = [d["properties"]["additionalProperties"] for d in arm.impacts.values()]
        assert any(e.get("SerialNumber") == gpu3.label("serial") and e.get("PciBusId") == gpu3.label("pci_bus_id")
                   for e in extra), extra
        fam = next(f for f in s.update(host.snapshot()).families if f.name == "gpumon_health_azure_ghr_reports_total")
        assert {x.label("outcome"): x.value for x in fam.samples}["filed"] == len(arm.impacts)
    finally:
        s.close()


def test_a_damaged_memory_file_costs_at_most_a_409(tmp_path, arm, imds) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "azure-ghr.json").write_text('{"filed": {"x": 3, "y": {"at": "soon"}}, "sent": {"c": ["a", 1]}}')
    a = action(tmp_path, arm, imds)
    a.act(verdict(XID79))
    assert len(arm.impacts) == 1
    (state / "azure-ghr.json").write_text("not json")
    arm.faults = [(409, {})]
    action(tmp_path, arm, imds).act(verdict(XID79))  # forgotten: asked again, ARM has it
    assert len(arm.puts()) == 2 and len(arm.impacts) == 1


def test_a_clock_that_jumps_back_neither_lifts_nor_sticks_the_rate_limit(tmp_path, arm, imds) -> None:
    now = [1_732_467_700.0]
    a = GuestHealthReportAction(settings(arm, imds, azure_ghr_rate_limit=1, azure_ghr_rate_window=3600.0),
                                str(tmp_path / "state"), credential(), clock=lambda: now[0])
    a.act(verdict(XID79))
    now[0] -= 10 * 86400  # the clock steps back ten days
    later = finding("gpu.xid.79", "GPU 5: XID 79", {"gpu": "5"})
    a.act(verdict(XID79, later))
    assert len(arm.puts()) == 1 and a.counts["rate_limited"] == 1  # the report just filed still counts
    now[0] += 3601  # and ages out one window later, not ten days later
    a.act(verdict(XID79, later))
    assert len(arm.puts()) == 2
