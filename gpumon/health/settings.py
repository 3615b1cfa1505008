"""The ``[health]`` config section: which rules run, their thresholds, and the VM size to hold the
node to. Parsed once into :class:`~gpumon.health.stage.HealthSettings`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpumon.config import Option, SectionSchema
from gpumon.health.actions.settings import ActionSettings
from gpumon.health.catalogue import RULE_BY_ID
from gpumon.health.rules import Thresholds
from gpumon.health.stage import HealthSettings


def _known_rules(value: Any) -> str | None:
    unknown = [r for r in value if r not in RULE_BY_ID and not str(r).startswith("gpu.xid.")]
    return f"unknown rule ids: {', '.join(map(str, unknown))} (known: {', '.join(RULE_BY_ID)})" if unknown else None


@dataclass(frozen=True)
class HealthSectionSettings:
    """The ``[health]`` section as parsed, one field per option; :func:`health_settings` and
    :func:`action_settings` turn it into what the stage and the actions use."""

    enabled: bool
    disabled_rules: tuple[str, ...]
    vm_size: str
    hold_seconds: float
    flap_threshold: int
    flap_window: float
    ib_error_threshold: float
    ib_error_window: float
    slurm: bool
    slurm_node: str
    scontrol: str
    kubernetes: bool
    kube_events: bool
    kube_taint: bool
    node_name: str
    kube_api: str
    kube_token_file: str
    kube_ca_file: str
    hook: str
    action_timeout: float
    action_backoff_initial: float
    action_backoff_max: float


HEALTH = SectionSchema("health", "The node's health verdict: rules over every snapshot, and what to hold "
                       "the node to.", (
    Option("enabled", bool, True, "Evaluate the health rules (`gpumon_health_state`, `gpumon_node_health`, "
           "`/health`, `health_changed` events)."),
    Option("disabled_rules", list, [], "Rule ids not evaluated (for example `gpu.thermal_slowdown`; "
           "`gpu.xid` turns off every `gpu.xid.<n>`).", check=_known_rules),
    Option("vm_size", str, "", "The Azure VM size whose inventory the node is held to; empty: IMDS's "
           "`vmSize`, and on a size without data the first healthy run (a baseline)."),
    Option("hold_seconds", float, 300.0, "Seconds a transient finding (a port down, a thermal slowdown) "
           "must stay absent before it clears.", min=0.0, max=86400.0 * 7),
    Option("flap_threshold", int, 5, "Flaps within `flap_window` that make a port flapping (NHC's check "
           "drains at 5 in 24 h).", min=1, max=10000),
    Option("flap_window", float, 86400.0, "Seconds of the flap window.", min=60.0, max=86400.0 * 30),
    Option("ib_error_threshold", float, 100.0, "Growth of a port's physical error counters (symbol errors, "
           "link error recoveries, local link integrity, excessive buffer overrun) that is unhealthy.",
           min=1.0),
    Option("ib_error_window", float, 3600.0, "Seconds over which `ib_error_threshold` counts.",
           min=60.0, max=86400.0 * 7),
    Option("slurm", bool, False, "Drain this Slurm node when the verdict is unhealthy with a drain-worthy "
           "action, and resume it when it clears (only a drain gpumon made). docs/health-actions.md."),
    Option("slurm_node", str, "", "The Slurm node name; empty: the short host name, as slurmd uses."),
    Option("scontrol", str, "scontrol", "The scontrol command (a path, or a name on PATH)."),
    Option("kubernetes", bool, False, "Set NodeConditions on this pod's node (needs the node-conditions "
           "component: RBAC patch on nodes/status)."),
    Option("kube_events", bool, False, "Post a Kubernetes Event on this pod's node for each change of the "
           "verdict, repeats aggregated as the kubelet does (needs the node-events component: RBAC create "
           "and patch on events in `default`)."),
    Option("kube_taint", bool, False, "Taint this pod's node `gpumon.io/unhealthy=<rule>:NoSchedule` while the "
           "verdict is unhealthy, untaint it once it clears (needs the node-taint component: RBAC get and "
           "patch on nodes)."),
    Option("node_name", str, "", "The Kubernetes node name; empty: the NODE_NAME variable (downward API)."),
    Option("kube_api", str, "", "The API server URL; empty: in-cluster (KUBERNETES_SERVICE_HOST/PORT)."),
    Option("kube_token_file", str, ActionSettings.kube_token_file, "Service account token, re-read on each "
           "call (it rotates)."),
    Option("kube_ca_file", str, ActionSettings.kube_ca_file, "CA bundle that verifies the API server."),
    Option("hook", str, "", "An executable run on each change of the verdict, the verdict as JSON on stdin."),
    Option("action_timeout", float, 10.0, "Seconds an action (scontrol, an API call, the hook) may take "
           "before it is killed.", min=0.1, max=600.0),
    Option("action_backoff_initial", float, 1.0, "Seconds before retrying a failed action; doubles with "
           "jitter.", min=0.01, max=600.0),
    Option("action_backoff_max", float, 300.0, "Longest wait between retries.", min=0.01, max=86400.0),
), HealthSectionSettings)


def health_settings(section: Mapping[str, Any] | None) -> HealthSettings:
    v = HEALTH.settings_of(section)
    thresholds = Thresholds(flap_threshold=int(v.flap_threshold), flap_window=float(v.flap_window),
                            ib_error_threshold=float(v.ib_error_threshold),
                            ib_error_window=float(v.ib_error_window),
                            disabled=frozenset(str(r) for r in v.disabled_rules))
    return HealthSettings(thresholds, hold_seconds=float(v.hold_seconds), vm_size=str(v.vm_size))


def action_settings(section: Mapping[str, Any] | None) -> ActionSettings:
    v = HEALTH.settings_of(section)
    return ActionSettings(
        slurm=bool(v.slurm), slurm_node=str(v.slurm_node), scontrol=str(v.scontrol),
        kubernetes=bool(v.kubernetes), kube_events=bool(v.kube_events), kube_taint=bool(v.kube_taint),
        node_name=str(v.node_name), kube_api=str(v.kube_api),
        kube_token_file=str(v.kube_token_file), kube_ca_file=str(v.kube_ca_file), hook=str(v.hook),
        timeout=float(v.action_timeout), backoff_initial=float(v.action_backoff_initial),
        backoff_max=float(v.action_backoff_max))


def actions_on(settings: ActionSettings) -> bool:
    return (settings.slurm or settings.kubernetes or settings.kube_events or settings.kube_taint
            or bool(settings.hook))
