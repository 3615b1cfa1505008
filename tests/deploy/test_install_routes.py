"""No install route resolves the name of another project.

"gpumon" on PyPI is an unrelated project; gpumon's distribution is "gpumon-exporter". Here
deploy/vm/install.sh runs against a package index on loopback (PEP 503 simple/ tree) that serves a
decoy under the old name "gpumon" and a decoy "gpumon-exporter" of the same version as the real
wheel but other bytes, next to the real dependencies. Every route either installs gpumon's own
artefact or refuses, and the index is never asked for the name "gpumon".
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.package_index import Index, serve, sha256, write_index
from tests.support.vm_install import REPO, SCRIPT, run_install

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

DECOY_MARK = "DECOY: not gpumon's artefact"


def make_wheel(out: Path, name: str, version: str) -> Path:
    """A pure-Python wheel of ``name`` whose import package is ``gpumon`` and says it is a decoy."""
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    files = {
        "gpumon/__init__.py": f'__version__ = "{version}"\nDECOY = "{DECOY_MARK}"\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: decoy\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": "[console_scripts]\ngpumon = gpumon:DECOY\n",
    }
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        writer.writerow([path, f"sha256={digest}", len(text.encode())])
    writer.writerow([f"{info}/RECORD", "", ""])
    target = out / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(target, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
        zf.writestr(f"{info}/RECORD", record.getvalue())
    return target


@pytest.fixture(scope="module")
def wheel(gpumon_wheel) -> Path:
    return gpumon_wheel  # built once per run (tests/support/artefacts.py)


@pytest.fixture(scope="module")
def dependencies(gpumon_wheelhouse) -> list[Path]:
    # Every extra: a self-reference of an extra to the old name would ask the index for "gpumon".
    return sorted(gpumon_wheelhouse.glob("*.whl"))


@pytest.fixture(scope="module")
def decoys(tmp_path_factory, wheel) -> dict[str, Path]:
    version = wheel.name.split("-")[1]
    old = make_wheel(tmp_path_factory.mktemp("decoy-old"), "gpumon", "99.0.0")
    same = make_wheel(tmp_path_factory.mktemp("decoy-new"), "gpumon-exporter", version)
    assert sha256(same) != sha256(wheel)
    return {"old_name": old, "new_name": same}


@pytest.fixture(scope="module")
def hostile_index(tmp_path_factory, dependencies, decoys) -> Iterator[Index]:
    """The real dependencies, a decoy "gpumon" and a decoy "gpumon-exporter" of the real version."""
    root = write_index(tmp_path_factory.mktemp("hostile"), [*dependencies, *decoys.values()])
    yield from serve(root)


@pytest.fixture(scope="module")
def honest_index(tmp_path_factory, dependencies, decoys, wheel) -> Iterator[Index]:
    """The real dependencies and the real gpumon-exporter, and still a decoy "gpumon"."""
    root = write_index(tmp_path_factory.mktemp("honest"), [*dependencies, decoys["old_name"], wheel])
    yield from serve(root)


def index_args(index: Index) -> list[str]:
    return ["--python", sys.executable, "--no-os-deps", f"--pip-arg=--index-url={index.url}"]


def venv_python(prefix: Path) -> Path:
    return prefix / "opt/gpumon/bin/python"


def installed_distributions(prefix: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(venv_python(prefix)), "-I", "-c",
         "from importlib.metadata import distributions as d\n"
         "for x in d(): print(x.metadata['Name'].lower(), x.version)"],
        capture_output=True, text=True, timeout=60, check=True)
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def assert_real_gpumon(prefix: Path, wheel: Path) -> None:
    """The venv's gpumon is the package inside ``wheel``, byte for byte, and no "gpumon" dist is there."""
    out = subprocess.run([str(venv_python(prefix)), "-I", "-c", "import gpumon; print(gpumon.__file__)"],
                         capture_output=True, text=True, timeout=60, check=True)
    package = Path(out.stdout.strip()).parent
    with zipfile.ZipFile(wheel) as zf:
        for name in ("gpumon/__init__.py", "gpumon/cli.py"):
            assert (package.parent / name).read_bytes() == zf.read(name), name
    dists = installed_distributions(prefix)
    assert "gpumon" not in dists, dists
    assert dists["gpumon-exporter"] == wheel.name.split("-")[1]
    version = subprocess.run([str(prefix / "opt/gpumon/bin/gpumon"), "--version"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert version.returncode == 0 and DECOY_MARK not in version.stdout + version.stderr


def test_default_route_installs_the_wheel_next_to_the_installer_with_every_extra(
        wheel, hostile_index, tmp_path):
    # What the cloud-init example does: the installer and the wheel fetched into one directory.
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    script = Path(shutil.copy(SCRIPT, shipped / "install.sh"))
    shutil.copy(wheel, shipped / wheel.name)
    prefix = tmp_path / "root"
    out = run_install("--prefix", str(prefix), "--extras", "all", "--sha256", sha256(wheel),
                      *index_args(hostile_index), script=script, timeout=380)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verified the SHA-256" in out.stdout
    assert_real_gpumon(prefix, wheel)
    assert not hostile_index.asked_for("gpumon"), hostile_index.requests
    assert not hostile_index.asked_for("gpumon-exporter"), hostile_index.requests
    # The extras really came from the index: the OTel and Azure SDKs import.
    subprocess.run([str(venv_python(prefix)), "-I", "-c", "import opentelemetry.sdk, azure.monitor.ingestion"],
                   check=True, timeout=60)


def test_no_wheel_and_no_version_refuses_without_asking_the_index(hostile_index, tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    script = Path(shutil.copy(SCRIPT, alone / "install.sh"))
    before = len(hostile_index.requests)
    out = run_install("--prefix", str(tmp_path / "root"), *index_args(hostile_index), script=script)
    assert out.returncode != 0
    assert "pass --wheel FILE, or --version X.Y.Z --sha256 HEX" in out.stderr
    assert len(hostile_index.requests) == before
    assert not (tmp_path / "root/opt/gpumon/bin/gpumon").exists()


def test_version_route_refuses_a_release_whose_hash_is_not_the_published_one(wheel, hostile_index, tmp_path):
    version = wheel.name.split("-")[1]
    prefix = tmp_path / "root"
    out = run_install("--prefix", str(prefix), "--version", version, "--sha256", sha256(wheel),
                      *index_args(hostile_index))
    assert out.returncode != 0
    assert "could not fetch gpumon-exporter==" in out.stderr
    assert "DO NOT MATCH THE HASHES" in out.stderr.upper()
    assert not (prefix / "opt/gpumon/bin/gpumon").exists()
    assert "gpumon-exporter" not in installed_distributions(prefix)
    assert not hostile_index.asked_for("gpumon")


def test_version_route_installs_the_release_with_the_published_hash(wheel, honest_index, tmp_path):
    version = wheel.name.split("-")[1]
    prefix = tmp_path / "root"
    out = run_install("--prefix", str(prefix), "--version", version, "--sha256", sha256(wheel).upper(),
                      *index_args(honest_index))
    assert out.returncode == 0, out.stdout + out.stderr
    assert_real_gpumon(prefix, wheel)
    assert honest_index.asked_for("gpumon-exporter")
    assert not honest_index.asked_for("gpumon")


def test_a_wheel_with_another_digest_is_refused_before_anything_is_installed(wheel, tmp_path):
    out = run_install("--prefix", str(tmp_path), "--wheel", str(wheel), "--sha256", "0" * 64,
                      "--python", sys.executable, "--no-os-deps")
    assert out.returncode != 0
    assert f"not the expected {'0' * 64}: refusing it" in out.stderr
    assert not (tmp_path / "opt/gpumon").exists()


def test_a_wheel_of_another_project_is_refused(decoys, tmp_path):
    out = run_install("--prefix", str(tmp_path), "--wheel", str(decoys["old_name"]),
                      "--python", sys.executable, "--no-os-deps")
    assert out.returncode != 0
    assert "is not a gpumon wheel" in out.stderr
    assert not (tmp_path / "opt/gpumon").exists()


def test_upgrade_replaces_a_gpumon_distribution_left_by_an_older_guide(wheel, decoys, honest_index, tmp_path):
    # A VM that followed the old guide holds PyPI's "gpumon" in /opt/gpumon; it owns gpumon/ too.
    prefix = tmp_path / "root"
    subprocess.run([sys.executable, "-m", "venv", str(prefix / "opt/gpumon")], check=True, timeout=120)
    subprocess.run([str(venv_python(prefix)), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    str(decoys["old_name"])], check=True, timeout=120, capture_output=True)
    assert "gpumon" in installed_distributions(prefix)
    out = run_install("--prefix", str(prefix), "--wheel", str(wheel), *index_args(honest_index))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "removing the distribution 'gpumon'" in out.stdout
    assert_real_gpumon(prefix, wheel)


def test_the_wheel_requires_no_project_by_the_old_name(wheel):
    with zipfile.ZipFile(wheel) as zf:
        (metadata,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        text = zf.read(metadata).decode()
    assert re.search(r"^Name: gpumon-exporter$", text, re.M), text[:200]
    required = [re.split(r"[\s\[;<>=!~(]", line.split(":", 1)[1].strip(), maxsplit=1)[0].lower()
                for line in text.splitlines() if line.startswith("Requires-Dist:")]
    assert required and "gpumon" not in required, required


DOCUMENTED = ["README.md", "Dockerfile", "deploy/vm/cloud-init.yaml", "deploy/vm/install.sh",
              "scripts/test.sh", *(str(p.relative_to(REPO)) for p in sorted((REPO / "docs").rglob("*.md")))]


@pytest.mark.parametrize("relative", DOCUMENTED)
def test_no_documented_command_installs_the_old_name(relative):
    text = (REPO / relative).read_text()
    # pip install gpumon, 'gpumon[azure]', gpumon==0.1.0, "gpumon[${EXTRAS}]": all resolve PyPI's gpumon
    # (up to the end of that command: "pip install . && gpumon run" is fine).
    hits = re.findall(r"""(?:pip3?|pipx)\s+install\b[^\n;&|#`]*?[\s'"](gpumon(?:\[[^\]]*\])?(?:==[\w.]+)?)(?=['"\s]|$)""",
                      text, re.M)
    hits += re.findall(r"""["']gpumon\[[^\]]*\]["']""", text)
    assert not hits, f"{relative} installs by the name of another project: {hits}"
