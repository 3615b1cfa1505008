#!/usr/bin/env python3
"""Writes deploy/azure/managed-prometheus.json: an Azure Monitor workspace that gpumon's remote_write
sink sends to from VMs and scale sets, with no agent.

    python deploy/azure/generate_managed_prometheus.py           # rewrite the template
    python deploy/azure/generate_managed_prometheus.py --check   # exit 1 if the committed one is stale

Resources: the workspace (Microsoft.Monitor/accounts); a data collection endpoint and a rule whose
Prometheus forwarder stream (Microsoft-PrometheusMetrics) goes to the workspace, as Azure's own
Managed Prometheus onboarding lays them out; a user-assigned identity for the VMs with Monitoring
Metrics Publisher on that rule; and, optionally, Monitoring Data Reader on the workspace for an Azure
Managed Grafana identity. The output ``remoteWriteUrl`` is what ``[remote_write] url`` takes.

And gpumon's recording and alerting rules, every group of every rule file under deploy/prometheus/, as
Microsoft.AlertsManagement/prometheusRuleGroups on the workspace (the same rules as the PrometheusRule
and a hand-configured Prometheus; one source, so they cannot drift).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from generate import MONITORING_METRICS_PUBLISHER  # noqa: E402

from gpumon.generated import sync  # noqa: E402
from gpumon.rulefiles import duration_seconds, iso8601, rule_groups  # noqa: E402

TEMPLATE_PATH = os.path.join(HERE, "managed-prometheus.json")
MONITORING_DATA_READER = "b0d8363b-8ddd-447d-831f-62ca05bff136"
STREAM = "Microsoft-PrometheusMetrics"
INGESTION_API_VERSION = "2023-04-24"
DC_API = "2023-03-11"
WORKSPACE_API = "2023-04-03"
IDENTITY_API = "2023-01-31"
ROLE_API = "2022-04-01"
RULES_API = "2023-03-01"
AZURE_SEVERITY = {"critical": 0, "warning": 2, "info": 3}
"""Prometheus severity label -> Azure alert severity (0 Critical, 1 Error, 2 Warning, 3 Informational)."""
MIN_INTERVAL = 60
"""Azure evaluates a rule group every 1 to 15 minutes; a group that asks for less runs every minute."""

WORKSPACE_ID = "[resourceId('Microsoft.Monitor/accounts', parameters('workspaceName'))]"
DCE_ID = "[resourceId('Microsoft.Insights/dataCollectionEndpoints', variables('dceName'))]"
DCR_ID = "[resourceId('Microsoft.Insights/dataCollectionRules', variables('dcrName'))]"
IDENTITY_ID = "[resourceId('Microsoft.ManagedIdentity/userAssignedIdentities', parameters('identityName'))]"


def _expr(arm: str) -> str:
    """The expression inside ``[...]``, to nest one ARM expression in another."""
    return arm[1:-1]


def _parameters() -> dict[str, Any]:
    return {
        "workspaceName": {"type": "string", "defaultValue": "amw-gpumon", "metadata": {
            "description": "Azure Monitor workspace to create (or update) in this resource group."}},
        "location": {"type": "string", "defaultValue": "[resourceGroup().location]", "metadata": {
            "description": "Region of the workspace, its endpoint and rule (the VMs may be elsewhere)."}},
        "identityName": {"type": "string", "defaultValue": "id-gpumon", "metadata": {
            "description": "User-assigned identity to attach to the VMs or scale set gpumon runs on."}},
        "grafanaPrincipalId": {"type": "string", "defaultValue": "", "metadata": {
            "description": "Object id of an Azure Managed Grafana's identity, given Monitoring Data Reader "
                           "on the workspace; empty skips it."}},
        "deployRuleGroups": {"type": "bool", "defaultValue": True, "metadata": {
            "description": "Create gpumon's recording and alerting rules as Prometheus rule groups on the "
                           "workspace."}},
        "clusterName": {"type": "string", "defaultValue": "", "metadata": {
            "description": "Evaluate the rules only over the series of this AKS cluster (their cluster "
                           "label), and suffix the rule group names with it; empty: the whole workspace."}},
        "actionGroupId": {"type": "string", "defaultValue": "", "metadata": {
            "description": "Resource id of an action group to notify when a gpumon alert fires; empty: the "
                           "alerts fire in Azure Monitor without notification."}},
    }


def _resources() -> list[dict[str, Any]]:
    publisher = f"[subscriptionResourceId('Microsoft.Authorization/roleDefinitions', '{MONITORING_METRICS_PUBLISHER}')]"
    reader = f"[subscriptionResourceId('Microsoft.Authorization/roleDefinitions', '{MONITORING_DATA_READER}')]"
    return [
        {"type": "Microsoft.Monitor/accounts", "apiVersion": WORKSPACE_API, "name": "[parameters('workspaceName')]",
         "location": "[parameters('location')]", "properties": {}},
        {"type": "Microsoft.ManagedIdentity/userAssignedIdentities", "apiVersion": IDENTITY_API,
         "name": "[parameters('identityName')]", "location": "[parameters('location')]"},
        {"type": "Microsoft.Insights/dataCollectionEndpoints", "apiVersion": DC_API, "name": "[variables('dceName')]",
         "location": "[parameters('location')]", "kind": "Linux",
         "properties": {"description": "gpumon remote write: metrics ingestion endpoint",
                        "networkAcls": {"publicNetworkAccess": "Enabled"}}},
        {"type": "Microsoft.Insights/dataCollectionRules", "apiVersion": DC_API, "name": "[variables('dcrName')]",
         "location": "[parameters('location')]", "kind": "Linux", "dependsOn": [WORKSPACE_ID, DCE_ID],
         "properties": {
             "description": "gpumon remote write: Prometheus samples into the Azure Monitor workspace",
             "dataCollectionEndpointId": DCE_ID,
             "dataSources": {"prometheusForwarder": [
                 {"name": "PrometheusDataSource", "streams": [STREAM], "labelIncludeFilter": {}}]},
             "destinations": {"monitoringAccounts": [{"name": "workspace", "accountResourceId": WORKSPACE_ID}]},
             "dataFlows": [{"streams": [STREAM], "destinations": ["workspace"]}],
         }},
        {"type": "Microsoft.Authorization/roleAssignments", "apiVersion": ROLE_API,
         "scope": "[format('Microsoft.Insights/dataCollectionRules/{0}', variables('dcrName'))]",
         "name": f"[guid({_expr(DCR_ID)}, {_expr(IDENTITY_ID)}, '{MONITORING_METRICS_PUBLISHER}')]",
         "dependsOn": [DCR_ID, IDENTITY_ID],
         "properties": {"roleDefinitionId": publisher,
                        "principalId": f"[reference({_expr(IDENTITY_ID)}, '{IDENTITY_API}').principalId]",
                        "principalType": "ServicePrincipal"}},
        {"condition": "[not(empty(parameters('grafanaPrincipalId')))]",
         "type": "Microsoft.Authorization/roleAssignments", "apiVersion": ROLE_API,
         "scope": "[format('Microsoft.Monitor/accounts/{0}', parameters('workspaceName'))]",
         "name": f"[guid({_expr(WORKSPACE_ID)}, parameters('grafanaPrincipalId'), '{MONITORING_DATA_READER}')]",
         "dependsOn": [WORKSPACE_ID],
         "properties": {"roleDefinitionId": reader, "principalId": "[parameters('grafanaPrincipalId')]",
                        "principalType": "ServicePrincipal"}},
    ]


def _literal(value: Any) -> Any:
    """``value`` with every string taken literally by ARM: one starting with ``[`` is escaped as ``[[``."""
    if isinstance(value, str):
        return "[" + value if value.startswith("[") else value
    if isinstance(value, dict):
        return {k: _literal(v) for k, v in value.items()}
    return value


def _rule(rule: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"expression": _literal(rule["expr"].strip()), "enabled": True}
    if "record" in rule:
        out = {"record": rule["record"], **out}
    else:
        severity = rule.get("labels", {}).get("severity")
        if severity not in AZURE_SEVERITY:
            raise ValueError(f"alert {rule['alert']}: severity {severity!r} is not one of {sorted(AZURE_SEVERITY)}")
        out = {"alert": rule["alert"], **out, "severity": AZURE_SEVERITY[severity],
               "actions": "[variables('ruleActions')]"}
        if "for" in rule:
            out["for"] = iso8601(duration_seconds(rule["for"]))
        out["annotations"] = _literal(rule.get("annotations", {}))
    if rule.get("labels"):
        out["labels"] = _literal(rule["labels"])
    return out


def rule_group_resources(root: str) -> list[dict[str, Any]]:
    """One prometheusRuleGroups resource per rule group of deploy/prometheus/."""
    resources = []
    for group in rule_groups(root):
        name = group["name"]
        interval = max(MIN_INTERVAL, duration_seconds(group.get("interval", "1m")))
        resources.append({
            "condition": "[parameters('deployRuleGroups')]",
            "type": "Microsoft.AlertsManagement/prometheusRuleGroups", "apiVersion": RULES_API,
            "name": f"[if(empty(parameters('clusterName')), '{name}', format('{name}-{{0}}', parameters('clusterName')))]",
            "location": "[parameters('location')]", "dependsOn": [WORKSPACE_ID],
            "properties": {
                "description": f"gpumon rule group {name}, generated from deploy/prometheus/",
                "enabled": True,
                "clusterName": "[if(empty(parameters('clusterName')), null(), parameters('clusterName'))]",
                "scopes": [WORKSPACE_ID],
                "interval": iso8601(interval),
                "rules": [_rule(r) for r in group["rules"]],
            },
        })
    return resources


def _outputs() -> dict[str, Any]:
    endpoint = f"reference({_expr(DCE_ID)}, '{DC_API}').metricsIngestion.endpoint"
    immutable = f"reference({_expr(DCR_ID)}, '{DC_API}').immutableId"
    url = (f"[format('{{0}}/dataCollectionRules/{{1}}/streams/{STREAM}/api/v1/write?api-version="
           f"{INGESTION_API_VERSION}', {endpoint}, {immutable})]")
    return {
        "remoteWriteUrl": {"type": "string", "value": url},
        "identityClientId": {"type": "string",
                             "value": f"[reference({_expr(IDENTITY_ID)}, '{IDENTITY_API}').clientId]"},
        "identityResourceId": {"type": "string", "value": IDENTITY_ID},
        "dcrImmutableId": {"type": "string", "value": f"[{immutable}]"},
        "workspaceId": {"type": "string", "value": WORKSPACE_ID},
        "prometheusQueryEndpoint": {"type": "string", "value": (
            f"[reference({_expr(WORKSPACE_ID)}, '{WORKSPACE_API}').metrics.prometheusQueryEndpoint]")},
    }


def build() -> dict[str, Any]:
    return {
        "$schema": "https://schema.management.azure.com/schemas/2019-04-01/deploymentTemplate.json#",
        "contentVersion": "1.0.0.0",
        "metadata": {"description": (
            "gpumon -> Azure Managed Prometheus with no agent: an Azure Monitor workspace, a data collection "
            "endpoint and rule for Prometheus remote write, a user-assigned identity with Monitoring Metrics "
            "Publisher on the rule, and gpumon's recording and alerting rules as Prometheus rule groups on "
            "the workspace. Generated by deploy/azure/generate_managed_prometheus.py; do not edit "
            "by hand.")},
        "parameters": _parameters(),
        "variables": {"dceName": "[format('{0}-dce', parameters('workspaceName'))]",
                      "dcrName": "[format('{0}-dcr', parameters('workspaceName'))]",
                      "ruleActions": ("[if(empty(parameters('actionGroupId')), createArray(), createArray("
                                      "createObject('actionGroupId', parameters('actionGroupId'))))]")},
        "resources": _resources() + rule_group_resources(ROOT),
        "outputs": _outputs(),
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed template is stale")
    args = parser.parse_args(argv)
    return sync({TEMPLATE_PATH: render()}, args.check, "python deploy/azure/generate_managed_prometheus.py")


if __name__ == "__main__":
    sys.exit(main())
