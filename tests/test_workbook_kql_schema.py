"""Every KQL query of the Azure Monitor Workbook parses and names only columns the tables have.

The table schemas come from the Log Analytics tables declared in deploy/azure/azuredeploy.json (what
the data collection rule writes), and the queries are analysed by the Kusto language service
(tests/kql/check.js, npm package @kusto/language-service-next; `npm ci --prefix tests/kql` installs it).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import REPO

WORKBOOK_DIR = os.path.join(REPO, "dashboards", "azure-workbook")
DCR_TEMPLATE = os.path.join(REPO, "deploy", "azure", "azuredeploy.json")
CHECKER = os.path.join(REPO, "tests", "kql", "check.js")
LANGUAGE_SERVICE = os.path.join(REPO, "tests", "kql", "node_modules", "@kusto", "language-service-next")
TABLES = ("GpuMonGpu_CL", "GpuMonInfiniBand_CL", "GpuMonEvents_CL")
# Table schema types (ARM spelling) to Kusto scalar types.
KUSTO_TYPES = {"dateTime": "datetime", "datetime": "datetime", "string": "string", "int": "int", "long": "long",
               "real": "real", "boolean": "bool", "bool": "bool", "dynamic": "dynamic", "guid": "guid"}
# Workbook parameters as the Workbook expands them: a multi-select with quote ' and delimiter ,.
PARAMETERS = {"{Computer}": "'node-a', 'node-b'", "{TimeRange:grain}": "5m"}


def table_schemas() -> dict[str, list[list[str]]]:
    with open(DCR_TEMPLATE, encoding="utf-8") as fh:
        template = json.load(fh)
    out = {}
    for resource in template["resources"]:
        if resource["type"] == "Microsoft.OperationalInsights/workspaces/tables":
            schema = resource["properties"]["schema"]
            out[schema["name"]] = [[c["name"], KUSTO_TYPES[c["type"]]] for c in schema["columns"]]
    return out


def walk(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for item in items:
        yield item
        yield from walk(item.get("content", {}).get("items", []))


def workbook_queries(path: str) -> dict[str, str]:
    """Every query of the Workbook (steps and parameter drop-downs), parameters expanded."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    content = data if "items" in data else json.loads(json.dumps(data["variables"]["workbookContent"]))
    out = {}
    for item in walk(content["items"]):
        found = []
        if item["type"] == 3:
            found.append((item["name"], item["content"]["query"]))
        if item["type"] == 9:
            found += [(f"parameter {p['name']}", p["query"]) for p in item["content"]["parameters"] if "query" in p]
        for name, kql in found:
            for key, value in PARAMETERS.items():
                kql = kql.replace(key, value)
            assert "{" not in kql.replace("{}", ""), f"{name}: unexpanded parameter in {kql}"
            out[name] = kql
    return out


def analyse(tables: dict[str, list[list[str]]], queries: dict[str, str]) -> dict[str, list[str]]:
    if shutil.which("node") is None:
        pytest.skip("needs node")
    if not os.path.isdir(LANGUAGE_SERVICE):
        pytest.fail("the Kusto language service is not installed: run `npm ci --prefix tests/kql`")
    proc = subprocess.run(["node", CHECKER], input=json.dumps({"tables": tables, "queries": queries}),
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def schemas() -> dict[str, list[list[str]]]:
    tables = table_schemas()
    assert set(TABLES) <= set(tables), f"the DCR template lacks {set(TABLES) - set(tables)}"
    return tables


@pytest.mark.parametrize("name", ["gpumon-workbook.json", "azuredeploy.json"])
def test_every_workbook_query_parses_against_the_tables(schemas, name: str) -> None:
    queries = workbook_queries(os.path.join(WORKBOOK_DIR, name))
    assert len(queries) >= 15, f"expected the Workbook's queries, found {len(queries)}"
    used = {t for q in queries.values() for t in TABLES if t in q}
    assert used == set(TABLES), f"tables never queried: {set(TABLES) - used}"
    errors = {k: v for k, v in analyse(schemas, queries).items() if v}
    assert not errors, json.dumps(errors, indent=2)


@pytest.mark.parametrize(("table", "column"), [
    ("GpuMonGpu_CL", "UtilizationAvg"),
    ("GpuMonInfiniBand_CL", "FlapsIncrease"),
    ("GpuMonEvents_CL", "Kind"),
])
def test_a_renamed_column_breaks_the_check(schemas, table: str, column: str) -> None:
    renamed = copy.deepcopy(schemas)
    for entry in renamed[table]:
        if entry[0] == column:
            entry[0] = column + "Renamed"
            break
    else:
        raise AssertionError(f"{table} has no column {column}")
    queries = workbook_queries(os.path.join(WORKBOOK_DIR, "gpumon-workbook.json"))
    result = analyse(renamed, queries)
    broken = sorted(name for name, errors in result.items() if any(column in e for e in errors))
    assert broken, f"renaming {table}.{column} went unnoticed"


def test_a_typo_in_a_query_is_an_error(schemas) -> None:
    result = analyse(schemas, {"typo": "GpuMonGpu_CL | summarize avg(UtilisationAvg) by Computer",
                               "syntax": "GpuMonGpu_CL | where Lost ==",
                               "good": "GpuMonGpu_CL | summarize avg(UtilizationAvg) by Computer"})
    assert result["typo"] and result["syntax"] and not result["good"], result


def test_committed_workbook_files_are_generated() -> None:
    proc = subprocess.run([sys.executable, os.path.join(WORKBOOK_DIR, "generate.py"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_arm_template_deploys_the_workbook_content() -> None:
    with open(os.path.join(WORKBOOK_DIR, "azuredeploy.json"), encoding="utf-8") as fh:
        template = json.load(fh)
    (resource,) = template["resources"]
    assert resource["type"] == "Microsoft.Insights/workbooks"
    assert resource["kind"] == "shared"
    assert "variables('workbookContent')" in resource["properties"]["serializedData"]
    assert resource["properties"]["sourceId"] == "[parameters('workspaceResourceId')]"
    content = template["variables"]["workbookContent"]
    assert content["version"] == "Notebook/1.0"
    # ARM evaluates any string starting with '[' as an expression: the content must hold none.
    strings: list[str] = []

    def collect(node: Any) -> None:
        if isinstance(node, str):
            strings.append(node)
        elif isinstance(node, dict):
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    collect(content)
    assert not [s for s in strings if s.startswith("[")]
    with open(os.path.join(WORKBOOK_DIR, "gpumon-workbook.json"), encoding="utf-8") as fh:
        standalone = json.load(fh)
    assert workbook_queries(os.path.join(WORKBOOK_DIR, "azuredeploy.json")) == workbook_queries(
        os.path.join(WORKBOOK_DIR, "gpumon-workbook.json"))
    assert [i["name"] for i in standalone["items"]] == [i["name"] for i in content["items"]]
