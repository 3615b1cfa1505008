"""The OTLP resource: service, host, Azure placement (IMDS) and Kubernetes node attributes."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gpumon.model import AzureInstance
from gpumon.sinks.base import SinkContext
from gpumon.sinks.otel.settings import parse_kv

if TYPE_CHECKING:
    pass


log = logging.getLogger("gpumon.sinks.otel")


def azure_attributes(instance: AzureInstance | None, physical_host: str = "") -> dict[str, str]:
    """Resource attributes for an Azure VM: the cloud.* / host.* semantic conventions (``host.id`` the
    vmId, ``cloud.resource_id`` the ARM id), and its placement (the facts of ``gpumon_host_info``)
    under ``gpumon.azure.*``, which no convention names. Empty values are left out."""
    if instance is None:
        return {PHYSICAL_HOST: physical_host} if physical_host else {}
    attrs = {
        "cloud.provider": "azure",
        "cloud.platform": "azure.aks" if instance.aks else "azure.vm",
        "cloud.region": instance.location,
        "host.id": instance.vm_id,
        "host.type": instance.vm_size,
        "cloud.resource_id": instance.resource_id,
        "cloud.account.id": instance.subscription_id,
        "cloud.availability_zone": instance.zone,
        "azure.resource_group.name": instance.resource_group,
        "gpumon.azure.vmss": instance.vmss_name,
        "gpumon.azure.placement_group": instance.placement_group_id,
        "gpumon.azure.fault_domain": instance.platform_fault_domain,
        PHYSICAL_HOST: physical_host,
    }
    return {k: v for k, v in attrs.items() if v}


PHYSICAL_HOST = "gpumon.azure.physical_host"
"""The Hyper-V KVP pool's PhysicalHostName: what several VMs failing together may share."""


K8S_NODE_VARIABLES = ("K8S_NODE_NAME", "NODE_NAME")
"""Where a pod finds its node's name (set from the downward API's ``spec.nodeName``)."""


def kubernetes_attributes(environ: Mapping[str, str]) -> dict[str, str]:
    """``k8s.node.name`` in a pod: K8S_NODE_NAME or NODE_NAME, else GPUMON_DAEMON_HOSTNAME, which
    gpumon's DaemonSet sets from ``spec.nodeName``; nothing outside Kubernetes."""
    if not environ.get("KUBERNETES_SERVICE_HOST"):
        return {}
    for key in (*K8S_NODE_VARIABLES, "GPUMON_DAEMON_HOSTNAME"):
        if environ.get(key, "").strip():
            return {"k8s.node.name": environ[key].strip()}
    return {}


def resource_attributes(
    ctx: SinkContext,
    configured: Sequence[str],
    environ: Mapping[str, str],
    detected: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Layers, later wins: gpumon's own (and k8s.node.name in a pod), detected (IMDS),
    OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME, the config's ``resource_attributes``."""
    attrs = {"service.name": "gpumon", "service.version": ctx.version, "host.name": ctx.hostname}
    attrs.update(kubernetes_attributes(environ))
    attrs.update(detected or {})
    attrs.update(parse_kv(environ.get("OTEL_RESOURCE_ATTRIBUTES", ""), unquote=True))
    if environ.get("OTEL_SERVICE_NAME", "").strip():
        attrs["service.name"] = environ["OTEL_SERVICE_NAME"].strip()
    attrs.update(parse_kv(configured))
    return {k: v for k, v in attrs.items() if v != ""}
