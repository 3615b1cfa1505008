"""The monitoring mixin (mixin/), rendered by a real jsonnet: with the default _config it is the shipped
rule files and dashboards, its rules pass promtool, and its _config reaches every place it names."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any

import _jsonnet  # the jsonnet wheel, in the test extra (scripts/test.sh installs it)
import pytest
import yaml

from gpumon.rulefiles import rule_files, rule_groups
from tests.conftest import REPO

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")
MIXIN = os.path.join(REPO, "mixin")


def render(field: str, config: str = "{}") -> Any:
    """``field`` of the mixin with ``config`` merged into its _config, as a user's jsonnet would."""
    snippet = f'((import "mixin.libsonnet") + {{_config+:: {config}}}).{field}'
    return json.loads(_jsonnet.evaluate_snippet("render", snippet, jpathdir=[MIXIN]))


def load(path: str) -> Any:
    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def test_generated_copies_are_current():
    proc = subprocess.run([sys.executable, os.path.join(MIXIN, "generate.py"), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_default_config_renders_the_shipped_rule_files():
    files = render("ruleFiles")
    shipped = {os.path.basename(p): p for p in rule_files(REPO)}
    assert sorted(files) == sorted(shipped)
    for name, path in shipped.items():
        assert files[name] == load(path), name


def test_alerts_and_rules_hold_every_shipped_group_once():
    alerts, records = render("prometheusAlerts")["groups"], render("prometheusRules")["groups"]
    shipped = rule_groups(REPO)
    assert sorted(g["name"] for g in alerts + records) == sorted(g["name"] for g in shipped)
    by_name = {g["name"]: g for g in alerts + records}
    assert all(by_name[g["name"]] == g for g in shipped)
    # a rule file goes whole to prometheusAlerts when it has any alert (job-rules.yaml's recording groups
    # feed its alerts, and travel with them); a recording-only file to prometheusRules
    alert_files = [load(p)["groups"] for p in rule_files(REPO)
                   if any("alert" in r for g in load(p)["groups"] for r in g["rules"])]
    assert sorted(g["name"] for g in alerts) == sorted(g["name"] for groups in alert_files for g in groups)
    assert not any("alert" in r for g in records for r in g["rules"])


def test_default_config_renders_the_shipped_dashboards():
    dashboards = render("grafanaDashboards")
    shipped = sorted(os.listdir(os.path.join(REPO, "dashboards", "grafana")))
    assert sorted(dashboards) == [n for n in shipped if n.endswith(".json")]
    for name, dashboard in dashboards.items():
        with open(os.path.join(REPO, "dashboards", "grafana", name), encoding="utf-8") as fh:
            assert dashboard == json.load(fh), name


@needs_promtool
def test_rendered_rules_pass_promtool(tmp_path):
    paths = []
    for field in ("prometheusAlerts", "prometheusRules"):
        path = tmp_path / f"{field}.yaml"
        path.write_text(yaml.safe_dump(render(field)), encoding="utf-8")
        paths.append(str(path))
    proc = subprocess.run([PROMTOOL, "check", "rules", *paths], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _exporter_alerts(tmp_path, selector: str) -> subprocess.CompletedProcess[str]:
    """promtool's rule test on the rendered alerts, with one gpumon target (job gpumon) down for 20 minutes:
    GpumonExporterDown must fire for a selector that matches it, GpumonExporterAbsent for one that does not."""
    rendered = render("prometheusAlerts", f"{{gpumonSelector: {json.dumps(selector)}}}")
    for group in rendered["groups"]:  # promtool compares annotations too; the expression is what is tested
        for rule in group["rules"]:
            rule.pop("annotations", None)
    rules = tmp_path / "alerts.yaml"
    rules.write_text(yaml.safe_dump(rendered), encoding="utf-8")
    matches = selector == 'job=~"gpumon.*"'
    down = [{"exp_labels": {"severity": "warning", "job": "gpumon", "instance": "h1:9470"}}] if matches else []
    # absent() keeps the label of an equality matcher: job="nope" becomes the alert's job label.
    absent = [] if matches else [{"exp_labels": {"severity": "critical", "job": "nope"}}]
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": 'up{job="gpumon", instance="h1:9470"}', "values": "0x20"}],
            "alert_rule_test": [
                {"eval_time": "15m", "alertname": "GpumonExporterDown", "exp_alerts": down},
                {"eval_time": "15m", "alertname": "GpumonExporterAbsent", "exp_alerts": absent},
            ],
        }],
    }
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test), encoding="utf-8")
    return subprocess.run([str(PROMTOOL), "test", "rules", str(path)], capture_output=True, text=True, timeout=60)


@needs_promtool
def test_default_selector_finds_the_down_target(tmp_path):
    proc = _exporter_alerts(tmp_path, 'job=~"gpumon.*"')
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_selector_that_matches_nothing_is_caught_by_the_absent_alert(tmp_path):
    # A wrong job name silences GpumonExporterDown; GpumonExporterAbsent is what says so.
    proc = _exporter_alerts(tmp_path, 'job="nope"')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rules = render("prometheusAlerts", '{gpumonSelector: \'job="nope"\'}')
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert not any('job=~"gpumon.*"' in e for e in exprs)


def test_selector_replaces_the_job_matcher_everywhere_it_is_used():
    selector = 'job="gpu-exporters", namespace="gpumon"'
    config = f"{{gpumonSelector: {json.dumps(selector)}}}"
    shipped = [r["expr"] for g in rule_groups(REPO) for r in g["rules"]]
    rendered = [r["expr"] for f in ("prometheusAlerts", "prometheusRules")
                for g in render(f, config)["groups"] for r in g["rules"]]
    assert len(rendered) == len(shipped)
    used = [e for e in shipped if 'job=~"gpumon.*"' in e]
    assert used, "the shipped rules no longer use the job matcher that gpumonSelector replaces"
    assert sum(selector in e for e in rendered) == len(used)
    assert not any('job=~"gpumon.*"' in e for e in rendered)
    dashboards = json.dumps(render("grafanaDashboards", config))
    assert 'job=~\\"gpumon.*\\"' not in dashboards and json.dumps(selector)[1:-1] in dashboards


def test_thresholds_reach_their_alerts():
    config = "{gpuSlowdownRatio: 0.8, ibPortErrorsPerSecond: 1.5, powerSwingRatio: '0.75', jobStragglerScore: 7," \
             " remapTableRows: 100}"
    exprs = {r["alert"]: r["expr"] for g in render("prometheusAlerts", config)["groups"]
             for r in g["rules"] if "alert" in r}
    assert exprs["GpumonGpuThermalSlowdown"].endswith("[10m]) > 0.8")
    assert exprs["GpumonGpuPowerBrake"].endswith("[10m]) > 0.8")
    assert exprs["GpumonIBPortErrorsHigh"] == "port:gpumon_ib_errors:rate5m > 1.5"
    assert exprs["GpumonGpuPowerSwing"].endswith(" > 0.75")
    assert exprs["GpumonJobStraggler"] == "max without (shard) (gpumon_job:straggler_score) > 7"
    assert exprs["GpumonGpuRemapTableFilling"].endswith(" >= 100")


def test_a_threshold_that_moved_in_the_rule_file_fails_the_render():
    snippet = textwrap.dedent("""
        local render = import 'lib/render.libsonnet';
        render.rule({alert: 'GpumonJobStraggler', expr: 'gpumon_job:straggler_score > 6'},
                    (import 'config.libsonnet')._config)
    """)
    with pytest.raises(RuntimeError, match="GpumonJobStraggler.* > 5"):
        _jsonnet.evaluate_snippet("moved", snippet, jpathdir=[MIXIN])
