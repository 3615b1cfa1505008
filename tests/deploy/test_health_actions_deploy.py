"""deploy/kubernetes/components/node-conditions, node-events and node-taint: composed with the base
and with an overlay that patches the same container (and all three together), they build, validate
against the strict Kubernetes schemas of the oldest and newest AKS versions, pass the policy scan,
and grant no more than each action needs (`patch` on `nodes/status`; `create` and `patch` on events
in `default`; `get` and `patch` on nodes), with the node's name from the downward API and a
projected token."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.kubernetes import K8S_VERSIONS, KUSTOMIZE, docs, find, kustomize, pod_spec, tool

COMPONENT = KUSTOMIZE / "components" / "node-conditions"
BASES = ["base", "overlays/azure-logs"]
ALL = "base+node-conditions+node-events+node-taint"
ACTIONS = [KUSTOMIZE / "components" / c for c in ("node-conditions", "node-events", "node-taint")]
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for base in BASES:
        combo = tmp_path_factory.mktemp("node-conditions")
        (combo / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(KUSTOMIZE / base, combo)],
            "components": [os.path.relpath(COMPONENT, combo)]}))
        path = combo / "rendered.yaml"
        path.write_text(kustomize(combo))
        out[base] = path
    combo = tmp_path_factory.mktemp("all-actions")
    (combo / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(KUSTOMIZE / "overlays/azure-logs", combo)],
        "components": [os.path.relpath(c, combo) for c in ACTIONS]}))
    (combo / "rendered.yaml").write_text(kustomize(combo))
    out[ALL] = combo / "rendered.yaml"
    return out


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_composition_validates_against_kubernetes_schemas(built, version):
    out = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", version, *map(str, built.values())],
                         capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Couldn't find schema" not in out.stdout + out.stderr


def test_policy_scan_reports_no_failed_check(built, tmp_path):
    for name, path in built.items():
        shutil.copy(path, tmp_path / (name.replace("/", "_") + ".yaml"))
    out = subprocess.run([tool("checkov"), "-d", str(tmp_path), "--framework", "kubernetes", "--skip-download",
                          "--output", "json", "--quiet"], capture_output=True, text=True, timeout=240, check=False,
                         env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"})
    reports = json.loads(out.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [(c["check_id"], c["resource"]) for r in reports for c in r["results"]["failed_checks"]]
    assert not failed, failed
    assert sum(r["summary"]["passed"] for r in reports) > 0


@pytest.mark.parametrize("base", BASES)
def test_rbac_is_patch_on_nodes_status_for_gpumons_service_account_only(built, base):
    role = find(built[base], "ClusterRole", "gpumon-node-conditions")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]}]
    binding = find(built[base], "ClusterRoleBinding", "gpumon-node-conditions")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "gpumon-node-conditions"}
    sa = find(built[base], "ServiceAccount", "gpumon")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpumon",
                                    "namespace": sa["metadata"]["namespace"]}]
    assert [d["kind"] for d in docs(built[base]) if d["kind"] in ("Role", "RoleBinding")] == []
    policy = find(built[base], "ValidatingAdmissionPolicy", "gpumon-own-node-status")
    assert "system:serviceaccount:gpumon:gpumon" in policy["spec"]["matchConditions"][0]["expression"]
    assert find(built[base], "ValidatingAdmissionPolicyBinding")["spec"]["policyName"] == "gpumon-own-node-status"


@pytest.mark.parametrize("base", BASES)
def test_the_pod_knows_its_node_and_gets_a_rotating_token_and_the_cluster_ca(built, base):
    spec = pod_spec(built[base])
    assert spec["automountServiceAccountToken"] is False  # the token comes only through the volume below
    (container,) = spec["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["GPUMON_HEALTH_KUBERNETES"]["value"] == "true"
    if base == "overlays/azure-logs":  # the overlay's own patch of the same container survives
        assert container["envFrom"][0]["configMapRef"]["name"].startswith("gpumon-azure")
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == TOKEN_DIR)
    assert mount["readOnly"] is True
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    sources = volume["projected"]["sources"]
    token = next(s["serviceAccountToken"] for s in sources if "serviceAccountToken" in s)
    assert token["path"] == "token" and token["expirationSeconds"] <= 3607
    ca = next(s["configMap"] for s in sources if "configMap" in s)
    assert ca == {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_events_rbac_is_create_and_patch_on_events_in_default_only(built):
    role = find(built[ALL], "Role", "gpumon-node-events")
    assert role["metadata"]["namespace"] == "default"  # where the API server keeps a Node's events
    assert role["rules"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]}]
    binding = find(built[ALL], "RoleBinding", "gpumon-node-events")
    assert binding["metadata"]["namespace"] == "default"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "gpumon-node-events"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpumon", "namespace": "gpumon"}]


def test_taint_rbac_is_get_and_patch_on_nodes_held_to_its_own_node_and_taint(built):
    role = find(built[ALL], "ClusterRole", "gpumon-node-taint")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    binding = find(built[ALL], "ClusterRoleBinding", "gpumon-node-taint")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpumon", "namespace": "gpumon"}]
    policy = find(built[ALL], "ValidatingAdmissionPolicy", "gpumon-own-node-taint")
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["resources"] == ["nodes"]
    checks = " ".join(v["expression"] for v in policy["spec"]["validations"])
    assert "authentication.kubernetes.io/node-name" in checks and "variables.others == variables.othersBefore" in checks
    assert find(built[ALL], "ValidatingAdmissionPolicyBinding", "gpumon-own-node-taint")["spec"]["policyName"] \
        == "gpumon-own-node-taint"


def test_all_three_actions_share_one_node_name_and_one_token_volume(built):
    spec = pod_spec(built[ALL])
    (container,) = spec["containers"]
    names = [e["name"] for e in container["env"]]
    assert names.count("NODE_NAME") == 1
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPUMON_HEALTH_KUBERNETES"] == env["GPUMON_HEALTH_KUBE_EVENTS"] == env["GPUMON_HEALTH_KUBE_TAINT"] == "true"
    assert [v["name"] for v in spec["volumes"]].count("kube-api-access") == 1
    assert [m["mountPath"] for m in container["volumeMounts"]].count(TOKEN_DIR) == 1
    assert container["envFrom"][0]["configMapRef"]["name"].startswith("gpumon-azure")
