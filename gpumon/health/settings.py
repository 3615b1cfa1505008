"""The ``[health]`` config section: which rules run, their thresholds, and the VM size to hold the
node to. Parsed once into :class:`~gpumon.health.stage.HealthSettings`."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpumon.config import Config, ConfigError, IntList, Option, SectionSchema, TableList, shown
from gpumon.health.actions.settings import ActionSettings
from gpumon.health.catalogue import ACTIONS, RULE_BY_ID, Level, XidPolicy
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


LEVELS = {"ok": Level.OK, "degraded": Level.DEGRADED, "unhealthy": Level.UNHEALTHY}
XID_KEYS = ("xid", "level", "action", "sticky")


def xid_entry_problem(index: int, entry: Mapping[str, Any], seen: set[int]) -> str | None:
    """What is wrong with one ``[health] xids`` table, naming its position and key; None if nothing."""
    where = f"entry {index + 1}"
    unknown = [k for k in entry if k not in XID_KEYS]
    if unknown:
        return f"{where}: unknown key {unknown[0]!r} (known: {', '.join(XID_KEYS)})"
    xid = entry.get("xid")
    if isinstance(xid, bool) or not isinstance(xid, int) or not 1 <= xid <= 65535:
        return f"{where}: xid must be an integer from 1 to 65535 (got {shown(xid)})"
    where = f"entry {index + 1} (xid {xid})"
    if xid in seen:
        return f"{where}: xid {xid} is listed twice"
    seen.add(xid)
    if entry.get("level") not in LEVELS:
        return f"{where}: level must be one of {', '.join(LEVELS)} (got {shown(entry.get('level'))})"
    if "action" in entry and entry["action"] not in ACTIONS:
        return f"{where}: action must be one of {', '.join(ACTIONS)} (got {shown(entry['action'])})"
    if "sticky" in entry and not isinstance(entry["sticky"], bool):
        return f"{where}: sticky must be true or false (got {shown(entry['sticky'])})"
    return None


def _xids_check(value: Any) -> str | None:
    seen: set[int] = set()
    for index, entry in enumerate(value):
        problem = xid_entry_problem(index, entry, seen)
        if problem:
            return problem
    return None


def xid_policies(entries: Any) -> dict[int, XidPolicy | None]:
    """``[health] xids`` (validated) as the rules use it: level ok is "not a hardware fault"."""
    out: dict[int, XidPolicy | None] = {}
    for entry in entries:
        level = LEVELS[entry["level"]]
        default_action = "none" if level is Level.DEGRADED else "reset_gpu"
        out[int(entry["xid"])] = None if level is Level.OK else XidPolicy(
            level, str(entry.get("action", default_action)), bool(entry.get("sticky", False)))
    return out


def _positive(value: Any) -> str | None:
    return None if all(v > 0 for v in value) else "XIDs are positive integers"


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
    xids: tuple[dict[str, Any], ...]
    xid_repeat: tuple[int, ...]
    xid_repeat_threshold: int
    xid_repeat_window: float
    xid_gpc_threshold: int
    reset_repeat_threshold: int
    reset_repeat_window: float
    remediation_budget: int
    remediation_window: float
    slurm: bool
    slurm_node: str
    scontrol: str
    kubernetes: bool
    kube_events: bool
    kube_taint: bool
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
    Option("xids", TableList, [], "XIDs added to the catalogue or classified again, without a release: an array "
           "of tables such as `{ xid = 999, level = \"unhealthy\", action = \"reboot\", sticky = true }` "
           "(level `ok` (not a hardware fault), `degraded` or `unhealthy`; action one of " + ", ".join(ACTIONS)
           + ", default `reset_gpu` (`none` when degraded); sticky default false). docs/health.md.",
           check=_xids_check),
    Option("xid_repeat", IntList, [13, 31, 43], "Application-class XIDs that count as the GPU's fault when one "
           "GPU has `xid_repeat_threshold` of the same within `xid_repeat_window` (rule `gpu.xid.repeated`).",
           check=_positive),
    Option("xid_repeat_threshold", int, 5, "Repeats of one XID on one GPU that make `gpu.xid.repeated`.",
           min=2, max=10000),
    Option("xid_repeat_window", float, 86400.0, "Seconds over which XID repeats count (also for "
           "`gpu.xid.same_gpc`).", min=60.0, max=86400.0 * 30),
    Option("xid_gpc_threshold", int, 2, "XID 13/31 on the same GPC of one GPU within `xid_repeat_window` that "
           "make `gpu.xid.same_gpc` (the kernel log names the GPC).", min=2, max=10000),
    Option("reset_repeat_threshold", int, 3, "GPU resets that cleared a hardware fault on the same GPU within "
           "`reset_repeat_window` that make `gpu.reset.repeated` (replace the hardware).", min=2, max=10000),
    Option("reset_repeat_window", float, 86400.0 * 7, "Seconds over which those resets count.",
           min=60.0, max=86400.0 * 90),
    Option("remediation_budget", int, 5, "Verdicts asking to take the node out (a drain, a report) allowed "
           "within `remediation_window`; one more is `node.remediation_budget` (replace_hardware, nothing "
           "filed again).", min=1, max=10000),
    Option("remediation_window", float, 86400.0 * 7, "Seconds over which the remediation budget counts.",
           min=60.0, max=86400.0 * 90),
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
                            disabled=frozenset(str(r) for r in v.disabled_rules),
                            xids=xid_policies(v.xids), xid_repeat=frozenset(int(x) for x in v.xid_repeat),
                            xid_repeat_threshold=int(v.xid_repeat_threshold),
                            xid_repeat_window=float(v.xid_repeat_window),
                            xid_gpc_threshold=int(v.xid_gpc_threshold),
                            reset_repeat_threshold=int(v.reset_repeat_threshold),
                            reset_repeat_window=float(v.reset_repeat_window),
                            remediation_budget=int(v.remediation_budget),
                            remediation_window=float(v.remediation_window))
    return HealthSettings(thresholds, hold_seconds=float(v.hold_seconds), vm_size=str(v.vm_size))


def action_settings(section: Mapping[str, Any] | None) -> ActionSettings:
    v = HEALTH.settings_of(section)
    return ActionSettings(
        slurm=bool(v.slurm), slurm_node=str(v.slurm_node), scontrol=str(v.scontrol),
        kubernetes=bool(v.kubernetes), kube_events=bool(v.kube_events), kube_taint=bool(v.kube_taint),
        node_name=str(v.node_name), kube_api=str(v.kube_api),
        kube_token_file=str(v.kube_token_file), kube_ca_file=str(v.kube_ca_file), hook=str(v.hook),
        azure_ghr=bool(v.azure_ghr), azure_ghr_client_id=str(v.azure_ghr_client_id),
        azure_ghr_dry_run=bool(v.azure_ghr_dry_run), azure_ghr_arm=str(v.azure_ghr_arm),
        azure_ghr_rate_limit=int(v.azure_ghr_rate_limit), azure_ghr_rate_window=float(v.azure_ghr_rate_window),
        timeout=float(v.action_timeout), backoff_initial=float(v.action_backoff_initial),
        backoff_max=float(v.action_backoff_max))


def actions_on(settings: ActionSettings) -> bool:
    return (settings.slurm or settings.kubernetes or settings.kube_events or settings.kube_taint
            or bool(settings.hook) or settings.azure_ghr)
