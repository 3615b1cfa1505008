"""Restructuring changes no output: every simulated profile's Prometheus page, dcgm-exporter page,
OpenTelemetry mapping and Azure Monitor rows, and the catalogue's generated outputs (OTel table, DCR
template, column tables), equal the dump committed under tests/fixtures/outputs/ (values normalised)."""

from __future__ import annotations

import pytest

from tests.support import outputs_dump


@pytest.fixture(autouse=True)
def _no_gpumon_environment(monkeypatch):
    import os

    for key in [k for k in os.environ if k.startswith("GPUMON_")]:
        monkeypatch.delenv(key)


def test_catalogue_outputs_are_unchanged():
    diffs = outputs_dump.differences({"catalogue.txt": outputs_dump.catalogue_dump()})
    assert not diffs, ("the catalogue's outputs changed (if on purpose: python -m tests.support.outputs_dump --write)\n"
                       + "\n".join(diffs)[:6000])


@pytest.mark.parametrize("profile", outputs_dump.PROFILES)
def test_simulated_outputs_are_unchanged(profile):
    name = f"{profile}.txt"
    diffs = outputs_dump.differences({name: outputs_dump.profile_dump(profile)})
    assert not diffs, (f"{profile}'s outputs changed (if on purpose: python -m tests.support.outputs_dump --write)\n"
                       + "\n".join(diffs)[:6000])
