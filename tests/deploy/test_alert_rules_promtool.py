"""The Prometheus rules are valid, unit-tested with promtool, documented, and name only real metrics."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO
from tests.support.rules import RULE_FILES, known_metrics, metric_names, rules

RULES = os.path.join(REPO, "deploy", "prometheus")
# The job rules' tests are generated (deploy/prometheus/tests/generate_job_tests.py); one promtool run per file.
TEST_FILES = sorted(glob.glob(os.path.join(RULES, "tests", "*-test.yaml")))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
SEVERITIES = {"critical", "warning", "info"}


@needs_promtool
def test_promtool_check_rules() -> None:
    proc = subprocess.run([PROMTOOL, "check", "rules", *RULE_FILES], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@needs_promtool
@pytest.mark.parametrize("suite", ["rules-test.yaml"] + [os.path.basename(p) for p in TEST_FILES
                                                        if not p.endswith("/rules-test.yaml")])
def test_promtool_unit_tests_pass(suite: str) -> None:
    proc = subprocess.run([PROMTOOL, "test", "rules", os.path.join(RULES, "tests", suite)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_generated_job_rule_tests_are_current() -> None:
    proc = subprocess.run([sys.executable, os.path.join(RULES, "tests", "generate_job_tests.py"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_every_alert_is_unit_tested() -> None:
    tested = set()
    for path in TEST_FILES:
        with open(path, encoding="utf-8") as fh:
            suite = yaml.safe_load(fh)
        tested |= {case["alertname"] for test in suite["tests"] for case in test.get("alert_rule_test", [])
                   if case.get("exp_alerts")}
    assert {r["alert"] for r in rules("alert")} == tested


def test_every_alert_has_severity_summary_and_runbook() -> None:
    for rule in rules("alert"):
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        annotations = rule["annotations"]
        for key in ("summary", "description", "runbook"):
            assert annotations.get(key, "").strip(), f"{rule['alert']} lacks {key}"
        assert rule["alert"].startswith("Gpumon"), rule["alert"]


def test_rules_name_only_metrics_gpumon_exports() -> None:
    known = known_metrics()
    for rule in rules("alert") + rules("record"):
        used = metric_names(rule["expr"])
        assert used, f"{rule.get('alert') or rule.get('record')}: no metric found in {rule['expr']}"
        unknown = used - known
        assert not unknown, f"{rule.get('alert') or rule.get('record')} reads unknown metrics {unknown}"


def test_scrape_configs_are_valid_prometheus_config(tmp_path) -> None:
    if PROMTOOL is None:
        pytest.skip("needs promtool")
    with open(os.path.join(RULES, "prometheus.yml"), encoding="utf-8") as fh:
        config = yaml.safe_load(fh)
    # The example loads the rule files relative to itself; check it from here with absolute paths.
    config["rule_files"] = [os.path.join(RULES, os.path.basename(p)) for p in config["rule_files"]]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The ama-metrics scrape job has one home, the Kustomize overlay (its kustomization turns it into
    # the kube-system ConfigMap; tests/deploy/test_deploy_kubernetes.py checks that side).
    overlay = os.path.join(os.path.dirname(RULES), "kubernetes", "overlays", "azure-managed-prometheus")
    with open(os.path.join(overlay, "ama-metrics-scrape.yaml"), encoding="utf-8") as fh:
        scrape = yaml.safe_load(fh)
    (job,) = scrape["scrape_configs"]
    assert job["job_name"] == "gpumon" and job["kubernetes_sd_configs"] == [
        {"role": "pod", "namespaces": {"names": ["gpumon"]}}]
    # Debian's promtool is built without Kubernetes discovery: check the rest (relabelling included)
    # with the discovery swapped for a static target.
    job.pop("kubernetes_sd_configs")
    job["static_configs"] = [{"targets": ["127.0.0.1:9470"]}]
    (tmp_path / "ama.yml").write_text(yaml.safe_dump(scrape))
    proc = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / "ama.yml")], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shipped_scrape_jobs_match_the_exporter_alerts() -> None:
    """GpumonExporterDown and GpumonExporterAbsent find gpumon by its job name: every shipped scrape
    configuration must name its job so that they match (the PodMonitor: tests/deploy/test_deploy_kubernetes.py)."""
    exporter = [r for r in rules("alert") if r["alert"] in ("GpumonExporterDown", "GpumonExporterAbsent")]
    assert len(exporter) == 2
    regexes = {m for r in exporter for m in re.findall(r'\bup\{job=~"([^"]+)"\}', r["expr"])}
    assert len(regexes) == 1, regexes
    (regex,) = regexes
    assert next(r for r in exporter if r["alert"] == "GpumonExporterAbsent")["expr"].startswith("absent(")
    with open(os.path.join(RULES, "prometheus.yml"), encoding="utf-8") as fh:
        jobs = [job["job_name"] for job in yaml.safe_load(fh)["scrape_configs"]]
    overlay = os.path.join(os.path.dirname(RULES), "kubernetes", "overlays", "azure-managed-prometheus")
    with open(os.path.join(overlay, "ama-metrics-scrape.yaml"), encoding="utf-8") as fh:
        jobs += [job["job_name"] for job in yaml.safe_load(fh)["scrape_configs"]]
    # The Prometheus Operator's default job name for the PodMonitor (namespace/name) matches as well.
    jobs.append("gpumon/gpumon")
    assert [j for j in jobs if not re.fullmatch(regex, j)] == []
    assert not re.fullmatch(regex, "node-exporter")
