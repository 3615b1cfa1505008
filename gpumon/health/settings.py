"""The ``[health]`` config section: which rules run, their thresholds, and the VM size to hold the
node to. Parsed once into :class:`~gpumon.health.stage.HealthSettings`."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpumon.config import Config, ConfigError, Option, SectionSchema, shown
from gpumon.health.actions.settings import ActionSettings
from gpumon.health.catalogue import RULE_BY_ID
from gpumon.health.rules import Thresholds
from gpumon.health.stage import HealthSettings


def _known_rules(value: Any) -> str | None:
    unknown = [r for r in value if r not in RULE_BY_ID and not str(r).startswith("gpu.xid.")]
    return f"unknown rule ids: {', '.join(map(str, unknown))} (known: {', '.join(RULE_BY_ID)})" if unknown else None


def _kube_api_url(value: Any) -> str | None:
    parts = urllib.parse.urlsplit(str(value))
    if value and (parts.scheme not in ("https", "http") or not parts.hostname):
        return f"must be an https:// URL such as https://10.0.0.1:443 (got {shown(value)})"
    return None


def check_config(config: Config) -> None:
    """What one option alone cannot say: an http:// ``kube_api`` needs ``kube_api_allow_http``
    (ConfigError, exit 2, naming the key and where it came from)."""
    section = config.sections.get("health")
    if section is None:
        return
    api = str(section["kube_api"])
    if urllib.parse.urlsplit(api).scheme == "http" and not section["kube_api_allow_http"]:
        raise ConfigError(config.origin("health", "kube_api"), "[health] kube_api",
                          f"{api} is plain http: the service-account token would travel in cleartext; use "
                          "https://, or set [health] kube_api_allow_http = true to accept that")


def _client_id(value: Any) -> str | None:
    """A managed identity's client id is a GUID (Entra ID application ids are)."""
    if value and not re.fullmatch(r"[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}", str(value)):
        return f"must be a client id (a GUID such as 6f1c43b5-6a1b-4c53-9d0e-2f8b7c1e9a40), got {value!r}"
    return None


def _https_url(value: Any) -> str | None:
    parts = urllib.parse.urlsplit(str(value))
    if parts.scheme != "https" or not parts.hostname:
        return f"must be an https:// URL such as https://management.azure.com (got {value!r})"
    return None


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
    node_name: str
    kube_api: str
    kube_api_allow_http: bool
    kube_token_file: str
    kube_ca_file: str
    hook: str
    azure_ghr: bool
    azure_ghr_client_id: str
    azure_ghr_dry_run: bool
    azure_ghr_arm: str
    azure_ghr_rate_limit: int
    azure_ghr_rate_window: float
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
    Option("node_name", str, "", "The Kubernetes node name; empty: the NODE_NAME variable (downward API)."),
    Option("kube_api", str, "", "The API server URL (https://); empty: in-cluster (KUBERNETES_SERVICE_HOST/"
           "PORT). An http:// URL is refused unless `kube_api_allow_http` is set.", check=_kube_api_url),
    Option("kube_api_allow_http", bool, False, "Allow an http:// `kube_api`, which sends the service-account "
           "token in cleartext (a `kubectl proxy` on loopback is the one sound use); logged as a warning at "
           "every start."),
    Option("kube_token_file", str, ActionSettings.kube_token_file, "Service account token, re-read on each "
           "call (it rotates)."),
    Option("kube_ca_file", str, ActionSettings.kube_ca_file, "CA bundle that verifies the API server."),
    Option("hook", str, "", "An executable run on each change of the verdict, the verdict as JSON on stdin."),
    Option("azure_ghr", bool, False, "File a Guest Health Report (Azure Impact Reporting API) for each new "
           "unhealthy finding that has an AzNHC fault code, as the VM's managed identity (needs the Impact "
           "Reporter role). docs/health-actions.md."),
    Option("azure_ghr_client_id", str, "", "Client id of the user-assigned managed identity that files the "
           "reports; empty: the system-assigned identity.", check=_client_id),
    Option("azure_ghr_dry_run", bool, False, "Log each report's request instead of sending it."),
    Option("azure_ghr_arm", str, ActionSettings.azure_ghr_arm, "The Azure Resource Manager endpoint (another "
           "cloud's, such as https://management.usgovcloudapi.net).", check=_https_url),
    Option("azure_ghr_rate_limit", int, ActionSettings.azure_ghr_rate_limit, "Reports per impact category "
           "within `azure_ghr_rate_window`; more are logged and counted, not filed.", min=1, max=1000),
    Option("azure_ghr_rate_window", float, ActionSettings.azure_ghr_rate_window, "Seconds of the rate "
           "limit's window.", min=60.0, max=86400.0 * 30),
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
        kubernetes=bool(v.kubernetes), node_name=str(v.node_name), kube_api=str(v.kube_api),
        kube_token_file=str(v.kube_token_file), kube_ca_file=str(v.kube_ca_file), hook=str(v.hook),
        azure_ghr=bool(v.azure_ghr), azure_ghr_client_id=str(v.azure_ghr_client_id),
        azure_ghr_dry_run=bool(v.azure_ghr_dry_run), azure_ghr_arm=str(v.azure_ghr_arm),
        azure_ghr_rate_limit=int(v.azure_ghr_rate_limit), azure_ghr_rate_window=float(v.azure_ghr_rate_window),
        timeout=float(v.action_timeout), backoff_initial=float(v.action_backoff_initial),
        backoff_max=float(v.action_backoff_max))


def actions_on(settings: ActionSettings) -> bool:
    return settings.slurm or settings.kubernetes or bool(settings.hook) or settings.azure_ghr
