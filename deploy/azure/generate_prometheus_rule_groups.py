#!/usr/bin/env python3
"""Writes deploy/azure/prometheus-rule-groups.json: gpumon's Prometheus rules (deploy/prometheus/*-rules.yaml,
the one source) as Azure Monitor managed Prometheus rule groups, to deploy next to an Azure Monitor workspace.

    python deploy/azure/generate_prometheus_rule_groups.py           # rewrite the template
    python deploy/azure/generate_prometheus_rule_groups.py --check   # exit 1 if the committed one is stale

One ``Microsoft.AlertsManagement/prometheusRuleGroups`` resource per rule group, in the order Prometheus
loads them (the recording rules first: the alerts and the job rules read them). What changes on the way:
``for`` becomes an ISO-8601 duration, the ``severity`` label becomes Azure's alert severity (0 critical,
2 warning, 3 informational; the label stays too), and a group interval under Azure's minimum of one minute
becomes one minute. Parameters: the workspace, an optional cluster name (empty: the rules see every
cluster of the workspace) and an optional action group for the alerts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from gpumon.generated import sync  # noqa: E402

TEMPLATE_PATH = os.path.join(HERE, "prometheus-rule-groups.json")
RULES_DIR = os.path.join(os.path.dirname(HERE), "prometheus")
RULE_FILES = ("recording-rules.yaml", "alerting-rules.yaml", "job-rules.yaml")
API_VERSION = "2023-03-01"
SEVERITY = {"critical": 0, "warning": 2, "info": 3}
MIN_INTERVAL_S = 60  # Azure: a rule group's interval is 1 to 15 minutes
MAX_RULES = 20  # rules per Azure rule group
_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def seconds(duration: str) -> int:
    """A Prometheus duration (5m, 1h30m, 30s) in seconds."""
    parts = re.findall(r"(\d+)([dhms])", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"unsupported duration {duration!r}")
    return sum(int(n) * _UNITS[u] for n, u in parts)


def iso8601(total: int) -> str:
    """Seconds as an ISO-8601 duration (PT5M, P1D, PT1H30M)."""
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    time = "".join(f"{v}{u}" for v, u in ((hours, "H"), (minutes, "M"), (secs, "S")) if v)
    return "P" + (f"{days}D" if days else "") + (f"T{time}" if time else "") if total else "PT0S"


def groups() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name in RULE_FILES:
        with open(os.path.join(RULES_DIR, name), encoding="utf-8") as fh:
            out += [(name, g) for g in yaml.safe_load(fh)["groups"]]
    return out


def _rule(rule: dict[str, Any]) -> dict[str, Any]:
    if "record" in rule:
        out: dict[str, Any] = {"record": rule["record"], "expression": rule["expr"].strip()}
        if rule.get("labels"):
            out["labels"] = rule["labels"]
        return out
    out = {"alert": rule["alert"], "expression": rule["expr"].strip(), "enabled": True}
    if "for" in rule:
        out["for"] = iso8601(seconds(rule["for"]))
    out["severity"] = SEVERITY[rule["labels"]["severity"]]
    out["labels"] = rule["labels"]
    out["annotations"] = rule["annotations"]
    out["resolveConfiguration"] = {"autoResolved": True, "timeToResolve": "PT10M"}
    out["actions"] = "[variables('actions')]"
    return out


def _resource(source: str, group: dict[str, Any]) -> dict[str, Any]:
    if len(group["rules"]) > MAX_RULES:
        raise ValueError(f"{source}: group {group['name']} has {len(group['rules'])} rules, Azure takes {MAX_RULES}")
    interval = max(seconds(group.get("interval", "1m")), MIN_INTERVAL_S)
    return {
        "type": "Microsoft.AlertsManagement/prometheusRuleGroups",
        "apiVersion": API_VERSION,
        "name": group["name"],
        "location": "[parameters('location')]",
        "properties": {
            "description": f"gpumon: group {group['name']} of deploy/prometheus/{source}",
            "scopes": ["[parameters('azureMonitorWorkspaceId')]"],
            "clusterName": "[if(empty(parameters('clusterName')), null(), parameters('clusterName'))]",
            "enabled": True,
            "interval": iso8601(interval),
            "rules": [_rule(r) for r in group["rules"]],
        },
    }


def build() -> dict[str, Any]:
    return {
        "$schema": "https://schema.management.azure.com/schemas/2019-04-01/deploymentTemplate.json#",
        "contentVersion": "1.0.0.0",
        "metadata": {"description": (
            "gpumon's Prometheus recording and alerting rules (node, fleet and job health) as Azure Monitor "
            "managed Prometheus rule groups. Generated from deploy/prometheus/*-rules.yaml by "
            "deploy/azure/generate_prometheus_rule_groups.py; do not edit by hand.")},
        "parameters": {
            "azureMonitorWorkspaceId": {"type": "string", "metadata": {
                "description": "Resource id of the Azure Monitor workspace the gpumon series go to."}},
            "location": {"type": "string", "defaultValue": "[resourceGroup().location]", "metadata": {
                "description": "Region of the rule groups (the workspace's)."}},
            "clusterName": {"type": "string", "defaultValue": "", "metadata": {
                "description": "Evaluate only series of this cluster (the `cluster` label the AKS add-on "
                               "sets); empty: every series of the workspace (VMs sending by remote write)."}},
            "actionGroupId": {"type": "string", "defaultValue": "", "metadata": {
                "description": "Resource id of an action group the alerts notify; empty: none."}},
        },
        "variables": {"actions": (
            "[if(empty(parameters('actionGroupId')), createArray(), "
            "createArray(createObject('actionGroupId', parameters('actionGroupId'))))]")},
        "resources": [_resource(source, g) for source, g in groups()],
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed template is stale")
    args = parser.parse_args(argv)
    return sync({TEMPLATE_PATH: render()}, args.check, "python deploy/azure/generate_prometheus_rule_groups.py")


if __name__ == "__main__":
    sys.exit(main())
