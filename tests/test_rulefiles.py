"""gpumon.rulefiles: which files under deploy/prometheus are rule files, and the duration conversion the
Azure rule groups need (Prometheus ``5m`` -> ISO 8601 ``PT5M``)."""

from __future__ import annotations

import os

import pytest

from gpumon.rulefiles import duration_seconds, iso8601, rule_files, rule_groups
from tests.conftest import REPO


def test_every_rule_file_is_found_and_nothing_else():
    names = [os.path.basename(p) for p in rule_files(REPO)]
    assert {"alerting-rules.yaml", "recording-rules.yaml"} <= set(names)
    assert "prometheus.yml" not in names and names == sorted(names)


def test_a_new_rule_file_is_picked_up_and_a_duplicate_group_is_refused(tmp_path):
    rules = tmp_path / "deploy" / "prometheus"
    rules.mkdir(parents=True)
    (rules / "a-rules.yaml").write_text("groups:\n  - name: one\n    rules: []\n")
    (rules / "b-rules.yaml").write_text("groups:\n  - name: two\n    rules: []\n")
    (rules / "scrape.yaml").write_text("scrape_configs: []\n")
    (rules / "empty.yaml").write_text("")
    assert [g["name"] for g in rule_groups(str(tmp_path))] == ["one", "two"]
    (rules / "c-rules.yaml").write_text("groups:\n  - name: one\n    rules: []\n")
    with pytest.raises(ValueError, match="'one' is in both .*a-rules.yaml and .*c-rules.yaml"):
        rule_groups(str(tmp_path))


@pytest.mark.parametrize(("text", "seconds", "iso"), [
    ("30s", 30, "PT30S"), ("5m", 300, "PT5M"), ("1h", 3600, "PT1H"), ("1h30m", 5400, "PT1H30M"),
    ("2d", 172800, "P2D"), ("1d2h", 93600, "P1DT2H"), ("0s", 0, "PT0S"),
])
def test_durations_convert_to_iso8601(text, seconds, iso):
    assert duration_seconds(text) == seconds
    assert iso8601(duration_seconds(text)) == iso


@pytest.mark.parametrize("text", ["", "5", "5 m", "m5", "1.5h", "5x"])
def test_a_malformed_duration_is_refused(text):
    with pytest.raises(ValueError, match="not a Prometheus duration"):
        duration_seconds(text)
