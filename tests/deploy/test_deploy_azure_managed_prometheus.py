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
from tests.conftest import REPO

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


def rule_group_resources() -> list[dict]:
    return [r for r in template()["resources"] if r["type"] == "Microsoft.AlertsManagement/prometheusRuleGroups"]


def _unescaped(value):
    """An ARM literal back to the text it stands for (``[[`` is an escaped ``[``)."""
    if isinstance(value, dict):
        return {k: _unescaped(v) for k, v in value.items()}
    return value[1:] if isinstance(value, str) and value.startswith("[[") else value


def test_every_rule_of_every_rule_file_is_a_rule_group_rule_on_the_workspace():
    """The same rules as deploy/prometheus/: expression, for, labels and annotations, per group."""
    from gpumon.rulefiles import duration_seconds, rule_groups

    groups = rule_groups(REPO)
    resources = rule_group_resources()
    assert len(resources) == len(groups)
    for group, resource in zip(groups, resources):
        assert f"'{group['name']}'" in resource["name"]
        props = resource["properties"]
        assert resource["condition"] == "[parameters('deployRuleGroups')]"
        assert one("Microsoft.Monitor/accounts")["name"] == "[parameters('workspaceName')]"
        assert props["scopes"] == ["[resourceId('Microsoft.Monitor/accounts', parameters('workspaceName'))]"]
        assert props["scopes"][0] in resource["dependsOn"]
        assert len(props["rules"]) == len(group["rules"])
        for rule, azure in zip(group["rules"], props["rules"]):
            assert _unescaped(azure["expression"]) == rule["expr"].strip()
            assert azure.get("record") == rule.get("record") and azure.get("alert") == rule.get("alert")
            assert _unescaped(azure.get("labels", {})) == rule.get("labels", {})
            if "alert" in rule:
                assert _unescaped(azure["annotations"]) == rule["annotations"]
                assert azure["severity"] == {"critical": 0, "warning": 2, "info": 3}[rule["labels"]["severity"]]
                assert azure["actions"] == "[variables('ruleActions')]"
                if "for" in rule:
                    iso = re.fullmatch(r"PT(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?", azure["for"])
                    assert iso, azure["for"]
                    h, m, s = (int(x or 0) for x in iso.groups())
                    assert h * 3600 + m * 60 + s == duration_seconds(rule["for"])
                else:
                    assert "for" not in azure


def test_rule_groups_keep_within_azures_limits():
    """An interval of 1 to 15 minutes (a group asking for 30 s runs every minute) and at most 20 rules a
    group, as Azure Monitor's Prometheus rule groups allow."""
    for resource in rule_group_resources():
        props = resource["properties"]
        assert re.fullmatch(r"PT([1-9]|1[0-5])M", props["interval"]), props["interval"]
        assert 0 < len(props["rules"]) <= 20, resource["name"]


def test_no_rule_text_is_taken_for_an_arm_expression():
    """Only the few properties the generator means as expressions start with ``[``; a rule's text that
    did would be evaluated by ARM, so it is escaped."""
    meant = {"[variables('ruleActions')]"}
    for resource in rule_group_resources():
        for rule in resource["properties"]["rules"]:
            texts = [rule["expression"], *rule.get("labels", {}).values(), *rule.get("annotations", {}).values()]
            texts += [rule.get("actions", "")]
            assert all(not t.startswith("[") or t.startswith("[[") or t in meant for t in texts)


def test_an_unknown_severity_or_a_literal_bracket_is_handled(monkeypatch, tmp_path):
    sys.path.insert(0, os.path.join(REPO, "deploy", "azure"))
    import generate_managed_prometheus as gen

    rules = tmp_path / "deploy" / "prometheus"
    rules.mkdir(parents=True)
    (rules / "r.yaml").write_text(
        "groups:\n  - name: g\n    rules:\n      - record: r\n        expr: '[1] == 1'\n"
        "      - alert: A\n        expr: up == 0\n        labels: {severity: page}\n")
    try:
        gen.rule_group_resources(str(tmp_path))
        raise AssertionError("an unknown severity was accepted")
    except ValueError as err:
        assert "alert A: severity 'page'" in str(err)
    (rules / "r.yaml").write_text("groups:\n  - name: g\n    rules:\n      - record: r\n        expr: '[1] == 1'\n")
    (resource,) = gen.rule_group_resources(str(tmp_path))
    assert resource["properties"]["rules"][0]["expression"] == "[[1] == 1"


def test_policy_scan_of_the_template_reports_no_failed_check(tmp_path):
    """checkov's ARM framework parses the template and fails none of its checks (it has none yet for the
    Monitor and AlertsManagement types, so this guards what it does know: a parse error or a new check)."""
    import shutil

    checkov = shutil.which("checkov", path=os.environ.get("DEPLOY_TOOLS_BIN", "/opt/gpumon-tools/bin")) \
        or shutil.which("checkov")
    assert checkov, "checkov not found: run ./scripts/test.sh, which installs it"
    shutil.copy(TEMPLATE, tmp_path / "managed-prometheus.json")
    out = subprocess.run([checkov, "-d", str(tmp_path), "--framework", "arm", "--skip-download", "--output", "json",
                          "--quiet"], capture_output=True, text=True, timeout=240, check=False,
                         env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"})
    report = json.loads(out.stdout)
    summary = report.get("summary", report)
    assert summary["failed"] == 0 and summary["parsing_errors"] == 0, out.stdout[:2000]


def test_every_recording_rule_a_rule_group_reads_is_recorded_on_the_workspace():
    """Azure evaluates each group on its own: a rule reading a recorded series finds it only if one of
    the groups deployed records it (the job rules read the node rules' series)."""
    resources = rule_group_resources()
    defined = {r["record"] for res in resources for r in res["properties"]["rules"] if "record" in r}
    for res in resources:
        for rule in res["properties"]["rules"]:
            read = set(re.findall(r"\b[a-z_]+:gpumon_[a-z0-9_:]+|\bgpumon_[a-z_]+:[a-z0-9_:]+", rule["expression"]))
            assert read <= defined, (res["name"], read - defined)
    assert {"gpumon_job:straggler_score", "gpumon_job_host:straggler_score"} <= defined
