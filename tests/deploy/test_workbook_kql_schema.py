"""Every KQL query of the Azure Monitor Workbook parses and names only columns the tables have.

The table schemas come from the Log Analytics tables declared in deploy/azure/azuredeploy.json (what
the data collection rule writes), and the queries are analysed by the Kusto language service
(tests/kql/check.js, npm package @kusto/language-service-next; `npm ci --prefix tests/kql` installs it).
"""

from __future__ import annotations

import copy
import json
import os
import re
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


class Checker:
    """tests/kql/check.js, started once for the module (loading the language service takes seconds):
    one request a line on its stdin, one answer a line on its stdout."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def analyse(self, tables: dict[str, list[list[str]]], queries: dict[str, str]) -> dict[str, list[str]]:
        if self.proc is None:
            self.proc = subprocess.Popen(["node", CHECKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"tables": tables, "queries": queries}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()  # bounded by the module's pytest timeout
        if not answer:
            stderr = self.close()
            raise AssertionError(f"check.js exited {self.proc.returncode}: {stderr}")
        return json.loads(answer)

    def close(self) -> str:
        """Stop the checker; what it wrote to stderr."""
        if self.proc is None:
            return ""
        try:
            _, stderr = self.proc.communicate(timeout=30)  # closes stdin: it ends its input and exits
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, stderr = self.proc.communicate()
        return stderr


CHECK = Checker()


@pytest.fixture(scope="module", autouse=True)
def _checker() -> Iterator[None]:
    yield
    CHECK.close()
    CHECK.proc = None


def analyse(tables: dict[str, list[list[str]]], queries: dict[str, str]) -> dict[str, list[str]]:
    if shutil.which("node") is None:
        pytest.skip("needs node")
    if not os.path.isdir(LANGUAGE_SERVICE):
        pytest.fail("the Kusto language service is not installed: run `npm ci --prefix tests/kql`")
    return CHECK.analyse(tables, queries)


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


# --- null-safe arithmetic and "sent occasionally" columns ----------------------------------------------------
# No KQL engine runs here (the language service parses and binds, it does not evaluate), so what Log Analytics
# would compute is pinned by the shape of the queries: the sink leaves a zero increase out of a row
# (omit_zero_increases) and sends static columns only now and then (static_every), so both are null on most rows.


def _tokens(kql: str) -> list[str]:
    kql = re.sub(r'"[^"]*"', '""', kql)
    kql = re.sub(r"//[^\n]*", "", kql)
    return re.findall(r"\w+|\S", kql)


def bare_increase_arithmetic(kql: str) -> list[str]:
    """Every arithmetic operator with a bare ``...Increase`` column as an operand (null when the column is)."""
    tokens = _tokens(kql)
    found = []
    for i, tok in enumerate(tokens):
        if tok not in {"+", "-", "*", "/"}:
            continue
        left = tokens[i - 1] if i else ""
        right = tokens[i + 1] if i + 1 < len(tokens) else ""
        right_is_call = i + 2 < len(tokens) and tokens[i + 2] == "("
        if left.endswith("Increase") or (right.endswith("Increase") and not right_is_call):
            found.append(" ".join(tokens[max(0, i - 3):i + 4]))
    return found


def arg_max_columns(kql: str) -> list[str]:
    """The columns every arg_max()/arg_min() of a query returns."""
    out = []
    for m in re.finditer(r"\barg_(?:max|min)\s*\(", kql):
        depth, j = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(kql[j], 0)
            j += 1
        out += [c.strip() for c in kql[m.end():j - 1].split(",")[1:]]
    return out


def static_columns() -> set[str]:
    from gpumon.confdoc import declared_specs
    from gpumon.sinks.azure_monitor.rows import InfoColumns, MetricColumns, column_hints

    hints = column_hints(declared_specs())
    out = {col for info in hints if isinstance(info, InfoColumns) for _, col in info.labels}
    static = (m for m in hints if isinstance(m, MetricColumns) and m.static)
    return out | {col for m in static for col, _ in m.column_names()}


def test_no_query_does_arithmetic_on_a_bare_increase_column() -> None:
    queries = workbook_queries(os.path.join(WORKBOOK_DIR, "gpumon-workbook.json"))
    found = {name: bad for name, kql in queries.items() if (bad := bare_increase_arithmetic(kql))}
    assert not found, ("adding ...Increase columns row by row is null when any one is missing; "
                       f"use sum(A) + sum(B) with coalesce: {found}")
    # The check itself catches the forms it is for, and passes the null-safe ones.
    assert bare_increase_arithmetic("T | summarize E = sum(AIncrease + BIncrease)")
    assert bare_increase_arithmetic("T | extend E = 2 * AIncrease")
    assert not bare_increase_arithmetic("T | summarize E = coalesce(sum(AIncrease), 0.0) + coalesce(sum(BIncrease), 0.0)")


def test_sums_of_increases_read_a_missing_column_as_zero() -> None:
    queries = workbook_queries(os.path.join(WORKBOOK_DIR, "gpumon-workbook.json"))
    for name, kql in queries.items():
        tokens = _tokens(kql)
        for i, tok in enumerate(tokens):
            # sum(XIncrease) + ... : each summed term of a total is wrapped in coalesce()
            if tok == "sum" and tokens[i + 1] == "(" and tokens[i + 2].endswith("Increase") and tokens[i + 3] == ")":
                nearby = tokens[i + 4] if i + 4 < len(tokens) else ""
                before = tokens[i - 1] if i else ""
                if nearby in {"+", "-"} or before in {"+", "-"}:
                    assert tokens[i - 2:i] == ["coalesce", "("], f"{name}: sum({tokens[i + 2]}) added without coalesce"


def test_thermal_time_does_not_rest_on_counters_only_r580_has() -> None:
    """R550-R575 drivers export the `thermal` violation counter but not the sw/hw thermal slowdown ones."""
    queries = workbook_queries(os.path.join(WORKBOOK_DIR, "gpumon-workbook.json"))
    r580 = ("ClockViolationSwThermalSlowdownIncrease", "ClockViolationHwThermalSlowdownIncrease",
            "ClockViolationHwPowerBrakeSlowdownIncrease")
    seen = 0
    for name, kql in queries.items():
        if any(c in kql for c in r580):
            seen += 1
            assert "ClockViolationThermalIncrease" in kql, f"{name}: thermal time only from R580 counters"
            assert "ClockViolationSwPowerCapIncrease" in kql, f"{name}: power time only from R580 counters"
    assert seen >= 2


def test_static_columns_are_not_taken_from_the_latest_row() -> None:
    """arg_max(TimeGenerated, Model) returns the newest row's Model: empty unless that row repeated the statics."""
    static = static_columns()
    assert {"Model", "Serial", "LinkLayer", "NvlinkLinks", "PowerLimitWatts"} <= static
    queries = workbook_queries(os.path.join(WORKBOOK_DIR, "gpumon-workbook.json"))
    found = {name: sorted(set(arg_max_columns(kql)) & static) for name, kql in queries.items()}
    assert not {k: v for k, v in found.items() if v}, found
    assert arg_max_columns("T | summarize arg_max(TimeGenerated, Model, f(a, b)), x = sum(y)") == ["Model", "f(a", "b)"]


def test_number_formats_match_the_column_units() -> None:
    """Workbook number-format units (as the gallery templates use them): 2 bytes, 3 kilobytes, 11 bytes/s."""
    with open(os.path.join(WORKBOOK_DIR, "gpumon-workbook.json"), encoding="utf-8") as fh:
        content = json.load(fh)
    checked = 0
    for item in walk(content["items"]):
        for fmt in item.get("content", {}).get("gridSettings", {}).get("formatters", []):
            unit = fmt.get("numberFormat", {}).get("unit")
            column = fmt["columnMatch"]
            if column.endswith("BytesPerSecond"):
                assert unit == 11, f"{column}: unit {unit} is not bytes per second (11)"
                checked += 1
            elif column.endswith("Bytes"):
                assert unit == 2, f"{column}: unit {unit} is not bytes (2)"
                checked += 1
    assert checked


def test_kusto_examples_in_the_docs_parse_and_read_static_columns_where_they_are(schemas) -> None:
    """The KQL examples of docs/azure-monitor.md and docs/dashboards.md against the same schemas."""
    queries = {}
    for doc in ("azure-monitor.md", "dashboards.md"):
        with open(os.path.join(REPO, "docs", doc), encoding="utf-8") as fh:
            blocks = re.findall(r"```kusto\n(.*?)```", fh.read(), re.S)
        queries.update({f"{doc} example {i + 1}": block for i, block in enumerate(blocks)})
    assert queries
    errors = {k: v for k, v in analyse(schemas, queries).items() if v}
    assert not errors, json.dumps(errors, indent=2)
    static = static_columns()
    for name, kql in queries.items():
        assert not bare_increase_arithmetic(kql), name
        for column in set(arg_max_columns(kql)) & static:
            assert re.search(r"isnotempty\(\s*\w+\s*\)", kql), f"{name}: arg_max of {column} over every row"


def test_health_section_reads_the_latest_health_changed_event_per_host() -> None:
    """The verdict and findings come from each host's latest health_changed event (it holds the whole
    verdict), not from a count of events; the findings are expanded one row per rule."""
    queries = {name: kql for name, kql in workbook_queries(os.path.join(WORKBOOK_DIR, "gpumon-workbook.json")).items()
               if name.startswith("health-")}
    assert set(queries) == {"health-verdicts", "health-changes", "health-findings", "health-by-size"}
    for name, kql in queries.items():
        assert 'Kind == "health_changed"' in kql, name
    for name in ("health-verdicts", "health-findings", "health-by-size"):
        assert re.search(r"summarize arg_max\(TimeGenerated, Attributes\b.*\) by Computer", queries[name]), name
    assert "mv-expand Finding = Attributes.findings" in queries["health-findings"]
    assert "Rule = tostring(Finding.rule)" in queries["health-findings"]
