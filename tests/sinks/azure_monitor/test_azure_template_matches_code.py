"""deploy/azure/azuredeploy.json is what generate.py makes from the column table, and is deployable."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from gpumon.catalogue.hints import MetricColumns, NoColumns
from gpumon.catalogue.lookup import azure_hints
from gpumon.confdoc import declared_specs
from gpumon.model import MetricType
from gpumon.sinks.azure_monitor.rows import IDENTITY, TABLES, stream_columns
from tests.conftest import REPO

TEMPLATE = os.path.join(REPO, "deploy", "azure", "azuredeploy.json")
RESERVED = {"id", "type", "tenantid", "_resourceid", "uniqueid", "title"}


def resources(kind: str) -> list[dict]:
    with open(TEMPLATE, encoding="utf-8") as fh:
        return [r for r in json.load(fh)["resources"] if r["type"] == kind]


def test_committed_template_equals_generated():
    result = subprocess.run([sys.executable, os.path.join(REPO, "deploy", "azure", "generate.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_column_names_follow_log_analytics_rules():
    for table, columns in stream_columns(declared_specs()).items():
        names = [n for n, _ in columns]
        assert len(names) == len(set(names)), table
        assert len(names) <= 500
        for name in names:
            assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,44}", name), name
            assert name.lower() not in RESERVED, name
        assert names[:3] == ["TimeGenerated", "Computer", "RowId"]


def test_dcr_streams_tables_and_flows_agree():
    (dcr,) = resources("Microsoft.Insights/dataCollectionRules")
    props = dcr["properties"]
    assert dcr["kind"] == "Direct"
    tables = {t["properties"]["schema"]["name"]: t["properties"]["schema"]["columns"]
              for t in resources("Microsoft.OperationalInsights/workspaces/tables")}
    assert set(tables) == set(TABLES.values())
    for flow in props["dataFlows"]:
        (stream,) = flow["streams"]
        assert flow["transformKql"] == "source" and flow["destinations"] == ["workspace"]
        table = flow["outputStream"].removeprefix("Custom-")
        declared = [(c["name"], c["type"]) for c in props["streamDeclarations"][stream]["columns"]]
        in_table = [(c["name"], c["type"].replace("dateTime", "datetime")) for c in tables[table]]
        assert declared == in_table  # transformKql "source" passes every column through unchanged
    (role,) = resources("Microsoft.Authorization/roleAssignments")
    assert role["properties"]["principalId"] == "[parameters('principalId')]"
    with open(TEMPLATE, encoding="utf-8") as fh:
        template = json.load(fh)
    assert "3913510d-42f4-4e42-8a64-420c390055eb" in template["variables"]["roleDefinitionId"]
    outputs = template["outputs"]
    assert {"endpoint", "dcrImmutableId", "streamGpu", "streamInfiniband", "streamEvents"} <= set(outputs)


def _collector_specs(module: str) -> list:
    if importlib.util.find_spec(module) is None:
        return []
    mod = importlib.import_module(module)
    specs = []
    for obj in vars(mod).values():
        if isinstance(obj, type) and obj.__module__ == mod.__name__ and "metrics" in vars(obj):
            specs.extend(obj.metrics())
    return specs


@pytest.mark.parametrize("module", ["gpumon.collectors.infiniband", "gpumon.collectors.linkflap",
                                    "gpumon.collectors.nvml"])
def test_every_gpu_and_port_metric_has_columns(module):
    specs = _collector_specs(module)
    assert specs, f"{module} declares no metrics"
    row_labels = {IDENTITY[table][0][0] for table in IDENTITY}  # gpu, device
    missing = []
    for spec in specs:
        hints = azure_hints(spec)
        excluded = any(isinstance(h, NoColumns) for h in hints)
        if not spec.labels or spec.labels[0] not in row_labels or excluded:
            continue  # host-wide series (no GPU/port) have no row to live in
        if not hints:
            missing.append(spec.name)
            continue
        for columns in (h for h in hints if isinstance(h, MetricColumns)):
            aggs = set(columns.aggs)
            if spec.type is MetricType.GAUGE:
                assert not aggs & {"increase", "rate"}, f"{spec.name} is a gauge"
    assert not missing, f"metrics without Azure columns (add an azure hint to their MetricSpec): {missing}"
