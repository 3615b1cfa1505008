"""deploy/azure/managed-prometheus.json is what its generator makes, wires the workspace, endpoint, rule,
identity and role together, and the VM cloud-init's gpumon.toml is a config gpumon accepts whose
remote_write URL has the shape the template's output gives."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from gpumon.cli import schemas
from gpumon.config import load

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(REPO, "deploy", "azure", "managed-prometheus.json")
CLOUD_INIT = os.path.join(REPO, "deploy", "vm", "cloud-init-managed-prometheus.yaml")
PUBLISHER = "3913510d-42f4-4e42-8a64-420c390055eb"
URL_SHAPE = re.compile(r"https://[^/]+/dataCollectionRules/dcr-[0-9a-f]{32}/streams/Microsoft-PrometheusMetrics"
                       r"/api/v1/write\?api-version=2023-04-24")


def template() -> dict:
    with open(TEMPLATE, encoding="utf-8") as fh:
        return json.load(fh)


def one(kind: str, **where: str) -> dict:
    found = [r for r in template()["resources"] if r["type"] == kind
             and all(str(r.get(k, "")).find(v) >= 0 for k, v in where.items())]
    assert len(found) == 1, (kind, where, found)
    return found[0]


def test_committed_template_equals_generated():
    result = subprocess.run([sys.executable, os.path.join(REPO, "deploy", "azure", "generate_managed_prometheus.py"),
                             "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_rule_forwards_prometheus_samples_into_the_workspace_through_the_endpoint():
    workspace = one("Microsoft.Monitor/accounts")
    assert workspace["name"] == "[parameters('workspaceName')]"
    dce = one("Microsoft.Insights/dataCollectionEndpoints")
    dcr = one("Microsoft.Insights/dataCollectionRules")
    props = dcr["properties"]
    assert props["dataCollectionEndpointId"].endswith("variables('dceName'))]") and dce["name"] == "[variables('dceName')]"
    (source,) = props["dataSources"]["prometheusForwarder"]
    assert source["streams"] == ["Microsoft-PrometheusMetrics"]
    (account,) = props["destinations"]["monitoringAccounts"]
    assert "Microsoft.Monitor/accounts" in account["accountResourceId"]
    (flow,) = props["dataFlows"]
    assert flow == {"streams": ["Microsoft-PrometheusMetrics"], "destinations": [account["name"]]}
    assert set(dcr["dependsOn"]) >= {account["accountResourceId"], props["dataCollectionEndpointId"]}


def test_the_identity_may_publish_metrics_on_the_rule_and_nothing_wider():
    identity = one("Microsoft.ManagedIdentity/userAssignedIdentities")
    assert identity["name"] == "[parameters('identityName')]"
    role = one("Microsoft.Authorization/roleAssignments", scope="dataCollectionRules")
    assert "condition" not in role
    assert PUBLISHER in role["properties"]["roleDefinitionId"]
    assert "userAssignedIdentities" in role["properties"]["principalId"]
    assert role["properties"]["principalId"].endswith(".principalId]")
    assert role["properties"]["principalType"] == "ServicePrincipal"
    assert role["scope"] == "[format('Microsoft.Insights/dataCollectionRules/{0}', variables('dcrName'))]"
    grafana = one("Microsoft.Authorization/roleAssignments", scope="Microsoft.Monitor/accounts")
    assert grafana["condition"] == "[not(empty(parameters('grafanaPrincipalId')))]"


def test_outputs_give_what_the_remote_write_sink_needs():
    outputs = template()["outputs"]
    url = outputs["remoteWriteUrl"]["value"]
    assert ".metricsIngestion.endpoint" in url and ".immutableId" in url
    assert "/streams/Microsoft-PrometheusMetrics/api/v1/write?api-version=2023-04-24" in url
    assert outputs["identityClientId"]["value"].endswith(".clientId]")
    every_expression = json.dumps(template())
    assert every_expression.count("[") == every_expression.count("]")


def test_the_cloud_init_config_loads_and_sends_with_the_managed_identity(tmp_path):
    with open(CLOUD_INIT, encoding="utf-8") as fh:
        document = yaml.safe_load(fh)
    (toml,) = [f["content"] for f in document["write_files"] if f["path"] == "/etc/gpumon/gpumon.toml"]
    path = tmp_path / "gpumon.toml"
    path.write_text(toml)
    config = load(schemas(), str(path), {}, {})
    assert "remote_write" in config.daemon.sinks
    rw = config["remote_write"]
    assert URL_SHAPE.fullmatch(rw["url"]), rw["url"]
    assert (rw["auth"], rw["credential"]) == ("azure", "managed_identity")
    assert config["azure_events"]["acknowledge"] == []
    assert document["runcmd"] == [["/usr/local/sbin/gpumon-fetch-and-install"]]


# --- Prometheus rule groups (deploy/azure/prometheus-rule-groups.json) ---------------------------------------

RULE_GROUPS = os.path.join(REPO, "deploy", "azure", "prometheus-rule-groups.json")
sys.path.insert(0, os.path.join(REPO, "deploy", "azure"))
import generate_prometheus_rule_groups as rule_groups  # noqa: E402


def rule_group_template() -> dict:
    with open(RULE_GROUPS, encoding="utf-8") as fh:
        return json.load(fh)


def test_committed_rule_groups_equal_generated():
    result = subprocess.run([sys.executable, os.path.join(REPO, "deploy", "azure", "generate_prometheus_rule_groups.py"),
                             "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_rule_groups_carry_every_rule_of_the_rule_files_unchanged():
    resources = rule_group_template()["resources"]
    source = [(g["name"], r) for _, g in rule_groups.groups() for r in g["rules"]]
    converted = [(res["name"], r) for res in resources for r in res["properties"]["rules"]]
    assert len(source) == len(converted)
    for (group, rule), (azure_group, azure) in zip(source, converted):
        assert group == azure_group
        assert azure["expression"] == rule["expr"].strip()
        assert azure.get("record") == rule.get("record") and azure.get("alert") == rule.get("alert")
        if "alert" in rule:
            assert azure["labels"] == rule["labels"] and azure["annotations"] == rule["annotations"]
            assert azure["severity"] == {"critical": 0, "warning": 2, "info": 3}[rule["labels"]["severity"]]
            if "for" in rule:
                assert rule_groups.seconds(rule["for"]) == iso_seconds(azure["for"])


def iso_seconds(duration: str) -> int:
    """An ISO-8601 duration as Azure takes it (P1D, PT5M, PT1H30M) in seconds; written here apart from the
    generator so that the two check each other."""
    match = re.fullmatch(r"P(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?)?", duration)
    assert match and duration not in ("P", "PT"), duration
    d, h, m, s = (int(v or 0) for v in match.groups())
    return d * 86400 + h * 3600 + m * 60 + s


def test_rule_groups_fit_azure_limits_and_run_after_what_they_read():
    defined: set[str] = set()
    for res in rule_group_template()["resources"]:
        assert res["type"] == "Microsoft.AlertsManagement/prometheusRuleGroups" and res["apiVersion"] == "2023-03-01"
        props = res["properties"]
        assert 60 <= iso_seconds(props["interval"]) <= 900
        assert 1 <= len(props["rules"]) <= 20
        assert props["scopes"] == ["[parameters('azureMonitorWorkspaceId')]"]
        for rule in props["rules"]:
            # A recording rule read here is recorded by this group or an earlier one (the template lists
            # the groups in the order Prometheus loads the files).
            read = set(re.findall(r"\b[a-z_]+:gpumon_[a-z0-9_:]+|\bgpumon_[a-z_]+:[a-z0-9_:]+", rule["expression"]))
            in_group = {r["record"] for r in props["rules"] if "record" in r}
            assert read <= defined | in_group, (res["name"], read - defined - in_group)
        defined |= {r["record"] for r in props["rules"] if "record" in r}
    assert {"gpumon_job:straggler_score", "gpumon_job_host:straggler_score"} <= defined


def test_durations_convert_both_ways():
    for text, iso in (("30s", "PT30S"), ("5m", "PT5M"), ("90s", "PT1M30S"), ("1h", "PT1H"), ("1d", "P1D"),
                      ("1d2h", "P1DT2H")):
        assert rule_groups.iso8601(rule_groups.seconds(text)) == iso
        assert iso_seconds(iso) == rule_groups.seconds(text)
    with pytest.raises(ValueError):
        rule_groups.seconds("5 minutes")
