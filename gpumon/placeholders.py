"""The stand-in values the shipped examples carry (AKS overlays, cloud-init, docs), recognised so that
``gpumon check`` names the key still holding one instead of failing later on a token or an upload.

The examples use an all-zero GUID for client and tenant ids, ``dcr-`` and 32 zeros for a DCR immutable
id, and the invented endpoints below; none of them can name a real Azure resource (a DCR immutable id
is ``dcr-`` and 32 hex digits that Azure generates; an all-zero GUID is the nil UUID, RFC 9562 5.9).
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

NIL_GUID = re.compile(r"^0{8}-0{4}-0{4}-0{4}-0{12}$")
NIL_DCR = re.compile(r"(?<![0-9a-zA-Z])dcr-0{32}(?![0-9a-zA-Z])")
EXAMPLE_HOSTS = frozenset({
    # deploy/kubernetes/overlays/azure-logs/azure.env, deploy/vm/cloud-init.yaml
    "gpumon-dce.eastus-1.ingest.monitor.azure.com",
    # deploy/vm/cloud-init-managed-prometheus.yaml
    "amw-gpumon-dce-abcd.eastus-1.metrics.ingest.monitor.azure.com",
})
IDENTITY_VARIABLES = ("AZURE_CLIENT_ID", "AZURE_TENANT_ID")
"""Set by the AKS workload identity webhook from the service account's annotation, or by hand."""
AZURE_IDENTITY_SINKS = ("azure_monitor", "remote_write")
"""The sinks that can take their Azure identity from those variables."""


@dataclass(frozen=True)
class Placeholder:
    where: str
    """``[section] key`` or an environment variable's name."""
    origin: str
    """Where the value came from (a file, ``environment GPUMON_...``, a flag)."""
    what: str
    """What the value is and what belongs there."""
    section: str = ""
    """The config section holding it; empty for an environment variable."""


def describe(value: str) -> str | None:
    """What kind of stand-in ``value`` is, or None for a value that may be real."""
    text = value.strip()
    if NIL_GUID.match(text):
        return f"is still {text}, the all-zero GUID of the shipped examples: put in the real id"
    if NIL_DCR.search(text):
        return ("is still dcr-000…000, the DCR immutable id of the shipped examples: put in your DCR's "
                "immutableId (an output of deploy/azure/)")
    host = urllib.parse.urlsplit(text).hostname if "://" in text else None
    if host in EXAMPLE_HOSTS:
        return (f"still names {host}, the example endpoint of the shipped files: put in your data "
                "collection endpoint (an output of deploy/azure/)")
    return None


def find(sections: Mapping[str, Mapping[str, Any]], origin: Callable[[str, str], str],
         environ: Mapping[str, str]) -> Iterator[Placeholder]:
    """Every config value (strings, and strings in lists) and Azure identity variable still a stand-in.
    ``origin(section, key)`` says where a value came from."""
    for section, values in sections.items():
        for key, value in values.items():
            items = value if isinstance(value, (list, tuple)) else [value]
            for item in items:
                what = describe(item) if isinstance(item, str) else None
                if what:
                    yield Placeholder(f"[{section}] {key}", origin(section, key), what, section)
                    break
    for name in IDENTITY_VARIABLES:
        what = describe(environ.get(name, ""))
        if what:
            hint = ("; on AKS the workload identity webhook sets it from the service account's annotation "
                    "azure.workload.identity/client-id (workload-identity.yaml)") if name == "AZURE_CLIENT_ID" else ""
            yield Placeholder(name, "environment variable", what + hint)
