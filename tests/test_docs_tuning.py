"""docs/tuning.md: its table is generated from the committed results of `python -m bench tuning`, the
series in those results are what a simulated ND H100 v5 exports with each switch now, and the page's
sample arithmetic adds up."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.tuning import DOC, RESULTS_FILE, SWITCHES, doc_with_table, series_by_switch

pytestmark = pytest.mark.timeout(180)


def results() -> list[dict]:
    return json.loads(Path(RESULTS_FILE).read_text(encoding="utf-8"))["switches"]


def test_the_table_is_the_committed_results():
    doc = Path(DOC).read_text(encoding="utf-8")
    assert doc == doc_with_table(doc, results()), "docs/tuning.md's table is stale: run python -m bench.tuning"


def test_results_cover_every_switch_bench_measures():
    assert [row["switch"] for row in results()] == [switch for switch, _ in SWITCHES]


def test_the_results_series_are_what_a_simulated_host_exports_now():
    measured = dict(series_by_switch())
    base = measured["defaults"]["series"]
    for row in results():
        got = measured[row["switch"]]
        assert (row["series"], row["series_added"], row["series_per_gpu"]) == (
            got["series"], got["series"] - base, got["series_per_gpu"]), (
            f"{row['switch']}: the series changed; run python -m bench tuning, then python -m bench.tuning")


def test_samples_a_day_follow_from_the_default_series():
    text = Path(DOC).read_text(encoding="utf-8")
    defaults = results()[0]["series"]
    match = re.search(r"At the defaults, (\d+) series scraped every 30 s are\s+(\d+) scrapes a day, (\d+) samples",
                      text)
    assert match, "the worked example of samples a day is gone"
    assert int(match.group(1)) == defaults
    assert int(match.group(2)) == 86400 // 30
    assert int(match.group(3)) == defaults * (86400 // 30)
