"""deploy/azure/managed-prometheus.json is what its generator makes, wires the workspace, endpoint, rule,
identity and role together, and the VM cloud-init's gpumon.toml is a config gpumon accepts whose
remote_write URL has the shape the template's output gives."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

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
