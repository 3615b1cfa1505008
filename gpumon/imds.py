"""Azure Instance Metadata Service: who this VM is, asked once with a short timeout.

Off Azure the link-local address does not answer; the timeout keeps that from delaying anything,
and callers run this on a background thread.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass

IMDS_URL = "http://169.254.169.254/metadata/instance/compute?api-version=2021-02-01"


@dataclass(frozen=True)
class AzureInstance:
    vm_id: str
    vm_size: str
    location: str
    name: str
    resource_id: str
    vmss_name: str = ""
    aks: bool = False
    zone: str = ""
    subscription_id: str = ""
    resource_group: str = ""

    @classmethod
    def from_compute(cls, doc: dict) -> AzureInstance:
        tags = doc.get("tagsList") or []
        aks = any(t.get("name", "").startswith("aks-managed") for t in tags if isinstance(t, dict))
        return cls(
            vm_id=str(doc.get("vmId", "")),
            vm_size=str(doc.get("vmSize", "")),
            location=str(doc.get("location", "")),
            name=str(doc.get("name", "")),
            resource_id=str(doc.get("resourceId", "")),
            vmss_name=str(doc.get("vmScaleSetName", "")),
            aks=aks or str(doc.get("resourceGroupName", "")).upper().startswith("MC_"),
            zone=str(doc.get("zone", "")),
            subscription_id=str(doc.get("subscriptionId", "")),
            resource_group=str(doc.get("resourceGroupName", "")),
        )


def fetch_instance(url: str = IMDS_URL, timeout: float = 0.5) -> AzureInstance | None:
    """The VM's identity, or None when not on Azure (or IMDS is unreachable) within ``timeout``."""
    request = urllib.request.Request(url, headers={"Metadata": "true"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # IMDS must bypass proxies
    try:
        with opener.open(request, timeout=timeout) as response:
            doc = json.loads(response.read(1 << 20))
    except (OSError, ValueError):
        return None
    return AzureInstance.from_compute(doc) if isinstance(doc, dict) else None
