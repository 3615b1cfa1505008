"""A simulated host's Azure side: its IMDS (identity, placement, Scheduled Events) on loopback and
its Hyper-V KVP pool file, so ``host_info`` and ``azure_events`` run their real code under
``--simulate`` and dashboards see a fleet.

Identity comes from the host name, so several simulated gpumon instances (``[daemon] hostname``)
form a fleet: hosts whose names differ only in their trailing digits share a placement group and
VM scale set; each VM has its own physical host.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from typing import Any

from gpumon.simulate.files import replace_file
from gpumon.simulate.imds import ImdsServer, rfc1123, scheduled_event
from gpumon.sources.kvp import KEY_SIZE, VALUE_SIZE


def compute_document(hostname: str, vm_size: str) -> dict[str, Any]:
    """IMDS compute metadata for a simulated VM (keys as IMDS api-version 2021-02-01 returns them)."""
    family = re.sub(r"[-_]?\d+$", "", hostname) or hostname
    digest = hashlib.sha256(hostname.encode()).digest()
    subscription = str(uuid.uuid5(uuid.NAMESPACE_DNS, "gpumon-simulated-subscription"))
    return {
        "azEnvironment": "AzurePublicCloud", "location": "eastus2", "name": hostname,
        "vmId": str(uuid.uuid5(uuid.NAMESPACE_DNS, f"vm.{hostname}")), "vmSize": vm_size,
        "zone": str(1 + digest[0] % 3), "vmScaleSetName": family,
        "placementGroupId": str(uuid.uuid5(uuid.NAMESPACE_DNS, f"pg.{family}")),
        "platformFaultDomain": str(digest[1] % 2), "platformUpdateDomain": "0",
        "subscriptionId": subscription, "resourceGroupName": "rg-gpumon-simulated",
        "resourceId": f"/subscriptions/{subscription}/resourceGroups/rg-gpumon-simulated/providers/"
                      f"Microsoft.Compute/virtualMachineScaleSets/{family}/virtualMachines/{hostname}",
        "tagsList": [],
    }


def physical_host_name(hostname: str) -> str:
    return "SIM" + hashlib.sha256(f"host.{hostname}".encode()).hexdigest()[:9].upper()


def write_kvp_pool(path: str, values: dict[str, str]) -> None:
    """A host-to-guest KVP pool file: 2,560-byte records, key and value NUL-padded (hv_kvp_daemon.c)."""
    data = b"".join(k.encode().ljust(KEY_SIZE, b"\0") + v.encode().ljust(VALUE_SIZE, b"\0")
                    for k, v in values.items())
    replace_file(path, data)


class SimulatedAzure:
    """The IMDS server and KVP pool of one simulated VM; ``apply`` takes the control commands."""

    def __init__(self, workdir: str, hostname: str, vm_size: str) -> None:
        self.imds = ImdsServer(compute_document(hostname, vm_size))
        self.kvp_pool = os.path.join(workdir, "kvp_pool_3")
        write_kvp_pool(self.kvp_pool, {"PhysicalHostName": physical_host_name(hostname),
                                       "PhysicalHostNameFullyQualified": physical_host_name(hostname)
                                       + ".sim.gpumon", "VirtualMachineName": hostname})
        self._events: dict[str, dict[str, Any]] = {}

    @property
    def imds_url(self) -> str:
        return self.imds.url

    def scheduled_event(self, command: dict[str, Any]) -> None:
        """``{"action": "scheduled_event", "event_id": "E1", "type": "Reboot", "status": "Scheduled",
        "not_before_in": 900, "duration": -1, "source": "Platform"}``; status ``Started`` (NotBefore
        empty, as IMDS shows a started event) or ``done`` (the event leaves the document)."""
        event_id = str(command["event_id"])
        status = str(command.get("status", "Scheduled"))
        if status == "done":
            self._events.pop(event_id, None)
        else:
            not_before = "" if status == "Started" else rfc1123(time.time() + float(command.get("not_before_in",
                                                                                               900)))
            self._events[event_id] = scheduled_event(
                event_id, str(command.get("type", "Reboot")), status, not_before,
                str(command.get("source", "Platform")), int(command.get("duration", -1)),
                (self.imds.compute["name"],), str(command.get("description", "Host server is undergoing "
                                                                            "maintenance.")))
        self.imds.set_events(*self._events.values())

    def close(self) -> None:
        self.imds.close()
