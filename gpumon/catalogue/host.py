"""The host's metrics beside GPUs and ports: the kernel log, PCIe AER, who holds a GPU, Azure
Scheduled Events and the VM, each declared once (name, type, typed unit, help, labels)."""

from __future__ import annotations

from gpumon.catalogue.units import (
    COUNT,
    ERRORS,
    EVENTS,
    INFO,
    SECONDS,
    STATE,
    count,
)
from gpumon.model import MetricSpec, MetricType

AER_LABELS = ("pci_bus_id", "role", "device")
HOST_LABELS = ("vm_size", "region", "zone", "vmss", "vm_id", "placement_group", "fault_domain", "physical_host")

# --- the kernel log (kmsg collector) ----------------------------------------------------------------
KMSG_RECORDS = MetricSpec("gpumon_kmsg_records_total", MetricType.COUNTER,
                          "Kernel log records read, by the driver message recognised (other: anything else).",
                          unit=count("record"),
                          labels=("kind",))
KMSG_LOST = MetricSpec("gpumon_kmsg_lost_records_total", MetricType.COUNTER,
                       "Kernel log records overwritten in the ring buffer before gpumon read them.",
                       unit=count("record"))
KMSG_XIDS = MetricSpec("gpumon_kmsg_xid_errors_total", MetricType.COUNTER,
                       "XIDs from the driver's kernel-log lines that NVML's event API did not report (add "
                       "gpumon_gpu_xid_errors_total for all XIDs; join on pci_bus_id with gpumon_gpu_info).",
                       unit=ERRORS,
                       labels=("pci_bus_id", "xid"))
SXIDS = MetricSpec("gpumon_nvswitch_sxid_errors_total", MetricType.COUNTER,
                   "NVSwitch SXID errors from the kernel log (Hopper and earlier), by switch and SXID.",
                   unit=ERRORS,
                   labels=("switch", "pci_bus_id", "sxid"))

# --- PCIe AER (aer collector) -----------------------------------------------------------------------
AER_TOTAL = MetricSpec("gpumon_pcie_aer_errors_total", MetricType.COUNTER,
                       "PCIe AER errors the function reported since boot, by severity (correctable, nonfatal, "
                       "fatal): the TOTAL_ERR_* lines of aer_dev_*.",
                       unit=ERRORS, labels=AER_LABELS + ("severity",))
AER_BY_TYPE = MetricSpec("gpumon_pcie_aer_error_types_total", MetricType.COUNTER,
                         "PCIe AER errors by type (the aer_dev_* line name, e.g. RxErr, BadTLP, CmpltTO); by "
                         "default only types that have counted.",
                         unit=EVENTS, labels=AER_LABELS + ("severity", "type"))
AER_ROOT = MetricSpec("gpumon_pcie_aer_rootport_errors_total", MetricType.COUNTER,
                      "Errors reported to a root port by the devices below it (aer_rootport_total_err_*).",
                      unit=ERRORS,
                      labels=("pci_bus_id", "severity"))
PCI_FUNCTION_INFO = MetricSpec("gpumon_pcie_function_info", MetricType.INFO,
                               "A watched PCI function; value 1. parent is the bridge above it (pci_bus_id form), "
                               "sysfs_name the directory under /sys/bus/pci/devices.", unit=INFO,
                               labels=AER_LABELS + ("parent", "sysfs_name"))

# --- who holds a GPU (attribution collector) --------------------------------------------------------
ALLOCATION = MetricSpec(
    "gpumon_gpu_allocation_info", MetricType.INFO,
    "Who holds a GPU: one series per pod container or job (labels that do not apply are empty). "
    "Join with: ... * on(instance, gpu) group_left(namespace, pod) gpumon_gpu_allocation_info.", unit=INFO,
    labels=("gpu", "uuid", "gpu_instance", "namespace", "pod", "container", "job_id"))
ATTRIBUTION_SOURCE_UP = MetricSpec(
    "gpumon_attribution_source_up", MetricType.GAUGE,
    "1 while an attribution source answers (kubelet, job_mapping, processes, simulation); 0 while it "
    "fails.", unit=STATE,
    labels=("source",))

# --- Azure Scheduled Events (azure_events collector) ------------------------------------------------
SCHEDULED_EVENT = MetricSpec(
    "gpumon_azure_scheduled_event", MetricType.GAUGE,
    "Scheduled Events in the IMDS document by type (Freeze, Reboot, Redeploy, Preempt, Terminate), source "
    "(Platform, User) and status (Scheduled, Started); only combinations that have an event.", unit=COUNT,
    labels=("type", "source", "status"))
SCHEDULED_EVENT_NOT_BEFORE = MetricSpec(
    "gpumon_azure_scheduled_event_not_before_timestamp_seconds", MetricType.GAUGE,
    "Unix time before which a Scheduled event will not start (its NotBefore); absent once it started.",
    SECONDS, ("event_id", "type", "source"))
SCHEDULED_EVENTS_INCARNATION = MetricSpec(
    "gpumon_azure_scheduled_events_document_incarnation", MetricType.GAUGE,
    "DocumentIncarnation of the latest Scheduled Events document read (changes whenever an event does); "
    "present while IMDS answers.", unit=COUNT)

# --- the VM (host_info collector) -------------------------------------------------------------------
HOST_INFO = MetricSpec(
    "gpumon_host_info", MetricType.INFO,
    "The Azure VM and its placement (value 1): IMDS vmSize, location, zone, vmScaleSetName, vmId, "
    "placementGroupId, platformFaultDomain, and the Hyper-V KVP PhysicalHostName; empty where unknown.",
    unit=INFO,
    labels=HOST_LABELS)
