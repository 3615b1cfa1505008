"""docs/tuning.md: its series figures are what a simulated ND H100 v5 exports with each switch, its
CPU figures are the committed results of `python -m bench tuning`, and its sample arithmetic adds up."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.tuning import SWITCHES, series_by_switch
from tests.conftest import REPO

DOC = Path(REPO) / "docs/tuning.md"
RESULTS = Path(REPO) / "bench/results/tuning.json"

pytestmark = pytest.mark.timeout(180)


def table() -> list[list[str]]:
    text = DOC.read_text(encoding="utf-8")
    block = text.split("<!-- tuning-table", 1)[1].split("<!-- /tuning-table -->", 1)[0]
    rows = [[c.strip().strip("`") for c in line.strip("|").split("|")] for line in block.splitlines()
            if line.startswith("| ") and not line.startswith("| Switch")]
    return rows


def signed(n: float) -> str:
    return f"{n:+}" if n else str(n)


def test_rows_are_the_switches_bench_measures():
    assert [row[0] for row in table()] == [switch for switch, _ in SWITCHES]


def test_series_columns_match_a_simulated_run():
    measured = dict(series_by_switch())
    base = measured["defaults"]["series"]
    for switch, series, added, per_gpu, *_ in table():
        got = measured[switch]
        assert (int(series), added, int(per_gpu)) == (got["series"], signed(got["series"] - base),
                                                      got["series_per_gpu"]), (
            f"docs/tuning.md row {switch!r} is stale: run python -m bench tuning and copy its figures")


def test_cpu_columns_are_the_committed_results():
    results = {r["switch"]: r for r in json.loads(RESULTS.read_text(encoding="utf-8"))["switches"]}
    for switch, series, _, _, cpu, cpu_added in table():
        row = results[switch]
        assert int(series) == row["series"]
        assert float(cpu) == row["cpu_ms_per_cycle"] and float(cpu_added) == row["cpu_ms_added"], switch


def test_samples_a_day_follow_from_the_default_series():
    text = DOC.read_text(encoding="utf-8")
    defaults = int(table()[0][1])
    match = re.search(r"At the defaults, (\d+) series scraped every 30 s are\s+(\d+) scrapes a day, (\d+) samples",
                      text)
    assert match, "the worked example of samples a day is gone"
    assert int(match.group(1)) == defaults
    assert int(match.group(2)) == 86400 // 30
    assert int(match.group(3)) == defaults * (86400 // 30)
