"""scripts/sbom.sh: the CycloneDX SBOM of the wheel's dependency set lists every runtime dependency of
pyproject.toml, at an installed version that satisfies it, and nothing that only the extras or the
tests need. Builds the wheel and a throwaway venv with pip, then runs cyclonedx-bom's cyclonedx-py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from gpumon import __version__
from tests.conftest import REPO, clean_env

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SCRIPT = os.path.join(REPO, "scripts", "sbom.sh")
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def project() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)["project"]


@pytest.fixture(scope="module")
def bom(tmp_path_factory) -> dict:
    from tests.support.artefacts import checkout_build_lock

    out = tmp_path_factory.mktemp("sbom") / "gpumon.cdx.json"
    with checkout_build_lock(tmp_path_factory):  # the script builds the wheel from this checkout in place
        proc = subprocess.run([SCRIPT, "wheel", str(out)], capture_output=True, text=True, timeout=280,
                              check=False, env=clean_env(PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def components(bom: dict) -> dict[str, str]:
    return {canonicalize_name(c["name"]): c["version"] for c in bom["components"]}


def test_the_bom_is_cyclonedx_with_gpumon_as_its_root(bom):
    assert bom["bomFormat"] == "CycloneDX" and bom["specVersion"] == "1.6"
    root = bom["metadata"]["component"]
    assert (root["name"], root["version"], root["type"]) == ("gpumon-exporter", __version__, "application")
    assert [lic["license"]["id"] for lic in root["licenses"]] == ["MIT"]
    (tree,) = [d for d in bom["dependencies"] if d["ref"] == root["bom-ref"]]
    assert len(tree["dependsOn"]) == len(bom["components"]), "the root depends on every listed component"


def test_every_runtime_dependency_is_listed_at_a_version_that_satisfies_it(bom):
    listed = components(bom)
    environment = default_environment()
    wanted = [Requirement(r) for r in project()["dependencies"]]
    assert len(wanted) >= 4
    for req in wanted:
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate(environment):
            assert name not in listed, f"{req} does not apply to this Python"
            continue
        assert name in listed, f"{req} missing from the SBOM"
        assert req.specifier.contains(listed[name], prereleases=True), (req, listed[name])
    purls = [c["purl"] for c in bom["components"]]
    assert all(p.startswith("pkg:pypi/") and "@" in p for p in purls), purls


def test_nothing_from_the_extras_or_the_tests_is_listed(bom):
    listed = set(components(bom))
    extras = {canonicalize_name(Requirement(r).name) for group in project()["optional-dependencies"].values()
              for r in group} - {"gpumon-exporter"}
    assert {"pytest", "hypothesis", "mypy", "opentelemetry-sdk", "azure-identity", "grpcio"} <= extras
    assert not listed & extras, listed & extras
    assert not listed & {"pip", "setuptools", "wheel", "gpumon-exporter"}, "build tooling or gpumon itself"


def test_a_directory_that_is_not_a_venv_is_refused(tmp_path):
    proc = subprocess.run([SCRIPT, "venv", str(tmp_path), str(tmp_path / "out.json")], capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode == 2 and "is not a venv" in proc.stderr
    assert not (tmp_path / "out.json").exists()
    usage = subprocess.run([SCRIPT, "image"], capture_output=True, text=True, timeout=30, check=False)
    assert usage.returncode == 2 and "usage:" in usage.stderr
